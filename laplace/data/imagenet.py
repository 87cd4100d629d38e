"""ImageNet-1k (ILSVRC-2012) from a local folder tree or a local copy of the HF parquet files.

Two on-disk layouts are read, auto-detected per split:
  * folder:  root/train/<wnid>/*.JPEG and root/val/<wnid>/*.JPEG (the usual layout after
    extracting the tars and sorting val into class folders), read with torchvision ImageFolder;
    labels are the sorted wnid order, which is the standard 0..999 ImageNet index order.
  * parquet: the Hugging Face `imagenet-1k` files, root/data/train-*.parquet and
    root/data/validation-*.parquet (or the same names directly in root), columns
    `image` (struct bytes, path) and `label` (int 0..999), read with `datasets`.

Usage:
    ds = build_imagenet("/data/imagenet", train=True, transform=three_augment(224))
    img, label = ds[0]

Each item is read and decoded in __getitem__ (laplace.data.images.load: an unreadable image is one
line naming its file, parquet: file and row), and both datasets pickle into DataLoader workers.
`python prepare.py source=imagefolder` writes the parquet layout from the folder one.
"""

import bisect
import glob
import io
import itertools
import os
from collections.abc import Callable

import torch
from torchvision import datasets as tv_datasets
from torchvision.datasets.folder import find_classes

from laplace.data import DatasetNotFoundError
from laplace.errors import ConfigError, one_line

from .images import CorruptImages, load

_FOLDER_SPLIT = {True: "train", False: "val"}
_PARQUET_SPLIT = {True: "train", False: "validation"}


class ImageFolder(CorruptImages, tv_datasets.ImageFolder):
    """torchvision's ImageFolder (its file list and sorted-wnid labels) whose images are read by
    laplace.data.images.load: an unreadable file is one line naming it, or skipped (its
    __getitem__ is CorruptImages', data.skip_corrupt's policy)."""

    def __init__(self, root: str, transform: Callable | None = None, skip_corrupt: bool = False):
        try:
            super().__init__(root, transform=transform)
        except FileNotFoundError as e:  # torchvision's: a class folder without images, or no class folder
            raise DatasetNotFoundError(f"{root}: {one_line(e)}; add its images or remove the empty "
                                       f"class folder") from None
        self.init_corrupt(skip_corrupt)

    def _load(self, index: int) -> tuple:
        path, target = self.samples[index]  # labels: the sorted wnids' order, ImageNet's 0..999
        return load(path, path, self.transform), target


class ParquetImageNet(CorruptImages, torch.utils.data.Dataset):
    """ImageNet rows from parquet files with an `image` {bytes, path} and a `label` column.

    Args:
        files: parquet file paths of one split.
        transform: applied to each opened image (laplace.data.images.load).
        cache_dir: where `datasets` keeps its Arrow cache (data.cache_dir; None: the HF default).
            It converts the parquet files into it on first use (about their size).
        skip_corrupt: serve the next row in place of one whose image does not decode (counted).
    """

    def __init__(self, files: list[str], transform: Callable | None = None, cache_dir: str | None = None,
                 skip_corrupt: bool = False):
        import pyarrow.parquet as pq
        from datasets import Image as HFImage
        from datasets import load_dataset

        self.files = sorted(files)  # HF names its shards train-00000-of-NNNNN, ...: sorted is row order
        cache_dir = os.path.abspath(os.path.expanduser(str(cache_dir))) if cache_dir is not None else None
        # A memory-mapped Arrow table: items are read one at a time, and it pickles into workers.
        ds = load_dataset("parquet", data_files=self.files, split="train", cache_dir=cache_dir)
        # decode=False hands us the raw {bytes, path} struct, whether or not the files carry
        # HF feature metadata, and leaves decoding (and its errors) to one place below.
        self.ds = ds.cast_column("image", HFImage(decode=False))
        self.transform = transform
        # The rows concatenate the files in order: where each file starts, to name a bad row
        # (read from the footers; the Arrow cache keeps no file boundaries).
        self.starts = [0, *itertools.accumulate(pq.read_metadata(f).num_rows for f in self.files[:-1])]
        self.init_corrupt(skip_corrupt)

    def __len__(self) -> int:
        return len(self.ds)

    def _load(self, index: int) -> tuple:
        row = self.ds[index]
        image = row["image"]
        # HF's image struct holds the file's bytes, or (rarely) only a path to it.
        src = io.BytesIO(image["bytes"]) if image["bytes"] is not None else image["path"]
        k = bisect.bisect_right(self.starts, index) - 1
        return load(src, f"{self.files[k]} row {index - self.starts[k]}", self.transform), row["label"]


def _parquet_files(root: str, train: bool) -> list[str]:
    split = _PARQUET_SPLIT[train]
    # `hf download --local-dir root` puts them under root/data/; a bare copy may have them in root.
    for folder in (os.path.join(root, "data"), root):
        files = glob.glob(os.path.join(folder, f"{split}-*.parquet"))
        if files:
            return sorted(files)
    return []


def build_imagenet(root: str, train: bool, transform: Callable | None = None, fmt: str = "auto",
                   cache_dir: str | None = None, skip_corrupt: bool = False) -> torch.utils.data.Dataset:
    """Build an ImageNet-1k split; items are (transformed image, int label in 0..999).

    Args:
        root: dataset directory (folder layout: holds train/ and val/; parquet: holds data/).
        train: the training split if True, else the 50k validation split.
        transform: applied to each opened image (laplace.data.images.load).
        fmt: "folder", "parquet", or "auto" (folder if present, else parquet).
        cache_dir: Arrow cache directory for the parquet layout (data.cache_dir; None: HF default).
        skip_corrupt: serve the next sample in place of an unreadable image (counted) instead
            of stopping with one line naming it.
    """
    if fmt not in ("auto", "folder", "parquet"):  # data.format
        raise ConfigError(f"unknown ImageNet format {fmt!r}; expected 'auto', 'folder' or 'parquet'")
    root = os.path.abspath(os.path.expanduser(root))
    folder = os.path.join(root, _FOLDER_SPLIT[train])
    # data.format=auto: the folder layout when it is there (both in one root: the folder one wins).
    if fmt in ("auto", "folder") and os.path.isdir(folder):
        ds = ImageFolder(folder, transform=transform, skip_corrupt=skip_corrupt)
        train_dir = os.path.join(root, _FOLDER_SPLIT[True])
        # A label is its class folder's sorted position: a class missing from val/ shifts every later one.
        classes = find_classes(train_dir)[0] if not train and os.path.isdir(train_dir) else ds.classes
        if classes != ds.classes:
            lacks, extra = sorted(set(classes) - set(ds.classes)), sorted(set(ds.classes) - set(classes))
            raise ConfigError(f"{folder} and {train_dir} hold other class folders (val/ lacks {lacks[:3]}, has "
                              f"{extra[:3]} more): labels are sorted class positions, make both hold the same")
        return ds
    files = _parquet_files(root, train) if fmt in ("auto", "parquet") else []
    if files:
        return ParquetImageNet(files, transform=transform, cache_dir=cache_dir, skip_corrupt=skip_corrupt)
    split = _PARQUET_SPLIT[train]
    looked = {
        "folder": f"{folder}/<wnid>/*.JPEG (folder layout)",
        "parquet": f"{root}/data/{split}-*.parquet (Hugging Face imagenet-1k parquet layout)",
    }
    wanted = " or ".join(v for k, v in looked.items() if fmt in ("auto", k))
    raise DatasetNotFoundError(
        f"ImageNet-1k {split} split not found: looked for {wanted}; "
        f"set data.root to a directory holding either layout"
    )
