"""DINO's multi-crop augmentation (facebookresearch/dino main_dino.py `DataAugmentationDINO`), built
from the `trainer.multicrop` node (configs/trainer/dino.yaml):

    mc = MultiCrop.from_config(cfg.trainer.multicrop, cfg.data.mean, cfg.data.std)
    crops = mc(pil_image)                              # [global_1, global_2, local_1, ..., local_8]
    batch = multicrop_collate([(crops, label), ...])   # [tensor [B, 3, S, S] per crop]

Each crop is DINO's: random resized crop (bicubic), flip, colour jitter with probability 0.8,
grayscale, PIL's Gaussian blur (DINO: 1.0 / 0.1 on the global crops, 0.5 on the local ones),
solarize (the second global crop, 0.2), ToTensor + Normalize. With `device_augment` a worker only
draws and decodes, and `augment_batch` does the rest on the training device (laplace.data.crop_augment).
"""
import random
from dataclasses import dataclass

import torch
from PIL import Image, ImageFilter, ImageOps
from torchvision.transforms import v2

from laplace.errors import ConfigError

from .crop_augment import crop_and_augment, decoded_collate, decoded_sample
from .decode import draft, reduction, rgb, window
from .transforms import ToNormalizedTensor


@dataclass
class GaussianBlur:
    """DINO's utils.GaussianBlur: with probability p, PIL's Gaussian blur of radius U(lo, hi),
    both drawn from Python's `random`, as DINO draws them."""

    p: float = 0.5
    radius_min: float = 0.1
    radius_max: float = 2.0

    def __call__(self, img: Image.Image) -> Image.Image:
        if random.random() > self.p:  # DINO: blur when random() <= p
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(self.radius_min, self.radius_max)))


@dataclass
class Solarization:
    """DINO's utils.Solarization: with probability p (Python's `random`), PIL's solarize at 128."""

    p: float

    def __call__(self, img: Image.Image) -> Image.Image:
        return ImageOps.solarize(img) if random.random() < self.p else img


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
        self.mean, self.std, self.blur_radius = tuple(mean), tuple(std), tuple(blur_radius)
        self.device_augment = bool(device_augment)
        self.reduce = True  # device_augment's decode at reduced size (the trainer sets data.reduced_decode)

        def view(size, scale, blur, solarize):  # one crop of DataAugmentationDINO
            return v2.Compose([
                v2.RandomResizedCrop(size, scale=tuple(scale), interpolation=v2.InterpolationMode.BICUBIC),
                v2.RandomHorizontalFlip(p=flip),
                v2.RandomApply([v2.ColorJitter(*color_jitter)], p=color_jitter_prob),
                v2.RandomGrayscale(p=grayscale),
                GaussianBlur(blur, *blur_radius),
                *([Solarization(solarize)] if solarize > 0 else []),
                ToNormalizedTensor(mean, std),
            ])

        # Every crop in order, as (its transform, its side), the global crops first (one transform
        # each), then the local ones (one transform for all): what __call__ applies and plan draws.
        self.views = [(view(global_size, global_scale, b, s), int(global_size))
                      for b, s in zip(global_blur, global_solarize)]
        self.views += [(view(local_size, local_scale, local_blur, local_solarize), int(local_size))] * int(local_crops)

    @classmethod
    def from_config(cls, node, mean, std) -> "MultiCrop":
        """From a `multicrop` config node (keys as the constructor's)."""
        try:
            return cls(**dict(node), mean=tuple(mean), std=tuple(std))
        except TypeError as e:
            raise ConfigError(f"trainer.multicrop: {e}") from None

    def __call__(self, img: Image.Image):
        if self.device_augment:
            return self.decoded(img)
        # Decoded once, in full, for every crop: a reduced decode must hold twice every crop's
        # output (448 px for a 224 px global crop, 192 px for each local one), which ImageNet's
        # typical 500 x 375 photos never do at DINO's sizes.
        img = rgb(img)
        return [t(img) for t, _ in self.views]

    def plan(self, img: Image.Image) -> list[tuple[tuple, dict]]:
        """Every crop's (box on the full-size image, parameters) without its pixels: device_augment's
        draws. Only the image's size is read."""
        out = []
        for t, _ in self.views:
            # The view's own steps draw, in its order and from its generators: the same values
            # for the same seed as __call__ (tests/test_device_augment.py compares the states).
            crop, flip, jitter, gray, blur, *solarize = t.transforms[:-1]
            box = crop.make_params([img])
            # v2's random steps apply when torch.rand(1) < p, drawn before their own parameters.
            p = dict(flip=bool(torch.rand(1) < flip.p))
            p["jitter"] = jitter.transforms[0].make_params([]) if torch.rand(1) < jitter.p else None
            p["grayscale"] = bool(torch.rand(1) < gray.p)
            # DINO's blur and solarize draw from Python's random (GaussianBlur, Solarization above).
            p["radius"] = None if random.random() > blur.p else random.uniform(blur.radius_min, blur.radius_max)
            p["solarize"] = bool(solarize) and random.random() < solarize[0].p
            top, left = box["top"], box["left"]
            out.append(((left, top, left + box["width"], top + box["height"]), p))
        return out

    def decoded(self, img: Image.Image) -> dict:
        """device_augment's worker half: the image decoded once with each crop's window, box and
        parameters (decoded_sample)."""
        plans = self.plan(img)
        # One decode for every crop: at the reduced size the crop that needs the most pixels allows.
        s = min(reduction(box, (size, size)) for (box, _), (_, size) in zip(plans, self.views)) if self.reduce else 1
        s = draft(img, s)
        image = rgb(img)
        return decoded_sample(image, [(window(box, s, image.size), p) for box, p in plans])

    def augment_batch(self, batch: dict) -> list[torch.Tensor]:
        """device_augment's batch (multicrop_collate) -> the normalised crop batches, cut, resized
        and augmented on the device the batch is on."""
        return crop_and_augment(batch, [size for _, size in self.views], self.mean, self.std, self.blur_radius[1])


def multicrop_collate(items):
    """[(crops, label), ...] -> one batch per crop position: [tensor [B, 3, S_v, S_v] for v]; with
    device_augment decoded_collate's dict. Labels are dropped (self-supervised)."""
    crops = [c for c, _ in items]  # the datasets are labelled: (crops, label)
    if isinstance(crops[0], dict):  # device_augment: the decoded images and their crops
        return decoded_collate(crops)
    return [torch.stack([c[v] for c in crops]) for v in range(len(crops[0]))]
