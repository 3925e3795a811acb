"""The data side of train_gpt2.py: .npy and .bin shards, the TokenStream's coverage of an epoch across ranks,
the same global batch for any split of processes and accumulation steps, shard reshuffling, exact state
restore, and text files."""
import dataclasses
import json
import os
import resource
from collections import Counter

import numpy as np
import pytest

import train_gpt2
from helpers import TINY, read_log, run_command, save_tokens, script_command, script_env, train_records, write_shards
from machinery import errors, shard_files, tokenizer
from train_gpt2 import TokenStream, TrainConfig

BIG_VOCAB = 1 << 16  # unique token values as positions: the check of ids against the vocab lets all through


@pytest.mark.parametrize("ext", ["npy", "bin"])
def test_reads_npy_and_bin_shards(tmp_path, ext):
    tokens = np.random.default_rng(0).integers(0, 65535, 1234, dtype=np.uint16)
    path = str(tmp_path / f"x_train.{ext}")
    save_tokens(path, tokens)
    if ext == "bin":  # llm.c's layout, checked here by hand
        raw = open(path, "rb").read()
        assert len(raw) == 1024 + 2 * 1234
        assert list(np.frombuffer(raw[:12], dtype=np.int32)) == [20240520, 1, 1234]
    shard = shard_files.open_shard(path)
    assert len(shard) == 1234 and shard[:].dtype == np.uint16
    assert np.array_equal(shard[:], tokens) and np.array_equal(shard[1000:1300], tokens[1000:])


def test_load_data_mixes_formats_and_fixes_val(tmp_path):
    """A directory of one .bin and one .npy train shard; the validation set is val_tokens rounded to whole
    sequences (plus the last target), from the start of the val shards, whatever the rest of the config."""
    d = tmp_path / "data"
    d.mkdir()
    a, b, v1, v2 = (np.arange(n, dtype=np.uint16) % 100 + k for n, k in ((700, 0), (500, 1), (300, 2), (300, 3)))
    save_tokens(d / "s_train_0.bin", a)
    save_tokens(d / "s_train_1.npy", b)
    save_tokens(d / "s_val_0.npy", v1)
    save_tokens(d / "s_val_1.bin", v2)
    np.save(d / "notes.txt.npy.bak", a)  # neither .npy nor .bin at the end: ignored
    cfg = TrainConfig(data=str(d), vocab_size=128, seq_len=32, total_batch_size=256, val_tokens=500)
    stream, val = train_gpt2.load_data(cfg)
    train_tokens = sum(len(s) for s in stream.shards)
    assert train_tokens == 1200 and sorted(len(s) for s in stream.shards) == [500, 700]
    assert len(val) == (500 // 32) * 32 + 1  # 481
    assert np.array_equal(val, np.concatenate([v1, v2])[:481])
    cfg = dataclasses.replace(cfg, val_tokens=10_000)  # more than there is: all of it, in whole sequences
    _, val = train_gpt2.load_data(cfg)
    assert len(val) == (599 // 32) * 32 + 1


def test_the_split_is_a_whole_word_of_the_shard_name(tmp_path):
    """fineweb.py names shards after the output directory: "interval" holds no val shard, "training" no train one."""
    d = tmp_path / "data"
    d.mkdir()
    save_tokens(d / "interval_train_000001.npy", np.full(600, 1, dtype=np.uint16))
    save_tokens(d / "training_val_000000.npy", np.full(300, 2, dtype=np.uint16))
    save_tokens(d / "tiny_shakespeare_train.bin", np.full(400, 3, dtype=np.uint16))  # llm.c's names
    save_tokens(d / "retrieval.npy", np.full(100, 4, dtype=np.uint16))  # no split word: ignored
    cfg = TrainConfig(data=str(d), vocab_size=128, seq_len=32, total_batch_size=256, val_tokens=256)
    stream, val = train_gpt2.load_data(cfg)
    train_tokens = sum(len(s) for s in stream.shards)
    assert train_tokens == 1000 and sorted(len(s) for s in stream.shards) == [400, 600]
    assert set(val.tolist()) == {2}


def test_fineweb_tells_shards_apart_by_the_pattern_the_trainer_splits_by(tmp_path, monkeypatch):
    """fineweb.py refuses an output directory that holds shards it did not make, so it must tell train and val
    shards apart as the trainer does: both use the one pattern, shard_files.SPLIT_WORD (no copy that could drift), and
    the trainer reads every shard name of --data through it."""
    import fineweb
    assert fineweb.SPLIT_WORD is shard_files.SPLIT_WORD
    assert fineweb.SPLIT_WORD.pattern == shard_files.SPLIT_WORD.pattern
    d = tmp_path / "data"
    d.mkdir()
    names = ["interval_train_000001.npy", "training_val_000000.npy", "retrieval.npy"]
    for name, value in zip(names, (1, 2, 3)):
        save_tokens(d / name, np.full(600, value, dtype=np.uint16))
    split_word, read = shard_files.SPLIT_WORD, []

    class Spy:
        def findall(self, name):
            read.append(name)
            return split_word.findall(name)

    monkeypatch.setattr(shard_files, "SPLIT_WORD", Spy())
    cfg = TrainConfig(data=str(d), vocab_size=128, seq_len=32, total_batch_size=256, val_tokens=256)
    stream, val = train_gpt2.load_data(cfg)
    assert sorted(read) == sorted(names)
    assert stream.names == [str(d / names[0])] and set(val.tolist()) == {2}


def unique_shards(lengths):
    """Shards whose tokens are their global positions 0, 1, 2, ...: every token can be traced."""
    starts = np.cumsum([0, *lengths])
    return [np.arange(starts[i], starts[i + 1], dtype=np.uint16) for i in range(len(lengths))]


def test_one_epoch_covers_every_token_once_without_overlap():
    lengths = [1000, 1500, 700, 800, 96]  # 4096 tokens, odd shard sizes: batches straddle shard ends
    shards = unique_shards(lengths)
    B, T, world, accum = 2, 8, 2, 2  # 64 tokens a step: 64 steps an epoch
    streams = [TokenStream(shards, [f"s{i}" for i in range(5)], seed=5) for _ in range(world)]  # one per rank
    per_step_chunks = []
    for _ in range(64):
        chunks = {}
        for rank in range(world):
            for micro, (x, y) in enumerate(streams[rank].next_step(B, T, accum, rank, world, BIG_VOCAB)):
                assert x.shape == y.shape == (B, T)
                chunks[micro * world + rank] = (x.flatten().numpy(), y.flatten().numpy())
        assert sorted(chunks) == list(range(world * accum))
        seen = np.concatenate([chunks[c][0] for c in sorted(chunks)])
        assert len(set(seen.tolist())) == len(seen)  # no two ranks or micro-steps share a token
        per_step_chunks.append(chunks)
    inputs = np.concatenate([chunks[c][0] for chunks in per_step_chunks for c in sorted(chunks)])
    targets = np.concatenate([chunks[c][1] for chunks in per_step_chunks for c in sorted(chunks)])
    assert Counter(inputs.tolist()) == Counter(range(4096))  # every token once, none wasted at shard ends
    # the epoch is the shards end to end in some order: each shard appears whole, in one piece
    order = []
    position = 0
    while position < 4096:
        shard = next(i for i, s in enumerate(shards) if s[0] == inputs[position])
        assert np.array_equal(inputs[position: position + lengths[shard]], shards[shard])
        order.append(shard)
        position += lengths[shard]
    assert sorted(order) == list(range(5))
    # targets are the inputs one token later, across shard ends too; the last one opens the next epoch
    assert np.array_equal(targets[:-1], inputs[1:])
    shard_sizes = [[f"s{i}", n] for i, n in enumerate(lengths)]
    assert all(s.state_dict() == {"epoch": 1, "index": 0, "offset": 0, "seed": 5, "shards": shard_sizes}
               for s in streams)
    next_epoch_first = streams[0].next_step(1, 1, 1, 0, 1, BIG_VOCAB)[0][0].item()
    assert targets[-1] == next_epoch_first


def global_batches(world, accum, B, T, steps, shards, seed=3):
    """The tokens of each step, chunk by chunk in global order, from `world` ranks' streams."""
    streams = [TokenStream(shards, ["a", "b", "c"], seed) for _ in range(world)]
    out = []
    for _ in range(steps):
        chunks = {}
        for rank, stream in enumerate(streams):
            for micro, (x, y) in enumerate(stream.next_step(B, T, accum, rank, world, BIG_VOCAB)):
                chunks[micro * world + rank] = (x, y)
        out.append((np.concatenate([chunks[c][0].numpy().ravel() for c in sorted(chunks)]),
                    np.concatenate([chunks[c][1].numpy().ravel() for c in sorted(chunks)])))
    return out


def test_same_global_batch_for_any_split():
    shards = unique_shards([900, 1300, 500])
    B, T = 2, 16  # 4 x 32 = 128 tokens a step: 1 process x 4 accumulation steps, 2 x 2, 4 x 1
    steps = 40  # > 2 epochs of 2700 tokens
    reference = global_batches(1, 4, B, T, steps, shards)
    for world, accum in ((2, 2), (4, 1)):
        other = global_batches(world, accum, B, T, steps, shards)
        for step, ((x1, y1), (x2, y2)) in enumerate(zip(reference, other)):
            assert np.array_equal(x1, x2) and np.array_equal(y1, y2), (world, accum, step)
    # and a different micro-batch shape for the same 128 tokens: 1 x 32, 8 accumulation steps, 1 process
    for (x1, _), (x2, _) in zip(reference, global_batches(1, 8, 1, 16, steps, shards)):
        assert np.array_equal(x1, x2)
    # consecutive steps follow each other in the stream
    for (x1, y1), (x2, _) in zip(reference, reference[1:]):
        assert np.array_equal(y1[:-1], x1[1:]) and y1[-1] == x2[0]


def epoch_orders(seed, n_epochs, n_shards=6, length=50):
    """The shard order of each epoch, read off the stream: shard i holds only the value i."""
    shards = [np.full(length, i, dtype=np.uint16) for i in range(n_shards)]
    stream = TokenStream(shards, [str(i) for i in range(n_shards)], seed)
    orders = []
    for _ in range(n_epochs):
        x = np.concatenate([stream.next_step(1, length, 1, 0, 1, 128)[0][0].numpy().ravel() for _ in range(n_shards)])
        orders.append(tuple(x[::length].tolist()))
        assert np.array_equal(x, np.repeat(orders[-1], length))
    return orders


def test_shard_order_reshuffled_each_epoch_from_the_seed():
    orders = epoch_orders(seed=1337, n_epochs=4)
    for order in orders:
        assert sorted(order) == list(range(6))
    assert len(set(orders)) > 1  # not the same order every epoch
    assert epoch_orders(seed=1337, n_epochs=4) == orders  # reproducible from the seed
    assert epoch_orders(seed=1338, n_epochs=4) != orders  # and a different seed shuffles differently
    assert len({epoch_orders(seed, 1)[0] for seed in range(10)}) > 3  # the first epoch is shuffled too


def test_state_dict_restores_the_exact_position():
    shards = unique_shards([333, 1000, 250])
    stream = TokenStream(shards, ["a", "b", "c"], seed=9)
    for _ in range(10):  # 1920 tokens: into the second epoch of 1583, mid-shard
        stream.next_step(2, 16, 3, 1, 2, BIG_VOCAB)
    state = json.loads(json.dumps(stream.state_dict()))  # plain numbers: safe for torch.load(weights_only=True)
    assert state["epoch"] == 1
    restored = TokenStream(shards, ["a", "b", "c"], seed=9)
    restored.load_state_dict(state)
    for _ in range(40):
        for rank in range(2):  # both ranks, read from copies of the stream state
            a = TokenStream(shards, ["a", "b", "c"], seed=9)
            a.load_state_dict(stream.state_dict())
            b = TokenStream(shards, ["a", "b", "c"], seed=9)
            b.load_state_dict(restored.state_dict())
            for (x1, y1), (x2, y2) in zip(a.next_step(2, 16, 3, rank, 2, BIG_VOCAB),
                                          b.next_step(2, 16, 3, rank, 2, BIG_VOCAB)):
                assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
        stream.next_step(2, 16, 3, 0, 2, BIG_VOCAB)
        restored.next_step(2, 16, 3, 0, 2, BIG_VOCAB)
        assert stream.state_dict() == restored.state_dict()


def test_text_file_is_tokenized_with_gpt2_bpe(tmp_path):
    enc = tokenizer.gpt2_tokenizer()
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's known ids
    path = tmp_path / "tiny.txt"
    path.write_text("Hello world, " * 200)
    cfg = TrainConfig(data=str(path), vocab_size=50304, seq_len=8, total_batch_size=64, val_tokens=40)
    stream, val = train_gpt2.load_data(cfg)
    train_tokens = sum(len(s) for s in stream.shards)
    tokens = enc.encode_ordinary("Hello world, " * 200)
    split = int(0.9 * len(tokens))
    assert train_tokens == split and np.array_equal(stream.shards[0], tokens[:split])
    assert np.array_equal(val, tokens[split: split + 41])  # the last 10%: 5 sequences of 8, and one target more


def test_the_stream_over_shard_files_reads_the_tokens_np_load_gives(tmp_path):
    """Shards read from their files as the stream reaches them train on the same tokens, in the same order, as the
    whole arrays np.load reads: across shard ends and epochs, in both formats."""
    rng = np.random.default_rng(4)
    lengths = [900, 1300, 500, 77, 1024]
    paths = []
    for i, n in enumerate(lengths):
        paths.append(str(tmp_path / f"s_train_{i}.{'bin' if i % 2 else 'npy'}"))
        save_tokens(paths[-1], rng.integers(0, tokenizer.GPT2_VOCAB, n, dtype=np.uint16))
    arrays = [np.load(p) if p.endswith(".npy") else np.fromfile(p, np.uint16, offset=1024) for p in paths]
    from_files = TokenStream([shard_files.open_shard(p) for p in paths], paths, seed=3)
    in_memory = TokenStream(arrays, paths, seed=3)
    for _ in range(30):  # 30 x 3 x 96 tokens: past two epochs of 3801
        for (x1, y1), (x2, y2) in zip(from_files.next_step(3, 32, 1, 0, 1, BIG_VOCAB),
                                      in_memory.next_step(3, 32, 1, 0, 1, BIG_VOCAB)):
            assert torch_equal(x1, x2) and torch_equal(y1, y2)
    assert from_files.state_dict() == in_memory.state_dict()


def torch_equal(a, b):
    return a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy())


def test_any_number_of_shards_trains_under_a_small_descriptor_limit(tmp_path):
    """FineWeb-Edu's 350B sample makes about 3,500 shards, and 1024 open files (ulimit -n) is a common default: each
    shard kept open (a memory map holds a descriptor) refused any run of more than about 1,010 of them, blaming a good
    shard. Here 1,000 shards under a limit of 256 train, save a checkpoint and resume, on the tokens of the run that
    had no limit."""
    data = write_shards(tmp_path / "data", train_lengths=[40 + i % 50 for i in range(1000)], val_length=600)
    args = TINY + ["--data", data, "--max-steps", "4", "--checkpoint-every", "2", "--warmup-steps", "1"]

    def train(log_dir, limit, max_steps):
        command = script_command(args + ["--log-dir", tmp_path / log_dir, "--max-steps", max_steps])
        result = run_command(command, tmp_path, script_env(), 240,  # ulimit -n limit
                             limits={"RLIMIT_NOFILE": (limit, limit)} if limit else None)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    train("free", None, 4)
    train("limited", 256, 2)
    assert "resuming from the checkpoint of step 2" in train("limited", 256, 4)
    free, limited = train_records(read_log(tmp_path / "free")), train_records(read_log(tmp_path / "limited"))
    assert sorted(limited) == [0, 1, 2, 3]
    assert [limited[s]["train_loss"] for s in range(4)] == [free[s]["train_loss"] for s in range(4)]


def test_too_many_open_files_is_named_for_what_it_is(tmp_path):
    """Where the process holds all the files its limit allows, a shard that cannot be opened is not at fault: the
    line says so, and how to raise the limit."""
    path = str(tmp_path / "x_train_000000.npy")
    save_tokens(path, np.arange(100))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        with pytest.raises(OSError):
            while len(held) < 100:
                held.append(os.open(os.devnull, os.O_RDONLY))
        with pytest.raises(errors.UsageError) as raised:
            shard_files.open_shard(path)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    line = str(raised.value)
    assert path in line and "too many open files" in line and "ulimit -n 64" in line, line


def test_a_shard_cut_short_during_the_run_is_named(tmp_path):
    """The tokens are read as the stream reaches them: a shard truncated since its length was read (a copy still
    going on, another fineweb.py) is named, not read short."""
    path = str(tmp_path / "x_train_000000.npy")
    save_tokens(path, np.arange(1000))
    shard = shard_files.open_shard(path)
    os.truncate(path, os.path.getsize(path) - 2 * 300)
    assert np.array_equal(shard[100:700], np.arange(100, 700))
    with pytest.raises(errors.UsageError, match="ends before token 700 of 1,000: it changed since this run began"):
        shard[600:800]
