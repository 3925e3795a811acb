"""fineweb.py end to end: real subprocesses against a fake Hugging Face hub served on 127.0.0.1."""

import http.server
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from urllib.parse import parse_qs, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import train_gpt2
from helpers import REPO, expect_usage_error, process_stat, resolved, run_command, run_main, serving, start_command
from machinery.tokenizer import EOT, gpt2_tokenizer

FINEWEB = os.path.join(REPO, "fineweb.py")
DATASET = "HuggingFaceFW/fineweb-edu"
SUBSET = "sample/10BT"

# -----------------------------------------------------------------------------
# the reference: tiktoken's encode_ordinary per document, each prefixed by <|endoftext|>

gpt2 = gpt2_tokenizer()

def reference_stream(docs):
    return np.array([t for doc in docs for t in [EOT] + gpt2.encode_ordinary(doc)], dtype=np.uint16)

def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()

def expected_shards(docs, shard_size, prefix):
    stream = reference_stream(docs)
    return {f"{prefix}_{'val' if i == 0 else 'train'}_{i:06d}.npy": npy_bytes(stream[start:start + shard_size])
            for i, start in enumerate(range(0, len(stream), shard_size))}

def shards_in(directory):
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory)) if name.endswith(".npy") and not name.startswith(".")}

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when what if can who more will no do so "
         "learning students photosynthesis mitochondria theorem école naïve 東京 数学 🙂 don't it's we'll 1984 3.14159 "
         "<|endoftext|> \n \n\n \t").split(" ")

def make_docs(seed, count):
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400))) for _ in range(count)]
    docs[1] = ""  # an empty document is still a document: just <|endoftext|>
    return docs

def write_parquet(path, docs, row_group_size=16, column="text"):
    table = pa.table({column: docs, "id": [f"<urn:{i}>" for i in range(len(docs))]})
    pq.write_table(table, path, row_group_size=row_group_size, compression="none")  # big enough for Range tests

def environment(env=None):
    return {**{k: v for k, v in os.environ.items() if k not in ("HF_ENDPOINT", "HF_TOKEN")}, **(env or {})}

def run_fineweb(*args, env=None, **how):
    """python fineweb.py ARGS, forked by the tests' fork server (how: its limits and ignored signals): the
    CompletedProcess."""
    return run_command([sys.executable, FINEWEB, *map(str, args)], None, environment(env), timeout=120, **how)

def fineweb_after(setup, *args):
    """The command line of python fineweb.py ARGS, with the statement setup run first in that process."""
    code = f"import runpy, sys; {setup}; sys.argv[0] = {FINEWEB!r}; runpy.run_path({FINEWEB!r}, run_name='__main__')"
    return [sys.executable, "-c", code, *map(str, args)]

def start_fineweb(*args, stdout=subprocess.PIPE):
    """python fineweb.py ARGS, started with Ctrl-C's SIGINT raising KeyboardInterrupt as in a terminal: a shell's
    background job (CI's, maybe) ignores SIGINT, and this child would inherit that and shrug the test's SIGINT off;
    and SIGHUP as a terminal's, which nohup would have ignored."""
    setup = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); " \
            "signal.signal(signal.SIGHUP, signal.SIG_DFL)"
    return start_command(fineweb_after(setup, *args), None, environment(), stdout=stdout, stderr=subprocess.PIPE,
                         text=True)

def wait_until(condition, process, seconds=30):
    """Poll condition while the started run goes on; it must come true within seconds."""
    deadline = time.time() + seconds
    while not condition():
        assert process.poll() is None, process.communicate()[1]
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)

def finish(process, timeout):
    """The CompletedProcess of a started run, which must end within timeout seconds."""
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

def assert_error(result, *words):
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: "), result.stderr
    for word in words:
        assert word in last_line, last_line

# -----------------------------------------------------------------------------
# a fake hub: the tree API and resolve with Range, and ways to misbehave

class Hub(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.dataset = DATASET  # the dataset repository that the URLs must name
        self.files = {}  # repo path -> bytes
        self.token = None  # when set, requests need "Authorization: Bearer <token>"
        self.status = None  # when set, every request gets this status
        self.page = None  # when set, every request gets this HTML page, as from a proxy's login page
        self.fail = 0  # the next `fail` requests get HTTP 500
        self.drop_after = {}  # repo path -> [bytes sent before each of the next responses for it hangs up]
        self.content_length = True  # False: file bodies end with the connection, so a cut one looks whole
        self.on_request = None  # called with the repo path when a file is requested, before its body is sent
        self.corrupt = Counter()  # repo path -> responses left that serve it with a flipped byte
        self.page_size = None  # paginate the tree listing with Link headers, as the hub does
        self.rate = None  # bytes per second for file bodies
        self.hold = {}  # repo path -> (offset, threading.Event): its body pauses at offset until the event is set
        self.log = []  # (request path, Range header, status)
        self.served = Counter()  # repo path -> body bytes sent

    def add(self, name, docs, subset=SUBSET):
        path = f"{subset}/{name}"
        buffer = io.BytesIO()
        write_parquet(buffer, docs)
        self.files[path] = buffer.getvalue()
        return path

class HubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status, body=b"", headers=()):
        self.server.log.append((self.path, self.headers.get("Range"), status))
        self.send_response(status)
        for header in headers:
            self.send_header(*header)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        hub, url = self.server, urlparse(self.path)
        if hub.status:
            return self.reply(hub.status)
        if hub.page:
            return self.reply(200, hub.page.encode(), [("Content-Type", "text/html")])
        if hub.fail:
            hub.fail -= 1
            return self.reply(500)
        if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
            return self.reply(401)
        tree, resolve = f"/api/datasets/{hub.dataset}/tree/main/", f"/datasets/{hub.dataset}/resolve/main/"
        if url.path.startswith(tree):
            folder = url.path[len(tree):]
            entries = [{"type": "directory", "path": f"{folder}/nested", "oid": "0" * 40, "size": 0},
                       {"type": "file", "path": f"{folder}/README.md", "oid": "1" * 40, "size": 5}]
            entries += [{"type": "file", "path": path, "size": len(data), "oid": "2" * 40,
                         "lfs": {"oid": sha256(data), "size": len(data), "pointerSize": 134}}
                        for path, data in sorted(hub.files.items()) if path.startswith(folder + "/")]
            if not entries[2:]:
                return self.reply(404)
            headers = []
            if hub.page_size:
                cursor = int(parse_qs(url.query).get("cursor", ["0"])[0])
                if cursor + hub.page_size < len(entries):
                    headers.append(("Link", f'<{hub.url}{url.path}?cursor={cursor + hub.page_size}>; rel="next"'))
                entries = entries[cursor:cursor + hub.page_size]
            return self.reply(200, json.dumps(entries).encode(), headers)
        path = url.path[len(resolve):]
        if not url.path.startswith(resolve) or path not in hub.files:
            return self.reply(404)
        data = hub.files[path]
        if hub.corrupt[path]:
            hub.corrupt[path] -= 1
            data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
        start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
        if start >= len(data):
            return self.reply(416)
        if hub.on_request:
            hub.on_request(path)
        status = 206 if start else 200
        hub.log.append((self.path, self.headers.get("Range"), status))
        self.send_response(status)
        if hub.content_length:
            self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        stop_at = len(data)
        if hub.drop_after.get(path):
            stop_at = start + hub.drop_after[path].pop(0)
        step = 16384
        for offset in range(start, stop_at, step):
            if path in hub.hold and offset >= hub.hold[path][0]:
                hub.hold[path][1].wait(60)
            chunk = data[offset:min(offset + step, stop_at)]
            hub.served[path] += len(chunk)  # counted before the client can see it: no race with the test's asserts
            try:
                self.wfile.write(chunk)
            except OSError:
                return  # the client went away (killed)
            if hub.rate:
                time.sleep(len(chunk) / hub.rate)
        self.close_connection = True

def sha256(data):
    import hashlib
    return hashlib.sha256(data).hexdigest()

@pytest.fixture
def hub():
    with serving(Hub()) as server:
        yield server

HUB_DOCS = [make_docs(seed, 120) for seed in range(3)]  # three parquet files of ~160 KB, ~35k tokens each

def add_hub_files(hub):
    return [hub.add(f"{i:03d}_00000.parquet", docs) for i, docs in enumerate(HUB_DOCS)]

def hub_args(hub, output, *args):
    return ["--endpoint", hub.url, "--output", output, "--shard-size", 5000, "--retry-delay", 0.01, *args]

def hub_run(hub, output, *args, **kwargs):
    return run_fineweb(*hub_args(hub, output, *args), **kwargs)

def resolve_requests(hub, path):
    return [(r, status) for p, r, status in hub.log if p.endswith(path)]

# -----------------------------------------------------------------------------

def test_hub_pipeline_matches_tiktoken_per_document(hub, tmp_path):
    paths = add_hub_files(hub)
    hub.token, hub.page_size = "secret", 2
    output = tmp_path / "edu"
    result = run_fineweb("--output", output, "--shard-size", 5000, env={"HF_ENDPOINT": hub.url, "HF_TOKEN": "secret"})
    assert result.returncode == 0, result.stderr
    expected = expected_shards([doc for docs in HUB_DOCS for doc in docs], 5000, "edufineweb")
    assert shards_in(output) == expected  # exact names, boundaries and bytes
    assert list(expected)[:2] == ["edufineweb_val_000000.npy", "edufineweb_train_000001.npy"]
    manifest = json.loads((output / "manifest.json").read_text())
    assert [(s["path"], s["sha256"]) for s in manifest["sources"]] == [(p, sha256(hub.files[p])) for p in paths]
    assert manifest["shards"] == len(expected) and manifest["done"]
    assert not (output / "downloads").exists()  # each parquet is deleted once tokenized
    assert f"{len(expected)} shards" in result.stdout and "documents" in result.stdout

    # the same parquet files fetched some other way and prepared locally give the same shards
    fetched = tmp_path / "fetched" / "sample" / "10BT"
    fetched.mkdir(parents=True)
    for path in paths:
        (fetched / os.path.basename(path)).write_bytes(hub.files[path])
    local = run_fineweb("--input", tmp_path / "fetched", "--output", tmp_path / "local", "--prefix", "edufineweb",
                        "--shard-size", 5000)
    assert local.returncode == 0, local.stderr
    assert shards_in(tmp_path / "local") == expected

    requests_so_far = len(hub.log)
    again = run_fineweb("--output", output, "--shard-size", 5000, env={"HF_ENDPOINT": hub.url})
    assert again.returncode == 0 and "already complete" in again.stdout
    assert len(hub.log) == requests_so_far  # a finished run re-run touches nothing
    assert not (output / "downloads").exists()
    assert shards_in(output) == expected


@pytest.fixture(scope="module")
def big_text(tmp_path_factory):
    # one big .txt file is one unit: its worker is busy for seconds
    path = tmp_path_factory.mktemp("big") / "big.txt"
    path.write_text((" ".join(WORDS) + "\n") * 200_000)  # 68 MB, ~4 s of tokenizing
    return path

def busy_worker(process):
    """The pid of a child of process that is tokenizing."""
    deadline = time.time() + 60
    while time.time() < deadline and process.poll() is None:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            stat = process_stat(int(entry))
            if stat and stat[1] == process.pid and stat[2] > 0.3:
                return int(entry)
        time.sleep(0.01)
    raise AssertionError("no busy worker seen")

@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_workers_die_with_a_killed_main_process(big_text, tmp_path):
    # the case where an orphan would tokenize on alone and then crash with a BrokenPipeError traceback
    process = start_fineweb("--input", big_text, "--output", tmp_path / "out", "--workers", "1")
    worker = busy_worker(process)
    process.kill()
    process.wait()
    deadline = time.time() + 10  # it takes ~50 ms; the margin is for a loaded machine
    while process_stat(worker) and time.time() < deadline:
        time.sleep(0.01)
    assert process_stat(worker) is None, "the worker outlived the main process"
    _, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_worker_killed_mid_run_is_a_prompt_one_line_error(big_text, tmp_path):
    process = start_fineweb("--input", big_text, "--output", tmp_path / "out", "--workers", "1")
    os.kill(busy_worker(process), signal.SIGKILL)  # as the kernel's OOM killer does
    try:
        result = finish(process, timeout=20)  # its unit of work is lost: nothing must wait for it
    finally:
        process.kill()
    assert_error(result, "worker died", "memory", "--workers", "run the same command again")


def test_workers_stopped_while_sending_results_do_not_hang_the_pool():
    # Ctrl-C used to hang fineweb.py now and then: a worker terminated halfway through sending its tokens left the
    # pool's thread waiting for the rest of the message, and shutdown waited for that thread (17 stops in 20 hung)
    script = os.path.join(REPO, "tests", "scripts", "stop_workers_while_sending.py")
    result = run_command([sys.executable, script, REPO], None, dict(os.environ), timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "stopped", result.stderr


def test_workers_stopped_while_starting_do_not_hang_the_pool():
    # A run with nothing left to read (a resume past its last input) stops its pool as soon as it starts: a worker
    # still starting had the main process's SIGTERM handler, which the stop's SIGTERM ran, and the main process waited
    # for it forever (seen once in 15 runs of the suite, on a loaded machine)
    script = os.path.join(REPO, "tests", "scripts", "stop_workers_while_starting.py")
    try:
        result = run_command([sys.executable, script, REPO], None, dict(os.environ), timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("stop_workers waited for a worker that was still starting")
    assert result.returncode == 0 and result.stdout.strip() == "stopped", result.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="forkserver and fork are POSIX start methods")
def test_the_default_start_method_does_not_matter(tmp_path):
    # Python 3.14 made forkserver the default on Linux, where a worker's parent is the fork server
    (tmp_path / "a.txt").write_text("a few words " * 1000)
    command = fineweb_after("import multiprocessing; multiprocessing.set_start_method('forkserver')",
                            "--input", tmp_path / "a.txt", "--output", tmp_path / "out")
    result = run_command(command, None, dict(os.environ), timeout=60)
    assert result.returncode == 0, result.stderr
    assert shards_in(tmp_path / "out") == expected_shards([(tmp_path / "a.txt").read_text()], 10**8, "out")


def test_killed_and_interrupted_runs_resume_to_identical_shards(hub, tmp_path):
    paths = add_hub_files(hub)
    clean = hub_run(hub, tmp_path / "clean", "--workers", 1)
    assert clean.returncode == 0, clean.stderr
    hub.served.clear()

    output = tmp_path / "resumed"
    manifest = output / "manifest.json"

    def shards_done():
        try:
            return json.loads(manifest.read_text())["shards"]
        except (OSError, ValueError):
            return 0

    hub.rate = 200_000  # slow enough to stop it partway
    # each run is stopped with a download stalled halfway through a file: it cannot finish first, however late this
    # process gets to send the signal, and it must not wait for the stalled read; the target counts from where the
    # previous run stopped
    for signal_number, shards_before_stop, held in ((signal.SIGKILL, 1, paths[1]), (signal.SIGINT, 10, paths[2])):
        release, stall = threading.Event(), len(hub.files[held]) // 2
        hub.hold = {held: (stall, release)}
        target = max(shards_before_stop, shards_done() + 1)  # one shard of its own: past its imports, in prepare()
        process = start_fineweb(*hub_args(hub, output, "--workers", 2))
        try:
            wait_until(lambda: shards_done() >= target and hub.served[held] >= stall, process)  # noqa: B023 (now)
            process.send_signal(signal_number)
            _, stderr = process.communicate(timeout=15)
        finally:
            release.set()
            process.kill()
        assert process.returncode in (-signal.SIGKILL, 130), stderr
        assert "Traceback" not in stderr
        assert not json.loads(manifest.read_text())["done"]
    assert "run the same command again to resume" in stderr
    hub.rate, hub.hold = None, {}
    result = hub_run(hub, output, "--workers", 2)
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stdout
    assert shards_in(output) == shards_in(tmp_path / "clean")
    for path in paths:  # what was downloaded before the interruptions was kept, not fetched again
        assert hub.served[path] <= len(hub.files[path]) + 3 * 65536, (path, hub.served[path])


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "close-delimited"])
def test_dropped_connection_and_partial_file_resume_with_range(hub, tmp_path, content_length):
    first, second, _ = add_hub_files(hub)
    hub.drop_after[first] = [100_000]
    hub.content_length = content_length  # without one, a body cut short ends like a whole one, whatever the urllib3
    output = tmp_path / "edu"
    (output / "downloads").mkdir(parents=True)
    (output / "downloads" / (os.path.basename(second) + ".part")).write_bytes(hub.files[second][:70_000])
    result = hub_run(hub, output)
    assert result.returncode == 0, result.stderr
    assert shards_in(output) == expected_shards([d for docs in HUB_DOCS for d in docs], 5000, "edufineweb")
    # what arrived before the connection dropped was kept; the rest came with a Range request
    (first_range, first_status), (second_range, second_status) = resolve_requests(hub, first)
    assert (first_range, first_status, second_status) == (None, 200, 206)
    assert 0 < int(second_range.removeprefix("bytes=").removesuffix("-")) <= 100_000
    assert resolve_requests(hub, second) == [("bytes=70000-", 206)]
    assert hub.served[second] == len(hub.files[second]) - 70_000


def read_json(path):
    """A JSON file that another process replaces by renaming; None until it exists."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None

def test_downloads_overlap_tokenizing_go_once_tokenized_and_resume_from_a_file_end(hub, tmp_path):
    hub.dataset, subset = "someone/fineweb-like", "data/part-1"  # only the --dataset and --subset asked for are there
    paths = [hub.add(f"{i:03d}.parquet", docs, subset) for i, docs in enumerate(HUB_DOCS)]
    output = tmp_path / "edu"
    seen = {}  # repo path -> (tokens in shards, files in downloads/) when that file was requested

    def on_request(path):
        seen[path] = (read_json(output / "manifest.json")["next"]["tokens"], sorted(os.listdir(output / "downloads")))
    hub.on_request = on_request
    release = threading.Event()
    hub.hold = {paths[2]: (0, release)}  # the last file stalls before its first byte
    args = hub_args(hub, output, "--dataset", hub.dataset, "--subset", subset, "--workers", 1)
    process = start_fineweb(*args)
    try:
        # with nothing left to tokenize, the run waits for the download with everything recorded: its last
        # checkpoint is the end of file 1, which carries a partial shard over to file 2
        wait_until(lambda: (read_json(output / "manifest.json") or {"next": {}})["next"].get("file") == 2, process)
        process.kill()
        process.wait()
    finally:
        release.set()
    state = read_json(output / "manifest.json")["next"]
    assert (state["file"], state["unit"], state["skip"], state["carry"]) == (2, 0, 0, ".carry_000002.npy")
    first_file_tokens = len(reference_stream(HUB_DOCS[0]))
    assert seen[paths[1]][0] < first_file_tokens / 2  # the next file downloads while this one is tokenized
    assert seen[paths[2]][1] == ["001.parquet"]  # each file is gone once tokenized: two parquet files at most

    hub.hold, hub.on_request = {}, None
    result = run_fineweb(*args)
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stdout
    assert shards_in(output) == expected_shards([doc for docs in HUB_DOCS for doc in docs], 5000, "edufineweb")
    assert [hub.served[path] for path in paths[:2]] == [len(hub.files[path]) for path in paths[:2]]  # not again


def test_a_second_run_on_the_same_output_is_refused(hub, tmp_path):
    path = hub.add("000_00000.parquet", HUB_DOCS[0])
    release = threading.Event()
    hub.hold = {path: (0, release)}
    output = tmp_path / "edu"
    first = start_fineweb(*hub_args(hub, output))
    try:
        wait_until(lambda: resolve_requests(hub, path), first)
        # refused before it reaches any network: with no lock, it would fail otherwise
        second = run_fineweb("--endpoint", "http://127.0.0.1:9", "--output", output, "--retries", 0)
        assert_error(second, "another fineweb.py is writing", str(output), f"pid {first.pid}")
    finally:
        release.set()
    result = finish(first, timeout=60)
    assert result.returncode == 0, result.stderr
    assert shards_in(output) == expected_shards(HUB_DOCS[0], 5000, "edufineweb")


def test_server_errors_are_retried_then_reported(hub, tmp_path):
    add_hub_files(hub)
    hub.fail = 3
    result = hub_run(hub, tmp_path / "ok", "--retries", 3, "--keep-downloads")
    assert result.returncode == 0, result.stderr
    assert [status for _, _, status in hub.log[:4]] == [500, 500, 500, 200]
    assert sorted(os.listdir(tmp_path / "ok" / "downloads")) == [os.path.basename(p) for p in sorted(hub.files)]

    hub.fail = 100
    result = hub_run(hub, tmp_path / "down", "--retries", 2)
    assert_error(result, "after 2 retries", "HTTP 500", "HF_ENDPOINT")

    hub.fail, hub.content_length = 0, False
    hub.drop_after[sorted(hub.files)[0]] = [0] * 10  # bodies that end at once, as if whole
    result = hub_run(hub, tmp_path / "cut", "--retries", 2)
    assert_error(result, "after 2 retries", "connection closed at byte 0", "HF_ENDPOINT")


def test_a_listing_that_is_not_json_fails_at_once(hub, tmp_path):
    add_hub_files(hub)
    hub.page = "<html><body>Sign in to the proxy to continue</body></html>"
    assert_error(hub_run(hub, tmp_path / "edu", "--retries", 3), "unexpected answer", "--endpoint")
    assert len(hub.log) == 1  # the same page again would not help


OFFLINE = "http://127.0.0.1:9"  # nothing listens there: each connection is refused, as with no network


def test_offline_it_says_what_it_waits_for_and_leaves_no_directory(tmp_path):
    """Offline, `python fineweb.py` printed nothing while it retried (ten retries, doubling: about 5 minutes). It
    says what it asks for before the first try, and each retry with the wait in all; and when it gives up, the
    directory it made is gone: the trainer would take it for shards."""
    result = run_fineweb("--endpoint", OFFLINE, "--output", tmp_path / "edu", "--retries", 2, "--retry-delay", 0.25)
    assert_error(result, f"giving up on {OFFLINE} after 2 retries (Connection refused)", "HF_ENDPOINT")
    waits = "giving up after 2 retries, 0.75 s of waiting in all (--retries, --retry-delay)"
    assert result.stdout.splitlines() == [
        f"asking {OFFLINE} for the files of {DATASET}/{SUBSET} (each try waits up to 30 s to connect)",
        f"{OFFLINE}: Connection refused; retry 1 of 2 in 0.25 s; {waits}",
        f"{OFFLINE}: Connection refused; retry 2 of 2 in 0.5 s; {waits}"]
    assert not (tmp_path / "edu").exists()


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGHUP])
def test_a_run_stopped_while_it_waits_leaves_no_directory(hub, tmp_path, signal_number):
    """`kill` or a closed terminal ended it where it stood, leaving OUTPUT/.lock: a directory at the trainer's
    default --data, which then stopped falling back to tiny Shakespeare. They end it as Ctrl-C does."""
    hub.status = 503
    output, printed = tmp_path / "edu", tmp_path / "printed"
    with open(printed, "w") as stdout:
        process = start_fineweb(*hub_args(hub, output, "--retry-delay", 60), stdout=stdout)
    try:
        wait_until(lambda: "retry 1 of 10 in 1 min;" in printed.read_text(), process)
        process.send_signal(signal_number)
        result = finish(process, timeout=15)
    finally:
        process.kill()
    assert result.returncode == 128 + signal_number, result.stderr
    assert "Traceback" not in result.stderr and "run the same command again to resume" in result.stderr
    assert not output.exists()


def test_a_download_stopped_keeps_its_bytes_and_the_trainer_tells_it_from_shards(hub, tmp_path, capsys,
                                                                                 monkeypatch):
    """Stopped before the first byte of the first download, a run leaves nothing; after some, it keeps them (they
    resume), and `python train_gpt2.py` finds no shards in edu_fineweb10B/: it trains on tiny Shakespeare, saying
    what is there and what to do."""
    path = hub.add("000_00000.parquet", HUB_DOCS[0])
    output = tmp_path / "edu_fineweb10B"
    part = output / "downloads" / "000_00000.parquet.part"
    for held_at in (0, 65536):  # 65536: one whole chunk of the download, written to the .part file
        release = threading.Event()
        hub.hold = {path: (held_at, release)}
        process = start_fineweb(*hub_args(hub, output))
        try:
            wait_until(lambda: part.exists() and part.stat().st_size == held_at, process)  # noqa: B023 (now)
            process.send_signal(signal.SIGTERM)
            result = finish(process, timeout=15)
        finally:
            release.set()
            process.kill()
        assert result.returncode == 128 + signal.SIGTERM, result.stderr
        assert output.exists() == bool(held_at)
    assert sorted(os.listdir(output)) == [".lock", "downloads", "manifest.json"]

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    cfg = resolved([], train_gpt2.Env(0, 0, 1, "cpu", "cpu"))
    assert cfg.data == os.path.join(REPO, "input.txt")
    assert capsys.readouterr().out.splitlines()[0] == (
        "no FineWeb shards in edu_fineweb10B/ (only .lock, downloads, manifest.json, left by an unfinished `python "
        "fineweb.py`: rerun it to finish them, or delete edu_fineweb10B/): training a small model on tiny "
        "Shakespeare instead")


@pytest.mark.parametrize("status", [401, 403])
def test_refused_access_names_hf_token(hub, tmp_path, status):
    add_hub_files(hub)
    hub.status = status
    assert_error(hub_run(hub, tmp_path / "edu"), f"HTTP {status}", "HF_TOKEN")


def test_checksum_mismatch_downloads_again_once_then_fails(hub, tmp_path):
    first, _, _ = add_hub_files(hub)
    hub.corrupt[first] = 1
    result = hub_run(hub, tmp_path / "once")
    assert result.returncode == 0, result.stderr
    assert resolve_requests(hub, first) == [(None, 200), (None, 200)]

    hub.corrupt[first] = 2
    result = hub_run(hub, tmp_path / "twice")
    assert_error(result, first, "checksum", "HF_ENDPOINT")
    # the bad file is not kept; and when no other file was downloaded before the run stopped (the workers race), its
    # directory holds nothing of value, and is gone too
    downloads = tmp_path / "twice" / "downloads"
    assert not (downloads.exists() and [name for name in os.listdir(downloads) if name.startswith("000_")])
    assert not (tmp_path / "twice").exists() or not shards_in(tmp_path / "twice")


def write_local_inputs(directory):
    """A .txt folder, a .jsonl and a .parquet; returns their paths and documents, in the order they are read."""
    texts = directory / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("First document.\r\nWith a Windows line end and <|endoftext|> in it.\n")
    (texts / "b.txt").write_text("Второй документ 🙂")
    jsonl_docs = make_docs(7, 1100)  # more lines than one unit of work
    jsonl_docs[5] = "a lone surrogate \ud83d survives"
    lines = [json.dumps({"body": doc, "n": i}) for i, doc in enumerate(jsonl_docs)]
    lines.insert(10, "")  # blank lines are not documents
    (directory / "docs.jsonl").write_text("\n".join(lines) + "\n")
    parquet_docs = make_docs(8, 50)
    write_parquet(directory / "docs.parquet", parquet_docs, column="body")
    docs = [(texts / "a.txt").read_bytes().decode(), "Второй документ 🙂"] + jsonl_docs + parquet_docs
    return [texts, directory / "docs.jsonl", directory / "docs.parquet"], docs


def test_local_txt_jsonl_parquet_independent_of_workers(tmp_path):
    inputs, docs = write_local_inputs(tmp_path)
    expected = expected_shards(docs, 20_000, "corpus")
    for workers in (1, 3):
        output = tmp_path / f"w{workers}" / "corpus"
        result = run_fineweb("--input", *inputs, "--output", output, "--shard-size", 20_000, "--text-field", "body",
                             "--workers", workers)
        assert result.returncode == 0, result.stderr
        assert shards_in(output) == expected


def test_hidden_files_and_folders_of_an_input_directory_are_skipped(tmp_path):
    """Jupyter's .ipynb_checkpoints/ holds copies of the notebooks' files, and macOS's ._a.txt is a's metadata:
    tokenized, they duplicated the data (or stopped the run, not being text). Hidden names are skipped, as the
    trainer skips hidden shards, and counted."""
    books = tmp_path / "books"
    (books / ".ipynb_checkpoints").mkdir(parents=True)
    (books / "poems").mkdir()
    (books / "a.txt").write_text("The first book.")
    (books / "poems" / "b.txt").write_text("The second book.")
    (books / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("The first book.")
    (books / "._a.txt").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ")  # AppleDouble
    (books / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")  # not a type it reads: nothing to say
    result = run_fineweb("--input", books, "--output", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert shards_in(tmp_path / "out") == expected_shards(["The first book.", "The second book."], 10**8, "out")
    assert [line for line in result.stdout.splitlines() if "skipped" in line] == [
        f"--input {books}: skipped 2 hidden files, whose name or folder's starts with a dot (e.g. ._a.txt), as "
        "train_gpt2.py skips hidden shards"]


def test_a_preparation_that_read_hidden_files_resumes_with_its_list(tmp_path):
    """A preparation started by the fineweb.py before hidden files were skipped, and stopped: it listed them with the
    rest, and its shards hold their tokens. Resumed, the list of today's fineweb.py differed, and it was refused,
    naming a file that never changed. It resumes with its own list, saying so in one line, to the shards its run
    would have made. The earlier run is this fineweb.py given that list (the hidden file first, in the order of
    their paths), killed while it tokenizes a long file, its manifest naming the directory as --input, as the
    earlier fineweb.py's did."""
    books = tmp_path / "books"
    (books / ".ipynb_checkpoints").mkdir(parents=True)
    (books / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("The first book, a draft. " * 20_000)
    (books / "a.txt").write_text("The first book. " * 20_000)  # with the draft, 2 shards of 100,000 tokens
    (books / "b.txt").write_text((" ".join(WORDS) + "\n") * 20_000)  # 7 MB: a second or two of tokenizing, one unit
    (books / "c.txt").write_text("The last book.")
    listed = [books / ".ipynb_checkpoints" / "a-checkpoint.txt", books / "a.txt", books / "b.txt", books / "c.txt"]
    flags = ["--shard-size", 100_000, "--workers", 1, "--prefix", "books"]
    clean = run_fineweb("--input", *listed, "--output", tmp_path / "clean", *flags)
    assert clean.returncode == 0, clean.stderr
    output = tmp_path / "out"
    process = start_fineweb("--input", *listed, "--output", output, *flags)
    try:
        wait_until(lambda: output.is_dir() and len(shards_in(output)) >= 2, process)  # b.txt's shards to come
        process.kill()
        process.communicate(timeout=15)
    finally:
        process.kill()
    manifest = json.loads((output / "manifest.json").read_text())
    assert not manifest["done"] and manifest["shards"] < len(shards_in(tmp_path / "clean"))
    manifest["config"]["--input"] = [str(books)]
    (output / "manifest.json").write_text(json.dumps(manifest))
    result = run_fineweb("--input", books, "--output", output, *flags)
    assert result.returncode == 0, result.stderr
    hidden = os.path.join(books, ".ipynb_checkpoints", "a-checkpoint.txt")
    assert f"{output} was started by an earlier fineweb.py, which read hidden files too: resuming with its list, " \
           f"1 hidden file and all (e.g. {hidden}), as its shards began" in result.stdout.splitlines()
    assert "skipped" not in result.stdout
    assert shards_in(output) == shards_in(tmp_path / "clean")


# a step of a tiny model on the shards made here, GPT-2's tokens: its vocabulary padded to 50304
TINY_TRAINING = ["--n-layer", "1", "--n-head", "1", "--n-embd", "16", "--vocab-size", 50304, "--seq-len", "32",
                 "--batch-size", "4", "--total-batch-size", "128", "--val-tokens", "256", "--num-samples", "0",
                 "--hellaswag-every", "0", "--core-every", "0", "--device", "cpu", "--max-steps", "1"]


def test_the_trainer_refuses_shards_still_being_made_and_trains_once_they_are(tmp_path, capsys):
    """A run on what an unfinished fineweb.py had written trained with no word, and could never be resumed once the
    preparation finished (`sh_train_000026.npy is new`). It is refused in one line while fineweb.py runs (here
    stopped by SIGSTOP, holding its lock) and once it was killed, each saying what to do; once the same command has
    finished the shards, the same training runs."""
    (tmp_path / "a.txt").write_text("The first book. " * 20_000)  # 80,000 tokens: 8 shards of 10,000
    (tmp_path / "b.txt").write_text((" ".join(WORDS) + "\n") * 6_000)  # 2 MB: half a second of tokenizing
    output = tmp_path / "sh"
    prepare = ["--input", tmp_path / "a.txt", tmp_path / "b.txt", "--output", output, "--shard-size", 10_000,
               "--workers", 1]
    train = TINY_TRAINING + ["--data", output, "--log-dir", tmp_path / "log"]
    process = start_fineweb(*prepare)
    try:
        wait_until(lambda: output.is_dir() and len(shards_in(output)) >= 2, process)  # b.txt's shards to come
        os.kill(process.pid, signal.SIGSTOP)
        expect_usage_error(train, capsys, f"--data {output}: fineweb.py is still making these shards (pid "
                                          f"{process.pid} on ", "train once it is done")
        process.kill()
        process.communicate(timeout=15)
    finally:
        process.kill()
    assert not json.loads((output / "manifest.json").read_text())["done"]
    expect_usage_error(train, capsys, f"--data {output}: its shards are unfinished ({output}/manifest.json says so: ",
                       f"run the fineweb.py command that made them again, with --output {output}: it carries on "
                       f"where it stopped")
    assert not (tmp_path / "log").exists()
    assert run_fineweb(*prepare).returncode == 0
    code, out, err = run_main(train, capsys)
    assert code == 0 and "done: step 1" in out, err


@pytest.fixture(scope="module")
def made_once(tmp_path_factory):
    """A directory holding a.txt and sh/, the shards and manifest that fineweb.py makes of it: 20,002 tokens in three
    shards, of 10,000, 10,000 and 2. Made once, as its worker processes take seconds to start; made_shards copies it."""
    directory = tmp_path_factory.mktemp("made")
    (directory / "a.txt").write_text("The first book. " * 5_000)
    result = run_fineweb("--input", directory / "a.txt", "--output", directory / "sh", "--shard-size", 10_000,
                         "--workers", 1)
    assert result.returncode == 0, result.stderr
    return directory


def made_shards(tmp_path, made_once):
    """A copy of made_once's shards and manifest in tmp_path/sh, and the arguments of the fineweb.py that makes them
    there (from made_once's a.txt, which the manifest names)."""
    shutil.copytree(made_once / "sh", tmp_path / "sh", ignore=shutil.ignore_patterns(".lock"))
    args = ["--input", made_once / "a.txt", "--output", tmp_path / "sh", "--shard-size", 10_000, "--workers", 1]
    return tmp_path / "sh", args


def test_a_damaged_manifest_is_refused_by_the_trainer_as_by_fineweb(tmp_path, capsys, made_once):
    """An unfinished preparation's manifest that is also damaged (no "next", cut short, a "done" that is no boolean,
    nested too deep to parse) was trained on with no word, where fineweb.py refused it: both read it with the same
    code, and refuse it in one line. An older fineweb.py's unfinished manifest, which listed its shards (thousands,
    for FineWeb), put the whole list in the trainer's line: their number is enough."""
    output, prepare = made_shards(tmp_path, made_once)
    path, log_dir = output / "manifest.json", tmp_path / "log"
    manifest = json.loads(path.read_text())
    train = TINY_TRAINING + ["--data", output, "--log-dir", log_dir]
    without_next = {key: value for key, value in manifest.items() if key != "next"}
    for damaged in [json.dumps(dict(without_next, done=False)), '{"done": false,',
                    *(json.dumps(dict(manifest, done=done)) for done in ("false", None, 0)),
                    "[" * 200_000 + "]" * 200_000]:
        path.write_text(damaged)
        expect_usage_error(train, capsys, f"--data {output}: {path}: it is damaged or not fineweb.py's",
                           "delete the manifest if fineweb.py finished them")
        assert_error(run_fineweb(*prepare), f"{path}: it is damaged or not fineweb.py's", f"delete {output}")
    assert not log_dir.exists()
    listed = [{"name": f"sh_train_{i:06d}.npy", "tokens": 10_000} for i in range(1, 5_000)]
    path.write_text(json.dumps(dict(manifest, done=False, shards=listed)))
    line = expect_usage_error(train, capsys, f"its shards are unfinished ({path} says so: 4999 shards and "
                                             f"{manifest['next']['tokens']:,} tokens so far)")
    assert "sh_train_" not in line  # no shard's name, nor 4,999 of them
    path.write_text(json.dumps(manifest))
    code, out, err = run_main(train, capsys)
    assert code == 0 and "done: step 1" in out, err


def test_a_damaged_position_to_resume_from_is_refused_and_nothing_is_lost(tmp_path, made_once):
    """fineweb.py resumes from its manifest's "next": the input file it stands at, and the carry file, the partial
    shard that a hub run carries from one input file to the next. A damaged carry crashed with numpy's traceback
    ("we only support format version ..."); a "next" past the last input file had it write its last shard and mark
    the set complete, as if every input were read. Each is refused in one line that names the file and what to do,
    every file left as it was; the same state, whole, resumes to the shards of a run never stopped."""
    output, args = made_shards(tmp_path, made_once)
    whole = shards_in(output)
    manifest_path, carry, last = output / "manifest.json", output / ".carry_000001.npy", "sh_train_000002.npy"
    # as a run leaves it that is killed once it has read its only input file: the last shard's tokens carried over
    carry.write_bytes(whole[last])
    os.remove(output / last)
    manifest = json.loads(manifest_path.read_text())
    manifest["done"], manifest["shards"] = False, len(whole) - 1
    manifest["next"].update(file=1, unit=0, skip=0, carry=carry.name)
    stopped = json.dumps(manifest)
    superseded = output / ".carry_000000.npy"  # as a kill after the manifest named the next carry leaves it
    superseded.write_bytes(whole[last])
    bad_version = whole[last][:6] + b"\x00\x00" + whole[last][8:]
    carried = np.load(io.BytesIO(whole[last]))
    said = f"{carry}: the partial shard that {manifest_path} resumes with"
    for manifest_text, carry_bytes, words in [
            (stopped, bad_version, f"{said} cannot be read (we only support format version"),
            (stopped, whole[last][:-2], f"{said} cannot be read"),  # cut short
            (stopped, None, f"{said} cannot be read (No such file or directory)"),
            (stopped, npy_bytes(carried[:-1]), f"{said} is not the {len(carried):,} tokens (uint16) that it counts"),
            (stopped, npy_bytes(carried.astype(np.int32)), f"{said} is not the {len(carried):,} tokens (uint16)"),
            (stopped.replace('"file": 1', '"file": 2'), whole[last],
             f"{manifest_path}: it resumes at input file 3 of 1, past the last")]:
        manifest_path.write_text(manifest_text)
        carry.unlink(missing_ok=True)
        if carry_bytes is not None:
            carry.write_bytes(carry_bytes)
        before = {name: (output / name).read_bytes() for name in os.listdir(output) if name != ".lock"}
        assert_error(run_fineweb(*args), words, f"delete {output} to start it afresh, or choose another --output")
        assert {name: (output / name).read_bytes() for name in os.listdir(output) if name != ".lock"} == before
    manifest_path.write_text(stopped)
    carry.write_bytes(whole[last])
    result = run_fineweb(*args)
    assert result.returncode == 0 and "done:" in result.stdout, result.stderr
    assert shards_in(output) == whole and not carry.exists() and not superseded.exists()


def test_eval_only_evaluates_shards_still_being_made(tmp_path, capsys, made_once):
    """An evaluation reads the val shard alone, the first that fineweb.py makes: --eval-only on an unfinished
    preparation evaluates, where a training on it is refused."""
    output, _ = made_shards(tmp_path, made_once)
    manifest = json.loads((output / "manifest.json").read_text())
    (output / "manifest.json").write_text(json.dumps(dict(manifest, done=False)))  # as a killed fineweb.py leaves it
    train = TINY_TRAINING + ["--data", output, "--log-dir", tmp_path / "log"]
    expect_usage_error(train, capsys, f"--data {output}: its shards are unfinished")
    code, out, err = run_main(train + ["--eval-only"], capsys)
    assert code == 0, err
    (record,) = [json.loads(line) for line in (tmp_path / "log" / "log.jsonl").read_text().splitlines()]
    assert record["eval_only"] and record["step"] == 0 and math.isfinite(record["val_loss"])


def test_a_changed_input_list_names_what_changed(tmp_path):
    """Resuming (or repeating) a preparation whose input directory lost or gained a file names that file: the first
    file at another place in the list was named as changed, though it was not."""
    books = tmp_path / "books"
    books.mkdir()
    for name in ("a", "b", "c"):
        (books / f"{name}.txt").write_text(f"The book {name}. " * 50)
    assert run_fineweb("--input", books, "--output", tmp_path / "out").returncode == 0
    os.remove(books / "b.txt")
    assert_error(run_fineweb("--input", books, "--output", tmp_path / "out"), f"{books / 'b.txt'} is gone",
                 "put them back")
    (books / "b.txt").write_text("The book b. " * 50)
    (books / "d.txt").write_text("Another book.")
    assert_error(run_fineweb("--input", books, "--output", tmp_path / "out"), f"{books / 'd.txt'} is new")


def test_max_tokens_stops_early(tmp_path):
    inputs, docs = write_local_inputs(tmp_path)
    output = tmp_path / "trial"
    result = run_fineweb("--input", inputs[1], "--output", output, "--shard-size", 3000, "--max-tokens", 10_000,
                         "--text-field", "body", "--prefix", "t")
    assert result.returncode == 0, result.stderr
    stream = reference_stream(docs[2:])[:10_000]
    names = ["t_val_000000.npy", "t_train_000001.npy", "t_train_000002.npy", "t_train_000003.npy"]
    assert shards_in(output) == {name: npy_bytes(stream[i * 3000:(i + 1) * 3000]) for i, name in enumerate(names)}
    again = run_fineweb("--input", inputs[1], "--output", output, "--shard-size", 3000, "--max-tokens", 10_000,
                        "--text-field", "body", "--prefix", "t")
    assert again.returncode == 0 and "already complete" in again.stdout
    assert_error(run_fineweb("--input", inputs[1], "--output", output, "--shard-size", 3000, "--text-field", "body",
                             "--prefix", "t"), "--max-tokens 10000")


def finish_a_run(tmp_path):
    """out/, prepared from a.txt to the end."""
    (tmp_path / "a.txt").write_text("hello world " * 100)
    result = run_fineweb("--input", tmp_path / "a.txt", "--output", tmp_path / "out", "--shard-size", 100)
    assert result.returncode == 0, result.stderr


def make_bad_input(tmp_path, case):
    if case == "malformed jsonl":
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": broken\n')
        return ["--input", tmp_path / "bad.jsonl"], ["bad.jsonl:3", "malformed JSON"]
    if case == "jsonl without the field":
        (tmp_path / "other.jsonl").write_text('{"text": "fine"}\n{"content": "no text"}\n')
        return ["--input", tmp_path / "other.jsonl"], ["other.jsonl:2", "--text-field"]
    if case == "parquet without a text column":
        write_parquet(tmp_path / "other.parquet", ["a", "b"], column="content")
        return ["--input", tmp_path / "other.parquet"], ["other.parquet", "'text' column", "content", "--text-field"]
    if case == "parquet text column of numbers":
        write_parquet(tmp_path / "numbers.parquet", [1, 2])
        return ["--input", tmp_path / "numbers.parquet"], ["numbers.parquet", "'text'", "int64", "--text-field"]
    if case == "empty input":
        (tmp_path / "empty.jsonl").write_text("\n")
        return ["--input", tmp_path / "empty.jsonl"], ["no text"]
    if case == "missing file":
        return ["--input", tmp_path / "nope.txt"], ["nope.txt", "no such file"]
    if case == "not utf-8":
        (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
        return ["--input", tmp_path / "latin1.txt"], ["latin1.txt", "UTF-8"]
    if case in ("damaged manifest", "another tool's manifest"):
        (tmp_path / "out").mkdir()
        manifest = '{"config": {' if case == "damaged manifest" else '{"files": []}'
        (tmp_path / "out" / "manifest.json").write_text(manifest)
        (tmp_path / "a.txt").write_text("hello")
        return ["--input", tmp_path / "a.txt"], ["manifest.json", "damaged or not fineweb.py's", "--output"]
    if case == "hub run into a local directory":
        finish_a_run(tmp_path)
        return ["--endpoint", "http://127.0.0.1:9", "--shard-size", 100], ["with --input", "not without --input"]
    if case == "foreign shards":
        (tmp_path / "out").mkdir()
        np.save(tmp_path / "out" / "edufineweb_train_000001.npy", np.zeros(10, dtype=np.uint16))
        (tmp_path / "a.txt").write_text("hello")
        return ["--input", tmp_path / "a.txt"], ["manifest.json", "--output"]
    if case == "different configuration":
        finish_a_run(tmp_path)
        return ["--input", tmp_path / "a.txt", "--shard-size", 200], ["--shard-size 100", "--output"]
    if case == "changed input":
        finish_a_run(tmp_path)
        (tmp_path / "a.txt").write_text("hello there " * 100)
        return ["--input", tmp_path / "a.txt", "--shard-size", 100], ["a.txt changed"]


@pytest.mark.parametrize("case", ["malformed jsonl", "jsonl without the field", "parquet without a text column",
                                  "parquet text column of numbers", "empty input", "missing file", "not utf-8",
                                  "damaged manifest", "another tool's manifest", "foreign shards",
                                  "different configuration", "changed input", "hub run into a local directory"])
def test_bad_input_is_one_line_error(tmp_path, case):
    args, words = make_bad_input(tmp_path, case)
    result = run_fineweb(*args, "--output", tmp_path / "out")
    assert_error(result, *words)
    # an error before the manifest leaves no directory of its own making: the lock file was all it held
    names = os.listdir(tmp_path / "out") if (tmp_path / "out").exists() else []
    assert not [name for name in names if "train" in name or "val" in name] \
        or case in ("foreign shards", "different configuration", "changed input", "hub run into a local directory")


def test_an_input_fixed_before_any_shard_needs_no_new_output(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n")
    assert_error(run_fineweb("--input", tmp_path / "a.jsonl", "--output", tmp_path / "out"), "no text")
    (tmp_path / "a.jsonl").write_text('{"text": "now there is text"}\n')
    result = run_fineweb("--input", tmp_path / "a.jsonl", "--output", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert shards_in(tmp_path / "out") == expected_shards(["now there is text"], 10**8, "out")


def test_disk_full_leaves_no_partial_shard(tmp_path):
    (tmp_path / "a.txt").write_text("plenty of words to fill a shard " * 2000)

    # a real write error: files may not grow past 16 KB; the first shard, 10000 tokens, needs 20 KB
    result = run_fineweb("--input", tmp_path / "a.txt", "--output", tmp_path / "out", "--shard-size", 10_000,
                         limits={"RLIMIT_FSIZE": (16384, 16384)}, ignore=("SIGXFSZ",))
    assert_error(result, "disk full", "run the same command again")
    assert not (tmp_path / "out").exists()  # it made the directory and nothing of value in it: no shard, no partial

    result = run_fineweb("--input", tmp_path / "a.txt", "--output", tmp_path / "out", "--shard-size", 10_000)
    assert result.returncode == 0, result.stderr
    assert shards_in(tmp_path / "out") == expected_shards([(tmp_path / "a.txt").read_text()], 10_000, "out")


def test_a_run_stopped_before_recording_its_first_shard_resumes(tmp_path):
    (tmp_path / "a.txt").write_text("plenty of words to fill a shard " * 2000)
    args = ["--input", tmp_path / "a.txt", "--output", tmp_path / "out", "--shard-size", 10_000]
    assert run_fineweb(*args).returncode == 0
    # what a kill or a full disk leaves between renaming the first shard into place and recording it
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["shards"], manifest["done"] = 0, False
    manifest["next"].update(file=0, unit=0, skip=0, carry=None, tokens=0, documents=0)
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    for name in shards_in(tmp_path / "out"):
        if name != "out_val_000000.npy":
            os.remove(tmp_path / "out" / name)

    result = run_fineweb(*args)
    assert result.returncode == 0, result.stderr
    assert shards_in(tmp_path / "out") == expected_shards([(tmp_path / "a.txt").read_text()], 10_000, "out")


def test_the_manifest_does_not_grow_with_the_shards(tmp_path):
    """The manifest is rewritten (and synced) after every shard: it listed every shard, so each rewrite was longer
    than the last and a run of small shards took time quadratic in their number (--shard-size 10: 15,155 tokens in
    28 s). It records how many there are: the same few hundred bytes for 3 shards or 201."""
    text = "hello world " * 1000  # 2,001 tokens
    (tmp_path / "a.txt").write_text(text)
    manifests = {}
    for shard_size in (10, 1000):
        output = tmp_path / f"by{shard_size}"
        result = run_fineweb("--input", tmp_path / "a.txt", "--output", output, "--shard-size", shard_size)
        assert result.returncode == 0, result.stderr
        assert shards_in(output) == expected_shards([text], shard_size, output.name)
        manifests[shard_size] = (output / "manifest.json").read_text()
    assert json.loads(manifests[10])["shards"] == 201 and json.loads(manifests[1000])["shards"] == 3
    assert abs(len(manifests[10]) - len(manifests[1000])) <= 4  # "10" and "201" against "1000" and "3"


def test_a_manifest_that_lists_its_shards_is_read(tmp_path):
    """One written by an older fineweb.py, which listed each shard's name and tokens, resumes: as their number."""
    text = "plenty of words to fill a shard " * 2000
    (tmp_path / "a.txt").write_text(text)
    args = ["--input", tmp_path / "a.txt", "--output", tmp_path / "out", "--shard-size", 5000]
    assert run_fineweb(*args, "--max-tokens", 12_000).returncode == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    names = ["out_val_000000.npy", "out_train_000001.npy", "out_train_000002.npy"]
    manifest["shards"] = [{"name": name, "tokens": 5000} for name in names[:2]]  # the third: the final, partial one
    manifest["done"], manifest["config"]["--max-tokens"] = False, None
    manifest["next"].update(file=0, unit=0, skip=10_000, carry=None, tokens=10_000, documents=1)
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    os.remove(tmp_path / "out" / names[2])
    result = run_fineweb(*args)
    assert result.returncode == 0, result.stderr
    assert "10,000 tokens already done" in result.stdout
    assert shards_in(tmp_path / "out") == expected_shards([text], 5000, "out")


def test_shakespeare_shards_for_the_trainer(tmp_path):
    output = tmp_path / "shakespeare"
    result = run_fineweb("--input", os.path.join(REPO, "input.txt"), "--output", output, "--shard-size", 100_000)
    assert result.returncode == 0, result.stderr
    text = open(os.path.join(REPO, "input.txt"), encoding="utf-8").read()
    assert shards_in(output) == expected_shards([text], 100_000, "shakespeare")
    assert list(shards_in(output)) == ["shakespeare_train_000001.npy", "shakespeare_train_000002.npy",
                                       "shakespeare_train_000003.npy", "shakespeare_val_000000.npy"]
    # the trainer takes them as they are
    log_dir = tmp_path / "log"
    train = run_command([sys.executable, os.path.join(REPO, "train_gpt2.py"), "--data", output, "--max-steps", "2",
                         "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--seq-len", "32", "--batch-size", "4",
                         "--total-batch-size", "128", "--val-tokens", "256", "--eval-every", "1", "--device", "cpu",
                         "--no-compile", "--num-samples", "0", "--log-dir", log_dir], None, dict(os.environ),
                        timeout=300)
    assert train.returncode == 0, train.stderr[-2000:]
    log = [json.loads(line) for line in (log_dir / "log.jsonl").read_text().splitlines()]
    assert any("val_loss" in entry for entry in log) and any("train_loss" in entry for entry in log)


def test_a_small_input_is_cut_in_tenths_and_its_size_reads_in_its_unit(tmp_path):
    """With the hub's 100M tokens a shard, 4 MB of one's own text made 1 validation shard and no train shard, and its
    size read "(0.00 GB)". Without --shard-size, a local input's shards are a tenth of its text, about (3.3 bytes a
    token): 400 kB of tiny Shakespeare in a directory and a short file make shards of 12,121 tokens, the reference
    tokenizer's stream cut there (10 shards of its 119,464 tokens), and the size reads 400.0 kB. A file added to the
    input then is named, as the same command carries on with the shards' own size, not the new input's."""
    (tmp_path / "books").mkdir()
    docs = [open(os.path.join(REPO, "input.txt"), encoding="utf-8").read()[:400_000], "Exeunt."]
    (tmp_path / "books" / "a.txt").write_text(docs[0], encoding="utf-8")
    (tmp_path / "b.txt").write_text(docs[1])
    args = ["--input", tmp_path / "books", tmp_path / "b.txt", "--output", tmp_path / "out", "--workers", 1]
    result = run_fineweb(*args)
    assert result.returncode == 0, result.stderr
    assert "(400.0 kB) -> " in result.stdout and "12,121 tokens per shard (for a small input: --shard-size sets it)" \
        in result.stdout and "(1 val + 9 train)" in result.stdout and "warning" not in result.stdout, result.stdout
    assert shards_in(tmp_path / "out") == expected_shards(docs, 12121, "out")
    (tmp_path / "books" / "c.txt").write_text(docs[0][:100_000], encoding="utf-8")
    assert_error(run_fineweb(*args), f"{tmp_path / 'books' / 'c.txt'} is new")

def test_the_default_prefix_never_names_a_split(tmp_path):
    """Shards are named after the output directory: `--output shakespeare_train` made shakespeare_train_val_000000.npy,
    which the trainer refuses (its name says both train and val). The split word is left out of the default prefix,
    and a --prefix holding one is refused before any work."""
    (tmp_path / "a.txt").write_text("plenty of words to fill a shard " * 2000)
    output = tmp_path / "shakespeare_train"
    result = run_fineweb("--input", tmp_path / "a.txt", "--output", output, "--shard-size", 10_000)
    assert result.returncode == 0, result.stderr
    assert list(shards_in(output)) == ["shakespeare_train_000001.npy", "shakespeare_val_000000.npy"]
    cfg = train_gpt2.TrainConfig(data=str(output), vocab_size=50257, seq_len=32, total_batch_size=256, val_tokens=256)
    stream, _ = train_gpt2.load_data(cfg)  # the trainer takes them as they are
    train_shards = [name for name in shards_in(output) if "_train_" in name]
    assert sum(len(shard) for shard in stream.shards) == sum(len(np.load(output / name)) for name in train_shards)
    for prefix in ("my_train", "val", "data.val"):
        assert_error(run_fineweb("--input", tmp_path / "a.txt", "--output", tmp_path / "other", "--prefix", prefix),
                     "--prefix", prefix)
    assert not os.path.exists(tmp_path / "other")


def test_a_prefix_that_is_a_path_or_hidden_is_refused(tmp_path):
    """A --prefix with a / writes shards into another directory (or fails there, half done); one starting with a dot
    names hidden files, which the trainer never reads."""
    (tmp_path / "a.txt").write_text("plenty of words to fill a shard " * 200)
    for prefix in ("sub/edu", ".edu", "../edu"):
        assert_error(run_fineweb("--input", tmp_path / "a.txt", "--output", tmp_path / "out", "--prefix", prefix),
                     "--prefix", prefix, "--output")
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]


def test_shards_an_older_fineweb_named_after_a_split_word_get_a_way_out(tmp_path):
    """Before the default prefix left out the split word, --output shakespeare_train made shakespeare_train_*.npy.
    Resuming there asked for --prefix shakespeare_train, which is refused now: a dead end. It says to start afresh."""
    (tmp_path / "a.txt").write_text("plenty of words to fill a shard " * 2000)
    output = tmp_path / "shakespeare_train"
    args = ("--input", tmp_path / "a.txt", "--output", output, "--shard-size", 10_000)
    assert run_fineweb(*args).returncode == 0
    manifest = json.loads((output / "manifest.json").read_text())
    manifest["config"]["--prefix"] = "shakespeare_train"  # as the older fineweb.py wrote it
    for done in (True, False):  # complete, or stopped part way
        manifest["done"] = done
        (output / "manifest.json").write_text(json.dumps(manifest))
        assert_error(run_fineweb(*args), "shakespeare_train_val_000000.npy", f"delete {output}", "--output")
