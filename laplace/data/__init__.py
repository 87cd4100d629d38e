"""Datasets: embedded ones that ship inside installed packages (digits, pydoc_text) and the
paper's real ones (CIFAR-10/100, ImageNet-1k, FineWeb-Edu), built by name from the Hydra `data`
config group."""
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from laplace.errors import DatasetNotFoundError  # noqa: F401  (data sets raise it; tokenizers too)


@dataclass
class Data:
    """What a trainer's `build_data` returns (train/engine.py).

    Args:
        train: a map-style dataset (the engine serves it through a MapFeed) or a feed (TokenStream).
        val: the validation set, or None.
        collate: how a DataLoader batches training items; val_collate: validation items (None: collate).
        unit: what throughput counts ("img", "tok", "conv"); units_per_sample: per row of a batch.
        identity: what the data is (not where: data.root may move), checked on resume.
    """

    train: Any
    val: Any = None
    collate: Callable = field(default=torch.utils.data.default_collate)
    val_collate: Callable | None = None
    unit: str = "samples"
    units_per_sample: int = 1
    identity: dict | None = None
