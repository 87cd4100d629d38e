"""Build an image classification split from the Hydra `data` node (digits, CIFAR, ImageNet)."""
from __future__ import annotations

from .transforms import eval_transform, three_augment

NAMES = ("digits", "cifar10", "cifar100", "imagenet")


def build_transform(cfg, train: bool):
    """Training: `data.augment` = three_augment | simple_random_crop (3-Augment after DeiT's
    `--src` crop) | none (the eval transform). Evaluation: resize + centre crop."""
    mean, std = tuple(cfg.mean), tuple(cfg.std)
    if not train or cfg.augment == "none":
        return eval_transform(cfg.img_size, cfg.get("eval_crop_pct", 1.0), mean, std)
    if cfg.augment not in ("three_augment", "simple_random_crop"):
        raise ValueError(f"data.augment={cfg.augment!r}: choose three_augment, "
                         f"simple_random_crop or none")
    return three_augment(cfg.img_size, cfg.get("color_jitter", 0.3),
                         simple_random_crop=cfg.augment == "simple_random_crop", mean=mean, std=std)


def build_vision_dataset(cfg, train: bool):
    """The `train` (True) or validation split named by `cfg.name`, with its transform."""
    tf = build_transform(cfg, train)
    if cfg.name == "digits":
        from .digits import Digits

        return Digits(train, tf, cfg.get("val_fraction", 0.2))
    if cfg.name in ("cifar10", "cifar100"):
        from .cifar import build_cifar

        return build_cifar(cfg.name, cfg.root, train, tf, download=cfg.get("download", False))
    if cfg.name == "imagenet":
        from .imagenet import build_imagenet

        return build_imagenet(cfg.root, train, tf, fmt=cfg.get("format", "auto"),
                              cache_dir=cfg.get("cache_dir"))
    raise ValueError(f"data={cfg.name!r} is not an image dataset; choose one of {NAMES}")
