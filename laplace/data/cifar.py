"""CIFAR-10 and CIFAR-100 through torchvision's readers.

Usage:
    ds = build_cifar("cifar100", root="/data", train=True, transform=three_augment(32))
    img, label = ds[0]                      # label in range(NUM_CLASSES["cifar100"])

`root` holds torchvision's on-disk layout: `cifar-10-batches-py/{data_batch_1..5, test_batch,
batches.meta}` or `cifar-100-python/{train, test, meta}`, which `download=True` creates on a
machine with internet.
"""

import os
from collections.abc import Callable

from torchvision import datasets

from laplace.data import DatasetNotFoundError

NUM_CLASSES = {"cifar10": 10, "cifar100": 100}


def _presence_only(cls: type) -> type:
    """torchvision's `cls` whose file checks are presence checks: torchvision checks every batch
    file's md5 before reading, which would reject a tiny set in the same format (what the tests
    write); a truncated real file still fails when unpickled. The archive's md5 (download) stays."""
    # (filename, None): torchvision's check_integrity then only asks that the file exists.
    blank = {"train_list": [[name, None] for name, _ in cls.train_list], "meta": {**cls.meta, "md5": None},
             "test_list": [[name, None] for name, _ in cls.test_list], "__module__": __name__}
    return type(cls.__name__, (cls,), blank)


# Module-level names, so that the datasets pickle into DataLoader workers.
CIFAR10, CIFAR100 = _presence_only(datasets.CIFAR10), _presence_only(datasets.CIFAR100)


def build_cifar(name: str, root: str, train: bool, transform: Callable | None = None,
                download: bool = False) -> datasets.CIFAR10:
    """Build a CIFAR split; items are (transformed PIL RGB 32x32 image, int label).

    Args:
        name: "cifar10" or "cifar100".
        root: directory that holds (or will hold) torchvision's CIFAR folder.
        train: the 50k training split if True, else the 10k test split.
        transform: applied to each PIL image.
        download: fetch and extract the archive into root if files are missing (needs internet).
    """
    cls = {"cifar10": CIFAR10, "cifar100": CIFAR100}[name]  # (laplace.data.vision passes only these)
    root = os.path.abspath(os.path.expanduser(root))
    folder = os.path.join(root, cls.base_folder)
    files = [f for f, _ in (cls.train_list if train else cls.test_list)] + [cls.meta["filename"]]
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    # torchvision's own error ("Dataset not found or corrupted") names neither folder nor key.
    if missing and not download:
        raise DatasetNotFoundError(
            f"{name} not found: missing {', '.join(missing)} in {folder}; "
            f"set data.root to the directory holding {cls.base_folder}/, "
            f"or data.download=true on a machine with internet"
        )
    try:
        return cls(root, train=train, transform=transform, download=download)
    except OSError as e:  # no network, DNS failure, ... (URLError is an OSError)
        if not missing:
            raise
        reason = " ".join(str(e).split())  # keep the message on one line
        raise DatasetNotFoundError(
            f"{name} not found in {folder} and download failed ({type(e).__name__}: {reason}); "
            f"set data.root to a directory holding {cls.base_folder}/"
        ) from e
