"""
The one HTTP downloader: requests retried with backoff, a file resumed with Range requests where a connection drops,
checked before it is renamed into place. fineweb.py fetches the hub's files with it, and the trainer fills a cache that
the processes of a node share: each file fetched once per node, whole or not at all.
"""

import hashlib
import os
import re
import time
import uuid
from typing import Any, Callable, NamedTuple

from safetensors import safe_open

from machinery.errors import BadFile, UsageError
from machinery.ranks import failing_together

# requests is imported inside the functions: its import takes a quarter of a second of every process's start, and few
# runs download
DOWNLOAD_CHUNK = 1 << 16  # bytes kept when a connection drops mid-download are whole chunks
CONNECT_TIMEOUT, READ_TIMEOUT = 30, 60  # seconds a request waits for a connection, then for each read


class Retrying(NamedTuple):
    """How a failing request is retried: `retries` times, waiting `delay` seconds, doubling each time up to a minute.
    Each retry is said with say(line), naming the flags that set it; a set stop (a threading.Event) ends the wait."""
    retries: int = 10
    delay: float = 1.0
    flags: str = ""
    say: Callable[[str], Any] = print
    stop: Any = None


RETRYING = Retrying()  # the trainer's downloads: about 5 minutes of waiting in all


class Refused(UsageError):
    """An answer that asking again would not change: an HTTP error status of 400 to 499, but 429 (too many requests)."""

    def __init__(self, status, url):
        super().__init__(f"{url} answered HTTP {status}")
        self.status, self.url = status, url


class GaveUp(UsageError):
    """A request that failed through every retry; its message is the last failure in words."""

    def __init__(self, error, retries):
        super().__init__(in_words(error))
        self.retries = retries


def hub_headers():
    """The header that sends $HF_TOKEN, if set: for requests to the Hugging Face hub or its mirror, no other host."""
    token = os.environ.get("HF_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def get(session, url, headers=None):
    """GET url; 5xx/429 and network failures raise requests exceptions (retried), other errors Refused."""
    import requests
    response = session.get(url, headers=headers, stream=True, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
    status = response.status_code
    if status < 400 or status == 416:
        return response
    response.close()
    if status >= 500 or status == 429:
        raise requests.HTTPError(f"HTTP {status} from {url}")
    raise Refused(status, url)


def in_words(error):
    """Why a request failed, in a few words: requests' own message runs over a line ("HTTPConnectionPool(host=...):
    Max retries exceeded with url: ... (Caused by NewConnectionError(...: [Errno 111] Connection refused'))")."""
    import requests
    reason = re.search(r"\[Errno -?\d+\] ([^'\"()]+)", str(error))
    if reason:
        return reason.group(1).strip()
    return "timed out" if isinstance(error, requests.Timeout) else str(error)


def retry_wait(retrying, retry):
    return min(retrying.delay * 2 ** (retry - 1), 60)


def duration(seconds):
    return f"{seconds:.3g} s" if seconds < 60 else f"{seconds / 60:.3g} min"


def wait_before_retry(failures, error, asked, retrying):
    """Waits before retry number `failures` of a request for `asked`, saying so; past the retries, raises GaveUp."""
    if failures > retrying.retries:
        raise GaveUp(error, retrying.retries)
    wait, waits = retry_wait(retrying, failures), sum(retry_wait(retrying, n) for n in range(1, retrying.retries + 1))
    flags = f" ({retrying.flags})" if retrying.flags else ""
    retrying.say(f"{asked}: {in_words(error)}; retry {failures} of {retrying.retries} in {duration(wait)}; giving up "
                 f"after {retrying.retries} retries, {duration(waits)} of waiting in all{flags}")
    if retrying.stop is None:
        time.sleep(wait)
    else:
        retrying.stop.wait(wait)


def stopped(retrying):
    return retrying.stop is not None and retrying.stop.is_set()


def whole_size(response, have):
    """The size of the whole file that a response's Content-Length implies (its body starts at byte `have` if it is
    206, Partial Content), or None where it sends none."""
    length = response.headers.get("Content-Length", "")
    if not length.isdigit():
        return None
    return int(length) + (have if response.status_code == 206 else 0)


def resume(session, url, part, asked, retrying, size=None, headers=None):
    """Appends url's bytes to the file part until it holds the whole file (size bytes, or as many as the server says),
    each request asking for the bytes it lacks (Range); False if retrying.stop was set."""
    import requests
    # identity: through a compressing proxy, Range offsets would count other bytes
    identity, failures = {**(headers or {}), "Accept-Encoding": "identity"}, 0
    while not stopped(retrying) and (size is None or not os.path.exists(part) or os.path.getsize(part) < size):
        have = os.path.getsize(part) if os.path.exists(part) else 0
        try:
            with get(session, url, {**identity, "Range": f"bytes={have}-"} if have else identity) as response:
                if response.status_code == 416:  # we hold more than the file has: verification decides
                    break
                if size is None:
                    size = whole_size(response, have)
                with open(part, "ab" if response.status_code == 206 else "wb") as f:
                    for chunk in response.iter_content(DOWNLOAD_CHUNK):
                        f.write(chunk)
                        failures = 0  # a flaky link that makes progress never runs out of retries
                        if stopped(retrying):
                            return False
                    if size is None:  # with no length said, the body ends the file as far as the server knows
                        break
                    # a body cut short raises nothing without a Content-Length, nor with one under urllib3 < 2
                    if f.tell() < size:
                        raise requests.ConnectionError(f"connection closed at byte {f.tell():,} of {size:,}")
        except requests.RequestException as e:
            if isinstance(e, ValueError):  # a malformed URL (InvalidURL, MissingSchema, ...): no retry would mend it
                raise
            failures += 1
            wait_before_retry(failures, e, asked, retrying)
    return not stopped(retrying)


def intact(path, size, sha256):
    """Whether path holds size bytes with the given sha256 (None: any)."""
    return os.path.getsize(path) == size and sha256 in (None, sha256_of(path))


def fetch(url, path, part, asked, retrying, check=None, size=None, sha256=None, headers=None):
    """Fetches url to path through the file part (a partial one resumed), retrying as `retrying` says; checked before
    the rename (its size and sha256 where given, then check(part), which raises BadFile), and fetched afresh once if it
    fails, then BadFile. Returns path, or None if retrying.stop was set."""
    import requests
    session = requests.Session()
    for attempt in range(2):  # a file that fails its check is downloaded afresh once
        if not resume(session, url, part, asked, retrying, size, headers):
            return None
        try:
            if size is not None and not intact(part, size, sha256):
                raise BadFile(f"expected {size:,} bytes with sha256 {sha256}")
            if check is not None:
                check(part)
            os.replace(part, path)
            return path
        except BadFile:
            os.remove(part)
            if attempt:
                raise


def check_safetensors(path):
    """Raises BadFile unless path is a whole safetensors file: its header must cover the file."""
    try:
        with safe_open(path, "pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types, not OSError
        raise BadFile(str(e))


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def default_cache_dir():
    return os.environ.get("GPT2_CACHE_DIR") or os.path.expanduser("~/.cache/train_gpt2")


def download(url, path, check, what, hint, headers=None):
    """Fetches url to path, retried as RETRYING says: the file appears whole and passed by check(temp_path), which
    raises BadFile, or not at all. what names the kind of file and hint says where else to get it, in the one-line
    errors."""
    cache_dir = os.path.dirname(path)
    # a unique temp name in the same directory: the rename is atomic and concurrent downloads (nodes sharing the
    # cache) don't mix. open() applies the umask to 0o666, so that a shared $GPT2_CACHE_DIR stays shared
    # (tempfile.mkstemp would make the file private to this user).
    tmp_path = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    import requests
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fetch(url, path, tmp_path, url, RETRYING, check, headers=headers)
    except BadFile as e:
        raise UsageError(f"downloaded {url} is not a valid {what} ({e}); nothing was cached; retry, or "
                         f"{hint}") from None
    except GaveUp as e:
        raise UsageError(f"could not download {url} ({e}; gave up after {e.retries} retries); {hint}") from None
    except Refused as e:
        raise UsageError(f"could not download {url} (HTTP {e.status}); {hint}") from None
    except requests.RequestException as e:  # a malformed URL, not retried; before OSError, which it subclasses
        raise UsageError(f"could not download {url} ({e}); {hint}") from None
    except OSError as e:
        raise UsageError(f"cannot write to the cache directory {cache_dir} ({e}); "
                         f"pass --cache-dir or set $GPT2_CACHE_DIR to a writable directory") from None
    except KeyboardInterrupt:
        raise UsageError(f"stopped by Ctrl-C while downloading {url}; nothing was cached, and the same command "
                         f"downloads it again") from None
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def hub_weights(repo, cache_dir=None):
    """The path in the cache of a model's weights (model.safetensors) from its repository on the Hugging Face hub, or
    $HF_ENDPOINT's mirror (with $HF_TOKEN, if set, sent to that host only): downloaded once, into a directory named
    for the repository (openai-community/gpt2: CACHE/gpt2/model.safetensors)."""
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    path = os.path.join(cache_dir or default_cache_dir(), os.path.basename(repo), "model.safetensors")
    download_once_per_node(f"{endpoint}/{repo}/resolve/main/model.safetensors", path, check_safetensors,
                           "safetensors file",
                           "set HF_ENDPOINT to a mirror (or HF_TOKEN if it needs a login)", hub_headers())
    return path


def download_once_per_node(url, path, check, what, hint, headers=None):
    """One process per node downloads (the cache may be node-local); the others wait for it, then all read the file.
    A failed download fails every rank with its one-line error. The group may span nodes, so all ranks learn whether
    any node's download failed."""
    with failing_together():  # also the wait: it ends once every node's download has ended
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.exists(path):
            print(f"downloading {url} to {path}")
            download(url, path, check, what, hint, headers)
