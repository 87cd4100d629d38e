"""The first step of every image transform: draw the recipe's crop, decode the image at the size that
crop needs, cut and resize it (`DecodeCrop`, data.reduced_decode).

The datasets hand a transform the opened, not yet decoded image (laplace.data.images.load). A crop
that keeps a few hundred of a photo's pixels throws most of a full decode away, and libjpeg decodes
at 1/2, 1/4 or 1/8 of the size for a fraction of the cost (PIL's `draft`). The box is drawn on the
size the file's header gives, exactly as the wrapped crop draws it, so the boxes and every later draw
are the same for the same seed; where no reduction applies (s = 1) the pixels are the crop's own.
tests/test_decode.py checks both and bounds the difference where s > 1.
"""
import math
import random

import numpy as np
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms as T
from torchvision.transforms.functional import pil_modes_mapping

SCALES = (8, 4, 2)  # the DCT scales libjpeg offers through PIL's draft, largest first


def resized_size(width: int, height: int, short: int) -> tuple[int, int]:
    """T.Resize(short)'s output (w, h) for a (width, height) image: torchvision's rule."""
    if width <= height:
        return short, int(short * height / width)
    return int(short * width / height), short


def reduction(box: tuple, out: tuple[int, int]) -> int:
    """The largest scale s whose reduced crop still has out's pixels on both sides (1: none)."""
    cw, ch = box[2] - box[0], box[3] - box[1]
    return next((s for s in SCALES if cw / s >= out[0] and ch / s >= out[1]), 1)


def draft(img: Image.Image, s: int) -> int:
    """Ask libjpeg to decode `img` (opened, not yet decoded) at 1/s; returns the scale it will use.
    Anything but an undecoded JPEG (a PNG, a decoded image) returns None from PIL: scale 1."""
    if s > 1 and img.draft(None, (img.size[0] // s, img.size[1] // s)) is not None:
        return img.decoderconfig[0]  # PIL's choice: s, but for images of a few pixels
    return 1


def window(box: tuple, s: int, size: tuple[int, int]) -> tuple[tuple[int, int, int, int], tuple[float, ...]]:
    """The crop `box` (full-size coordinates) on an image decoded at 1/s (of size `size`) as
    (the enclosing whole pixels (x0, y0, x1, y1): the only ones the filter may see, as in the
    reference that cuts the crop first; the box in those pixels' coordinates)."""
    l, t, r, b = (v / s for v in box)
    x0, y0 = math.floor(l), math.floor(t)
    x1, y1 = min(math.ceil(r), size[0]), min(math.ceil(b), size[1])
    return (x0, y0, x1, y1), (l - x0, t - y0, min(r, x1) - x0, min(b, y1) - y0)


def rgb(img: Image.Image) -> Image.Image:
    """img in RGB (any mode: L, P, RGBA, CMYK, 16-bit grey ...); a lazy image decodes when its pixels are read."""
    if img.mode.startswith("I;16"):  # a 16-bit grey PNG: convert("RGB") clips every value above 255
        img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))  # its top 8 bits, as L
    return img if img.mode == "RGB" else img.convert("RGB")


def crop_resize(img: Image.Image, box: tuple, s: int, out: tuple[int, int], resample: int) -> Image.Image:
    """The crop `box` (full-size coordinates) of `img`, decoded at 1/s, resized to `out`."""
    if s == 1 and box == (0, 0, *img.size):  # a resize of the whole image, as torchvision's
        return img.resize(out, resample)
    # The whole pixels enclosing the crop, then the exact box on them: the filter sees no pixel
    # outside the crop, as in torchvision, which crops first (s = 1: the window is the box).
    win, in_win = window(box, s, img.size)
    return img.crop(win).resize(out, resample, box=None if s == 1 else in_win)


class DecodeCrop:
    """A recipe's first step (its random resized crop, or the evaluation's resize), decoding the
    image at the reduced size that step's output needs.

    Args:
        crop: T.RandomResizedCrop, timm's RandomResizedCropAndInterpolation or T.Resize(short side);
            only its parameters and its draws are used.
        reduce: decode JPEGs at reduced size where the crop allows (data.reduced_decode); False
            decodes at full size, the step is then `crop` itself.
    """

    def __init__(self, crop, reduce: bool = True):
        if not isinstance(crop, (T.RandomResizedCrop, RandomResizedCropAndInterpolation, T.Resize)):
            raise TypeError(f"DecodeCrop takes a resized crop or a resize, got {crop!r}")
        self.crop, self.reduce = crop, reduce

    def plan(self, img: Image.Image) -> tuple[tuple, tuple[int, int], int]:
        """(box on the full-size image, output (w, h), PIL resample), drawn as `crop` draws them;
        only the image's size is read."""
        c = self.crop
        if isinstance(c, T.Resize):  # the short side to c.size: the whole image, no draw
            return (0, 0, *img.size), resized_size(*img.size, c.size), pil_modes_mapping[c.interpolation]
        # The crop's own draw (torchvision's from torch, timm's from Python's random), on the
        # size the header gives: the same box as on the decoded image.
        i, j, h, w = c.get_params(img, c.scale, c.ratio)
        interpolation = c.interpolation
        if isinstance(interpolation, (tuple, list)):  # timm's 'random': drawn after the box, as timm does
            interpolation = random.choice(interpolation)
        return (j, i, j + w, i + h), (c.size[1], c.size[0]), pil_modes_mapping[interpolation]

    def __call__(self, img: Image.Image) -> Image.Image:
        box, out, resample = self.plan(img)
        s = draft(img, reduction(box, out)) if self.reduce else 1
        return crop_resize(rgb(img), box, s, out, resample)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.crop!r}, reduce={self.reduce})"
