"""
An export's model card, its README.md: what the model is, what it was trained on and how well, what loads it and how
to use it, and how it was made. Each benchmark's line comes from its module in evaluation/ (card_line), handed over
by train_gpt2.py, so that the card names none itself.
"""

import os

from machinery.tokenizer import EOT, EOT_TEXT, GPT2_VOCAB


def published_facts(name):
    """The model card's facts of OpenAI's own weights, named name."""
    return dict(source=f"OpenAI's {name}, as published", trained="WebText, by OpenAI",
                validation="not evaluated by train_gpt2.py")


def name_only(path):
    """The last part of a path, which the model card gives for it (edu_fineweb10B of /scratch/alice/edu_fineweb10B/):
    hf upload publishes the card, where the directories above would tell only the layout of the user's machine."""
    return os.path.basename(os.path.normpath(path))


def checkpoint_facts(source, step, train_config, validation, start):
    """The model card's facts of the weights of a checkpoint at source, taken at step of a run of train_config that
    started from start (--init-from's weights in words, or None). The checkpoint and the data are named, not where
    they lay."""
    batch = train_config["total_batch_size"]
    fine_tuned = "" if start is None else f", fine-tuning {start}"
    return dict(source=f"the checkpoint {name_only(source)} (step {step} of {train_config['max_steps']})",
                trained=f"{step * batch:,} tokens ({step:,} steps of {batch:,}) of {name_only(train_config['data'])}"
                        f"{fine_tuned}",
                validation=validation)


def model_card(fmt, shape, model_config, n_params, about):
    """README.md: what the model is, what it was trained on and how well, what loads it and how to use it, and how
    it was made. about: the facts (source, trained, validation), the benchmarks' lines (scores: [(name, line)], in
    their order) and the command that made it."""
    vocab = shape["vocab_size"]
    if vocab < GPT2_VOCAB:
        vocab_note = (f"Its vocabulary is GPT-2's first {vocab} token ids (trained with `--vocab-size {vocab}`): the "
                      f"tokenizer is GPT-2's whole, and text that tokenizes to an id of {vocab} or more is outside "
                      f"the model (its embedding has no row for it, and no logit scores it); it knows no "
                      f"`{EOT_TEXT}`, so config.json names no bos or eos token.")
    else:
        vocab_note = f"Its vocabulary and tokenizer are GPT-2's, {GPT2_VOCAB:,} tokens with `{EOT_TEXT}` ({EOT})."
    scores = "".join(f"- {name}: {line}\n" for name, line in about["scores"])
    needs = f"- needs: {fmt.needs}\n" if fmt.needs else ""
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- {fmt.model_type}
- train_gpt2
---

# {fmt.architecture} from train_gpt2.py

{fmt.about(shape, model_config, n_params)} {vocab_note}

- weights: {about["source"]}
- trained on: {about["trained"]}
- validation: {about["validation"]}
{scores}{needs}
```python
from transformers import pipeline
print(pipeline("text-generation", model="path/to/this/directory")("Hello, I'm a language model,")[0]["generated_text"])
```

Made with `{about["command"]}`.
"""
