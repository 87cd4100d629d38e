"""Decode a JPEG at the reduced size its first crop needs (libjpeg's DCT scaling, PIL `draft`).

A training transform that starts with a resized crop throws most decoded pixels away. libjpeg
can decode at 1/2, 1/4 or 1/8 of the size for a fraction of the cost (the scaled inverse DCT).
`ReducedDecode(compose)` wraps a torchvision Compose whose first step (after ToRGB) is one of

    T.RandomResizedCrop                      DeiT-III's 3-Augment (laplace.data.transforms)
    timm RandomResizedCropAndInterpolation   timm's create_transform (data.augment=timm)
    T.Resize(short side) [+ CenterCrop]      the evaluation transform

`decode(img)` takes an opened, not yet decoded image (the ImageNet datasets hand it over, see
laplace.data.images.load) and draws that step's crop exactly as the step does, on the full-size
coordinates of the file's header: the same random draws in the same order, so the same boxes and
parameters for the same seed. It then takes the largest scale 1/s at which the crop still holds
at least the output's pixels on both sides, decodes at it, and resizes the crop box mapped onto
the reduced image (x / s). `rest` is the remainder of the Compose (its ToTensor + Normalize fused:
the same values); `__call__` on a decoded image is the wrapped Compose itself. What differs: where s > 1, libjpeg's scaled IDCT
does the first factor s of the down-sampling instead of PIL's filter (tests/test_decode.py
bounds the pixel difference). Where no crop can be reduced (s = 1) the pixels are the reference's.
"""
from __future__ import annotations

import random

import torch
from PIL import Image
from timm.data.transforms import MaybeToTensor, RandomResizedCropAndInterpolation
from torchvision import transforms as T
from torchvision.transforms import functional as F
from torchvision.transforms.functional import pil_modes_mapping

from .resample import window
from .transforms import ToRGB

SCALES = (8, 4, 2)  # libjpeg's DCT scales PIL's draft offers, largest first


def resized_size(width: int, height: int, short: int) -> tuple[int, int]:
    """T.Resize(short)'s output (w, h) for a (width, height) image: torchvision's rule."""
    if width <= height:
        return short, int(short * height / width)
    return int(short * width / height), short


def reduction(box: tuple, out: tuple[int, int]) -> int:
    """The largest DCT scale s whose reduced crop still has out's pixels on both sides (1: none)."""
    cw, ch = box[2] - box[0], box[3] - box[1]
    return next((s for s in SCALES if cw / s >= out[0] and ch / s >= out[1]), 1)


def draft(img: Image.Image, s: int) -> int:
    """Ask libjpeg to decode `img` (opened, undecoded) at 1/s; the scale it will use (1: none, as
    for every other format: PIL's draft is a no-op there)."""
    if s > 1 and img.draft(None, (img.size[0] // s, img.size[1] // s)) is not None:
        return img.decoderconfig[0]  # the scale PIL chose (equal to s but for images of a few pixels)
    return 1


def crop_resize(rgb: Image.Image, box: tuple, s: int, out: tuple[int, int], resample: int) -> Image.Image:
    """The crop `box` (full-size coordinates) of `rgb`, decoded at 1/s, resized to `out`."""
    if s == 1 and box == (0, 0, *rgb.size):  # torchvision's resize of the whole image: the reference pixels
        return rgb.resize(out, resample)
    # The whole pixels enclosing the crop (the filter sees no pixel outside it, as in the
    # reference, which crops first), then the exact box on them (s = 1: the crop itself).
    win, in_win = window(box, s, rgb.size)
    return rgb.crop(win).resize(out, resample, box=None if s == 1 else in_win)


def loaded_rgb(img: Image.Image) -> Image.Image:
    img.load()
    return img if img.mode == "RGB" else img.convert("RGB")


def _resample(interpolation) -> int:
    return pil_modes_mapping[interpolation] if isinstance(interpolation, T.InterpolationMode) else interpolation


def _flat(transform) -> list:
    """The steps of a (nested) Compose in order: timm's Compose sits inside ours after ToRGB."""
    if isinstance(transform, T.Compose):
        return [s for t in transform.transforms for s in _flat(t)]
    return [transform]


class ToNormalizedTensor:
    """ToTensor + Normalize with their arithmetic ((x / 255 - mean) / std in float32: the same
    values bit for bit) and two float copies fewer.

    Args:
        mean, std: per-channel normalisation constants.
    """

    def __init__(self, mean, std):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        return F.pil_to_tensor(img).contiguous().float().div_(255).sub_(self.mean).div_(self.std)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


def fused_tail(steps: list) -> list:
    """steps with a final ToTensor + Normalize replaced by ToNormalizedTensor."""
    if len(steps) >= 2 and isinstance(steps[-2], (T.ToTensor, MaybeToTensor)) and isinstance(steps[-1], T.Normalize):
        return steps[:-2] + [ToNormalizedTensor(steps[-1].mean, steps[-1].std)]
    return steps


class ReducedDecode:
    """A crop-first transform that decodes JPEGs at the reduced size its crop needs (module docstring).

    Args:
        transform: a T.Compose of [ToRGB,] crop step, rest...; the crop step is one of the three above.
    """

    def __init__(self, transform: T.Compose):
        steps = _flat(transform)
        k = 1 if steps and isinstance(steps[0], ToRGB) else 0
        first = steps[k] if len(steps) > k else None
        if not isinstance(first, (T.RandomResizedCrop, RandomResizedCropAndInterpolation, T.Resize)):
            raise TypeError(f"ReducedDecode: the first step must be a resized crop or a resize, got {first!r}")
        if isinstance(first, T.Resize) and (not isinstance(first.size, int) and len(first.size) != 1
                                            or first.max_size is not None):
            raise TypeError(f"ReducedDecode: T.Resize must resize the short side, got {first!r}")
        self.transform, self.first, self.rest = transform, first, T.Compose(fused_tail(steps[k + 1:]))

    def __call__(self, img: Image.Image):
        return self.transform(img)

    @property
    def transforms(self) -> list:
        """The wrapped Compose's steps, for code that reads a T.Compose's."""
        return self.transform.transforms

    def plan(self, img: Image.Image) -> tuple[tuple, tuple[int, int], int]:
        """(box on the full-size image, output (w, h), PIL resample), drawn as the first step draws."""
        f = self.first
        if isinstance(f, T.Resize):
            short = f.size if isinstance(f.size, int) else f.size[0]
            return (0, 0, *img.size), resized_size(*img.size, short), _resample(f.interpolation)
        i, j, h, w = f.get_params(img, f.scale, f.ratio)  # only the header's size is read
        interpolation = f.interpolation
        if isinstance(interpolation, (tuple, list)):  # timm's 'random': drawn after the box, as timm does
            interpolation = random.choice(interpolation)
        return (j, i, j + w, i + h), (f.size[1], f.size[0]), _resample(interpolation)

    def decode(self, img: Image.Image) -> Image.Image:
        """An opened, undecoded image -> the first step's output (RGB), decoded at reduced size
        where the crop allows. Call it while the file is open; decoding errors come from here."""
        box, out, resample = self.plan(img)
        s = draft(img, reduction(box, out))
        return crop_resize(loaded_rgb(img), box, s, out, resample)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transform!r})"
