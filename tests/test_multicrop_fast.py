"""DINO's multi-crop drawn first and decoded once (MultiCrop.plan / decode / rest) and its
device-side augmentation (multicrop.device_augment, laplace.data.crop_augment) against the
reference pipelines (MultiCrop.reference: DINO's T.Compose per view), on real photographs."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from bench.images import jpeg, photos
from laplace.data.images import load, open_rgb
from laplace.data.multicrop import PARAMS, MultiCrop, multicrop_collate

SEEDS = range(6)
# Device-side against PIL, 0-255 units, measured on these photographs (docs/LOG.md, issue 33).
MEAN_BOUND, MAX_BOUND = 3.0, 255.0


@pytest.fixture(scope="module")
def files() -> list[bytes]:
    return [jpeg(img) for _, img in photos()]


def seeded(seed: int, fn):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    out = fn()
    return out, torch.get_rng_state(), random.getstate()


def test_planned_crops_are_the_reference_bit_for_bit(files):
    """Drawn first, decoded once from the undecoded file, applied on PIL: the reference's crops,
    pixels and random draws (the generators' states after the image are equal)."""
    mc = MultiCrop(local_crops=3)
    for data in files:
        decoded = open_rgb(io.BytesIO(data), "photo")
        for seed in SEEDS:
            ref, ref_torch, ref_py = seeded(seed, lambda: mc.reference(decoded))
            new, new_torch, new_py = seeded(seed, lambda: load(io.BytesIO(data), "photo", mc))
            assert torch.equal(ref_torch, new_torch) and ref_py == new_py
            assert len(new) == len(ref) == mc.n_crops
            for a, b in zip(ref, new):
                assert torch.equal(a, b)


def test_device_augment_matches_the_pil_pipeline(files):
    """The workers' uint8 crops with their parameter rows, augmented as batches: the reference's
    draws (equal generator states) and pixels within the bound."""
    mc, dev = MultiCrop(local_crops=2), MultiCrop(local_crops=2, device_augment=True)
    refs, items = [], []
    for data in files:
        decoded = open_rgb(io.BytesIO(data), "photo")
        for seed in SEEDS:
            ref, ref_torch, ref_py = seeded(seed, lambda: mc.reference(decoded))
            item, new_torch, new_py = seeded(seed, lambda: load(io.BytesIO(data), "photo", dev))
            assert torch.equal(ref_torch, new_torch) and ref_py == new_py
            crops, rows = item
            assert all(c.dtype == torch.uint8 for c in crops) and all(r.shape == (len(PARAMS),) for r in rows)
            refs.append(ref)
            items.append((item, 0))
    batch = multicrop_collate(items)
    assert set(batch) == {"crops", "params"} and batch["crops"][0].shape == (len(items), 3, 224, 224)
    out = dev.augment_batch(batch)
    std = torch.tensor(mc.std).view(1, 3, 1, 1) * 255
    diffs = []
    for v, got in enumerate(out):
        want = torch.stack([r[v] for r in refs])
        assert got.shape == want.shape and got.dtype == torch.float32
        diffs.append(((got - want).abs() * std).flatten())
    d = torch.cat(diffs)
    assert float(d.mean()) < MEAN_BOUND and float(d.max()) <= MAX_BOUND, (float(d.mean()), float(d.max()))
