"""
How fast fineweb.py tokenizes, against the single-core rate and the simple baseline, and
what overlapping download with tokenization gains, on the same text and cores.

    python benchmarks/bench_fineweb.py                   # ~50M tokens of tiny Shakespeare, all cores
    python benchmarks/bench_fineweb.py --text some.parquet --tokens 50000000 --workers 8

Prints:
- single core: encode_ordinary per document, in this process, no I/O;
- baseline: build-nanogpt's way, multiprocessing.Pool.imap of encode_ordinary per document
  (chunksize 16), documents read from the same parquet files, tokens copied into shards;
- fineweb.py: `fineweb.py --input <the parquet files>` (its main(), in this process, as the
  baseline runs), shards written, start to finish;
- end to end, against a local hub throttled so that downloading takes about as long as
  tokenizing: every file downloaded first, then `fineweb.py --input` (download, then tokenize),
  against fineweb.py's hub mode, which tokenizes one file while it downloads the next.
Each in-process timing is the best of --rounds, to see past other load on the machine; their
CPU times, which that load hardly changes, bound the parallel efficiency the cores would give alone.
"""

import argparse
import contextlib
import hashlib
import http.server
import io
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import requests

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
import fineweb  # noqa: E402
from machinery.tokenizer import EOT, gpt2_tokenizer  # noqa: E402

TREE = "/api/datasets/HuggingFaceFW/fineweb-edu/tree/main/sample/10BT"
RESOLVE = "/datasets/HuggingFaceFW/fineweb-edu/resolve/main/"

encoding = gpt2_tokenizer()

def baseline_tokenize(text):
    # build-nanogpt's fineweb.py tokenize(): <|endoftext|> then encode_ordinary, as a uint16 array
    return np.array([EOT] + encoding.encode_ordinary(text), dtype=np.uint16)

def read_documents(path, tokens_wanted):
    if path.endswith(".parquet"):
        return pq.read_table(path, columns=["text"]).column(0).to_pylist()
    text = open(path, encoding="utf-8").read()
    # documents of 1-8 KB of consecutive text (FineWeb-Edu's average is about 4 KB), repeated to size
    docs, start, size, characters = [], 0, 1000, 0
    while characters < tokens_wanted * 4:  # ~4 characters per token
        size = size * 7919 % 7001 + 1000
        docs.append(text[start:start + size])
        start, characters = (start + size) % max(len(text) - 8000, 1), characters + size
    return docs

def write_parquet_files(docs, directory, files):
    paths = []
    per_file = -(-len(docs) // files)
    for i in range(files):
        path = os.path.join(directory, f"{i:03d}_00000.parquet")
        # FineWeb's files hold hundreds of row groups of ~1000 documents; smaller ones give this small
        # benchmark as many units of work to spread over the cores
        pq.write_table(pa.table({"text": docs[i * per_file:(i + 1) * per_file]}), path, row_group_size=256)
        paths.append(path)
    return paths

def cpu_seconds():
    # this process and its reaped children (the pools' workers, once a run has closed its pool)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

def best_of(rounds, runs):
    """The shortest wall time and CPU time of each run over `rounds`; the runs take turns, so that load
    from elsewhere on the machine hits them alike. CPU time, unlike wall time, hardly depends on that load."""
    wall, cpu = {name: float("inf") for name in runs}, {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), cpu_seconds()
            run()
            wall[name] = min(wall[name], time.perf_counter() - start)
            cpu[name] = min(cpu[name], cpu_seconds() - start_cpu)
    return wall, cpu

def run_baseline(paths, workers, shard_size=10**7):
    shard, fill = np.empty(shard_size, dtype=np.uint16), 0
    def documents():
        for path in paths:
            pf = pq.ParquetFile(path)
            for row_group in range(pf.num_row_groups):
                yield from pf.read_row_group(row_group, columns=["text"]).column(0).to_pylist()
    with multiprocessing.Pool(workers) as pool:
        for tokens in pool.imap(baseline_tokenize, documents(), chunksize=16):
            while len(tokens):
                take = min(shard_size - fill, len(tokens))
                shard[fill:fill + take] = tokens[:take]
                fill, tokens = fill + take, tokens[take:]
                if fill == shard_size:
                    fill = 0

def quietly(function, *args):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        function(*args)

def run_fineweb(args, output):
    return subprocess.run([sys.executable, os.path.join(REPO, "fineweb.py"), *args, "--output", output],
                          capture_output=True, text=True, check=True)

def throttled_hub(paths, rate):
    """A local hub with the tree and resolve endpoints, serving the files at `rate` bytes/s."""
    files = {f"sample/10BT/{os.path.basename(p)}": open(p, "rb").read() for p in paths}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == TREE:
                body = json.dumps([{"type": "file", "path": p, "size": len(d),
                                    "lfs": {"oid": hashlib.sha256(d).hexdigest()}} for p, d in files.items()]).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            data = files[self.path[len(RESOLVE):]]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            start = time.perf_counter()
            for offset in range(0, len(data), 1 << 16):
                self.wfile.write(data[offset:offset + (1 << 16)])
                time.sleep(max(0.0, (offset + (1 << 16)) / rate - (time.perf_counter() - start)))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--text", default=os.path.join(REPO, "input.txt"),
                        help="a .txt to cut into documents, or a .parquet")
    parser.add_argument("--tokens", type=int, default=50_000_000, help="about this many tokens (for a .txt)")
    parser.add_argument("--workers", type=int, default=fineweb.usable_cores())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files", type=int, default=8, help="parquet files the text is split into")
    args = parser.parse_args()

    docs = read_documents(args.text, args.tokens)
    tokens = sum(len(encoding.encode_ordinary(d)) + 1 for d in docs)
    print(f"{len(docs):,} documents, {tokens:,} tokens, {args.workers} workers, best of {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_parquet_files(docs, tmp, args.files)
        megabytes = sum(os.path.getsize(p) for p in paths) / 1e6

        outputs = iter(range(args.rounds))  # a fresh output each round: a finished one is not redone
        wall, cpu = best_of(args.rounds, {
            "single": lambda: [encoding.encode_ordinary(d) for d in docs],
            "baseline": lambda: run_baseline(paths, args.workers),
            "fineweb": lambda: quietly(fineweb.main, ["--input", *paths, "--output",
                                                      os.path.join(tmp, f"out{next(outputs)}"),
                                                      "--shard-size", "10000000", "--workers", str(args.workers)]),
        })
        single, baseline, ours = (tokens / wall[name] for name in ("single", "baseline", "fineweb"))
        print(f"single core encode_ordinary: {single / 1e6:6.2f} M tokens/s")
        print(f"baseline Pool.imap, chunk 16: {baseline / 1e6:6.2f} M tokens/s "
              f"({baseline / (args.workers * single):.0%} of {args.workers} x single core)")
        print(f"fineweb.py (whole run):       {ours / 1e6:6.2f} M tokens/s "
              f"({ours / (args.workers * single):.0%} of {args.workers} x single core, "
              f"{ours / baseline:.2f}x baseline)")
        # what the efficiency would be with the cores to itself: the single core's CPU time over each run's
        print(f"CPU time per token against the single core: baseline {cpu['baseline'] / cpu['single']:.2f}x "
              f"(efficiency bound {cpu['single'] / cpu['baseline']:.0%}), "
              f"fineweb.py {cpu['fineweb'] / cpu['single']:.2f}x (bound {cpu['single'] / cpu['fineweb']:.0%})")

        tokenize_seconds = tokens / ours
        rate = megabytes * 1e6 / tokenize_seconds  # downloading then takes as long as tokenizing
        server, url = throttled_hub(paths, rate)
        runs = iter(range(2 * args.rounds))

        def download_then_tokenize():  # the usual way (build-nanogpt lets `datasets` fetch everything first)
            run = next(runs)
            downloaded = os.path.join(tmp, f"downloaded{run}")
            os.mkdir(downloaded)
            for path in paths:
                with requests.get(f"{url}{RESOLVE}sample/10BT/{os.path.basename(path)}", stream=True) as response, \
                        open(os.path.join(downloaded, os.path.basename(path)), "wb") as f:
                    for chunk in response.iter_content(1 << 16):
                        f.write(chunk)
            run_fineweb(["--input", downloaded, "--shard-size", "10000000", "--workers", str(args.workers)],
                        os.path.join(tmp, f"sequential{run}"))

        def overlapped():
            run_fineweb(["--endpoint", url, "--shard-size", "10000000", "--workers", str(args.workers)],
                        os.path.join(tmp, f"overlapped{next(runs)}"))

        end_to_end, _ = best_of(args.rounds, {"sequential": download_then_tokenize, "overlapped": overlapped})
        server.shutdown()
        print(f"end to end, {args.files} files, {megabytes:.0f} MB at {rate / 1e6:.1f} MB/s "
              f"(download {megabytes * 1e6 / rate:.1f} s, tokenize {tokenize_seconds:.1f} s):")
        print(f"  download all, then tokenize:        {end_to_end['sequential']:6.1f} s")
        print(f"  fineweb.py, overlapped (hub mode):  {end_to_end['overlapped']:6.1f} s "
              f"({end_to_end['sequential'] / end_to_end['overlapped']:.2f}x faster)")

if __name__ == "__main__":
    main()
