"""Crops and their colour work cut, resized and augmented as whole batches on the training device:
the opt-in device path (data.device_augment for 3-Augment, trainer.multicrop.device_augment for
DINO's multi-crop), for when the data-loader workers cannot keep up (docs/performance.md,
"Input pipelines").

A worker draws every crop's box and parameters exactly as the PIL pipeline draws them (the same
values for the same seed), decodes the image once (laplace.data.decode) and hands over the uint8
image with each crop's window, box and parameter row (`decoded_sample`; `decoded_collate` pads a
batch's images to its largest). The training step's `crop_and_augment` resizes every crop as PIL's
bicubic does (laplace.data.resample) and `augment` applies flip, colour jitter, grayscale, blur,
solarize and normalisation with torchvision's tensor formulas. tests/test_device_augment.py bounds
the difference to the PIL pipelines.
"""
import functools
import math
import random

import torch
import torch.nn.functional as nnf
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import transforms as T
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor
from torchvision.transforms.v2.functional._color import _hsv_to_rgb, _rgb_to_hsv  # adjust_hue's halves

from .decode import DecodeCrop, draft, reduction, rgb, window
from .resample import resize_crops

# A crop's parameters as one float row: what each step of the PIL pipeline drew.
PARAMS = ("flip", "jitter", "order0", "order1", "order2", "order3", "brightness", "contrast", "saturation",
          "hue", "grayscale", "blur", "radius", "solarize")
C = {k: i for i, k in enumerate(PARAMS)}
FACTORS = ("brightness_factor", "contrast_factor", "saturation_factor", "hue_factor")  # v2.ColorJitter's


def param_row(p: dict) -> torch.Tensor:
    """A crop's parameters as the float row PARAMS names. p["jitter"]: v2.ColorJitter's drawn
    params, or None (skipped: order 0-3, neutral factors)."""
    order, factors = [0, 1, 2, 3], [1.0, 1.0, 1.0, 0.0]
    if p["jitter"] is not None:
        order = p["jitter"]["fn_idx"].tolist()
        factors = [n if p["jitter"][k] is None else float(p["jitter"][k]) for k, n in zip(FACTORS, factors)]
    radius = p["radius"]
    row = [p["flip"], p["jitter"] is not None, *order, *factors, p["grayscale"], radius is not None, radius or 0.0,
           p["solarize"]]
    return torch.tensor(row, dtype=torch.float32)


class ThreeAugmentCrops:
    """The worker's half of 3-Augment on the device (data.device_augment): the crop's box and every
    later parameter drawn as laplace.data.transforms.three_augment draws them, the image decoded once;
    returns decoded_sample's dict for `crop_and_augment(batch, [img_size], ..., jitter_last=True)`.

    Args:
        as three_augment's (no simple_random_crop).
    """

    def __init__(self, img_size: int, color_jitter: float | None = 0.3, mean=IMAGENET_DEFAULT_MEAN,
                 std=IMAGENET_DEFAULT_STD, reduce: bool = True):
        crop = T.RandomResizedCrop(img_size, scale=(0.08, 1.0), interpolation=T.InterpolationMode.BICUBIC)
        self.crop = DecodeCrop(crop, reduce)  # only its plan: the device cuts the crop
        self.jitter = v2.ColorJitter(color_jitter, color_jitter, color_jitter) if color_jitter else None
        self.size, self.mean, self.std = int(img_size), tuple(mean), tuple(std)

    def __call__(self, img) -> dict:
        box, out, _ = self.crop.plan(img)  # bicubic, as three_augment's
        # three_augment's draws in its order: flip, the one of three, then the jitter.
        p = dict(flip=bool(torch.rand(1) < 0.5))
        k = random.choices(range(3), weights=[1 / 3] * 3)[0]  # T.RandomChoice's draw
        p["grayscale"] = k == 0
        p["solarize"] = k == 1 and bool(torch.rand(1) < 1.0)  # RandomSolarize(p=1) draws too
        p["radius"] = float(torch.empty(1).uniform_(0.1, 2.0)) if k == 2 else None  # PILGaussianBlur's
        p["jitter"] = self.jitter.make_params([]) if self.jitter is not None else None
        s = draft(img, reduction(box, out)) if self.crop.reduce else 1
        image = rgb(img)  # decoded here, at 1/s
        return decoded_sample(image, [(window(box, s, image.size), p)])


def decoded_sample(rgb, views: list) -> dict:
    """A decoded image and its crops [((window, box), parameters), ...] -> what a worker hands
    over: the uint8 image [3, H, W], windows [V, 4] (int), boxes [V, 4] and parameter rows [V, P]."""
    return dict(image=pil_to_tensor(rgb), windows=torch.tensor([w for (w, _), _ in views], dtype=torch.int32),
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


def augment(crops: torch.Tensor, params: torch.Tensor, mean, std, max_radius: float = 2.0,
            jitter_last: bool = False) -> torch.Tensor:
    """Crops [B, 3, S, S] (uint8, or float holding 0-255 values as resize_crops returns) and their
    parameter rows [B, len(PARAMS)] (same device) -> the augmented, normalised float32 batch.
    Order: flip, jitter, grayscale, blur, solarize (DINO); jitter_last: flip, grayscale, blur,
    solarize, jitter (3-Augment)."""
    # Every choice is a torch.where over the batch: no host synchronisation in the step.
    on = lambda k: (params[:, C[k]] > 0.5).view(-1, 1, 1, 1)  # noqa: E731
    with torch.autocast(crops.device.type, enabled=False):  # float32, also inside the step's autocast
        x = crops.float() / 255
        x = torch.where(on("flip"), x.flip(-1), x)
        if not jitter_last:
            x = _jitter(x, params)
        x = torch.where(on("grayscale"), _gray(x).expand_as(x), x)
        x = _blur(x, params[:, C["radius"]], on("blur").view(-1), max_radius)
        # PIL inverts the uint8 pixels >= 128: a float rounds to 128 from 127.5 / 255 on.
        x = torch.where(on("solarize") & (x >= 127.5 / 255), 1 - x, x)
        if jitter_last:
            x = _jitter(x, params)
        m, s = _channel_constants(tuple(mean), tuple(std), x.device, x.dtype)
        return (x - m) / s


# The colour jitter's four operations with a factor per image, as torchvision's tensor kernels
# compute them (no rounding to uint8 between steps, unlike PIL); torchvision's take one factor
# for the whole batch.
def _gray(x: torch.Tensor) -> torch.Tensor:
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)  # torchvision's weights


def _blend(x: torch.Tensor, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    f = f.view(-1, 1, 1, 1)
    return (f * x + (1 - f) * y).clamp(0, 1)


def _hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate each image's hue by shift (a fraction of the circle): torchvision's own RGB <-> HSV
    (its adjust_hue's), with a shift per image where adjust_hue takes one for the batch."""
    h, s, v = _rgb_to_hsv(x).unbind(1)
    return _hsv_to_rgb(torch.stack(((h + shift.view(-1, 1, 1)) % 1, s, v), 1))


JITTER = (  # in ColorJitter's numbering: its fn_idx order names them
    lambda x, f: _blend(x, torch.zeros_like(x), f),  # brightness
    lambda x, f: _blend(x, _gray(x).mean((1, 2, 3), keepdim=True), f),  # contrast
    lambda x, f: _blend(x, _gray(x), f),  # saturation
    _hue,
)


def _jitter(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Each image's jitter in its own drawn order: at each of the 4 positions, the op it drew there."""
    jitter = params[:, C["jitter"]] > 0.5
    for pos in range(4):
        for k, op in enumerate(JITTER):
            pick = (jitter & (params[:, C[f"order{pos}"]] == k)).view(-1, 1, 1, 1)
            x = torch.where(pick, op(x, params[:, C["brightness"] + k]), x)
    return x


def _blur(x: torch.Tensor, radius: torch.Tensor, on: torch.Tensor, max_radius: float) -> torch.Tensor:
    """Separable Gaussian blur, standard deviation `radius` per image (edges repeated); images
    with `on` false get the identity kernel. A true Gaussian: PIL approximates one with three box
    blurs, the difference is within the test's bound."""
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


@functools.lru_cache(maxsize=8)
def _channel_constants(mean: tuple, std: tuple, device: torch.device, dtype: torch.dtype):
    """mean and std as [1, 3, 1, 1] tensors on `device`, made once: a host-to-device copy of a
    new tensor every step would make the host wait for the GPU's queue."""
    return tuple(torch.tensor(v, device=device, dtype=dtype).view(1, 3, 1, 1) for v in (mean, std))
