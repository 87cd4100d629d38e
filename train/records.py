"""What runs and evaluations write beside the weights: the fields every results.json opens with,
and whole-line appends for the logs (metrics.jsonl, samples.jsonl).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from laplace import model_label
from laplace.errors import name_storage_error


def results_header(model: dict, dataset: Optional[str], checkpoint, **fields) -> dict:
    """The fields every results.json opens with (trainers, k-NN, linear, segmentation, lm-eval):
    what `analysis.tables` groups runs by. `model` is the model node; `fields` follow."""
    k = model["num_laplacian_heads"]
    # checkpoints from before learned modes have no laplacian_mode: theirs was fixed
    return {"model": model_label(model), "num_laplacian_heads": list(k) if isinstance(k, (list, tuple)) else k,
            "laplacian_mode": model.get("laplacian_mode", "fixed"), "attention": model.get("attention", "softmax"),
            "dataset": dataset,
            "checkpoint": str(checkpoint), **fields}


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` + newline to a log file (metrics.jsonl, samples.jsonl) whole or not at all;
    the error names the file."""
    path, data = Path(path), (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # unbuffered: nothing is left to flush (and fail again) at close
                view = view[os.write(fd, view):]
        except OSError as e:
            # A full disk or quota cut the write short: the part written is cut off again, so
            # readers never meet half a line in the middle of the file.
            try:
                os.ftruncate(fd, start)
            except OSError:  # nothing more to do: readers skip a torn last line
                pass
            name_storage_error(e, path)
            raise
    finally:
        os.close(fd)
