"""
Downloads into a cache that the processes of a node share: each file fetched once per node, whole or not at all.
"""

import hashlib
import os
import uuid

from safetensors import safe_open

from machinery.errors import BadFile, UsageError
from machinery.ranks import failing_together


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
    """Fetches url to path: the file appears whole and passed by check(temp_path), which raises BadFile, or not at all.
    what names the kind of file and hint says where else to get it, in the one-line errors."""
    cache_dir = os.path.dirname(path)
    # a unique temp name in the same directory: the rename is atomic and concurrent downloads (nodes sharing the
    # cache) don't mix. os.open applies the umask to 0o666, so that a shared $GPT2_CACHE_DIR stays shared
    # (tempfile.mkstemp would make the file private to this user).
    tmp_path = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    import requests  # here: its import takes a quarter of a second of every process's start, and few runs download
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f, \
                requests.get(url, headers=headers, stream=True, timeout=60) as response:
            response.raise_for_status()
            for chunk in response.iter_content(chunk_size=1 << 20):
                f.write(chunk)
        check(tmp_path)  # never cache a truncated or wrong file
        os.replace(tmp_path, path)
    except BadFile as e:
        raise UsageError(f"downloaded {url} is not a valid {what} ({e}); nothing was cached; retry, or "
                         f"{hint}") from None
    except requests.RequestException as e:  # before OSError, which it subclasses
        raise UsageError(f"could not download {url} ({e}); {hint}") from None
    except OSError as e:
        raise UsageError(f"cannot write to the cache directory {cache_dir} ({e}); "
                         f"pass --cache-dir or set $GPT2_CACHE_DIR to a writable directory") from None
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def download_openai_weights(name, cache_dir=None):
    """The path of OpenAI's GPT-2 `name` (gpt2, gpt2-medium, ...) in the cache, downloaded once from the Hugging Face
    hub, or from $HF_ENDPOINT's mirror (with $HF_TOKEN, if set, sent to that host only)."""
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    path = os.path.join(cache_dir or default_cache_dir(), name, "model.safetensors")
    headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else None
    download_once_per_node(f"{endpoint}/openai-community/{name}/resolve/main/model.safetensors", path,
                           check_safetensors, "safetensors file",
                           "set HF_ENDPOINT to a mirror (or HF_TOKEN if it needs a login)", headers)
    return path


def download_once_per_node(url, path, check, what, hint, headers=None):
    """One process per node downloads (the cache may be node-local); the others wait for it, then all read the file.
    A failed download fails every rank with its one-line error. The group may span nodes, so all ranks learn whether
    any node's download failed."""
    with failing_together():  # also the wait: it ends once every node's download has ended
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.exists(path):
            print(f"downloading {url} to {path}")
            download(url, path, check, what, hint, headers)
