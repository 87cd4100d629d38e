"""DINO's multi-crop augmentation (facebookresearch/dino main_dino.py `DataAugmentationDINO`).

Each image gives `global_crops` crops at `global_size` (scale `global_scale`, DINO (0.4, 1))
and `local_crops` crops at `local_size` (scale `local_scale`, DINO (0.05, 0.4)), each:

    random resized crop (bicubic) -> horizontal flip p 0.5
    -> colour jitter (0.4, 0.4, 0.2, 0.1) with p 0.8 -> grayscale p 0.2
    -> Gaussian blur (PIL, radius U(0.1, 2)) with p global_blur[i] (DINO: 1.0, 0.1) / local_blur (0.5)
    -> solarize (PIL, threshold 128) with p global_solarize[i] (DINO: 0.0, 0.2) / local_solarize (0)
    -> ToTensor -> Normalize(mean, std)

Everything comes from the config node (`trainer.multicrop`, see configs/trainer/dino.yaml):

    mc = MultiCrop.from_config(cfg.trainer.multicrop, cfg.data.mean, cfg.data.std)
    crops = mc(pil_image)                       # [global_1, global_2, local_1, ..., local_8]
    batch = multicrop_collate([(crops, label), ...])   # [tensor [B, 3, S, S] per crop]

Randomness: torch's global generator (crop, flip, jitter, grayscale) and Python's `random`
(blur, solarize, as DINO's utils): the training feed seeds both per sample (train/feeds.py).

No draw depends on a pixel, so `plan` draws every crop's parameters first, in the reference's
order (the same values for the same seed), and the image is decoded once, at the reduced size
(laplace.data.decode) that the crop needing the most resolution allows. With `device_augment`
a worker only decodes: it hands over the uint8 image with each crop's window, box and parameter
row (laplace.data.crop_augment.decoded_sample), and `augment_batch` cuts and resizes the crops
and applies flip, jitter, grayscale, blur, solarize and normalisation to whole batches on the
training device (laplace.data.crop_augment.crop_and_augment).
"""
from __future__ import annotations

import random

import torch
from PIL import Image, ImageFilter, ImageOps
from torchvision import transforms as T
from torchvision.transforms import functional as F

from laplace.errors import ConfigError

from .crop_augment import crop_and_augment, decoded_collate, decoded_sample
from .decode import ToNormalizedTensor, crop_resize, draft, loaded_rgb, reduction
from .resample import window
from .transforms import ToRGB

BICUBIC = T.InterpolationMode.BICUBIC


class GaussianBlur:
    """DINO's utils.GaussianBlur: with probability p, PIL's Gaussian blur of radius U(lo, hi)."""

    def __init__(self, p: float = 0.5, radius_min: float = 0.1, radius_max: float = 2.0):
        self.p, self.radius_min, self.radius_max = p, radius_min, radius_max

    def __call__(self, img: Image.Image) -> Image.Image:
        if random.random() > self.p:  # DINO: do it when random() <= p
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(self.radius_min, self.radius_max)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p}, radius=({self.radius_min}, {self.radius_max}))"


class Solarization:
    """DINO's utils.Solarization: with probability p, PIL's solarize (threshold 128)."""

    def __init__(self, p: float):
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        return ImageOps.solarize(img) if random.random() < self.p else img

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"


class MultiCrop:
    """Image -> list of crop tensors: the global crops first, then the local ones.

    Args:
        global_size, local_size: crop sides in pixels.
        global_scale, local_scale: random-resized-crop area ranges.
        local_crops: how many local crops (DINO: 8; 0 for global crops only).
        global_blur, global_solarize: one probability per global crop (their number is the
            number of global crops; DINO: [1.0, 0.1] and [0.0, 0.2]).
        local_blur, local_solarize: probabilities for every local crop (DINO: 0.5, 0.0).
        flip: horizontal flip probability; color_jitter: (brightness, contrast, saturation,
            hue); color_jitter_prob; grayscale: probability; blur_radius: (min, max).
        device_augment: return the decoded image and its crops' boxes and parameters for
            `augment_batch` on the device.
        mean, std: normalisation.
    """

    def __init__(self, global_size: int = 224, local_size: int = 96,
                 global_scale=(0.4, 1.0), local_scale=(0.05, 0.4), local_crops: int = 8,
                 global_blur=(1.0, 0.1), global_solarize=(0.0, 0.2), local_blur: float = 0.5,
                 local_solarize: float = 0.0, flip: float = 0.5, color_jitter=(0.4, 0.4, 0.2, 0.1),
                 color_jitter_prob: float = 0.8, grayscale: float = 0.2, blur_radius=(0.1, 2.0),
                 device_augment: bool = False, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)):
        if len(global_blur) != len(global_solarize) or not global_blur:
            raise ConfigError(f"multicrop.global_blur {list(global_blur)} and global_solarize "
                              f"{list(global_solarize)} need one probability per global crop (DINO: 2)")
        self.n_global, self.n_local = len(global_blur), int(local_crops)
        self.global_size, self.local_size = int(global_size), int(local_size)
        flip_and_color_jitter = [
            T.RandomHorizontalFlip(p=flip),
            T.RandomApply([T.ColorJitter(*color_jitter)], p=color_jitter_prob),
            T.RandomGrayscale(p=grayscale),
        ]
        normalize = [T.ToTensor(), T.Normalize(tuple(mean), tuple(std))]

        def view(size, scale, blur, solarize):
            tail = [Solarization(solarize)] if solarize > 0 else []
            return T.Compose([ToRGB(), T.RandomResizedCrop(size, scale=tuple(scale), interpolation=BICUBIC),
                              *flip_and_color_jitter, GaussianBlur(blur, *blur_radius), *tail, *normalize])

        # The reference pipelines (one T.Compose per view); plan() draws what they draw.
        self.global_transforms = [view(global_size, global_scale, b, s)
                                  for b, s in zip(global_blur, global_solarize)]
        self.local_transform = view(local_size, local_scale, local_blur, local_solarize)
        self.views = [(int(global_size), tuple(global_scale), b, s) for b, s in zip(global_blur, global_solarize)]
        self.views += [(int(local_size), tuple(local_scale), local_blur, local_solarize)] * self.n_local
        self.flip, self.jitter_prob, self.grayscale = flip, color_jitter_prob, grayscale
        self.jitter = T.ColorJitter(*color_jitter)
        self.blur_radius, self.device_augment = tuple(blur_radius), bool(device_augment)
        self.mean, self.std = tuple(mean), tuple(std)
        self.to_tensor = ToNormalizedTensor(self.mean, self.std)
        self.reduce = True  # decode at reduced size where every crop allows (the trainer sets data.reduced_decode)

    @classmethod
    def from_config(cls, node, mean, std) -> MultiCrop:
        """From a `multicrop` config node (keys as the constructor's)."""
        kwargs = dict(node)
        try:
            return cls(**kwargs, mean=tuple(mean), std=tuple(std))
        except TypeError as e:
            raise ConfigError(f"trainer.multicrop: {e}") from None

    @property
    def n_crops(self) -> int:
        return self.n_global + self.n_local

    def plan(self, img: Image.Image) -> list[tuple[tuple, dict]]:
        """Every view's (box on the full-size image, parameters), drawn in the reference's order
        from torch's and Python's generators; only the image's size is read."""
        out = []
        for size, scale, blur, solarize in self.views:
            i, j, h, w = T.RandomResizedCrop.get_params(img, list(scale), [3 / 4, 4 / 3])
            p = dict(flip=bool(torch.rand(1) < self.flip), jitter=not self.jitter_prob < torch.rand(1))
            if p["jitter"]:
                j_ = self.jitter
                p["order"], *p["factors"] = j_.get_params(j_.brightness, j_.contrast, j_.saturation, j_.hue)
            p["grayscale"] = bool(torch.rand(1) < self.grayscale)
            p["radius"] = None if random.random() > blur else random.uniform(*self.blur_radius)
            p["solarize"] = solarize > 0 and random.random() < solarize
            out.append(((j, i, j + w, i + h), p))
        return out

    def decode(self, img: Image.Image):
        """An opened, undecoded image, decoded once at the reduced size the most demanding crop
        allows -> each view's resized crop (PIL) and parameters; with device_augment
        decoded_sample's dict (the image, each crop's window, box and parameters)."""
        plans = self.plan(img)
        s = min(reduction(box, (v[0], v[0])) for (box, _), v in zip(plans, self.views)) if self.reduce else 1
        s = draft(img, s)
        rgb = loaded_rgb(img)
        if self.device_augment:  # cut and resized on the device (laplace.data.resample)
            return decoded_sample(rgb, [(window(box, s, rgb.size), p) for box, p in plans])
        return [(crop_resize(rgb, box, s, (v[0], v[0]), Image.BICUBIC), p) for (box, p), v in zip(plans, self.views)]

    def rest(self, decoded):
        """The planned crops -> normalised tensors (the reference's pixels); device_augment's dict
        as it is."""
        if self.device_augment:
            return decoded
        return [self.to_tensor(apply(c, p)) for c, p in decoded]

    def augment_batch(self, batch: dict) -> list[torch.Tensor]:
        """device_augment's batch (multicrop_collate) -> the normalised crop batches, cut, resized
        and augmented on the device the batch is on."""
        return crop_and_augment(batch, [v[0] for v in self.views], self.mean, self.std, self.blur_radius[1])

    def reference(self, img: Image.Image) -> list[torch.Tensor]:
        """The reference pipelines (DINO's T.Compose per view) on a decoded image: what `plan`,
        `decode` and `rest` reproduce (tests/test_device_augment.py)."""
        return [t(img) for t in self.global_transforms] + [self.local_transform(img) for _ in range(self.n_local)]

    def __call__(self, img: Image.Image):
        return self.rest(self.decode(img if img.mode == "RGB" else img.convert("RGB")))

    def __repr__(self) -> str:
        lines = [f"global {i + 1}: {t}" for i, t in enumerate(self.global_transforms)]
        lines.append(f"local x{self.n_local}: {self.local_transform}")
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"


def apply(img: Image.Image, p: dict) -> Image.Image:
    """One view's flip, jitter, grayscale, blur and solarize on PIL, as the reference applies them."""
    if p["flip"]:
        img = F.hflip(img)
    if p["jitter"]:
        adjust = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
        for k in p["order"]:
            if p["factors"][k] is not None:
                img = adjust[k](img, p["factors"][k])
    if p["grayscale"]:
        img = F.rgb_to_grayscale(img, num_output_channels=3)
    if p["radius"] is not None:
        img = img.filter(ImageFilter.GaussianBlur(radius=p["radius"]))
    return ImageOps.solarize(img) if p["solarize"] else img


def multicrop_collate(items):
    """[(crops, label), ...] -> one batch per crop position: [tensor [B, 3, S_v, S_v] for v]; with
    device_augment decoded_collate's dict. Labels are dropped (self-supervised)."""
    crops = [it[0] if isinstance(it, (tuple, list)) and not isinstance(it[0], torch.Tensor) else it
             for it in items]
    if isinstance(crops[0], dict):  # device_augment: the decoded images and their crops
        return decoded_collate(crops)
    return [torch.stack([c[v] for c in crops]) for v in range(len(crops[0]))]
