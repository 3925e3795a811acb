"""A run's sense of progress and time: each step line gives the step out of the total and the time left at this
launch's pace; log.jsonl keeps the run's training time (elapsed_s) across its launches, for plots against wall-clock
time; the checkpoint keeps it, and the end of a resumed run gives the whole run's time and this launch's."""
import re
import shlex

import torch

from helpers import TINY, checkpoint_path, read_log, run_main, train_records
from machinery import run_log

LEFT = re.compile(r"^step +(\d+)/(\d+) \|.*\| ([^|]+) left$", re.M)


def test_durations_read_at_a_glance():
    assert [run_log.duration(s) for s in (0, 0.4, 45, 59.6, 60, 725, 3599, 3600, 12000, 86399, 86400, 183600)] == [
        "0s", "0s", "45s", "1m 00s", "1m 00s", "12m 05s", "59m 59s", "1h 00m", "3h 20m", "23h 59m", "1d 00h",
        "2d 03h"]


def test_step_lines_show_the_step_of_the_total_and_the_time_left_at_the_pace(shards, tmp_path, capsys):
    code, out, err = run_main(TINY + ["--data", shards, "--log-dir", tmp_path, "--max-steps", "6"], capsys)
    assert code == 0, err
    steps = train_records(read_log(tmp_path))
    assert [f"step {s:5d}/6 |" in out for s in range(6)] == [True] * 6
    left = {int(step): text for step, total, text in LEFT.findall(out)}
    assert sorted(left) == [1, 2, 3, 4]  # none after the first step (it compiles) nor after the last
    for step, text in left.items():  # the pace since the end of the first step, from the times the log records
        pace = (steps[step]["elapsed_s"] - steps[0]["elapsed_s"]) / step
        assert text == run_log.duration(pace * (6 - step - 1)), step


def test_a_resumed_run_counts_the_time_of_all_its_launches(shards, tmp_path, capsys):
    args = TINY + ["--data", shards, "--log-dir", tmp_path]
    assert run_main(args + ["--max-steps", "3"], capsys)[0] == 0
    first = train_records(read_log(tmp_path))
    assert 0 < first[0]["elapsed_s"] < first[1]["elapsed_s"] < first[2]["elapsed_s"]
    ckpt = torch.load(checkpoint_path(tmp_path, 3), weights_only=True)
    assert ckpt["trained_seconds"] >= first[2]["elapsed_s"]
    ckpt["trained_seconds"] = 2 * 3600 + 65.0  # as if the first launch had trained for two hours
    torch.save(ckpt, checkpoint_path(tmp_path, 3))
    code, out, err = run_main(args + ["--max-steps", "5"], capsys)
    assert code == 0, err
    resumed = train_records(read_log(tmp_path))
    assert 7265 < resumed[3]["elapsed_s"] < resumed[4]["elapsed_s"] < 7265 + 60
    done = out.strip().splitlines()[-1]
    assert re.match(r"done: step 5, val loss \d+\.\d+, trained for 2h 01m \(\d+s in this launch\);", done), done
    assert torch.load(checkpoint_path(tmp_path, 5), weights_only=True)["trained_seconds"] > 7265


def test_the_last_line_gives_a_command_that_pastes_whatever_the_path(shards, tmp_path, capsys):
    """A --log-dir with a space (and a quote) in its name: the command for more samples is quoted for the shell."""
    log_dir = tmp_path / "Bob's run 1"
    code, out, err = run_main(TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "1"], capsys)
    assert code == 0, err
    command = out.strip().splitlines()[-1].split("; for more samples: ")[1]
    assert shlex.split(command) == ["python", "train_gpt2.py", "--sample", checkpoint_path(log_dir, 1)]
