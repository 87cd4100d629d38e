"""PIL's bicubic crop-and-resize as batched matmuls (laplace.data.resample) against PIL itself, on
real photographs: exact where one pass runs, within a measured bound where two do."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as F

from laplace.data.decode import crop_resize, window
from laplace.data.resample import resize_crops
from test_decode import files  # noqa: F401 (files: the photographs' fixture)

# Two passes: PIL rounds (and clips) to 8 bits between them and, in the Pillow we test with (13.0),
# runs the vertical pass first for some sizes; we always run the horizontal first. Measured on
# these photographs, 30 crops per image and scale (docs/LOG.md): at s = 1, 2.9% of the pixels
# differ, 99.6% of those by 1, mean 0.029, max 14 (a clipped overshoot at a hard edge); s = 2:
# 0.75%, mean 0.008, max 7; s = 4: 0.05%, max 3.
SHARE_BOUND, OVER_ONE_BOUND, MAX_BOUND = 0.05, 0.001, 32


def ours(img: Image.Image, box, s: int, out: int) -> torch.Tensor:
    win, in_win = window(box, s, img.size)
    x = F.pil_to_tensor(img).float()[None]
    return resize_crops(x, torch.tensor([win]), torch.tensor([in_win]), out)[0]


def pil(img: Image.Image, box, s: int, out: int) -> torch.Tensor:
    return F.pil_to_tensor(crop_resize(img, box, s, (out, out), Image.BICUBIC)).float()


@pytest.mark.parametrize("n_in,n_out", [(196, 224), (244, 224), (90, 96), (500, 224), (37, 37), (375, 96)])
def test_one_pass_is_pils_resize_exactly(n_in, n_out):
    """A row image (only the horizontal pass runs) and a column one (only the vertical): PIL's
    weights, so PIL's pixels exactly, also for a box that starts between pixels."""
    row = np.random.default_rng(n_in).integers(0, 256, (1, n_in, 3), dtype=np.uint8)
    for a in (row, row.transpose(1, 0, 2)):
        img = Image.fromarray(np.ascontiguousarray(a))
        horizontal = a.shape[0] == 1
        size = (n_out, 1) if horizontal else (1, n_out)
        lo, hi = 0.75, n_in - 0.25
        box = (lo, 0, hi, 1) if horizontal else (0, lo, 1, hi)
        want = F.pil_to_tensor(img.resize(size, Image.BICUBIC, box=box)).float()
        W, H = img.size
        win = torch.tensor([[0, 0, W, H]])
        x = F.pil_to_tensor(img).float()[None]
        # the other axis kept as it is (one output pixel, PIL's identity pass)
        got = resize_crops(x, win, torch.tensor([box], dtype=torch.float32), n_out)[0]
        got = got[:, :1, :] if horizontal else got[:, :, :1]
        assert torch.equal(got, want)


def test_crops_match_pil_within_the_bound(files):
    """Random resized crops of photographs decoded at 1, 1/2 and 1/4 (the windows and boxes the
    reduced decode gives), at DINO's and DeiT-III's sizes."""
    differ = over_one = total = worst = 0
    g = torch.Generator().manual_seed(0)
    for data in files:
        full = Image.open(io.BytesIO(data)).convert("RGB")
        for s in (1, 2, 4):
            img = full.reduce(s) if s > 1 else full
            for k in range(30):
                torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
                i, j, h, w = T.RandomResizedCrop.get_params(full, [0.05, 1.0], [3 / 4, 4 / 3])
                out = (96, 192, 224)[k % 3]
                d = (ours(img, (j, i, j + w, i + h), s, out) - pil(img, (j, i, j + w, i + h), s, out)).abs()
                differ, over_one = differ + int((d > 0).sum()), over_one + int((d > 1).sum())
                total, worst = total + d.numel(), max(worst, float(d.max()))
    assert differ / total < SHARE_BOUND and over_one / total < OVER_ONE_BOUND and worst <= MAX_BOUND, \
        (differ / total, over_one / total, worst)


def test_a_padded_batch_is_each_image_alone(files):
    """Images of different sizes zero-padded into one batch: each crop as if resized alone (the
    weights never reach the padding), in one call for the whole batch."""
    imgs = [Image.open(io.BytesIO(d)).convert("RGB") for d in files]
    assert len({im.size for im in imgs}) > 1
    H, W = max(im.size[1] for im in imgs), max(im.size[0] for im in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    wins, boxes, alone = [], [], []
    for n, im in enumerate(imgs):
        x[n, :, : im.size[1], : im.size[0]] = F.pil_to_tensor(im).float()
        box = (10 + n, 5, im.size[0] - 3, im.size[1] - 7 * n)
        win, in_win = window(box, 1, im.size)
        wins.append(win), boxes.append(in_win), alone.append(ours(im, box, 1, 64))
    got = resize_crops(x, torch.tensor(wins), torch.tensor(boxes), 64)
    assert torch.equal(got, torch.stack(alone))


def test_full_float32_inside_and_the_precision_restored():
    """The matmuls run in full float32 even where training set TF32 ("high"), and the setting
    comes back afterwards."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        x = torch.randint(0, 256, (1, 3, 20, 30)).float()
        resize_crops(x, torch.tensor([[0, 0, 30, 20]]), torch.tensor([[0.0, 0.0, 30.0, 20.0]]), 8)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(old)
