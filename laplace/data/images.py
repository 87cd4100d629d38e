"""Reading one image file for a dataset: the transform gets it opened but not yet decoded, and a file
that does not decode is one line naming it, or, with data.skip_corrupt=true, skipped and counted.

Large image sets hold a few unreadable files (copies broken in transfer, downloads cut short), and
PIL's error names no file: a run died at step N with a long traceback. The replacement sample of
`CorruptImages` keeps the batch full and is a function of the index alone, so exact resume holds.
"""
import functools
import multiprocessing
import sys

import torch
from PIL import Image, UnidentifiedImageError

from laplace.errors import UserError

from .decode import rgb

MAX_IN_A_ROW = 32  # more unreadable samples in a row than this: the data is wrong, not a few files
# What PIL raises for a file it cannot decode: truncated, broken, not an image, too large.
UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


class CorruptImageError(UserError):
    """An image file (or parquet row) that does not decode; the message names it. One positional
    argument, as torch re-raises a data-loader worker's exception with `type(e)(message)`."""

    def __init__(self, message: str, name: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.name, self.reason = name, reason


def _corrupt(name: str, e: BaseException) -> CorruptImageError:
    reason = "not an image format PIL reads" if isinstance(e, UnidentifiedImageError) else \
        " ".join(str(e).split()) or type(e).__name__  # one line
    return CorruptImageError(f"{name} is not a readable image ({reason}): replace or remove it, or set "
                             f"data.skip_corrupt=true to skip such files", name, reason)


def _named_load(load, name: str):
    try:
        return load()
    except UNREADABLE as e:
        raise _corrupt(name, e) from None


def load(src, name: str, transform=None):
    """`transform` of the image in `src` (a path or a binary file object), or without one the image
    in RGB. The transform gets the image opened but not yet decoded: its first step decodes it at
    the size its crop needs (laplace.data.decode). An image that does not decode, wherever that
    happens, is CorruptImageError naming `name`."""
    # Image.open reads the header only; the file stays open while the transform decodes it.
    with _named_load(functools.partial(Image.open, src), name) as img:
        # PIL decodes in `load`, which every pixel access calls first: name the file there.
        img.load = functools.partial(_named_load, img.load, name)
        return transform(img) if transform is not None else rgb(img).copy()  # copy: decoded while open


class CorruptImages:
    """Base of the datasets that read image files (their `_load(index)` reads sample `index`): what
    they do with a sample that raises CorruptImageError. Call `init_corrupt(skip)` in __init__;
    skip False raises it, True counts it, says so once per file and process, and serves the next
    index's sample instead (wrapping at the end)."""

    def init_corrupt(self, skip: bool = False):
        self.skip_corrupt = skip
        # In shared memory, inherited by the data-loader workers: their skips add up.
        self._count = multiprocessing.Value("q", 0) if skip else None
        self._named: set[str] = set()

    @property
    def skipped_corrupt(self) -> int:
        """Samples served in place of unreadable ones so far, by this process and its workers."""
        return self._count.value if self._count is not None else 0

    def __getitem__(self, index: int):
        n = len(self)
        # The replacement depends on the index alone (not on what this worker read before), so a
        # resumed run serves the same samples.
        for k in range(min(n, MAX_IN_A_ROW)):
            try:
                return self._load((int(index) + k) % n)
            except CorruptImageError as e:
                if not self.skip_corrupt:
                    raise
                with self._count.get_lock():
                    self._count.value += 1
                if e.name not in self._named:  # once per file and process, not once per epoch
                    self._named.add(e.name)
                    print(f"[laplace] data.skip_corrupt: skipped {e.name} ({e.reason})", file=sys.stderr, flush=True)
        raise CorruptImageError(f"{min(n, MAX_IN_A_ROW)} unreadable images in a row from sample {index}: "
                                f"is data.root the dataset you meant?")


def report_skipped(datasets: dict, device, is_main: bool):
    """Rank 0 prints how often the named datasets served a sample in place of an unreadable image
    (data.skip_corrupt), summed over every rank and its workers. Every rank calls it (a collective)."""
    sets = {k: d for k, d in datasets.items() if isinstance(d, CorruptImages)}
    if not sets:
        return
    n = torch.tensor([d.skipped_corrupt for d in sets.values()], device=device)
    if torch.distributed.is_initialized():  # every rank's skips, counted once
        torch.distributed.all_reduce(n)
    n = n.tolist()
    if is_main and any(n):
        counts = ", ".join(f"{k} {c}" for k, c in zip(sets, n))
        print(f"[laplace] data.skip_corrupt: {sum(n)} reads of an unreadable image served the next sample "
              f"({counts}); the files are named above", flush=True)
