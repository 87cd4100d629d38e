"""Atomic file writes: the one implementation behind checkpoints, token shards, tokenizer files,
prepare's meta.json, the feature cache, every results.json (`write_json`) and the run's config.yaml;
and atomic folders (`atomic_dir`: exports).

Readers see the old file or the new one, never a truncated one.
"""
import contextlib
import errno
import fcntl
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
    # A hidden temp file in the same folder (`.<name>.*.tmp`, which `list_shards` and readers skip;
    # the same file system, so the rename is atomic), written, fsynced, renamed over the target.
    # Mode 0666 minus the umask, not mkstemp's private 0600: prepared data and results are shared
    # on a cluster. O_EXCL: a name another writer holds (1 in 2**32) is an error, never overwritten.
    tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name points at them
        os.replace(tmp, path)
    except BaseException as e:  # a signal or a full disk too: no temp file is left behind
        Path(tmp).unlink(missing_ok=True)
        name_storage_error(e, path)
        raise
    # The folder fsynced too, so that the rename survives a crash (POSIX: laplace runs on Linux and
    # macOS only, train.rundir's lock is fcntl's).
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replaceable: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """`with atomic_dir(out) as tmp:` the files written into `tmp` become the folder `out` when the
    block ends, with an ordinary file's modes; an error or a signal (SIGTERM, SIGHUP, Ctrl-C) leaves
    nothing. Exclusive: an `out` that is not empty by then (another writer's, finished first) raises
    FileExistsError, unless `replaceable(out)` says it may be replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A SIGKILL cannot be caught: what one left (a temp folder, an old one moved aside) is removed
    # by the next call for the same folder (a ViT-B export's leftover was 343 MB); a temp folder
    # whose writer lives holds its lock and stays (two exports to one folder at once).
    for stale in [*path.parent.glob(f".{path.name}.*.tmp"), *path.parent.glob(f".{path.name}.*.old")]:
        if _abandoned(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    lock = None
    try:
        # Slurm's scancel and a closed terminal: their default action ends the process at once,
        # skipping every `finally`; as SystemExit they run the clean-up below.
        with _signals_as_exit(signal.SIGTERM, signal.SIGHUP):
            tmp.mkdir()
            lock = os.open(tmp, os.O_RDONLY)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel however this process ends
            yield tmp
            # An ordinary file's modes (0644 under umask 022): safetensors writes 0600, which a group
            # on a shared file system cannot read. The umask is read by setting it (and back).
            umask = os.umask(0)
            os.umask(umask)
            for f in tmp.rglob("*"):
                if f.is_file():
                    f.chmod(0o666 & ~umask)
            _swap_in(tmp, path, replaceable)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a failure's leftovers
        if lock is not None:
            os.close(lock)


def _abandoned(folder: Path) -> bool:
    """Whether no living atomic_dir holds `folder`'s lock (an `.old` folder has none: a moment's)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # EWOULDBLOCK: its writer is at work
        return False
    finally:
        os.close(fd)


def _swap_in(tmp: Path, out: Path, replaceable: Callable[[Path], bool] | None) -> None:
    """Rename the finished folder `tmp` to `out`; a non-empty `out` is moved aside first where
    `replaceable(out)`, else FileExistsError."""
    # rename(2) replaces an empty folder and refuses a non-empty one (ENOTEMPTY / EEXIST): the
    # kernel decides between two writers that both found `out` free, so neither is lost.
    old = None
    if replaceable is not None and out.is_dir() and any(out.iterdir()):
        if not replaceable(out):
            raise FileExistsError(errno.ENOTEMPTY, "not a folder to replace", str(out))
        # Two renames and no copy: `out` is at every moment the old folder or the new one (only
        # the instant between them has neither; a kill there leaves both, for the next call).
        old = out.parent / f".{out.name}.{secrets.token_hex(4)}.old"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise FileExistsError(e.errno, "written by another writer meanwhile", str(out)) from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
