"""evaluation/core_score.py: the CORE score of tiny models on a small bundle written here in the real one's layout
(2- and 4-option multiple choice, schema, 0-, 3- and 10-shot language modeling, delimiters other than a space,
prompts longer than the model's context), each example's choice checked against a plain one-example-at-a-time
reference that renders nanochat's prompts with its Jinja templates; ranks, FSDP and torch.compile; the download,
offline, and bad bundles."""
import contextlib
import functools
import json
import os
import random
import re
import shutil
import socket
import string
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jinja2 import Template
from test_hellaswag import TINY_MODEL, checkpoint_holding
from torch._dynamo.testing import CompileCounter

import train_gpt2
from evaluation import core_bundle, core_score
from helpers import (
    REPO,
    TINY,
    expect_usage_error,
    read_log,
    resolved,
    run_main,
    run_script,
    tiny_gpt,
    write_shards,
)
from machinery import downloads
from machinery.errors import UsageError
from machinery.tokenizer import EOT, gpt2_tokenizer

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import core_speed  # noqa: E402

BLOCK = 32  # the tiny models' context: the few-shot prompts outgrow it

# -----------------------------------------------------------------------------
# A bundle in the real one's layout


def phrases(seed, count, words=(3, 9)):
    """Text from the play, count phrases of a few words each."""
    with open(os.path.join(REPO, "input.txt")) as f:
        vocabulary = f.read(60000).split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(*words))) for _ in range(count)]


def bundle_tasks(model):
    """{label: (core.yaml entry, random baseline in percent, examples)}: the shapes of the real tasks, and text that
    tests the prompts' whitespace (a context with trailing spaces, an option ending in one, options sharing their
    first token, an option that is all of another's tokens and more). Half the 0-shot language modeling examples
    continue with the word model predicts, so that some are right."""
    text = phrases(0, 400)
    pick = iter(text).__next__
    mc2 = [{"query": pick(), "choices": [pick(), pick()], "gold": i % 2} for i in range(8)]
    mc4 = [{"query": f"Question: {pick()}?", "choices": [pick() for _ in range(4)], "gold": i % 4} for i in range(8)]
    mc4[3]["choices"] = ["the king", "the queen", "a king", "the"]  # a shared first token; one a prefix of another
    mc4[5]["query"] += "  "  # whitespace before the delimiter: its prompt is tokenized whole
    schema = [{"context_options": [f"{pick()} because he", f"{pick()} because she "], "continuation": pick(),
               "gold": i % 2} for i in range(8)]
    lm0 = [{"context": pick() + " " + pick() + "  \n", "continuation": pick().split()[0]} for _ in range(8)]
    for example in lm0[::2]:
        example["continuation"] = predicted_word(model, example["context"].strip()) or example["continuation"]
    lm3 = [{"context": f"Question: {pick()}", "continuation": pick()} for _ in range(8)]
    lm10 = [{"context": pick(), "continuation": pick().split()[-1], "category": "extra fields are ignored"}
            for _ in range(12)]
    return {
        "copa_like": ({"icl_task_type": "multiple_choice", "num_fewshot": [0]}, 50, mc2),
        "arc_like": ({"icl_task_type": "multiple_choice", "num_fewshot": [3], "continuation_delimiter": "\nAnswer: "},
                     25, mc4),
        "winograd_like": ({"icl_task_type": "schema", "num_fewshot": [2]}, 50, schema),
        "lambada_like": ({"icl_task_type": "language_modeling", "num_fewshot": [0]}, 0, lm0),
        "jeopardy_like": ({"icl_task_type": "language_modeling", "num_fewshot": [3],
                           "continuation_delimiter": "\nAnswer: "}, 0, lm3),
        "squad_like": ({"icl_task_type": "language_modeling", "num_fewshot": [10]}, 0, lm10),
    }


def write_bundle(directory, tasks):
    """The bundle's eval_bundle/ directory: core.yaml, eval_meta_data.csv (with DCLM's other columns), eval_data/."""
    lines, meta = ["icl_tasks:"], ["Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,Description"]
    for label, (entry, baseline, examples) in tasks.items():
        uri = f"synthetic/{label}.jsonl"
        lines += [f"-\n  label: {label}\n  dataset_uri: {uri}"] + [f"  {k}: {json.dumps(v)}" for k, v in entry.items()]
        shots = entry["num_fewshot"][0]
        meta.append(f'{label},test,{entry["icl_task_type"]},{shots},{len(examples)},{baseline},"quoted, as DCLM\'s"')
        path = directory / "eval_data" / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(example) + "\n" for example in examples))
    (directory / "core.yaml").write_text("\n".join(lines) + "\n")
    (directory / "eval_meta_data.csv").write_text("\n".join(meta) + "\n")
    return directory


def predicted_word(model, text):
    """The word model predicts after text, if its greedy next token is a space and a word that tokenizes back to it."""
    enc = gpt2_tokenizer()
    with torch.no_grad():
        logits, _ = model(torch.tensor([[EOT] + enc.encode_ordinary(text)]))
    token = logits[0, -1].argmax().item()
    word = enc.decode([token])
    return word[1:] if re.fullmatch(r" [A-Za-z]+", word) and enc.encode_ordinary(word) == [token] else None


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return str(write_bundle(tmp_path_factory.mktemp("bundle") / "eval_bundle", bundle_tasks(tiny_model())))


def tiny_model(recipe="gpt2"):
    """A random 2-layer model of GPT-2's vocabulary; weights larger than at init, so that options' losses differ."""
    model = tiny_gpt(block_size=BLOCK, n_head=2, n_embd=16, recipe=recipe)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    return model.eval()


# -----------------------------------------------------------------------------
# The reference: nanochat's prompts (its Jinja templates), one example a forward pass

FEWSHOT = "{%- for example in fewshot_examples -%}\n"
TEMPLATES = {
    "multiple_choice": FEWSHOT + "{{ example.query }}{{ continuation_delimiter }}{{ example.choices[example.gold] }}"
    "\n\n{% endfor -%}\n{{ item.query }}{{ continuation_delimiter }}{{ choice }}",
    "schema": FEWSHOT + "{{ example.context_options[example.gold] }}{{ continuation_delimiter }}"
    "{{ example.continuation }}\n\n{% endfor -%}\n{{ context }}{{ continuation_delimiter }}{{ item.continuation }}",
    "language_modeling": FEWSHOT + "{{ example.context | trim }}{{ continuation_delimiter }}{{ example.continuation }}"
    "\n\n{% endfor -%}\n{{ item.context | trim }}{{ continuation_delimiter }}"
    "{% if include_continuation %}{{ item.continuation }}{% endif %}",
}


def reference_rows(task, data, index):
    """nanochat's token rows of data[index] and the scored [start, end) of each, before cropping."""
    enc, item = gpt2_tokenizer(), data[index]
    shots = []
    if task.num_fewshot:
        others = [i for i in range(len(data)) if i != index]
        shots = [data[i] for i in random.Random(1234 + index).sample(others, task.num_fewshot)]
    template = Template(TEMPLATES[task.kind])
    context = dict(fewshot_examples=shots, continuation_delimiter=task.delimiter, item=item)
    if task.kind == "multiple_choice":
        prompts = [template.render(choice=choice, **context) for choice in item["choices"]]
    elif task.kind == "schema":
        prompts = [template.render(context=option, **context) for option in item["context_options"]]
    else:
        prompts = [template.render(include_continuation=False, **context).strip(),
                   template.render(include_continuation=True, **context)]
    rows = [[EOT] + enc.encode_ordinary(prompt) for prompt in prompts]
    if task.kind == "language_modeling":
        return [(rows[1], len(rows[0]), len(rows[1]))]
    if task.kind == "multiple_choice":
        start = next((i for i in range(min(map(len, rows))) if len({row[i] for row in rows}) > 1), min(map(len, rows)))
        return [(row, start, len(row)) for row in rows]
    suffix = next((i for i in range(min(map(len, rows))) if len({row[-1 - i] for row in rows}) > 1),
                  min(map(len, rows)))
    return [(row, len(row) - suffix, len(row)) for row in rows]


def reference_outcome(model, task, data, index):
    """One example's outcome, its rows in one forward pass, as nanochat scores it: (outcome, the gap between the best
    two options' mean losses, which must be far above float noise for the comparison to mean anything)."""
    cropped = []
    for row, start, end in reference_rows(task, data, index):
        crop = max(0, len(row) - BLOCK)
        cropped.append((row[crop:], max(1, start - crop), end - crop))
    width = max(len(row) for row, _, _ in cropped)
    tokens = torch.tensor([row + [EOT] * (width - len(row)) for row, _, _ in cropped])
    with torch.no_grad():
        logits, _ = model(tokens)
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    predictions = logits[:, :-1].argmax(dim=-1)
    if task.kind == "language_modeling":
        (row, start, end), = cropped
        return int(predictions[0, start - 1:end - 1].tolist() == row[start:end]), None
    means = [losses[i, start - 1:end - 1].mean().item() for i, (_, start, end) in enumerate(cropped)]
    finite = sorted(mean for mean in means if mean == mean)
    return means.index(min(means)), finite[1] - finite[0]


def reference_outcomes(model, tasks, max_per_task=None):
    """{label: each example's outcome} over the examples nanochat evaluates: shuffled by random.Random(1337), the first
    max_per_task."""
    outcomes = {}
    for task in tasks:
        data = list(task.examples)
        random.Random(1337).shuffle(data)
        data = data[:max_per_task]
        scored = [reference_outcome(model, task, data, index) for index in range(len(data))]
        assert all(gap is None or gap > 1e-4 for _, gap in scored), task.label  # no choice float noise could flip
        outcomes[task.label] = [outcome for outcome, _ in scored]
    return outcomes


def test_prompts_are_nanochats(bundle):
    """Every example's rows, whole and subset (a subset's few-shot examples are drawn from it): the tokens nanochat's
    templates render, the scored ranges it finds; tokenized in pieces, with the few-shot examples' shared."""
    enc, tasks = gpt2_tokenizer(), core_score.load(bundle, "", 0).tasks
    for task in tasks:
        for max_per_task in (None, 11):
            data, cache = core_score.chosen_examples(task, max_per_task), {}
            for index in range(len(data)):
                ours = [(np.concatenate(row.arrays).tolist(), row.start, row.end)
                        for row in core_score.rows_of(task, data, index, enc, 10**6, cache)]
                assert ours == reference_rows(task, data, index), (task.label, max_per_task, index)
            if task.num_fewshot:
                options = (core_score.option_texts(task, data, i) for i in range(len(data)))
                assert len(cache) < sum(map(len, options)) * 4


def test_text_is_split_only_where_gpt2s_tokens_split(bundle):
    """Two pieces tokenized apart give the tokens of the text whole wherever splits_cleanly says they split: random
    text of letters, digits, apostrophes, punctuation and every kind of whitespace (\x1c: Python's, not GPT-2's)."""
    enc, rng = gpt2_tokenizer(), random.Random(0)
    alphabet = string.ascii_letters[:6] + "07'.,-!" + " \n\t\r\x0b\x0c\xa0\u2009\u3000\x1c\x85" + "é中"
    split = 0
    for _ in range(3000):
        left, right = ("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(2))
        if core_score.splits_cleanly(left, right):
            split += 1
            assert enc.encode_ordinary(left) + enc.encode_ordinary(right) == enc.encode_ordinary(left + right), \
                (left, right)
    assert split > 200  # of 3000: enough splits to have met each kind of boundary


def test_fewshot_draws_are_nanochats():
    """random.Random(1234 + i).sample() of the other indices, without the list of them: the same draws."""
    for n, k in [(2, 1), (11, 10), (30, 3), (30, 10), (500, 10), (10042, 10)]:
        for index in {0, 1, n // 2, n - 1}:
            others = [i for i in range(n) if i != index]
            want = random.Random(1234 + index).sample(others, k)
            assert core_score.fewshot_indices(index, n, k) == want, (n, k, index)


@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_choices_match_a_plain_one_example_at_a_time_reference(bundle, recipe):
    """Each example's choice, and so each task's accuracy, equal the reference's: many rows a forward pass, padded to
    the pass's longest or, as for a compiled model, to one of 3 shapes, with a fixed count of scored positions."""
    model, loaded = tiny_model(recipe), core_score.load(bundle, "", 0)
    expected = reference_outcomes(model, loaded.tasks)
    eager = core_score.evaluate(model, loaded, "cpu", contextlib.nullcontext(), block_size=BLOCK, tokens_per_pass=512,
                          fixed_shapes=False)
    assert eager.outcomes == expected
    rows = loaded.prepared[None, BLOCK, 0, 1].rows
    assert len(core_score.batches(rows, 512, BLOCK, fixed_shapes=False)) * 8 < len(rows)
    fixed = core_score.evaluate(model, loaded, "cpu", contextlib.nullcontext(), block_size=BLOCK, tokens_per_pass=128,
                          fixed_shapes=True)
    assert fixed.outcomes == expected
    shapes = {shape for _, shape in core_score.batches(loaded.prepared[None, BLOCK, 0, 1].rows, 128, BLOCK, True)}
    assert len(shapes) == 2 and {scored for _, _, scored in shapes} == {BLOCK}  # 32 and 16 long, no 8-long row
    right = {task.label: [outcome == (1 if task.kind == "language_modeling" else example["gold"])
                          for outcome, example in zip(expected[task.label], core_score.chosen_examples(task, None))]
             for task in loaded.tasks}
    assert eager.accuracy == fixed.accuracy == {label: sum(r) / len(r) for label, r in right.items()}
    if recipe == "gpt2":
        assert 0 < eager.accuracy["lambada_like"] < 1  # half its examples made to be right: both kinds are tested
    baselines = {"copa_like": 0.5, "arc_like": 0.25, "winograd_like": 0.5}
    centered = {label: (a - baselines.get(label, 0)) / (1 - baselines.get(label, 0))
                for label, a in eager.accuracy.items()}
    assert eager.centered == pytest.approx(centered) and eager.core == pytest.approx(sum(centered.values()) / 6)
    assert eager.examples == 52 and eager.line().startswith(f"core {eager.core:.4f} (6 tasks, 52 examples, ")


def test_the_benchmarks_bundle_has_the_real_shape_and_its_plain_evaluation_chooses_as_ours(tmp_path):
    """benchmarks/core_speed.py: a synthetic bundle of DCLM's 22 tasks and 91,037 examples, and the one-example-a-pass
    evaluation it times ours against, which must choose as ours does (here on the tasks of one kind each)."""
    assert len(core_speed.REAL_SHAPE) == 22 and sum(shape[4] for shape in core_speed.REAL_SHAPE.values()) == 91037
    loaded = core_score.load(core_speed.synthetic_bundle(str(tmp_path), 11), "", 0)
    kept = ("copa", "winograd", "lambada_openai")
    loaded = core_score.Bundle([task for task in loaded.tasks if task.label in kept], {})
    model = tiny_model()
    ours = core_score.evaluate(model, loaded, "cpu", contextlib.nullcontext(), block_size=BLOCK, fixed_shapes=False)
    plain = {task.label: core_speed.plain_outcomes(model, task, None, BLOCK, "cpu", contextlib.nullcontext())
             for task in loaded.tasks}
    assert plain == ours.outcomes and len(plain) == 3


# -----------------------------------------------------------------------------
# In the trainer: --eval-only on one rank, compiled; on two under FSDP; the export's model card

FLAGS = [*TINY_MODEL, "--n-embd", "16", "--block-size", str(BLOCK)]  # the later flags win: tiny_model()'s shapes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint that train_gpt2.py wrote, holding tiny_model()'s weights, and its run's shards."""
    root = tmp_path_factory.mktemp("run")
    shards = write_shards(root / "data")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdout", open(os.devnull, "w"))
        path = checkpoint_holding(tiny_model(), shards, root / "log", _NoCapture(), "--n-embd", "16",
                                  "--block-size", str(BLOCK))
    return str(path), shards


class _NoCapture:
    def readouterr(self):
        return "", ""


def eval_only(checkpoint, shards, log_dir, *flags):
    return ["--eval-only", "--resume", checkpoint, "--core-every", "1", "--data", shards, "--log-dir", log_dir, *FLAGS,
            *flags]


def test_eval_only_compiled_then_two_ranks_under_fsdp(bundle, checkpoint, tmp_path, capsys, monkeypatch):
    """--eval-only --core-every 1 logs the line and record of core_score.evaluate's (eager) on the checkpoint's weights,
    compiled (dynamo traces, its graphs run eagerly): a graph a shape; 2 ranks under --fsdp, each scoring half the
    examples, log the same; an export of the checkpoint names it in its model card, and scores the same with
    --init-from."""
    ckpt, shards = checkpoint
    log_dir = os.path.dirname(ckpt)
    expected = core_score.evaluate(tiny_model(), core_score.load(bundle, "", 0), "cpu", contextlib.nullcontext(),
                             block_size=BLOCK, fixed_shapes=False)
    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))  # traces, runs eagerly
    torch._dynamo.reset()
    code, out, err = run_main(eval_only(ckpt, shards, log_dir, "--core-data", bundle, "--compile"), capsys)
    assert code == 0, err
    assert re.fullmatch(rf"step     1 \| core {expected.core:.4f} \(6 tasks, 52 examples, \d+ s\)",
                        out.strip().splitlines()[-1])
    logged = read_log(log_dir)[-1]
    assert {key: logged[key] for key in expected.record()} == expected.record()
    assert logged["eval_only"] and logged["step"] == 1
    assert counter.frame_count <= 1 + core_score.SHAPES  # the validation loss's graph, and one a shape

    two = run_script(eval_only(ckpt, shards, log_dir, "--core-data", bundle, "--fsdp"), cwd=tmp_path, nproc=2,
                     timeout=180)
    assert two.returncode == 0, two.stderr
    assert two.stdout.strip().splitlines()[-1].startswith(f"step     1 | core {expected.core:.4f} (6 tasks, 52 ")
    logged = read_log(log_dir)[-1]  # rank 0 alone logs
    assert {key: logged[key] for key in expected.record()} == expected.record()

    code, _, err = run_main(["--export-hf", tmp_path / "hf", "--resume", ckpt], capsys)
    assert code == 0, err
    card = open(tmp_path / "hf" / "README.md").read()
    assert f"- CORE: {expected.core:.4f} at step 1, on 52 examples of 6 tasks, scored as nanochat" in card
    code, _, err = run_main(["--eval-only", "--init-from", tmp_path / "hf", "--core-every", "1", "--core-data", bundle,
                             "--data", shards, "--log-dir", tmp_path / "evals", *FLAGS], capsys)
    assert code == 0, err  # the export's weights: GPT-2's 50,257 token rows of the checkpoint's 50,304
    assert read_log(tmp_path / "evals")[-1]["core_accuracy"] == expected.accuracy


def test_training_evaluates_every_n_steps_and_at_the_end(bundle, checkpoint, tmp_path, capsys):
    _, shards = checkpoint
    code, _, err = run_main([*FLAGS, "--data", shards, "--log-dir", tmp_path, "--max-steps", "3", "--warmup-steps", "1",
                             "--core-every", "2", "--core-data", bundle], capsys)
    assert code == 0, err
    logged = [record for record in read_log(tmp_path) if "core" in record]
    assert [record["step"] for record in logged] == [0, 2, 3]
    assert all(record["core_examples"] == 52 and len(record["core_accuracy"]) == 6 for record in logged)


def test_model_cards_of_openais_weights_give_nanochats_measure():
    assert core_score.card_line(None, published="gpt2").startswith("0.1139, as nanochat measured OpenAI's gpt2")
    assert core_score.card_line(None, published="random weights").startswith("not measured at these weights")


# -----------------------------------------------------------------------------
# The download, once; offline; bad bundles, each a line


def zipped(bundle, directory):
    """eval_bundle.zip of the bundle, as the real one holds it (eval_bundle/...), in directory."""
    path = directory / "eval_bundle.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for root, _, files in os.walk(bundle):
            for name in files:
                full = os.path.join(root, name)
                archive.write(full, os.path.join("eval_bundle", os.path.relpath(full, bundle)))
    return path


@pytest.fixture
def served_bundle(bundle, static_server, monkeypatch):
    """The bundle's zip served as $CORE_BUNDLE_URL, its checksum the one expected; the server's request log."""
    www, base_url = static_server
    path = zipped(bundle, www)
    monkeypatch.setenv("CORE_BUNDLE_URL", f"{base_url}/eval_bundle.zip")
    monkeypatch.setattr(core_bundle, "CORE_BUNDLE_SHA256", downloads.sha256_of(path))
    return static_server


def test_download_once_then_from_the_cache(bundle, served_bundle, tmp_path):
    cache = tmp_path / "cache"
    local = core_score.load(bundle, "", 0).tasks
    downloaded = core_score.load("", str(cache), 0).tasks
    assert [task._replace(path="") for task in downloaded] == [task._replace(path="") for task in local]
    assert sorted(os.listdir(cache)) == ["eval_bundle", "eval_bundle.lock"]  # no zip, no temp file left
    assert len(served_bundle.log) == 1
    (served_bundle[0] / "eval_bundle.zip").unlink()  # the server no longer has it: the cache must answer
    assert core_score.load("", str(cache), 0).tasks == downloaded and len(served_bundle.log) == 1


def test_a_run_waits_for_anothers_download(bundle, served_bundle, tmp_path):
    """While another process holds the cache's lock (downloading), a run waits for it, then reads what it unpacked:
    no second download."""
    cache = tmp_path / "cache"
    cache.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, shutil, sys, time\n"
        f"lock = open({str(cache / 'eval_bundle.lock')!r}, 'a')\n"
        "fcntl.lockf(lock, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(0.5)\n"
        f"shutil.copytree({bundle!r}, {str(cache / 'eval_bundle')!r})\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    assert len(core_score.load("", str(cache), 0).tasks) == 6
    assert holder.wait() == 0 and served_bundle.log == []


def test_offline_and_bad_downloads_are_one_line_and_cache_nothing(bundle, served_bundle, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(downloads, "RETRYING", downloads.Retrying(delay=0))  # offline: 10 retries, at once here
    monkeypatch.setattr(core_bundle, "CORE_BUNDLE_SHA256", "0" * 64)  # a mirror's other bundle, or a damaged download
    url = re.escape(os.environ["CORE_BUNDLE_URL"])
    with pytest.raises(UsageError, match=rf"^downloaded {url} is not a valid CORE bundle \(its sha256 is "
                                         rf"[0-9a-f]{{64}}, not 0{{64}}\); nothing was cached; retry, or pass "
                                         rf"--core-data DIR"):
        core_score.load("", str(cache), 0)
    assert os.listdir(cache) == ["eval_bundle.lock"]
    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CORE_BUNDLE_URL", f"http://127.0.0.1:{s.getsockname()[1]}/eval_bundle.zip")
    with pytest.raises(UsageError, match=r"^could not download http://127\.0\.0\.1:\d+/eval_bundle\.zip \(Connection "
                                         r"refused; gave up after 10 retries\); pass --core-data DIR"):
        core_score.load("", str(cache), 0)
    (tmp_path / "a_file").write_text("")  # fails for root too, unlike a read-only directory
    with pytest.raises(UsageError, match="cannot write to the cache directory .*a_file/cache .*; pass --cache-dir"):
        core_score.load("", str(tmp_path / "a_file" / "cache"), 0)


def test_offline_eval_only_stops_with_one_line(checkpoint, tmp_path, capsys, monkeypatch):
    ckpt, shards = checkpoint
    monkeypatch.setattr(downloads, "RETRYING", downloads.Retrying(delay=0))  # offline: 10 retries, at once here
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CORE_BUNDLE_URL", f"http://127.0.0.1:{s.getsockname()[1]}/eval_bundle.zip")
    expect_usage_error(eval_only(ckpt, shards, tmp_path / "log", "--cache-dir", tmp_path / "cache"), capsys,
                       "could not download http://127.0.0.1:", "pass --core-data DIR")


def rewrite(path, change):
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(change(text))


@pytest.mark.parametrize("damage, fragments", [
    (lambda d: os.remove(d / "eval_data/synthetic/arc_like.jsonl"),
     ["CORE task arc_like: its file ", "arc_like.jsonl is missing; fix it, or pass --core-data"]),
    (lambda d: rewrite(d / "core.yaml", lambda t: t.replace("icl_task_type: \"schema\"", "icl_task_type: generation")),
     ["core.yaml: task 3 (winograd_like) has icl_task_type 'generation'; CORE knows multiple_choice, schema, "
      "language_modeling"]),
    (lambda d: rewrite(d / "eval_meta_data.csv", lambda t: t.replace("lambada_like,", "lambada,")),
     ["core.yaml: task 4 (lambada_like) is not in ", "eval_meta_data.csv (its \"Eval Task\" column)"]),
    (lambda d: rewrite(d / "eval_meta_data.csv", lambda t: t.replace(",25,", ",x,")),
     ["eval_meta_data.csv: line 3 has no random baseline from 0 to 100"]),
    (lambda d: rewrite(d / "eval_data/synthetic/arc_like.jsonl", lambda t: t.replace("\n", "\nnot json\n", 1)),
     ["CORE task arc_like: ", "arc_like.jsonl: line 2 is not a multiple_choice example (", "it needs query, choices, "
      "gold)"]),
    (lambda d: rewrite(d / "eval_data/synthetic/winograd_like.jsonl", lambda t: t.replace('"gold": 1', '"gold": 2', 1)),
     ["winograd_like.jsonl: line 2 is not a schema example (its gold 2 is not the index of one of its "
      "context_options"]),
    (lambda d: rewrite(d / "eval_data/synthetic/squad_like.jsonl", lambda t: "".join(t.splitlines(True)[:10])),
     ["CORE task squad_like (", "squad_like.jsonl) is 10-shot, and an evaluation draws from 10 examples of it: each "
      "needs 10 others; fix it"]),
    (lambda d: rewrite(d / "core.yaml", lambda t: t.replace("label: arc_like", "label: copa_like")),  # it scored
     ["core.yaml: task 2 has the label copa_like, as task 1 has; each task needs a label of its own, naming its row "
      "of ", "eval_meta_data.csv (its random baseline)"]),
    (lambda d: rewrite(d / "eval_data/synthetic/arc_like.jsonl",  # its letters were taken for 3 choices
                       lambda t: re.sub(r'"choices": \[[^]]*\]', '"choices": "abc"', t, count=1)),
     ["arc_like.jsonl: line 1 is not a multiple_choice example (its choices is a str, not a list; it needs query"]),
    (lambda d: rewrite(d / "eval_data/synthetic/arc_like.jsonl",  # a RecursionError traceback
                       lambda t: t.replace("\n", "\n" + "[" * 100000 + "]" * 100000 + "\n", 1)),
     ["arc_like.jsonl: line 2 is not a multiple_choice example (", "; it needs query, choices, gold)"]),
    (lambda d: open(d / "eval_data/synthetic/arc_like.jsonl", "ab").write(b'{"query": "\xff"}\n'),  # not UTF-8
     ["CORE task arc_like: cannot read ", "arc_like.jsonl ('utf-8' codec can't decode byte 0xff in position "]),
    (lambda d: os.remove(d / "core.yaml"), ["no core.yaml in it; pass --core-data the eval_bundle directory"]),
    (lambda d: rewrite(d / "core.yaml", lambda t: t + "  - [unclosed"), ["cannot read ", "core.yaml ("]),
    (lambda d: rewrite(d / "core.yaml", lambda t: t + "-\n  label: " + "[" * 1000 + "]" * 1000),  # a traceback
     ["cannot read ", "core.yaml ("]),
])
def test_a_bad_bundle_is_one_line_naming_its_file(bundle, tmp_path, damage, fragments):
    copy = shutil.copytree(bundle, tmp_path / "eval_bundle")
    damage(copy)
    with pytest.raises(UsageError) as error:
        core_score.load(str(copy), "", 0)
    assert all(fragment in str(error.value) for fragment in fragments), str(error.value)
    assert "\n" not in str(error.value)


def test_too_few_examples_a_task_for_its_shots(bundle, checkpoint, tmp_path, capsys):
    ckpt, shards = checkpoint
    expect_usage_error(eval_only(ckpt, shards, tmp_path / "log", "--core-data", bundle, "--core-max-per-task", "5"),
                       capsys, "CORE task squad_like (", "is 10-shot, and an evaluation draws from 5 examples",
                       "raise --core-max-per-task above 10")
    with pytest.raises(UsageError, match="squad_like .* is 10-shot, and an evaluation draws from 10 examples"):
        core_score.load(bundle, "", 10)


# -----------------------------------------------------------------------------
# Settings: off without CUDA, as HellaSwag; every 2,000 steps on a GPU; GPT-2's whole vocabulary


def resolved_on(flags, device_type, capsys):
    capsys.readouterr()
    return resolved(flags, train_gpt2.Env(0, 0, 1, device_type, device_type)), capsys.readouterr().out


def test_core_is_off_without_cuda_and_on_with_it(shards, capsys):
    cfg, out = resolved_on(["--data", shards], "cpu", capsys)
    assert cfg.core_every == cfg.hellaswag_every == 0
    assert ("no HellaSwag or CORE on cpu (too slow without CUDA) sets: --hellaswag-every 0 (default: 250), "
            "--core-every 0 (default: 2000)") in " ".join(out.split())  # the lines wrapped
    cfg, out = resolved_on(["--data", shards, "--core-every", "10"], "cpu", capsys)
    assert (cfg.core_every, cfg.hellaswag_every) == (10, 0) and "no HellaSwag on cpu" in out and "CORE" not in out
    cfg, out = resolved_on(["--data", shards, "--dtype", "fp32"], "cuda", capsys)
    assert (cfg.core_every, cfg.core_max_per_task) == (2000, 0) and "CORE" not in out
    assert [core_score.examples_per_task(0, final) for final in (False, True)] == [500, None]  # nanochat's
    assert [core_score.examples_per_task(7, final) for final in (False, True)] == [7, 7]


def test_core_needs_gpt2s_vocabulary(shards, tmp_path, capsys):
    expect_usage_error(TINY + ["--data", shards, "--log-dir", tmp_path, "--core-every", "5"], capsys,
                       "--core-every 5 needs GPT-2's whole vocabulary, but --vocab-size is 128; pass --core-every 0")
    expect_usage_error(TINY + ["--data", shards, "--log-dir", tmp_path, "--core-max-per-task", "-1"], capsys,
                       "--core-max-per-task must be zero or more")
