import functools
import gc
import http.server
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import forkserver  # noqa: E402 (after the path that finds the repo's modules)
from helpers import serving, write_shards  # noqa: E402


def pytest_collection_finish(session):
    """What collecting the tests made (torch, transformers and the rest imported: some 450,000 objects) is left out of
    every later garbage collection, as the fork server leaves its own: each full collection walked them all, 0.25 s,
    and the trainer makes one as it ends a process group."""
    gc.freeze()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread (and the same as in the subprocesses, which get OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def forked_python_commands(monkeypatch):
    """subprocess.Popen (and so subprocess.run), for the code under test in this process: a python command (one the
    fork server runs, with no options it does not take) forked by the tests' fork server, a process like any other
    without the seconds of torch's import; any other command started as it is."""
    monkeypatch.setattr(subprocess, "Popen", forkserver.popen)


@pytest.fixture
def shards(tmp_path):
    """Synthetic train and val shards in tmp_path/data."""
    return write_shards(tmp_path / "data")


class Served(tuple):
    """(root_dir, base_url), and .log: the (path, Authorization header) of every request; .ranges: its Range header;
    .cut: path -> [body bytes sent before each of the next responses for it hangs up]."""


@pytest.fixture
def static_server(tmp_path):
    """A real HTTP server on 127.0.0.1 serving files under tmp_path/'www', from the byte a Range header asks for (as
    the hub does); yields Served((root_dir, base_url))."""
    root = tmp_path / "www"
    root.mkdir()
    log, ranges, cut = [], [], {}

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            log.append((self.path, self.headers.get("Authorization")))
            ranges.append(self.headers.get("Range"))
            if not (self.headers.get("Range") or cut.get(self.path)):
                return super().do_GET()
            path = self.translate_path(self.path)
            if not os.path.isfile(path):
                return self.send_error(404)
            with open(path, "rb") as f:
                data = f.read()
            start = int(self.headers.get("Range", "bytes=0-")[len("bytes="):].rstrip("-"))
            if start >= len(data):
                return self.send_error(416)
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            end = start + cut[self.path].pop(0) if cut.get(self.path) else len(data)
            self.wfile.write(data[start:end])
            self.close_connection = True

        def log_message(self, *args):
            pass

    handler = functools.partial(QuietHandler, directory=str(root))
    with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)) as server:
        served = Served((root, f"http://127.0.0.1:{server.server_address[1]}"))
        served.log, served.ranges, served.cut = log, ranges, cut
        yield served
