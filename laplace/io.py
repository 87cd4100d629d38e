"""Atomic file writes: the one implementation behind token shards, tokenizer files, prepare's
meta.json and every results.json.

A temp file in the same folder (hidden: `.<name>.*.tmp`, which `list_shards` and readers skip)
is written, fsynced and renamed over the target, then the folder is fsynced so the rename
survives a crash. Readers see the old file or the new one, never a truncated one.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from laplace.errors import name_storage_error


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[IO[bytes]], None]) -> Path:
    """Write `data` (bytes, or a function that writes into the open binary file) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        name_storage_error(e, path)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename durable (POSIX; Windows cannot open a folder)
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> Path:
    """`obj` as JSON (non-JSON leaves as str), atomically."""
    return atomic_write(path, (json.dumps(obj, indent=indent, default=str) + "\n").encode())
