"""DINO's multi-crop (laplace.data.multicrop) against torchvision's v1 pipeline of DINO's recipe, and
the device-side augmentation of DINO's crops (trainer.multicrop.device_augment) and of 3-Augment
(data.device_augment; laplace.data.crop_augment) against the PIL pipelines (MultiCrop,
three_augment), on real photographs."""
from __future__ import annotations

import io

import torch
from PIL import Image
from torchvision import transforms as T

from laplace.data.crop_augment import PARAMS, ThreeAugmentCrops, crop_and_augment, decoded_collate
from laplace.data.images import load
from laplace.data.multicrop import GaussianBlur, MultiCrop, Solarization, multicrop_collate
from laplace.data.transforms import three_augment
from test_decode import files, seeded  # noqa: F401 (files: the photographs' fixture)

SEEDS = range(6)
# Device-side against PIL, 0-255 units, measured on these photographs (docs/LOG.md, issue 33):
# DINO's views mean 1.1-1.3 / max 31; 3-Augment at 192 px 1.23 / 21, at 96 px (reduced decode too)
# 1.56 / 63 (a pixel near 128 that solarize flips in one path only).
MEAN_BOUND, MAX_BOUND = 2.5, 96.0


def within_bound(got: torch.Tensor, want: torch.Tensor, std) -> None:
    d = ((got - want).abs() * torch.tensor(std).view(1, 3, 1, 1) * 255).flatten()
    assert float(d.mean()) < MEAN_BOUND and float(d.max()) <= MAX_BOUND, (float(d.mean()), float(d.max()))


def dino_v1(local_crops: int):
    """DINO's recipe (main_dino.py DataAugmentationDINO, 2 x 224 + local_crops x 96) in torchvision's
    v1 transforms, as DINO writes it: what MultiCrop must equal."""
    jitter = [T.RandomHorizontalFlip(p=0.5), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
              T.RandomGrayscale(p=0.2)]
    tail = [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]

    def view(size, scale, *blur_solarize):
        return T.Compose([T.RandomResizedCrop(size, scale=scale, interpolation=Image.BICUBIC), *jitter,
                          *blur_solarize, *tail])

    views = [view(224, (0.4, 1.0), GaussianBlur(1.0)), view(224, (0.4, 1.0), GaussianBlur(0.1), Solarization(0.2))]
    views += [view(96, (0.05, 0.4), GaussianBlur(0.5))] * local_crops
    return lambda img: [t(img) for t in views]


def test_multicrop_is_dinos_pipeline_bit_for_bit(files):
    """MultiCrop (torchvision v2) on the opened file: DINO's v1 pipeline on the decoded image, the
    same crops, pixels and random draws (the generators' states after the image are equal)."""
    mc, ref = MultiCrop(local_crops=3), dino_v1(3)
    for data in files:
        decoded = load(io.BytesIO(data), "photo")
        for seed in SEEDS:
            want, ref_torch, ref_py = seeded(seed, lambda: ref(decoded))
            got, new_torch, new_py = seeded(seed, lambda: load(io.BytesIO(data), "photo", mc))
            assert torch.equal(ref_torch, new_torch) and ref_py == new_py
            assert len(got) == len(want) == len(mc.views)
            for a, b in zip(want, got):
                assert torch.equal(a, b)


def test_device_augment_matches_the_pil_pipeline(files):
    """The workers' decoded images with each crop's window, box and parameter row, cut, resized
    and augmented as batches: the reference's draws (equal generator states) and pixels within
    the bound."""
    mc, dev = MultiCrop(local_crops=2), MultiCrop(local_crops=2, device_augment=True)
    refs, items = [], []
    for data in files:
        decoded = load(io.BytesIO(data), "photo")
        for seed in SEEDS:
            ref, ref_torch, ref_py = seeded(seed, lambda: mc(decoded))
            item, new_torch, new_py = seeded(seed, lambda: load(io.BytesIO(data), "photo", dev))
            assert torch.equal(ref_torch, new_torch) and ref_py == new_py
            assert item["image"].dtype == torch.uint8 and item["params"].shape == (len(mc.views), len(PARAMS))
            assert item["windows"].shape == item["boxes"].shape == (len(mc.views), 4)
            refs.append(ref)
            items.append((item, 0))
    batch = multicrop_collate(items)
    assert set(batch) == {"images", "windows", "boxes", "params"} and batch["images"].shape[0] == len(items)
    out = dev.augment_batch(batch)
    for v, got in enumerate(out):
        want = torch.stack([r[v] for r in refs])
        assert got.shape == want.shape and got.dtype == torch.float32
        within_bound(got, want, mc.std)


def test_three_augment_on_the_device_matches_three_augment(files):
    """3-Augment's worker half (decode, draws) + the batched device half (crop, resize, colour):
    three_augment's draws (equal generator states) and pixels within the bound, also with images
    of different sizes padded into one batch."""
    dev, reference = ThreeAugmentCrops(96), three_augment(96)
    refs, samples = [], []
    for data in files:
        decoded = load(io.BytesIO(data), "photo")
        for seed in SEEDS:
            ref, ref_torch, ref_py = seeded(seed, lambda: reference(decoded))
            sample, new_torch, new_py = seeded(seed, lambda: load(io.BytesIO(data), "photo", dev))
            assert torch.equal(ref_torch, new_torch) and ref_py == new_py
            refs.append(ref), samples.append(sample)
    assert len({s["image"].shape for s in samples}) > 1  # landscape and portrait photographs
    (got,) = crop_and_augment(decoded_collate(samples), [dev.size], dev.mean, dev.std, jitter_last=True)
    within_bound(got, torch.stack(refs), dev.std)


def test_batched_jitter_is_torchvisions_tensor_jitter_per_image():
    """Each batched colour op with a factor per image equals torchvision's tensor kernel applied
    image by image (the PIL pipeline differs from both by its uint8 rounding between steps)."""
    from torchvision.transforms import functional as F

    from laplace.data.crop_augment import JITTER

    x = torch.rand(4, 3, 9, 7, generator=torch.Generator().manual_seed(0))
    factors = [torch.tensor([0.6, 1.0, 1.2, 1.4]), torch.tensor([0.6, 0.9, 1.1, 1.4]),
               torch.tensor([0.8, 1.0, 1.1, 1.2]), torch.tensor([-0.1, -0.02, 0.05, 0.1])]
    kernels = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
    for op, kernel, f in zip(JITTER, kernels, factors):
        want = torch.stack([kernel(x[i], float(f[i])) for i in range(4)])
        torch.testing.assert_close(op(x, f), want, atol=2e-6, rtol=0)
