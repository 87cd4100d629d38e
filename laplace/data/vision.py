"""An image classification split from the Hydra `data` node (digits, CIFAR, ImageNet) with its
transform. `data.augment` picks the training transform (laplace.data.transforms):

    three_augment        DeiT-III's 3-Augment (pre-training)
    simple_random_crop   the same after DeiT's `--src` crop (resize + reflect-padded random crop)
    randaugment          DeiT-III's fine-tuning: timm's transform with RandAugment (data.auto_augment)
    timm                 timm's train.py transform: data.auto_augment ('3a'), data.train_interpolation
    none                 the evaluation transform (resize + centre crop, data.eval_crop_pct)
"""
import hashlib
import os

from laplace.errors import ConfigError

from .transforms import eval_transform, three_augment, timm_transform

NAMES = ("digits", "cifar10", "cifar100", "imagenet")
AUGMENTS = ("three_augment", "simple_random_crop", "randaugment", "timm", "none")


def _required(cfg, key: str, example: str):
    # Only the recipes that use them state these keys (data=imagenet's auto_augment is RandAugment's).
    value = cfg.get(key)
    if value is None or value == "":
        raise ConfigError(f"data.augment={cfg.augment} needs data.{key}: set +data.{key}={example} "
                          f"(data={cfg.name})")
    return value


def build_transform(cfg, train: bool):
    """The training (data.augment) or the evaluation transform of the data node `cfg`."""
    mean, std, size = tuple(cfg.mean), tuple(cfg.std), cfg.img_size
    # Only data=imagenet states these keys; .get: also a checkpoint's node written before them.
    reduce = bool(cfg.get("reduced_decode", False))
    # data=digits states no colour jitter (its augment is none): an override gets DeiT-III's 0.3.
    jitter = cfg.get("color_jitter", 0.3)
    augment = cfg.augment if train else "none"
    if augment not in AUGMENTS:
        raise ConfigError(f"data.augment={augment!r}: choose one of {', '.join(AUGMENTS)}")
    if augment == "none":  # also every validation split: the evaluation is never augmented
        return eval_transform(size, cfg.eval_crop_pct, mean, std, reduce)
    if cfg.get("device_augment", False):  # the worker's half; the training step does the rest
        if augment != "three_augment":
            raise ConfigError(f"data.device_augment=true moves 3-Augment's colour work to the device: it needs "
                              f"data.augment=three_augment, not {augment}")
        from .crop_augment import ThreeAugmentCrops

        return ThreeAugmentCrops(size, jitter, mean, std, reduce)
    if augment in ("three_augment", "simple_random_crop"):
        return three_augment(size, jitter, augment == "simple_random_crop", mean, std, reduce)
    if augment == "randaugment":  # DeiT-III fine-tunes with bicubic crops
        policy = _required(cfg, "auto_augment", "rand-m9-mstd0.5-inc1")
        return timm_transform(size, policy, "bicubic", jitter, mean, std, reduce)
    # augment=timm: the first author's runs (experiment=deit3_in1k_author: '3a', random interpolation)
    interpolation = _required(cfg, "train_interpolation", "random")
    return timm_transform(size, cfg.get("auto_augment"), interpolation, jitter, mean, std, reduce)


def image_identity(*splits) -> dict:
    """What image splits are, wherever they lie (a resume compares it, train/resume.py): their
    sizes and a digest of their class names and file names (relative to the split's folder)."""
    h = hashlib.sha256()
    for ds in splits:
        root = str(getattr(ds, "root", ""))
        names = [*getattr(ds, "classes", []), *(os.path.relpath(p, root) for p, _ in getattr(ds, "samples", [])),
                 *(os.path.basename(f) for f in getattr(ds, "files", []))]  # ImageFolder's files, or parquet's
        h.update("\n".join(map(str, [len(ds), *names, ""])).encode())
    return {"images": [len(ds) for ds in splits], "images_digest": h.hexdigest()[:16]}


def build_vision_dataset(cfg, train: bool, transform=None):
    """The training (True) or validation split of `cfg.name`, with `transform` (None:
    build_transform's) applied to each opened image."""
    tf = build_transform(cfg, train) if transform is None else transform
    if cfg.name == "digits":
        from .digits import Digits

        return Digits(train, tf, cfg.val_fraction)
    if cfg.name in ("cifar10", "cifar100"):
        from .cifar import build_cifar

        return build_cifar(cfg.name, cfg.root, train, tf, download=cfg.download)
    if cfg.name == "imagenet":
        from .imagenet import build_imagenet

        # data.format=auto: the folder layout if there, else the HF parquet files (laplace.data.imagenet)
        ds = build_imagenet(cfg.root, train, tf, fmt=cfg.format, cache_dir=cfg.cache_dir,
                            skip_corrupt=bool(cfg.get("skip_corrupt", False)))
        if len(getattr(ds, "classes", ())) > cfg.num_classes:  # else an index error at step 1
            raise ConfigError(f"data.root={cfg.root} holds {len(ds.classes)} class folders, more than "
                              f"data.num_classes={cfg.num_classes}: set data.num_classes={len(ds.classes)}")
        return ds
    raise ConfigError(f"data={cfg.name!r} is not an image dataset; choose one of {NAMES}")
