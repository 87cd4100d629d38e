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

Images are decoded one item at a time in __getitem__ (never the whole split in memory), and
both dataset types pickle into DataLoader workers (the parquet one as a memory-mapped Arrow
table). On first use, `datasets` converts the parquet files into an Arrow cache (as large as
the parquet files; point `cache_dir` at fast local disk); later runs reuse it.
"""

import glob
import io
import os
from collections.abc import Callable

import torch
from PIL import Image
from torchvision import datasets as tv_datasets

from laplace.data import DatasetNotFoundError
from laplace.errors import ConfigError

NUM_CLASSES = 1000
_FOLDER_SPLIT = {True: "train", False: "val"}
_PARQUET_SPLIT = {True: "train", False: "validation"}


class ParquetImageNet(torch.utils.data.Dataset):
    """ImageNet rows from parquet files with an `image` {bytes, path} and a `label` column.

    Args:
        files: parquet file paths of one split.
        transform: applied to each decoded RGB PIL image.
        cache_dir: where `datasets` keeps its Arrow cache (None: the HF default).
    """

    def __init__(self, files: list[str], transform: Callable | None = None, cache_dir: str | None = None):
        from datasets import Image as HFImage
        from datasets import load_dataset

        ds = load_dataset("parquet", data_files=sorted(files), split="train", cache_dir=cache_dir)
        # decode=False hands us the raw {bytes, path} struct, whether or not the files carry
        # HF feature metadata, and leaves decoding (and its errors) to one place below.
        self.ds = ds.cast_column("image", HFImage(decode=False))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> tuple:
        row = self.ds[int(index)]
        image = row["image"]
        src = io.BytesIO(image["bytes"]) if image["bytes"] is not None else image["path"]
        with Image.open(src) as img:
            img = img.convert("RGB")  # also forces the lazy PIL decode before the file closes
        return (self.transform(img) if self.transform else img), row["label"]


def _parquet_files(root: str, train: bool) -> list[str]:
    split = _PARQUET_SPLIT[train]
    for folder in (os.path.join(root, "data"), root):
        files = glob.glob(os.path.join(folder, f"{split}-*.parquet"))
        if files:
            return sorted(files)
    return []


def build_imagenet(
    root: str,
    train: bool,
    transform: Callable | None = None,
    fmt: str = "auto",
    cache_dir: str | None = None,
) -> torch.utils.data.Dataset:
    """Build an ImageNet-1k split; items are (transformed RGB PIL image, int label in 0..999).

    Args:
        root: dataset directory (folder layout: holds train/ and val/; parquet: holds data/).
        train: the training split if True, else the 50k validation split.
        transform: applied to each PIL image.
        fmt: "folder", "parquet", or "auto" (folder if present, else parquet).
        cache_dir: Arrow cache directory for the parquet layout (None: HF default).
    """
    if fmt not in ("auto", "folder", "parquet"):
        raise ConfigError(f"unknown ImageNet format {fmt!r}; expected 'auto', 'folder' or 'parquet'")
    root = os.path.abspath(os.path.expanduser(root))
    folder = os.path.join(root, _FOLDER_SPLIT[train])
    if fmt in ("auto", "folder") and os.path.isdir(folder):
        return tv_datasets.ImageFolder(folder, transform=transform)
    files = _parquet_files(root, train) if fmt in ("auto", "parquet") else []
    if files:
        return ParquetImageNet(files, transform=transform, cache_dir=cache_dir)
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
