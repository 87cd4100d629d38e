"""DeiT-III image transforms: 3-Augment for training and the centre-crop eval transform.

3-Augment ("DeiT III: Revenge of the ViT", Touvron et al. 2022; facebookresearch/deit
`augment.py::new_data_aug_generator`) is the augmentation of the paper's supervised ViT runs:

    random resized crop (scale 0.08-1, bicubic) + horizontal flip      [or the `src` variant:
                                                                         resize + reflect-pad-4
                                                                         random crop + flip]
    -> exactly one of {grayscale, solarization, gaussian blur}, chosen uniformly
    -> colour jitter (brightness = contrast = saturation = 0.3, no hue)
    -> ToTensor -> Normalize(ImageNet mean/std)

Usage:
    train_tf = three_augment(224)                       # ImageNet
    train_tf = three_augment(32, simple_random_crop=True)  # small images (CIFAR)
    eval_tf = eval_transform(224)                        # DeiT-III evaluates at crop ratio 1.0

Both take PIL images of any mode (converted to RGB first) and return float tensors [3, S, S].
Randomness comes from torch's global RNG (the blur radius too) and, in torchvision's
RandomChoice, from Python's `random`: the training feed (train/feeds.py, `SeededDataset`)
seeds both per sample, so each sample's augmentation is a function of its seed alone.
"""


import torch
from PIL import Image, ImageFilter
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import transforms as T

BICUBIC = T.InterpolationMode.BICUBIC


class ToRGB:
    """Convert a PIL image of any mode (L, P, RGBA, ...) to RGB.

    torchvision v1 has no such transform, and a lambda would not pickle into spawned
    DataLoader workers, hence this small class.
    """

    def __call__(self, img: Image.Image) -> Image.Image:
        return img if img.mode == "RGB" else img.convert("RGB")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PILGaussianBlur:
    """Gaussian blur with a radius (PIL's standard deviation) drawn uniformly per call.

    Hand-written because torchvision's GaussianBlur needs a fixed kernel size and truncates
    the Gaussian to it, while DeiT-III blurs with PIL's `ImageFilter.GaussianBlur(radius)`,
    whose support grows with the radius; this keeps our pixels equal to DeiT's.

    Args:
        radius_min: smallest radius (DeiT: 0.1).
        radius_max: largest radius (DeiT: 2.0).
    """

    def __init__(self, radius_min: float = 0.1, radius_max: float = 2.0):
        self.radius_min, self.radius_max = radius_min, radius_max

    def __call__(self, img: Image.Image) -> Image.Image:
        return img.filter(ImageFilter.GaussianBlur(float(torch.empty(1).uniform_(self.radius_min, self.radius_max))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(radius=({self.radius_min}, {self.radius_max}))"


def three_augment(
    img_size: int,
    color_jitter: float | None = 0.3,
    simple_random_crop: bool = False,
    mean: tuple[float, ...] = IMAGENET_DEFAULT_MEAN,
    std: tuple[float, ...] = IMAGENET_DEFAULT_STD,
) -> T.Compose:
    """DeiT-III 3-Augment training transform.

    Args:
        img_size: output side length in pixels.
        color_jitter: brightness/contrast/saturation jitter strength; 0 or None skips it.
        simple_random_crop: DeiT's `--src` option: resize the short side to img_size, then a
            random img_size crop with reflect padding 4, instead of RandomResizedCrop.
        mean, std: per-channel normalisation constants.
    """
    if simple_random_crop:
        primary = [
            T.Resize(img_size, interpolation=BICUBIC),
            T.RandomCrop(img_size, padding=4, padding_mode="reflect"),
        ]
    else:
        # ratio defaults to (3/4, 4/3), as in timm's RandomResizedCropAndInterpolation used by DeiT.
        primary = [T.RandomResizedCrop(img_size, scale=(0.08, 1.0), interpolation=BICUBIC)]
    # Exactly one of the three, uniformly: each branch applies with probability 1 once chosen.
    # RandomSolarize's default threshold 128 is PIL ImageOps.solarize's, which DeiT calls.
    secondary = [
        T.RandomChoice([T.Grayscale(num_output_channels=3), T.RandomSolarize(threshold=128, p=1.0), PILGaussianBlur()])
    ]
    if color_jitter:
        secondary.append(T.ColorJitter(color_jitter, color_jitter, color_jitter))
    return T.Compose(
        [ToRGB(), *primary, T.RandomHorizontalFlip(), *secondary, T.ToTensor(), T.Normalize(mean, std)]
    )


def eval_transform(
    img_size: int,
    crop_pct: float = 1.0,
    mean: tuple[float, ...] = IMAGENET_DEFAULT_MEAN,
    std: tuple[float, ...] = IMAGENET_DEFAULT_STD,
) -> T.Compose:
    """Resize the short side to int(img_size / crop_pct) (bicubic), centre-crop img_size.

    Args:
        img_size: output side length in pixels.
        crop_pct: fraction of the resized image kept by the crop; DeiT-III evaluates at 1.0
            (DeiT's `eval_crop_ratio`), DeiT/timm ImageNet convention elsewhere is 0.875.
        mean, std: per-channel normalisation constants.
    """
    return T.Compose(
        [
            ToRGB(),
            T.Resize(int(img_size / crop_pct), interpolation=BICUBIC),
            T.CenterCrop(img_size),
            T.ToTensor(),
            T.Normalize(mean, std),
        ]
    )
