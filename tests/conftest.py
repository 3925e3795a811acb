import functools
import http.server
import os
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


class Served(tuple):
    """(root_dir, base_url), and .log: the (path, Authorization header) of every request."""


@pytest.fixture
def static_server(tmp_path):
    """A real HTTP server on 127.0.0.1 serving files under tmp_path/'www'; yields Served((root_dir, base_url))."""
    root = tmp_path / "www"
    root.mkdir()
    log = []

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            log.append((self.path, self.headers.get("Authorization")))
            super().do_GET()

        def log_message(self, *args):
            pass

    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    served = Served((root, f"http://127.0.0.1:{server.server_address[1]}"))
    served.log = log
    yield served
    server.shutdown()
    server.server_close()
