"""Token shards on disk and the streaming, resumable feed of fixed-length windows read from them.

A shard is one `.npy` file holding a 1-D array of token ids (uint16 when the vocabulary has at
most 2**16 ids, else uint32), written by `write_shard` and found by `list_shards`. The GPT
pipeline writes FineWeb-Edu this way, with <|bos|> before every document.

`TokenStream` reads the shards, in order, as one concatenated stream through memory maps (only
the pages a batch touches are read) and yields (x, y) micro-batches forever. Its position is two
ints (`state_dict`) that are saved in checkpoints, so a resumed run sees exactly the tokens it
would have seen, also at another world size:

    stream = TokenStream(list_shards(cfg.data.root, "train"), seq_len=1024,
                         micro_batch_size=16, rank=rank, world_size=world_size)
    stream.load_state_dict(ckpt["data"])          # optional
    for x, y in stream:                            # x, y: int64 [B, T]
        ...
        ckpt["data"] = stream.state_dict()

Validation is one pass that does not loop: `TokenStream(files, ..., loop=False)`.
"""
import bisect
import glob
import hashlib
import itertools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from laplace.data import DatasetNotFoundError
from laplace.errors import ConfigError, one_line
from laplace.io import atomic_write


def shard_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids 0 .. vocab_size - 1 (a tokenizer's: 1 .. 2**32)."""
    # uint16 when the ids fit: half the disk and page cache
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_shard(path: str | os.PathLike, tokens: np.ndarray | Sequence[int],
                vocab_size: int) -> Path:
    """Save `tokens` as a shard at `path` (".npy" is appended if missing, as np.save does), atomically;
    returns the shard's path.

    Args:
        path: where the shard goes; parent folders are created.
        tokens: 1-D integer token ids.
        vocab_size: ids must be in 0 .. vocab_size - 1; picks uint16 (<= 2**16) or uint32.
    """
    arr = np.asarray(tokens)
    # An id out of range would be read back as another token (uint16 wraps): refuse it here.
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"token ids must be in 0 .. {vocab_size - 1} (vocab_size={vocab_size}), "
                         f"got min {arr.min()} and max {arr.max()}")
    path = Path(path) if str(path).endswith(".npy") else Path(f"{path}.npy")
    # A hidden temp file, fsynced, then renamed: a crash never leaves a half-written shard under its
    # final name, and list_shards skips the hidden leftovers.
    return atomic_write(path, lambda f: np.save(f, arr.astype(shard_dtype(vocab_size), copy=False)))


def list_shards(root_or_pattern: str | os.PathLike, split: str | None = None) -> list[Path]:
    """The shard files, sorted by name; hidden files (temp files of `write_shard`) are skipped.

    `root_or_pattern` is a folder (its `*.npy`) or a glob pattern. With `split` ("train", "val"),
    a folder's subfolder `<split>/` is used if it exists, else the files whose name contains the
    split; a pattern's matches are filtered the same way. Raises DatasetNotFoundError if none.
    """
    where = os.path.expanduser(os.fspath(root_or_pattern))
    if not glob.has_magic(where):
        where = os.path.abspath(where)
        if not os.path.isdir(where):
            raise DatasetNotFoundError(f"token shards not found: folder {where} does not exist; "
                                       f"set data.root to the folder holding the *.npy shards")
        if split is not None and os.path.isdir(os.path.join(where, split)):  # prepare's train/ and val/
            where, split = os.path.join(where, split), None
        where = os.path.join(where, "*.npy")
    files = sorted(Path(p) for p in glob.glob(where)
                   if p.endswith(".npy") and not os.path.basename(p).startswith(".")
                   and (split is None or split in os.path.basename(p)) and os.path.isfile(p))
    if not files:
        named = f" with {split!r} in the name" if split else ""
        raise DatasetNotFoundError(f"no token shards found: looked for {where}{named}; "
                                   f"set data.root to the folder holding the *.npy shards")
    return files


def open_shard(path: Path) -> np.ndarray:
    """The shard at `path`, memory-mapped (reads the header only); a file that is not a token shard
    (empty, cut short, pickled objects, floats, not 1-D) is one ConfigError naming it."""
    try:
        a = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:  # zero bytes: EOFError; cut short: "mmap length"
        raise ConfigError(f"{path} is not a readable token shard ({one_line(e)}): write it again "
                          f"(python prepare.py) or remove it from data.root") from None
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ConfigError(f"{path} is not a token shard (1-D integer array), got shape {a.shape} and "
                          f"dtype {a.dtype}: write it again (python prepare.py) or remove it from data.root")
    return a


class TokenStream:
    """Fixed-length windows of a concatenated token stream, split over ranks, resumable.

    The shards, in the given order, are one stream of N tokens; global window g < (N - 1) // T
    (capped at `max_windows`) is tokens [g*T, g*T + T + 1) (x: its first T, y: its last T; windows
    overlap by one token and may span shards). The state is (epoch, position = windows consumed
    this epoch), independent of the world size: a run resumed with other ranks or another micro
    batch continues at the same global window, and its steps hold the same windows when the global
    batch is the same. Not shuffled: shards are expected to be shuffled when written.

    Args:
        files: shard paths, in stream order (e.g. from `list_shards`).
        seq_len: T, the model's context.
        micro_batch_size: B, windows per micro-batch of this process.
        rank: this process's rank.
        world_size: W, the number of processes that consume the stream in lockstep.
        loop: start again after the last window (training); False stops after one pass.
        max_windows: use at most the first this many windows (e.g. a validation budget).
        step_windows: end each epoch at a multiple of this many windows (one optimizer step: the
            global batch, a multiple of W*B) instead of W*B.
        vocab_size: ids read must be below it (one line naming the shard, not an embedding's error).
    """

    def __init__(self, files: Sequence[str | os.PathLike], seq_len: int, micro_batch_size: int,
                 rank: int = 0, world_size: int = 1, loop: bool = True,
                 max_windows: int | None = None, step_windows: int | None = None,
                 vocab_size: int | None = None):
        self.files = [Path(f) for f in files]  # none: "too little data" below, 0 tokens
        if seq_len < 1 or micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad TokenStream arguments: seq_len={seq_len}, micro_batch_size="
                             f"{micro_batch_size}, rank={rank}, world_size={world_size}")
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.rank, self.world_size, self.loop, self.vocab_size = rank, world_size, loop, vocab_size
        # Shard lengths from the .npy headers (mapping reads no data); cum[i] = first token of i.
        # open_shard reads each header: a check of every shard before step 1.
        self._cum = [0, *itertools.accumulate(len(open_shard(f)) for f in self.files)]
        self.num_tokens = self._cum[-1]
        self.windows_per_epoch = max(self.num_tokens - 1, 0) // seq_len
        if max_windows is not None:
            self.windows_per_epoch = min(self.windows_per_epoch, max_windows)
        per_round = world_size * micro_batch_size
        if self.windows_per_epoch < per_round:
            cap = f" (max_windows={max_windows})" if max_windows is not None else ""
            raise ConfigError(
                f"too little data: data.seq_len={seq_len} x micro batch {micro_batch_size} x "
                f"world size {world_size} needs {per_round * seq_len + 1} tokens, the shards hold "
                f"{self.num_tokens} tokens ({self.windows_per_epoch} windows{cap})")
        # An epoch ends when fewer than one round's windows remain (dropped, like drop_last), or
        # one optimizer step's (step_windows); the next starts again at window 0. A trainer that
        # accumulates micro-batches passes step_windows: where an epoch ends, and which windows
        # every later step holds, then depend on the global batch alone, not on how W*B splits it
        # (else a run resumed with another micro batch took another remainder).
        step = step_windows or per_round
        if step < 1 or step % per_round:
            raise ValueError(f"step_windows={step}: must be a positive multiple of "
                             f"world size x micro batch ({per_round})")
        if self.windows_per_epoch < step:
            raise ConfigError(f"too little data: one step of {step} windows of data.seq_len="
                              f"{seq_len} needs {step * seq_len + 1} tokens, the shards "
                              f"hold {self.num_tokens} tokens ({self.windows_per_epoch} windows)")
        self._epoch_end = self.windows_per_epoch // step * step
        self.epoch, self.position = 0, 0  # position: windows consumed this epoch, over all ranks
        self._maps: dict[int, np.ndarray] = {}  # opened on first use, see _map

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches each rank yields in a full epoch (the remainder is dropped)."""
        return self._epoch_end // (self.world_size * self.micro_batch_size)

    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "position": int(self.position)}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.windows_per_epoch:
            raise ValueError(f"bad TokenStream state {state}: position must be in 0 .. "
                             f"{self.windows_per_epoch} (windows per epoch) and epoch >= 0")
        self.epoch, self.position = epoch, position

    def identity(self) -> dict:
        """What the data is, wherever it lies: shard and token counts and a digest of each
        shard's length and first and last 4096 tokens (cheap at any size). A resumed run
        compares it (train/engine.py): the same shards moved to another root resume, other
        shards are refused."""
        # Not the paths (the same shards moved resume) and not every token (hours for FineWeb-Edu's
        # shards): the lengths and both ends of each shard tell other shards apart.
        h = hashlib.sha256()
        for i in range(len(self.files)):
            a = self._map(i)
            h.update(len(a).to_bytes(8, "little") + a.dtype.str.encode())
            h.update(np.ascontiguousarray(a[:4096]).tobytes() + np.ascontiguousarray(a[-4096:]).tobytes())
        return {"shards": len(self.files), "tokens": self.num_tokens, "digest": h.hexdigest()[:16]}

    def close(self) -> None:
        """Nothing to stop: the stream reads in the training process (train.feeds.Feed)."""

    def __getstate__(self):
        # Pickle paths and lengths only; each process maps the shards itself.
        return {**self.__dict__, "_maps": {}}

    def _map(self, i: int) -> np.ndarray:
        # A touched shard stays mapped (one file descriptor); the OS evicts pages not read.
        if i not in self._maps:
            self._maps[i] = np.load(self.files[i], mmap_mode="r")
        return self._maps[i]

    def _read(self, start: int, out: np.ndarray) -> None:
        """Copy tokens [start, start + len(out)) of the stream into out, across shards."""
        # The last shard that starts at or before `start` (skips empty shards).
        i = bisect.bisect_right(self._cum, start) - 1
        done = 0  # a window may span shards: copy shard by shard
        while done < len(out):
            lo = start + done - self._cum[i]
            n = min(len(out) - done, self._cum[i + 1] - self._cum[i] - lo)
            out[done:done + n] = part = self._map(i)[lo:lo + n]
            # Checked as read (a max over one window): a whole-shard scan at start costs minutes.
            if self.vocab_size and n and part.max() >= self.vocab_size:
                raise ConfigError(f"{self.files[i]} holds token id {part.max()} (near its token {lo}), but "
                                  f"data.vocab_size={self.vocab_size}: written with another tokenizer; "
                                  f"point data.root at shards of this one")
            done, i = done + n, i + 1

    def _batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        T, W = self.seq_len, self.world_size
        buf = np.empty((self.micro_batch_size, T + 1), dtype=np.int64)
        # A round is W*B consecutive windows from `position`; rank r takes windows r, r + W, ...:
        # rows r::W of one rank with micro batch W*B, so the steps hold the same windows however
        # W*B is split over ranks.
        for j in range(self.micro_batch_size):
            self._read((position + self.rank + W * j) * T, buf[j])
        chunk = torch.from_numpy(buf)
        # Contiguous x and y: one block each for pin_memory / non_blocking copies.
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (x, y), int64 [B, T], from the current state on (one iterator at a time)."""
        per_round = self.world_size * self.micro_batch_size
        while True:
            while self.position + per_round <= self._epoch_end:
                batch = self._batch(self.position)
                # Advanced before the yield: after k batches the state says k rounds consumed,
                # so a checkpoint saved after the step that used a batch resumes after it.
                self.position += per_round
                yield batch
            if not self.loop:
                return
            self.epoch, self.position = self.epoch + 1, 0
