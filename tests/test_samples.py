"""Samples are printed for a person to read: the decoded text as it is, line breaks and all, each sample under a
header line and the last followed by an end line; never as a Python string literal."""
import re

from helpers import SAMPLE_HEADER, TINY, one_thread, printed_samples, read_log, run_main, shards, val_records  # noqa: F401


def test_samples_print_as_text_with_real_line_breaks(shards, tmp_path, capsys):
    """A prompt of three lines (a play's speakers) comes back as three lines at the start of every sample, printed at
    each evaluation; a control character the model might sample (here, in the prompt) shows as its symbol."""
    args = TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--vocab-size", "50304", "--max-steps", "2",
                   "--eval-every", "2", "--num-samples", "3", "--max-new-tokens", "6", "--prompt", "ROMEO:\nJULIET:\nNURSE:\x1b[2J"]
    code, out, err = run_main(args, capsys)
    assert code == 0 and err == "", err
    samples = printed_samples(out)
    assert [(i, n, step) for i, n, step, _ in samples] == [(1, 3, 0), (2, 3, 0), (3, 3, 0), (1, 3, 2), (2, 3, 2), (3, 3, 2)]
    assert len(re.findall(SAMPLE_HEADER, out, re.M)) == 6 and out.count("\n--- end of samples ---\n") == 2
    for *_, text in samples:
        lines = text.split("\n")
        assert lines[:2] == ["ROMEO:", "JULIET:"] and lines[2].startswith("NURSE:␛[2J") and len(text) > len("ROMEO:\nJULIET:\nNURSE:␛[2J")
    assert "\\n" not in out and "\x1b" not in out and "'ROMEO" not in out and '"ROMEO' not in out  # no string literals
    assert sorted(val_records(read_log(tmp_path / "log"))) == [0, 2]
    # each evaluation's samples follow its validation line, and end before training goes on
    val_line = out.index("step     0 | val loss")
    assert val_line < out.index("--- sample 1/3 (step 0) ---") < out.index("--- end of samples ---") < out.index("step     0 | loss")
