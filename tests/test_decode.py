"""Reduced-size JPEG decode (laplace.data.decode) against the full-size reference path, on real
photographs (bench/images.py: scikit-learn's and matplotlib's, re-encoded as ImageNet's typical
500 x 375 q90 JPEGs): the same random draws for the same seed, the reference's pixels where no
reduction applies, and a stated bound where one does."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from bench.images import data_node, jpeg, photos
from laplace.data.decode import ReducedDecode, reduction, resized_size
from laplace.data.images import load, open_rgb
from laplace.data.vision import build_transform

SEEDS = range(12)
# Measured on these photographs (docs/LOG.md, issue 33), 120 samples, 0-255 units: mean 0.70 / max 63 at
# 96 px, 0.79 / 46 at 128 (the evaluation at 128: 1.44 / 25); the bounds leave room for other libjpeg builds.
MEAN_BOUND, MAX_BOUND = 1.5, 96.0


@pytest.fixture(scope="module")
def files() -> list[bytes]:
    return [jpeg(img) for _, img in photos()]


def transform(kind: str, img_size: int):
    node = OmegaConf.merge(data_node(img_size), {"augment": "three_augment" if kind == "deit3" else "timm"})
    return build_transform(node, train=kind != "eval")


def seeded(seed: int, fn):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    out = fn()
    return out, torch.get_rng_state(), random.getstate()


def both(tf, data: bytes, seed: int):
    """(reference output, fast output) for one file and seed, with the RNG states after each."""
    fast = ReducedDecode(tf)
    ref = seeded(seed, lambda: tf(open_rgb(io.BytesIO(data), "photo")))
    new = seeded(seed, lambda: load(io.BytesIO(data), "photo", fast))
    return ref, new


@pytest.mark.parametrize("kind", ["deit3", "timm", "eval"])
def test_same_boxes_and_parameters_as_the_reference(files, kind):
    """plan() on the undecoded file draws the box (and timm's interpolation) the reference's first
    step draws on the decoded image, and every later draw is the same: the RNG states after the
    whole transform are equal."""
    tf = ReducedDecode(transform(kind, 128))
    f = tf.first
    reduced = 0
    for data in files:
        decoded = open_rgb(io.BytesIO(data), "photo")
        for seed in SEEDS:
            with Image.open(io.BytesIO(data)) as lazy:
                (box, out, resample), *_ = seeded(seed, lambda: tf.plan(lazy))
            if kind == "eval":
                assert box == (0, 0, *decoded.size) and out == resized_size(*decoded.size, f.size)
            else:
                (i, j, h, w), *_ = seeded(seed, lambda: f.get_params(decoded, f.scale, f.ratio))
                assert box == (j, i, j + w, i + h) and out == (128, 128)
            reduced += reduction(box, out) > 1
            (ref, *ref_state), (new, *new_state) = both(tf.transform, data, seed)
            assert torch.equal(ref_state[0], new_state[0]) and ref_state[1] == new_state[1]
            assert ref.shape == new.shape
    assert reduced > 0  # the test has reductions to check


@pytest.mark.parametrize("kind", ["deit3", "timm", "eval"])
def test_reference_pixels_where_no_reduction_applies(files, kind):
    """At the paper's 192 px a 500 x 375 photo never allows a reduction (a crop would need 384
    rows): the fast path is the reference, bit for bit."""
    tf = transform(kind, 192)
    for data in files:
        for seed in SEEDS:
            (ref, *_), (new, *_) = both(tf, data, seed)
            assert torch.equal(ref, new)


def test_pixel_difference_where_reduced(files):
    """Where libjpeg's scaled IDCT does the first halving(s), the output stays within the bound
    (0-255 units; measured values in docs/LOG.md)."""
    tf, std = transform("deit3", 96), torch.tensor(data_node(None).std).view(3, 1, 1) * 255
    diffs = []
    for data in files:
        for seed in SEEDS:
            (ref, *_), (new, *_) = both(tf, data, seed)
            diffs.append(((ref - new).abs() * std).flatten())
    d = torch.cat(diffs)
    assert float(d.mean()) < MEAN_BOUND and float(d.max()) < MAX_BOUND, (float(d.mean()), float(d.max()))


def test_first_step_must_be_a_crop_or_a_resize():
    from torchvision import transforms as T

    with pytest.raises(TypeError, match="resized crop or a resize"):
        ReducedDecode(T.Compose([T.CenterCrop(8)]))
