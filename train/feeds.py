"""Feeds: where a trainer's micro-batches come from, with a position that checkpoints keep.

The engine asks a feed (`Feed`) for micro-batches forever and saves `feed.state_dict()` with every
checkpoint. Token shards are a feed themselves (laplace.data.shards.TokenStream); a map-style
dataset is served by a `MapFeed`: an epoch-seeded sampler, resumable mid-epoch, and a DataLoader
whose augmentations are seeded per sample, so that a resumed run sees what an uninterrupted one
would, on any number of processes and data-loader workers.
"""
import itertools
import random
from typing import Iterator, Protocol, runtime_checkable

import numpy as np
import torch
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from laplace.errors import ConfigError


@runtime_checkable
class Feed(Protocol):
    """The training data as the engine reads it (train/engine.py): a training set with these
    members (laplace.data.shards.TokenStream) is used as it is, any other is served by a MapFeed.
    Positions count over all ranks (a run resumed on another number of processes continues where
    the old one stopped) and an epoch ends on a whole optimizer step (the global batch), so where
    it ends does not depend on how that batch is split into micro batch x world size x accumulation."""

    epoch: int  # the epoch of the next micro-batch (it moves on with an epoch's last one)

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches each process takes in one epoch."""

    def __iter__(self) -> Iterator:
        """Micro-batches, forever, from the current position."""

    def state_dict(self) -> dict:
        """The position, as plain ints, global over ranks."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict() (of a run on any number of processes)."""

    def close(self) -> None:
        """At the loop's end: stop the feed's worker processes, if it has any."""


def split_batch(global_batch: int, micro_batch: int | None, world: int) -> tuple[int, int]:
    """(micro batch, accumulation steps) of the global batch on `world` processes.

    `trainer.micro_batch_size` is the most one process takes per forward (a memory bound; null:
    its whole share). Where it does not divide a process's share of the global batch, the largest
    divisor of the share below it is taken, so one recipe runs on any number of GPUs that divides
    its global batch: gpt_d20's 256 sequences with at most 32 per forward are 32 x 8 x 1 on 8 GPUs
    and 16 x 16 x 1 on 16 (where nanochat's assert wants --device_batch_size=16 set by hand).
    """
    if global_batch < 1 or global_batch % world:
        raise ConfigError(f"trainer.global_batch_size={global_batch} does not split over {world} processes: "
                          f"use a multiple of {world}, or a number of GPUs that divides it")
    if micro_batch is not None and micro_batch < 1:
        raise ConfigError(f"trainer.micro_batch_size={micro_batch}: use a count >= 1 (null: the whole share)")
    share = global_batch // world
    micro = next(d for d in range(min(micro_batch or share, share), 0, -1) if share % d == 0)
    return micro, share // micro


class ResumableSampler(Sampler):
    """Yield (index, seed) pairs from `inner`, starting `start` samples into this rank's share.

    Args:
        inner: a sampler with `set_epoch` whose order depends only on its seed and the epoch, dealt
            to the ranks in turn (rank r takes positions r, r + W, ...): torch's DistributedSampler
            and timm's RepeatAugSampler do.
        seed: base seed of the per-sample augmentation seeds.
        rank, world_size: this process's place, to turn its positions into global ones.
    """
    # What the stock samplers lack for an exact resume: starting an epoch part-way, and a seed per
    # sample fixed by (run seed, epoch, global position) rather than by the process, the worker or
    # the interruption (SeededDataset draws the sample's augmentation with it).

    def __init__(self, inner: Sampler, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.inner, self.seed, self.rank, self.world_size = inner, seed, rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0):
        self.epoch, self.start = epoch, start
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for pos, idx in itertools.islice(enumerate(self.inner), self.start, None):
            g = pos * self.world_size + self.rank  # the sample's global slot in the run, not the rank
            yield int(idx), ((self.seed * 1_000_003 + self.epoch) * 1_000_003 + g) % (2**63 - 1)  # 63 bits


class SeededDataset(Dataset):
    """Wraps a dataset so that item (index, seed) is produced with torch's CPU generator,
    Python's `random` and NumPy's global generator all seeded by `seed` (torchvision's
    RandomChoice draws from `random`, timm's RandAugment from `random` and NumPy): sample i of
    epoch e is augmented identically whatever the number of workers or processes."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        idx, seed = key
        # The states are restored afterwards, so loading in the main process leaves the model's
        # randomness (drop-path: torch; Mixup: NumPy) where it was.
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed would also queue a lazy CUDA seeding,
            # 15x slower per sample, and transforms draw from the CPU generator anyway.
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            try:
                return self.dataset[idx]
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)


class MapFeed:
    """Micro-batches of a map-style dataset, epoch after epoch, resumable mid-epoch.

    Args:
        dataset: the training set (items are augmented under SeededDataset).
        sampler: this rank's epoch-seeded sampler (see ResumableSampler).
        micro_batch_size: samples per process per forward.
        seed, rank, world_size: the run's seed and this process's place.
        step_size: samples of one optimizer step over all ranks (a multiple of micro batch x
            world size): each epoch uses the largest multiple of it (None: of one micro-batch
            round).
        **loader_kwargs: DataLoader options (workers, pinning, collate_fn, generator).
    """

    def __init__(self, dataset: Dataset, sampler: Sampler, micro_batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, step_size: int | None = None, **loader_kwargs):
        self.sampler = ResumableSampler(sampler, seed, rank, world_size)
        self.micro_batch_size, self.world_size = micro_batch_size, world_size
        self.step_size = step_size or micro_batch_size * world_size
        assert self.step_size % (micro_batch_size * world_size) == 0, "a step is whole micro-batch rounds"
        self.loader = DataLoader(SeededDataset(dataset), batch_size=micro_batch_size,
                                 sampler=self.sampler, drop_last=True, **loader_kwargs)
        self.epoch, self.position = 0, 0  # position: samples consumed in the epoch, all ranks
        self._batches = None  # the loader's live iterator (its workers), for close()

    @property
    def _rank_samples(self) -> int:
        """Samples each rank takes per epoch: whole steps of the global order."""
        per_epoch = len(self.sampler.inner) * self.world_size // self.step_size * self.step_size
        return per_epoch // self.world_size

    @property
    def micro_batches_per_epoch(self) -> int:
        return self._rank_samples // self.micro_batch_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict):
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self):
        W, B = self.world_size, self.micro_batch_size
        while True:
            skip = self.position // W  # rank r took global positions r, r + W, ...: position / W of its own
            self.sampler.set_epoch(self.epoch, skip)
            left = (self._rank_samples - skip) // B
            if left <= 0:  # resumed exactly at an epoch's end
                self.epoch, self.position = self.epoch + 1, 0
                continue
            self._batches = iter(self.loader)
            # zip ends after the epoch's last whole step: the loader may hold the samples of a
            # partial step, never used.
            for i, batch in zip(range(left), self._batches):
                # The epoch moves on with its last batch, not when the next one is asked for: a
                # checkpoint taken right after it resumes at the next epoch's start.
                last = i == left - 1
                self.epoch, self.position = (self.epoch + 1, 0) if last else (self.epoch, self.position + B * W)
                yield batch

    def close(self):
        """Stop the data-loader workers now and wait for them."""
        # The workers ignore SIGTERM (train.signals.ignore_in_worker), so neither DataLoader's own
        # shutdown, which falls back to it, nor multiprocessing's exit handler, which SIGTERMs
        # daemonic children and then joins them without a timeout, may be left to do it: the
        # process would hang at exit.
        it, self._batches = self._batches, None
        self.loader._iterator = None  # the persistent workers' iterator, kept by the DataLoader
        if it is None or not self.loader.num_workers:  # no workers
            return
        it._shutdown_workers()  # asks them to exit and joins them
        for w in it._workers:
            if w.is_alive():  # stuck in a dataset call: the signal it cannot ignore
                w.kill()
                w.join()


class SeededRepeatAugSampler(RepeatAugSampler):
    """timm's RepeatAugSampler (DeiT's RASampler) with the run's seed in its shuffle.

    Each image appears `num_repeats` times per epoch, the copies dealt to consecutive ranks (on one
    process: consecutive positions of a batch), and an epoch keeps the dataset's length (floored
    to a multiple of 256 as DeiT). The order depends only on seed + epoch, as torch's
    DistributedSampler, which is what ResumableSampler needs to skip into an epoch.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, num_repeats: int = 3, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, num_repeats=num_repeats)
        self.seed = seed

    def set_epoch(self, epoch: int):
        super().set_epoch(self.seed + epoch)


def train_sampler(dataset, seed: int, rank: int, world_size: int, repeated_aug: int | None = None):
    """The epoch-seeded order of the training samples: torch's DistributedSampler (also on one
    process: one code path), or repeated augmentation (DeiT-III's trainer.repeated_aug: 3)."""
    if repeated_aug and repeated_aug > 1:
        return SeededRepeatAugSampler(dataset, world_size, rank, repeated_aug, seed)
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
