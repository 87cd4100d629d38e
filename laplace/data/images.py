"""Image files that do not decode: one line naming the file, or skipped and counted.

Large image sets hold a few unreadable files (ImageNet's copies break in transfer; a download
stops half-way), and PIL's error names no file, so a run died at step N with a long traceback.
`open_rgb` names the file (for parquet: file and row); `CorruptImages` is a dataset's policy:
raise (default), or with `data.skip_corrupt=true` serve the next readable sample in its place and
count it. The replacement keeps the batch full and is a function of the index alone, so exact
resume holds; the count lives in shared memory, so the data-loader workers' skips add up.
"""
from __future__ import annotations

import multiprocessing
import sys

import torch
from PIL import Image, UnidentifiedImageError

from laplace import dist
from laplace.errors import UserError

MAX_IN_A_ROW = 32  # more unreadable samples in a row than this: the data is wrong, not a few files


class CorruptImageError(UserError):
    """An image file (or parquet row) that does not decode; the message names it. One positional
    argument, as torch re-raises a data-loader worker's exception with `type(e)(message)`."""

    def __init__(self, message: str, name: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.name, self.reason = name, reason


def open_rgb(src, name: str, decode=None) -> Image.Image:
    """Decode `src` (a path or a binary file object) fully, as RGB, or with `decode` (a function
    of the opened, undecoded image, laplace.data.decode) as it decodes; if it does not decode,
    CorruptImageError naming `name`."""
    try:
        with Image.open(src) as img:
            return decode(img) if decode else img.convert("RGB")  # decoded before the file closes
    except UnidentifiedImageError:
        reason = "not an image format PIL reads"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # truncated, broken
        reason = " ".join(str(e).split()) or type(e).__name__
    raise CorruptImageError(f"{name} is not a readable image ({reason}): replace or remove it, or set "
                            f"data.skip_corrupt=true to skip such files", name, reason)


def load(src, name: str, transform=None):
    """The transformed image of `src`. A transform with `decode` (ReducedDecode, MultiCrop,
    ThreeAugmentCrops) decodes the opened file itself, at the size its crops need, inside the error
    naming above, then applies its `rest`; any other transform gets the decoded RGB image."""
    decode = getattr(transform, "decode", None)
    if decode is not None:
        return transform.rest(open_rgb(src, name, decode))
    img = open_rgb(src, name)
    return transform(img) if transform is not None else img


class CorruptImages:
    """What a dataset does with a sample that raises CorruptImageError.

    Args:
        skip: False: raise it; True: count it, say so once per file and process, and serve the
            next index's sample instead (wrapping at the end).
    """

    def __init__(self, skip: bool = False):
        self.skip = skip
        self._count = multiprocessing.Value("q", 0) if skip else None  # inherited by the workers
        self._named: set[str] = set()

    @property
    def skipped(self) -> int:
        """Samples served in place of unreadable ones so far, by this process and its workers."""
        return self._count.value if self._count is not None else 0

    def get(self, load, index: int, n: int):
        """load(index), or with `skip` the first readable of load(index + 1), ... (mod n)."""
        for k in range(min(n, MAX_IN_A_ROW)):
            try:
                return load((index + k) % n)
            except CorruptImageError as e:
                if not self.skip:
                    raise
                with self._count.get_lock():
                    self._count.value += 1
                if e.name not in self._named:
                    self._named.add(e.name)
                    print(f"[laplace] data.skip_corrupt: skipped {e.name} ({e.reason})", file=sys.stderr, flush=True)
        raise CorruptImageError(f"{min(n, MAX_IN_A_ROW)} unreadable images in a row from sample {index}: "
                                f"is data.root the dataset you meant?")


def report_skipped(datasets: dict, device, is_main: bool):
    """Rank 0 prints how often the named datasets served a sample in place of an unreadable image
    (data.skip_corrupt), summed over every rank and its workers. Every rank calls it (a collective)."""
    sets = {k: d for k, d in datasets.items() if hasattr(d, "skipped_corrupt")}
    if not sets:
        return
    n = dist.all_reduce_sum(torch.tensor([d.skipped_corrupt for d in sets.values()], device=device)).tolist()
    if is_main and any(n):
        counts = ", ".join(f"{k} {c}" for k, c in zip(sets, n))
        print(f"[laplace] data.skip_corrupt: {sum(n)} reads of an unreadable image served the next sample "
              f"({counts}); the files are named above", flush=True)
