"""Atomic file writes: the one implementation behind checkpoints, token shards, tokenizer files,
prepare's meta.json, the feature cache, every results.json and the run's config.yaml; atomic
folders (`atomic_dir`: exports); and whole-line appends for the logs (`append_line`).

A temp file in the same folder (hidden: `.<name>.*.tmp`, which `list_shards` and readers skip)
is written, fsynced and renamed over the target, then the folder is fsynced so the rename
survives a crash. Readers see the old file or the new one, never a truncated one. The file gets
the modes of an ordinary `open(path, "w")` (0644 under umask 022), not mkstemp's private 0600:
prepared data and results are shared on a cluster.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from laplace.errors import name_storage_error


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[IO[bytes]], None],
                 sole_writer: bool = False) -> Path:
    """Write `data` (bytes, or a function that writes into the open binary file) to `path`.

    `sole_writer`: nothing else writes `path` (a run's checkpoint), so a temp file of this name
    is a killed writer's leftover (full size, for a checkpoint) and is removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if sole_writer:  # `*tmp*`: also the `.<name>.tmp<pid>` files of writers before this module
        for stale in path.parent.glob(f".{path.name}.*tmp*"):
            stale.unlink(missing_ok=True)
    fd, tmp = _create_temp(path)
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


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_dir(out) as tmp:` the files written into `tmp` become the folder `out` when the
    block ends: `tmp` is renamed to `out` (an existing `out` moved aside first, removed after), so
    `out` is at every moment the old folder or the new one. Its files get the modes of an ordinary
    `open` (safetensors writes 0600: a group on a shared file system could not read an export).

    An error, Ctrl-C, SIGTERM or SIGHUP (Slurm's scancel, a closed terminal) removes `tmp`: the
    block turns those signals into SystemExit, whose default action would end the process at once
    and skip every clean-up. A SIGKILL cannot be caught: the next call for the same `out` removes
    what one left (`.<name>.*.tmp`, `.<name>.*.old`) first, as one writer per folder is the rule.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*path.parent.glob(f".{path.name}.*.tmp"), *path.parent.glob(f".{path.name}.*.old")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        with _signals_as_exit(signal.SIGTERM, signal.SIGHUP):
            tmp.mkdir()
            yield tmp
            umask = os.umask(0)  # read it: only os.umask tells, by setting it
            os.umask(umask)
            for f in tmp.rglob("*"):
                if f.is_file():
                    f.chmod(0o666 & ~umask)
            _swap_in(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a failure's leftovers


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished folder `tmp` to `out`, moving a non-empty `out` aside first."""
    old = None
    if out.is_dir():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.{secrets.token_hex(4)}.old"
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old)


@contextlib.contextmanager
def _signals_as_exit(*signums: int) -> Iterator[None]:
    """Inside the block, `signums` raise SystemExit(128 + signal), the status their default action
    gives, after one line saying so. Only the main thread can set handlers: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        print(f"interrupted by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():  # None: a handler not set from Python, i.e. the default
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` + newline to a log file (metrics.jsonl, samples.jsonl) whole or not at all:
    a full disk or quota cuts the write short, and the part written is cut off again, so readers
    never meet half a line in the middle of the file. The error names the file."""
    path, data = Path(path), (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # unbuffered: nothing is left to flush (and fail again) at close
                view = view[os.write(fd, view):]
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:  # nothing more to do: readers skip a torn last line
                pass
            name_storage_error(e, path)
            raise
    finally:
        os.close(fd)


def _create_temp(path: Path) -> tuple[int, str]:
    """A new hidden temp file beside `path`, opened for writing with mode 0666 minus the umask."""
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                           0o666), tmp
        except FileExistsError:
            continue


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> Path:
    """`obj` as strict JSON, atomically: NaN / inf become null (strict readers such as jq or a
    browser refuse NaN, and every reader here treats both as "no value"), other non-JSON
    leaves become str."""
    return atomic_write(path, (json.dumps(_finite(obj), indent=indent, default=str) + "\n").encode())


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
