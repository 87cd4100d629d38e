"""Output folders: names that stay within the file system's limit, and one run per run directory.

`EXECUTION_KEYS` are the config keys a run directory's name leaves out (the loop names and
resumes runs with them, the analysis groups runs without them).

`short_name` keeps a long name's readable start and ends it in a hash of the whole, so the same
input names the same folder again (run directories, eval.lm's output folder, Slurm chains).

`RunDirLock` holds <run_dir>/.lock for the life of a run: a second run on the same folder is
refused in one line naming the holder (pid, host, start).

What goes into a run directory: `results_header`, the fields every results.json opens with, and
`append_line`, whole-line appends for the logs (metrics.jsonl, samples.jsonl).
"""
import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

from laplace import model_label
from laplace.errors import UserError, name_storage_error

MAX_NAME = 120  # characters of a run directory's last component (file systems allow 255)

# Config keys that say how a run executes, not what it trains: they do not change the run
# directory's name (more workers or another logger must resume the same run), a resume does not
# compare them with the checkpoint's config, and the tables do not group runs by them.
EXECUTION_KEYS = ("run_dir", "paths.", "logger", "hydra.",
                  "data.root", "data.tokenizer", "data.cache_dir", "data.download", "data.skip_corrupt",
                  "data.reduced_decode",
                  "trainer.device", "trainer.num_workers", "trainer.progress", "trainer.stop_after",
                  "trainer.log_every", "trainer.eval_every", "trainer.ckpt_every", "trainer.keep_every",
                  "trainer.micro_batch_size", "trainer.amp", "trainer.compile", "trainer.resume",
                  "model.grad_checkpointing")


def short_name(name: str, limit: int, sep: str = "~") -> str:
    """`name` if it has at most `limit` characters, else its start + `sep` + 10 hex of its SHA-1."""
    if len(name) <= limit:
        return name
    return f"{name[:limit - 11]}{sep}{hashlib.sha1(name.encode()).hexdigest()[:10]}"


class RunDirInUse(UserError):
    """Another live run holds the run directory."""


# lockf's errors where the file system has no locks (a `nolock` NFS mount, a FUSE file system)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _holder(line: list[str]) -> str:
    """What a lock file's line ("pid host start") says about the run that wrote it."""
    if len(line) < 3:
        return "another process (it wrote no pid yet)"
    pid, host, start = line[:3]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(start))) if start.isdigit() else start
    return f"pid {pid} on host {host} (since {when})"


def _alive_here(line: list[str]) -> bool:
    """Whether a lock file's line names a live process of this host other than this one."""
    if len(line) < 2 or not line[0].isdigit() or line[1] != socket.gethostname() or int(line[0]) == os.getpid():
        return False
    return psutil.pid_exists(int(line[0]))  # kill(pid, 0): also true of another user's process


class RunDirLock:
    """`with RunDirLock(run_dir):` -- this process alone runs in `run_dir` until the block ends."""
    # A POSIX record lock (fcntl): the kernel drops it when the holder ends in any way (SIGKILL
    # included), so a killed run's lock is taken over by the next run; unlike flock, data-loader
    # workers forked by the run do not inherit it. It sees any two runs on one machine, and on NFS
    # runs on different hosts too where the mount has a lock manager (NLM / NFSv4 locks). Where
    # it cannot (a `nolock` mount, a file system without locks: ENOLCK) the pid written in the
    # file tells a live run on the same host only; a holder on another host cannot be told from
    # a crashed one, so the run goes ahead with a warning.

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:  # a folder or a file not ours in its place: the user's to remove
            raise UserError(f"run_dir: cannot take the lock file {self.path} ({e.strerror}); remove it if no run "
                            f"is using {self.path.parent}, or give another run_dir=") from None
        previous = os.read(fd, 4096).decode(errors="replace").split()  # the last holder's line
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN, *NO_LOCKS):  # POSIX allows either for "held by another"
                os.close(fd)
                raise
            if e.errno not in NO_LOCKS or _alive_here(previous):  # no locks: refuse a holder known to be alive
                os.close(fd)
                raise RunDirInUse(f"run_dir {self.path.parent} is in use by {_holder(previous)}: wait for that run "
                                  f"to end (or stop it), or give another run_dir=") from None
            if len(previous) >= 2 and previous[0].isdigit() and previous[1] != socket.gethostname():
                print(f"[laplace] warning: {self.path} names {_holder(previous)} and this file system has no locks: "
                      f"if that run is alive, stop one of them", flush=True)
        if previous:  # a holder that ended without releasing: killed, or its machine died
            print(f"[laplace] run_dir: took over the lock of pid {previous[0]} on host "
                  f"{previous[1] if len(previous) > 1 else '?'} (that run is gone)", flush=True)
        os.ftruncate(fd, 0)  # the holder's line, for the refusal's message and the pid fall-back
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {int(time.time())}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self):
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)  # empty: the next run knows this one ended cleanly
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def check_writable(folder: str | os.PathLike, key: str) -> Path:
    """Create `folder` and write a file in it now, so that a run fails before its work, not after:
    a UserError naming `key` (the setting that chose the folder) if it cannot be written."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as f:  # removed when closed, whatever happens
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())  # a full disk or quota may only say so here
    except OSError as e:
        raise UserError(f"{key}: cannot write in {folder} ({e.strerror}); free space or make it writable, "
                        f"or give {key}=<a writable folder>") from None
    return folder


def results_header(model: dict, dataset: Optional[str], checkpoint, **fields) -> dict:
    """The fields every results.json opens with (trainers, k-NN, linear, segmentation, lm-eval):
    what `analysis.tables` groups runs by. `model` is the model node; `fields` follow."""
    k = model["num_laplacian_heads"]
    # checkpoints from before learned modes have no laplacian_mode: theirs was fixed
    return {"model": model_label(model), "num_laplacian_heads": list(k) if isinstance(k, (list, tuple)) else k,
            "laplacian_mode": model.get("laplacian_mode", "fixed"), "attention": model.get("attention", "softmax"),
            "dataset": dataset, "checkpoint": str(checkpoint), **fields}


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
            with contextlib.suppress(OSError):  # nothing more to do: readers skip a torn last line
                os.ftruncate(fd, start)
            name_storage_error(e, path)
            raise
    finally:
        os.close(fd)
