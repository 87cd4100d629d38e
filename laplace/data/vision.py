"""Build an image classification split from the Hydra `data` node (digits, CIFAR, ImageNet).

`data.augment` picks the training transform:
    three_augment        DeiT-III pre-training: random resized crop + flip, one of {grayscale,
                         solarize, blur}, colour jitter (laplace.data.transforms)
    simple_random_crop   the same after DeiT's `--src` crop (resize + reflect-pad-4 random crop)
    randaugment          DeiT-III fine-tuning: timm's random resized crop + flip + RandAugment
                         `data.auto_augment` (rand-m9-mstd0.5-inc1), no colour jitter
    timm                 timm train.py's training transform (`create_transform`): random resized
                         crop (`data.train_interpolation`, timm's default `random`: bilinear or
                         bicubic per image) + flip + `data.auto_augment` + colour jitter; with
                         `3a` (the first author's ImageNet runs) timm keeps the jitter on
    none                 the evaluation transform (resize + centre crop)

ImageNet's JPEGs are decoded at the size the first crop needs (`data.reduced_decode`,
laplace.data.decode); `data.device_augment=true` leaves 3-Augment's colour work (one of
grayscale / solarize / blur, jitter, normalisation) to the training step (laplace.data.crop_augment).
"""
from __future__ import annotations

from torchvision import transforms as T

from laplace.errors import ConfigError

from .transforms import ToRGB, eval_transform, three_augment

NAMES = ("digits", "cifar10", "cifar100", "imagenet")
AUGMENTS = ("three_augment", "simple_random_crop", "randaugment", "timm", "none")


def _required(cfg, key: str, example: str):
    value = cfg.get(key)
    if value is None or value == "":
        raise ConfigError(f"data.augment={cfg.augment} needs data.{key}: set +data.{key}={example} "
                          f"(data={cfg.name})")
    return value


def timm_transform(cfg, mean, std, interpolation: str) -> T.Compose:
    """timm's own training transform (`create_transform`, as timm's train.py builds it) with
    `data.auto_augment` (None: none), `data.color_jitter` and no random erasing.

    timm turns the colour jitter off under RandAugment (DeiT-III's fine-tuning runs) and keeps
    it with '3a'. It draws from Python's `random` and NumPy: the training feed seeds both per
    sample."""
    from timm.data import create_transform

    tf = create_transform(cfg.img_size, is_training=True, color_jitter=cfg.get("color_jitter", 0.3),
                          auto_augment=cfg.get("auto_augment") or None, interpolation=interpolation,
                          re_prob=0.0, mean=mean, std=std)
    return T.Compose([ToRGB(), tf])


def build_transform(cfg, train: bool):
    """The training (augmented, `data.augment`) or evaluation (resize + centre crop) transform."""
    mean, std = tuple(cfg.mean), tuple(cfg.std)
    if not train or cfg.augment == "none":
        return eval_transform(cfg.img_size, cfg.eval_crop_pct, mean, std)
    if cfg.augment not in AUGMENTS:
        raise ConfigError(f"data.augment={cfg.augment!r}: choose one of {', '.join(AUGMENTS)}")
    if cfg.get("device_augment", False):
        if cfg.augment != "three_augment":
            raise ConfigError(f"data.device_augment=true moves 3-Augment's colour work to the device: it needs "
                              f"data.augment=three_augment, not {cfg.augment}")
        from .crop_augment import ThreeAugmentCrops

        return ThreeAugmentCrops(cfg.img_size, cfg.get("color_jitter", 0.3), mean, std)
    if cfg.augment == "randaugment":  # DeiT-III's fine-tuning: RandAugment, bicubic crops
        _required(cfg, "auto_augment", "rand-m9-mstd0.5-inc1")
        return timm_transform(cfg, mean, std, "bicubic")
    if cfg.augment == "timm":
        return timm_transform(cfg, mean, std, _required(cfg, "train_interpolation", "random"))
    # data=digits states no colour jitter (its augment is none): an override gets DeiT-III's 0.3.
    return three_augment(cfg.img_size, cfg.get("color_jitter", 0.3),
                         simple_random_crop=cfg.augment == "simple_random_crop", mean=mean, std=std)


def build_vision_dataset(cfg, train: bool):
    """The `train` (True) or validation split named by `cfg.name`, with its transform."""
    tf = build_transform(cfg, train)
    if cfg.name == "digits":
        from .digits import Digits

        return Digits(train, tf, cfg.val_fraction)
    if cfg.name in ("cifar10", "cifar100"):
        from .cifar import build_cifar

        return build_cifar(cfg.name, cfg.root, train, tf, download=cfg.download)
    if cfg.name == "imagenet":
        from .imagenet import build_imagenet

        if cfg.get("reduced_decode", False) and isinstance(tf, T.Compose):  # JPEGs decoded at the crop's size
            from .decode import ReducedDecode

            tf = ReducedDecode(tf)
        # .get: the data node of a checkpoint written before the key (analysis reads those)
        return build_imagenet(cfg.root, train, tf, fmt=cfg.format, cache_dir=cfg.cache_dir,
                              skip_corrupt=bool(cfg.get("skip_corrupt", False)))
    raise ConfigError(f"data={cfg.name!r} is not an image dataset; choose one of {NAMES}")
