"""Resumable, seeded data order shared by every trainer.

Exact resume needs two things the stock samplers do not give: starting an epoch part-way
through, and augmentation randomness that does not depend on which worker process or which
run drew the sample. `ResumableSampler` wraps any epoch-seeded sampler (torch's
DistributedSampler, timm's RepeatAugSampler), skips the samples a resumed run has already
consumed, and pairs each index with a per-sample seed; `SeededDataset` applies that seed around
the wrapped dataset's __getitem__, so sample i of epoch e is augmented identically whatever
the number of workers and however often the run was interrupted.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler


class ResumableSampler(Sampler):
    """Yield (index, seed) pairs from `inner`, starting `start` samples into the epoch.

    Args:
        inner: a sampler with `set_epoch` (its order depends only on its seed and the epoch).
        seed: base seed of the per-sample augmentation seeds.
        rank: this process's rank (ranks draw different augmentation seeds).
    """

    def __init__(self, inner: Sampler, seed: int = 0, rank: int = 0):
        self.inner, self.seed, self.rank = inner, seed, rank
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0):
        self.epoch, self.start = epoch, start
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for pos, idx in enumerate(self.inner):
            if pos < self.start:
                continue
            # A 63-bit seed from (seed, epoch, rank, position): fixed for this slot of the run.
            g = (((self.seed * 1_000_003 + self.epoch) * 1_000_003 + self.rank) * 1_000_003 + pos)
            yield int(idx), g % (2**63 - 1)

    def __len__(self):
        return len(self.inner) - self.start


class SeededDataset(Dataset):
    """Wraps a dataset so that item (index, seed) is produced with torch's CPU RNG seeded by seed.

    The global RNG is restored afterwards (fork_rng), so loading in the main process does not
    disturb the model's dropout / drop-path randomness.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        idx, seed = key
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed would also queue a lazy CUDA seeding,
            # 15x slower per sample, and transforms draw from the CPU generator anyway.
            torch.default_generator.manual_seed(seed)
            return self.dataset[idx]


def epoch_sampler(n_or_dataset, shuffle: bool, seed: int, rank: int, world_size: int,
                  drop_last: bool = True) -> DistributedSampler:
    """torch's DistributedSampler, used with world_size 1 too: one code path, seeded by epoch."""
    return DistributedSampler(n_or_dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                              seed=seed, drop_last=drop_last)
