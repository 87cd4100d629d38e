"""The recipes' image transforms, one builder each, read top to bottom (laplace.data.vision picks one
by data.augment):

    three_augment    DeiT-III's 3-Augment (facebookresearch/deit augment.py `new_data_aug_generator`)
    timm_transform   timm's create_transform as timm's train.py calls it: the first author's '3a'
                     (experiment=deit3_in1k_author), DeiT-III's RandAugment fine-tuning
    eval_transform   resize + centre crop: DeiT-III's crop 1.0, the probes' Resize(256) + CenterCrop(224)

DINO's multi-crop is laplace.data.multicrop. Each takes a PIL image of any mode, opened or decoded,
and returns a normalised float tensor [3, S, S]: its first step is the recipe's crop decoded at the
size it needs (laplace.data.decode), its last ToTensor + Normalize in one.
"""
from dataclasses import dataclass

import torch
from PIL import Image, ImageFilter
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import transforms as T
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor

from .decode import DecodeCrop

BICUBIC = T.InterpolationMode.BICUBIC


class ToNormalizedTensor:
    """T.ToTensor + T.Normalize with their arithmetic, (x / 255 - mean) / std in float32: the same
    values bit for bit, with two float copies fewer (a measured few percent of a worker's time,
    docs/performance.md, "Input pipelines"). v2's ToDtype scales by * (1 / 255): not the same bits.

    Args:
        mean, std: per-channel normalisation constants.
    """

    def __init__(self, mean, std):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        # In place on one float copy; the order of operations is ToTensor's and Normalize's.
        return pil_to_tensor(img).contiguous().float().div_(255).sub_(self.mean).div_(self.std)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


@dataclass
class PILGaussianBlur:
    """PIL's Gaussian blur of a radius drawn uniformly from torch's generator, as DeiT-III's
    GaussianBlur. torchvision's truncates the Gaussian to a fixed kernel size; PIL's support grows
    with the radius, so DeiT's pixels need PIL's (DINO's blur draws from Python's: laplace.data.multicrop)."""

    radius_min: float = 0.1
    radius_max: float = 2.0

    def __call__(self, img: Image.Image) -> Image.Image:
        return img.filter(ImageFilter.GaussianBlur(float(torch.empty(1).uniform_(self.radius_min, self.radius_max))))


def three_augment(img_size: int, color_jitter: float | None = 0.3, simple_random_crop: bool = False,
                  mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, reduce: bool = True) -> v2.Compose:
    """DeiT-III's 3-Augment.

    Args:
        img_size: output side in pixels.
        color_jitter: brightness = contrast = saturation jitter (no hue); 0 or None: none.
        simple_random_crop: DeiT's `--src`: resize the short side to img_size, then a random crop
            with reflect padding 4, instead of the random resized crop.
        mean, std: normalisation constants.
        reduce: decode JPEGs at the size the crop needs (data.reduced_decode).
    """
    if simple_random_crop:
        crop = [DecodeCrop(T.Resize(img_size, interpolation=BICUBIC), reduce),
                v2.RandomCrop(img_size, padding=4, padding_mode="reflect")]
    else:  # ratio 3/4 to 4/3, as timm's RandomResizedCropAndInterpolation in DeiT
        crop = [DecodeCrop(T.RandomResizedCrop(img_size, scale=(0.08, 1.0), interpolation=BICUBIC), reduce)]
    jitter = [v2.ColorJitter(color_jitter, color_jitter, color_jitter)] if color_jitter else []
    return v2.Compose([
        *crop,
        v2.RandomHorizontalFlip(),
        # Exactly one of the three, uniformly. torchvision v1's RandomChoice, as DeiT's: it draws
        # from Python's `random` (v2's from torch: other choices for the same seed). Solarize at
        # 128 is PIL's ImageOps.solarize, which DeiT calls.
        T.RandomChoice([v2.Grayscale(num_output_channels=3), v2.RandomSolarize(threshold=128, p=1.0),
                        PILGaussianBlur()]),
        *jitter,
        ToNormalizedTensor(mean, std),
    ])


def timm_transform(img_size: int, auto_augment: str | None, interpolation: str, color_jitter: float | None,
                   mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, reduce: bool = True) -> T.Compose:
    """timm's training transform, as timm's train.py builds it (`create_transform`, no random
    erasing): random resized crop, flip, `auto_augment` ('3a': one of solarize / grayscale / blur;
    'rand-...': RandAugment), colour jitter (timm drops it under RandAugment, keeps it with '3a').
    Its draws come from Python's `random` and NumPy's generator.

    Args:
        img_size: output side in pixels.
        auto_augment: timm's policy string, or None.
        interpolation: the crop's ('random': bilinear or bicubic per image, timm's train.py default).
        color_jitter: timm's colour jitter strength.
        mean, std: normalisation constants.
        reduce: decode JPEGs at the size the crop needs (data.reduced_decode).
    """
    from timm.data import create_transform

    tf = create_transform(img_size, is_training=True, auto_augment=auto_augment or None, interpolation=interpolation,
                          color_jitter=color_jitter, re_prob=0.0, mean=mean, std=std)
    # timm's steps: its random resized crop, flip, [auto augment], [jitter], MaybeToTensor, Normalize.
    # The crop becomes the reduced decode's first step (it draws its box as timm's does) and the
    # tensor conversion ToNormalizedTensor: timm's pixels, bit for bit (tests/test_data_vision.py).
    crop, *middle, _, _ = tf.transforms
    return T.Compose([DecodeCrop(crop, reduce), *middle, ToNormalizedTensor(mean, std)])


def eval_transform(img_size: int, crop_pct: float = 1.0, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                   reduce: bool = True) -> v2.Compose:
    """Resize the short side to int(img_size / crop_pct) (bicubic), then the centre img_size crop.

    Args:
        img_size: output side in pixels.
        crop_pct: the share of the resized image kept: DeiT-III evaluates at 1.0, timm and the
            probes at 0.875 (224 px: Resize(256) + CenterCrop(224)).
        mean, std: normalisation constants.
        reduce: decode JPEGs at the size the resize needs (data.reduced_decode).
    """
    return v2.Compose([
        DecodeCrop(T.Resize(int(img_size / crop_pct), interpolation=BICUBIC), reduce),
        v2.CenterCrop(img_size),
        ToNormalizedTensor(mean, std),
    ])
