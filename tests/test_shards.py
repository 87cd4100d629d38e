"""Token shards and TokenStream: windows, resume, rank split, atomic writes (real .npy files)."""
from __future__ import annotations

import os
import pickle
import shutil
from itertools import islice

import numpy as np
import pytest
import torch

from laplace.data import DatasetNotFoundError
from laplace.data.shards import (TokenStream, list_shards, shard_dtype,
                                 write_shard)

T = 4


def make_shards(folder, lengths, vocab_size=1000, offset=0):
    """Write shards of consecutive ids (offset, offset + 1, ...); returns (paths, all tokens)."""
    tokens = offset + np.arange(sum(lengths))
    paths, start = [], 0
    for i, n in enumerate(lengths):
        chunk = tokens[start:start + n]
        paths.append(write_shard(folder / f"shard_{i:03d}.npy", chunk, vocab_size))
        start += n
    return paths, tokens


def window(tokens, g):
    return torch.from_numpy(tokens[g * T: g * T + T + 1].astype(np.int64))


@pytest.mark.parametrize("vocab_size,offset", [(1000, 0), (70000, 65530)])
def test_windows_are_the_concatenated_stream(tmp_path, vocab_size, offset):
    # 29 tokens over shards of 7, 0, 5, 13, 4: windows 1, 2, 5, 6 span a shard boundary.
    paths, tokens = make_shards(tmp_path, [7, 0, 5, 13, 4], vocab_size, offset)
    assert np.load(paths[0], mmap_mode="r").dtype == shard_dtype(vocab_size)
    stream = TokenStream(paths, seq_len=T, micro_batch_size=1, loop=False)
    assert stream.windows_per_epoch == 7 and stream.micro_batches_per_epoch == 7
    batches = list(stream)
    assert len(batches) == 7
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert x.dtype == torch.int64 and batches[0][0].shape == (1, T)
    assert torch.equal(x.flatten(), torch.from_numpy(tokens[:28]).long())
    assert torch.equal(y.flatten(), torch.from_numpy(tokens[1:29]).long())
    # Micro batch 2: 3 rounds, the 7th window is dropped like drop_last.
    stream = TokenStream(paths, seq_len=T, micro_batch_size=2, loop=False)
    assert stream.micro_batches_per_epoch == 3
    xs = [x for x, _ in stream]
    assert len(xs) == 3 and torch.equal(xs[2][1], window(tokens, 5)[:-1])


def test_resume_matches_uninterrupted_across_epochs(tmp_path):
    paths, _ = make_shards(tmp_path, [20, 21])  # 41 tokens: 10 windows, 3 rounds of 3 per epoch
    kw = dict(seq_len=T, micro_batch_size=3)
    ref = list(islice(TokenStream(paths, **kw), 9))
    for k in range(9):
        first = TokenStream(paths, **kw)
        list(islice(first, k))
        state = first.state_dict()
        # k yields = k rounds: the epoch turns over when the next round is drawn, not before.
        want = {"epoch": 0, "position": 0} if k == 0 else \
            {"epoch": (k - 1) // 3, "position": 3 * ((k - 1) % 3 + 1)}
        assert state == want
        resumed = TokenStream(paths, **kw)
        resumed.load_state_dict(state)
        rest = list(islice(resumed, 9 - k))
        for (x, y), (rx, ry) in zip(rest, ref[k:], strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    assert resumed.state_dict() == {"epoch": 2, "position": 9}
    # The first batch of epoch 1 is window 0 again.
    assert torch.equal(ref[3][0], ref[0][0]) and not torch.equal(ref[2][0], ref[3][0])


def test_state_and_pickle(tmp_path):
    paths, _ = make_shards(tmp_path, [41])
    stream = TokenStream(paths, seq_len=T, micro_batch_size=3)
    assert stream._maps == {}  # shards are mapped on first use, not at construction
    it = iter(stream)
    next(it)
    assert stream.state_dict() == {"epoch": 0, "position": 3}
    for _ in range(3):
        next(it)
    assert stream.state_dict() == {"epoch": 1, "position": 3} and stream.epoch == 1
    assert all(type(v) is int for v in stream.state_dict().values())
    copy = pickle.loads(pickle.dumps(stream))
    assert copy._maps == {} and copy.state_dict() == stream.state_dict()
    assert torch.equal(next(iter(copy))[0], next(it)[0])
    with pytest.raises(ValueError):
        stream.load_state_dict({"epoch": 0, "position": 11})


def test_two_ranks_split_a_round_like_one_rank(tmp_path):
    paths, tokens = make_shards(tmp_path, [30, 11, 40])  # 81 tokens: 20 windows
    one = iter(TokenStream(paths, seq_len=T, micro_batch_size=4))
    ranks = [iter(TokenStream(paths, seq_len=T, micro_batch_size=2, rank=r, world_size=2))
             for r in range(2)]
    for _ in range(12):  # 5 rounds per epoch: crosses two epoch boundaries
        x1, y1 = next(one)
        for r, it in enumerate(ranks):
            x, y = next(it)
            assert torch.equal(x, x1[r::2]) and torch.equal(y, y1[r::2])

    # World size change: 3 micro-batches of 2 at one rank, then 2 ranks continue at window 6.
    single = TokenStream(paths, seq_len=T, micro_batch_size=2)
    list(islice(single, 3))
    state = single.state_dict()
    assert state == {"epoch": 0, "position": 6}
    for r in range(2):
        s = TokenStream(paths, seq_len=T, micro_batch_size=2, rank=r, world_size=2)
        s.load_state_dict(state)
        x, y = next(iter(s))
        for j in range(2):
            w = window(tokens, 6 + r + 2 * j)
            assert torch.equal(x[j], w[:-1]) and torch.equal(y[j], w[1:])
        assert s.state_dict() == {"epoch": 0, "position": 10}


def _step_windows(paths, world, micro, step, steps, state=None):
    """The global windows (by first token / T) of each of `steps` optimizer steps of `step`
    windows, read by `world` ranks with micro batch `micro` (accumulating the rest)."""
    ranks = []
    for r in range(world):
        s = TokenStream(paths, seq_len=T, micro_batch_size=micro, rank=r, world_size=world, step_windows=step)
        if state is not None:
            s.load_state_dict(state)
        ranks.append((s, iter(s)))
    out = []
    for _ in range(steps):
        got = [int(x[0]) // T for _, it in ranks for _ in range(step // (world * micro)) for x in next(it)[0]]
        out.append(sorted(got))
    return out, ranks[0][0].state_dict()


def test_epoch_end_depends_on_the_step_not_on_its_split(tmp_path):
    """23 windows, steps of 8: an epoch is 2 steps whatever the split; before, micro-batches
    of 4 also took windows 16..19 (half a step) and the next epoch started mid-step."""
    paths, _ = make_shards(tmp_path, [50, 43])  # 93 tokens: 23 windows
    want = [list(range(0, 8)), list(range(8, 16))] * 3
    for world, micro in [(1, 8), (1, 4), (2, 4), (2, 2), (4, 1)]:
        got, _ = _step_windows(paths, world, micro, 8, 6)
        assert got == want, (world, micro)
        s = TokenStream(paths, seq_len=T, micro_batch_size=micro, world_size=world, step_windows=8)
        assert s.micro_batches_per_epoch * world * micro == 16
    # Killed after 3 steps (mid epoch 1) with micro batch 8 on one process; resumed with 2
    # processes of micro batch 2 (2 accumulation steps) across the next epoch end.
    _, state = _step_windows(paths, 1, 8, 8, 3)
    assert state == {"epoch": 1, "position": 8}
    resumed, _ = _step_windows(paths, 2, 2, 8, 3, state)
    assert resumed == want[3:]
    with pytest.raises(ValueError, match="multiple"):
        TokenStream(paths, seq_len=T, micro_batch_size=4, step_windows=6)


def test_identity_follows_the_content_not_the_folder(tmp_path):
    paths, _ = make_shards(tmp_path / "a", [50, 43])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    moved = [tmp_path / "b" / p.name for p in paths]
    other, _ = make_shards(tmp_path / "c", [50, 43], offset=1)
    ident = TokenStream(paths, seq_len=T, micro_batch_size=1).identity()
    assert ident == TokenStream(moved, seq_len=T, micro_batch_size=1).identity()
    assert ident["shards"] == 2 and ident["tokens"] == 93
    assert ident != TokenStream(other, seq_len=T, micro_batch_size=1).identity()
    assert ident != TokenStream(paths[:1], seq_len=T, micro_batch_size=1).identity()


def test_one_pass_skips_the_remainder(tmp_path):
    paths, tokens = make_shards(tmp_path, [29])  # 7 windows: one round of 2 x 2, 3 skipped
    rows = []
    for r in range(2):
        batches = list(TokenStream(paths, T, 2, rank=r, world_size=2, loop=False))
        assert len(batches) == 1
        rows += batches[0][0].tolist()
    assert sorted(rows) == [window(tokens, g)[:-1].tolist() for g in range(4)]
    capped = list(TokenStream(paths, T, 1, loop=False, max_windows=3))
    assert len(capped) == 3


def test_write_shard_is_atomic_and_checked(tmp_path, monkeypatch):
    assert shard_dtype(2**16) == np.uint16 and shard_dtype(2**16 + 1) == np.uint32
    p = write_shard(tmp_path / "a", [0, 5, 65535], 2**16)
    assert p == tmp_path / "a.npy" and np.load(p, mmap_mode="r").dtype == np.uint16
    p = write_shard(tmp_path / "b.npy", np.array([0, 69999]), 70000)
    assert np.load(p).dtype == np.uint32 and np.load(p).tolist() == [0, 69999]
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy"]  # no temp file left behind
    for bad in ([0, 1000], [-1, 3]):
        with pytest.raises(ValueError, match="token ids"):
            write_shard(tmp_path / "c.npy", bad, 1000)
    # A crash before the rename leaves nothing under the final name, and no temp file; while
    # the temp file exists (complete, in the same folder), list_shards does not see it.
    seen = []

    def crash(src, dst):
        seen.append((os.path.dirname(src), os.path.getsize(src), list_shards(tmp_path)))
        raise OSError("crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_shard(tmp_path / "c.npy", [1, 2], 1000)
    assert seen == [(str(tmp_path), os.path.getsize(tmp_path / "a.npy") - 2,
                     [tmp_path / "a.npy", tmp_path / "b.npy"])]
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy"]


def test_list_shards(tmp_path):
    write_shard(tmp_path / "s_001.npy", [1, 2], 10)
    write_shard(tmp_path / "s_000.npy", [1, 2], 10)
    (tmp_path / ".s_002.npy.x1y2.tmp").write_bytes(b"half a shard")  # a crashed write
    (tmp_path / ".s_003.npy").write_bytes(b"hidden")
    (tmp_path / "notes.txt").write_text("not a shard")
    assert list_shards(tmp_path) == [tmp_path / "s_000.npy", tmp_path / "s_001.npy"]
    assert list_shards(str(tmp_path / "s_00*.npy")) == list_shards(tmp_path)
    # Splits: by name, or by subfolder.
    write_shard(tmp_path / "fw_val_000.npy", [1], 10)
    assert list_shards(tmp_path, "val") == [tmp_path / "fw_val_000.npy"]
    write_shard(tmp_path / "train" / "000.npy", [1], 10)
    assert list_shards(tmp_path, "train") == [tmp_path / "train" / "000.npy"]

    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError) as e:
        list_shards(missing)
    msg = str(e.value)
    assert str(missing) in msg and "data.root" in msg and "\n" not in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError, match="data.root") as e:
        list_shards(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DatasetNotFoundError):
        list_shards(tmp_path, "test")


def test_too_little_data(tmp_path):
    paths, _ = make_shards(tmp_path, [5, 3])  # 8 tokens: 1 window of 4
    TokenStream(paths, seq_len=T, micro_batch_size=1)
    with pytest.raises(ValueError) as e:
        TokenStream(paths, seq_len=T, micro_batch_size=1, world_size=2)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("seq_len=4", "micro batch 1", "world size 2", "8 tokens"):
        assert part in msg
