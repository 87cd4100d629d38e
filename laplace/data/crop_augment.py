"""Resized crops and their augmentations on whole batches on the training device
(data.device_augment for DeiT-III's 3-Augment, trainer.multicrop.device_augment for DINO's multi-crop).

A worker then only decodes and draws: it draws every crop's box and parameters exactly as the
reference pipeline draws them (same calls, same order: the same values for the same seed), decodes
the image once (at the reduced size the crops allow, laplace.data.decode) and sends the uint8 image
with each crop's window and box (laplace.data.resample.window) and parameter row (PARAMS):
`decoded_sample`, batched by `decoded_collate` (images padded to the batch's largest).
On the device `crop_and_augment` cuts and resizes every crop as PIL's bicubic does
(laplace.data.resample.resize_crops) and `augment` applies flip, colour jitter (brightness,
contrast, saturation, hue, in the crop's own drawn order), grayscale, Gaussian blur, solarize and
normalisation (3-Augment: the jitter last). The colour formulas are torchvision's tensor kernels
(no rounding to uint8 between steps, as PIL's); the blur is a true Gaussian of standard deviation
`radius` (PIL approximates one with three box blurs). tests/test_device_augment.py bounds the
difference to the PIL pipelines. No host synchronisation: every choice is a `torch.where` over
the batch.
"""
from __future__ import annotations

import functools
import math
import random

import numpy as np
import torch
import torch.nn.functional as nnf
from torchvision.transforms import functional as F

from .decode import ReducedDecode, draft, loaded_rgb, reduction
from .resample import resize_crops, window
from .transforms import three_augment

# A crop's parameters as one float row: what each step of the reference pipeline drew.
PARAMS = ("flip", "jitter", "order0", "order1", "order2", "order3", "brightness", "contrast", "saturation",
          "hue", "grayscale", "blur", "radius", "solarize")
C = {k: i for i, k in enumerate(PARAMS)}


def param_row(p: dict) -> torch.Tensor:
    """A view's parameters as the float row PARAMS names (a skipped jitter: order 0-3, neutral factors)."""
    order, factors = [0, 1, 2, 3], [1.0, 1.0, 1.0, 0.0]
    if p["jitter"]:
        order = [int(k) for k in p["order"]]
        factors = [n if f is None else float(f) for f, n in zip(p["factors"], factors)]
    radius = p["radius"]
    row = [p["flip"], p["jitter"], *order, *factors, p["grayscale"], radius is not None, radius or 0.0, p["solarize"]]
    return torch.tensor(np.array(row, dtype=np.float32))


class ThreeAugmentCrops:
    """DeiT-III's 3-Augment with the crop and colour work left to the training device
    (data.device_augment): the crop's box and every later parameter drawn exactly as
    three_augment's steps draw them, the image decoded (at reduced size where the crop allows,
    laplace.data.decode); returns decoded_sample's dict for
    `crop_and_augment(batch, [img_size], ..., jitter_last=True)`.

    Args:
        as three_augment's (no simple_random_crop).
    """

    def __init__(self, img_size: int, color_jitter: float | None = 0.3, mean=None, std=None):
        kw = {k: v for k, v in dict(mean=mean, std=std).items() if v is not None}
        self.reference = three_augment(img_size, color_jitter, **kw)
        self.crop = ReducedDecode(self.reference)
        steps = self.reference.transforms  # ToRGB, crop, flip, RandomChoice, [ColorJitter], ToTensor, Normalize
        self.flip, self.choice = steps[2], steps[3]
        self.jitter = steps[4] if color_jitter else None
        self.blur = self.choice.transforms[2]
        self.mean, self.std = tuple(steps[-1].mean), tuple(steps[-1].std)
        self.size = int(img_size)

    def params(self) -> dict:
        """The draws of flip, the one-of-three and the jitter, in three_augment's order."""
        p = dict(flip=bool(torch.rand(1) < self.flip.p), grayscale=False, radius=None, solarize=False, jitter=False)
        k = random.choices(range(3), weights=self.choice.p)[0]  # RandomChoice's draw
        if k == 0:
            p["grayscale"] = True
        elif k == 1:
            p["solarize"] = bool(torch.rand(1).item() < self.choice.transforms[1].p)  # RandomSolarize's draw
        else:
            p["radius"] = float(torch.empty(1).uniform_(self.blur.radius_min, self.blur.radius_max))
        if self.jitter is not None:
            j = self.jitter
            p["jitter"] = True
            p["order"], *p["factors"] = j.get_params(j.brightness, j.contrast, j.saturation, j.hue)
        return p

    def decode(self, img) -> dict:
        """An opened, undecoded image -> decoded_sample's dict of its one crop."""
        box, out, _ = self.crop.plan(img)  # bicubic: three_augment's interpolation
        s = draft(img, reduction(box, out))
        rgb = loaded_rgb(img)
        return decoded_sample(rgb, [(window(box, s, rgb.size), self.params())])

    def rest(self, sample: dict) -> dict:
        return sample

    def __call__(self, img) -> dict:
        """A decoded image (any mode) -> decoded_sample's dict (the image is the crop's input)."""
        return self.decode(img.convert("RGB") if img.mode != "RGB" else img)


def decoded_sample(rgb, views: list) -> dict:
    """A decoded image and its crops [((window, box), parameters), ...] -> what a worker hands
    over: the uint8 image [3, H, W], windows [V, 4] (int), boxes [V, 4] and parameter rows [V, P]."""
    return dict(image=F.pil_to_tensor(rgb), windows=torch.tensor([w for (w, _), _ in views], dtype=torch.int32),
                boxes=torch.tensor([b for (_, b), _ in views], dtype=torch.float32),
                params=torch.stack([param_row(p) for _, p in views]))


def decoded_collate(samples: list[dict]) -> dict:
    """decoded_sample's dicts -> one batch: images [B, 3, H, W] uint8, zero-padded to the largest
    (no crop window reaches the padding), windows and boxes [B, V, 4], params [B, V, P]."""
    H = max(s["image"].shape[1] for s in samples)
    W = max(s["image"].shape[2] for s in samples)
    images = torch.zeros(len(samples), 3, H, W, dtype=torch.uint8)
    for i, s in enumerate(samples):
        images[i, :, : s["image"].shape[1], : s["image"].shape[2]] = s["image"]
    return dict(images=images, **{k: torch.stack([s[k] for s in samples]) for k in ("windows", "boxes", "params")})


def crop_and_augment(batch: dict, sizes: list[int], mean, std, max_radius: float = 2.0,
                     jitter_last: bool = False) -> list[torch.Tensor]:
    """decoded_collate's batch (on the training device) -> one normalised batch [B, 3, S, S] per
    crop position, S = sizes[v]: each crop cut and resized (resize_crops), then `augment`ed."""
    images = batch["images"].float()
    return [augment(resize_crops(images, batch["windows"][:, v], batch["boxes"][:, v], size),
                    batch["params"][:, v], mean, std, max_radius, jitter_last) for v, size in enumerate(sizes)]


def _gray(x: torch.Tensor) -> torch.Tensor:
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)  # torchvision's weights


def _blend(x: torch.Tensor, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    f = f.view(-1, 1, 1, 1)
    return (f * x + (1 - f) * y).clamp(0, 1)


def _hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate each image's hue by shift (a fraction of the circle): through HSV, as torchvision."""
    r, g, b = x.unbind(1)
    v, minc = x.max(1).values, x.min(1).values
    cr = v - minc
    s = cr / v.clamp_min(1e-12)
    d = cr.clamp_min(1e-12)
    rc, gc, bc = (v - r) / d, (v - g) / d, (v - b) / d
    h = torch.where(v == r, bc - gc, torch.where(v == g, 2 + rc - bc, 4 + gc - rc))
    h = (torch.fmod(h / 6 + 1, 1) + shift.view(-1, 1, 1)) % 1
    i = torch.floor(h * 6)
    f = h * 6 - i
    i = (i.long() % 6).unsqueeze(1)
    p, q, t = (v * (1 - s)).clamp(0, 1), (v * (1 - s * f)).clamp(0, 1), (v * (1 - s * (1 - f))).clamp(0, 1)
    pick = [torch.stack(c, 1).gather(1, i) for c in ((v, q, p, p, t, v), (t, v, v, q, p, p), (p, p, t, v, v, q))]
    return torch.cat(pick, 1)


JITTER = (
    lambda x, f: _blend(x, torch.zeros_like(x), f),  # brightness
    lambda x, f: _blend(x, _gray(x).mean((1, 2, 3), keepdim=True), f),  # contrast
    lambda x, f: _blend(x, _gray(x), f),  # saturation
    _hue,
)


def _blur(x: torch.Tensor, radius: torch.Tensor, on: torch.Tensor, max_radius: float) -> torch.Tensor:
    """Separable Gaussian blur, standard deviation `radius` per image (edges repeated); images
    with `on` false get the identity kernel."""
    B, ch, H, W = x.shape
    half = math.ceil(3 * max_radius)
    t = torch.arange(-half, half + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-t**2 / (2 * radius.clamp_min(1e-3).view(-1, 1) ** 2))
    k = torch.where(on.view(-1, 1), k / k.sum(1, keepdim=True), (t == 0).to(x.dtype).expand(B, -1))
    k = k.repeat_interleave(ch, 0)  # [B * 3, K]: one kernel per image and channel
    y = x.reshape(1, B * ch, H, W)
    y = nnf.conv2d(nnf.pad(y, (half, half, 0, 0), mode="replicate"), k.view(B * ch, 1, 1, -1), groups=B * ch)
    y = nnf.conv2d(nnf.pad(y, (0, 0, half, half), mode="replicate"), k.view(B * ch, 1, -1, 1), groups=B * ch)
    return y.view(B, ch, H, W)


def augment(crops: torch.Tensor, params: torch.Tensor, mean, std, max_radius: float = 2.0,
            jitter_last: bool = False) -> torch.Tensor:
    """Crops [B, 3, S, S] (uint8, or float holding 0-255 values as resize_crops returns) and their
    parameter rows [B, len(PARAMS)] (same device) -> the augmented, normalised float32 batch.
    Order: flip, jitter, grayscale, blur, solarize (DINO); jitter_last: flip, grayscale, blur,
    solarize, jitter (3-Augment)."""
    with torch.autocast(crops.device.type, enabled=False):  # in float32 inside the step's autocast too
        return _augment(crops.float() / 255, params, mean, std, max_radius, jitter_last)


def _jitter(x, params):
    jitter = params[:, C["jitter"]] > 0.5
    for pos in range(4):
        for k, op in enumerate(JITTER):
            pick = (jitter & (params[:, C[f"order{pos}"]] == k)).view(-1, 1, 1, 1)
            x = torch.where(pick, op(x, params[:, C["brightness"] + k]), x)
    return x


def _augment(x, params, mean, std, max_radius, jitter_last):
    on = lambda k: (params[:, C[k]] > 0.5).view(-1, 1, 1, 1)  # noqa: E731
    x = torch.where(on("flip"), x.flip(-1), x)
    if not jitter_last:
        x = _jitter(x, params)
    x = torch.where(on("grayscale"), _gray(x).expand_as(x), x)
    x = _blur(x, params[:, C["radius"]], on("blur").view(-1), max_radius)
    # PIL inverts the uint8 pixels >= 128: a float rounds to 128 from 127.5 / 255 on
    x = torch.where(on("solarize") & (x >= 127.5 / 255), 1 - x, x)
    if jitter_last:
        x = _jitter(x, params)
    m, s = _channel_constants(tuple(mean), tuple(std), x.device, x.dtype)
    return (x - m) / s


@functools.lru_cache(maxsize=8)
def _channel_constants(mean: tuple, std: tuple, device: torch.device, dtype: torch.dtype):
    """mean and std as [1, 3, 1, 1] tensors on `device`, made once: a host-to-device copy of a
    new tensor every step would make the host wait for the GPU's queue."""
    return tuple(torch.tensor(v, device=device, dtype=dtype).view(1, 3, 1, 1) for v in (mean, std))
