"""Output folders: names that stay within the file system's limit, and one run per run directory.

`EXECUTION_KEYS` are the config keys a run directory's name leaves out (the loop names and
resumes runs with them, the analysis groups runs without them).

`short_name` keeps a long name's readable start and ends it in a hash of the whole, so the same
input names the same folder again (run directories, eval.lm's output folder, Slurm chains).

`RunDirLock` holds <run_dir>/.lock for the life of a run: a second run on the same folder is
refused in one line naming the holder (pid, host, start).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
import tempfile
import time
from pathlib import Path

from laplace.errors import UserError

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the process exists is checked
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, someone else's
        pass
    return True


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

    def _holder(self) -> tuple[str, str]:
        """(one-line description, host) of what the file says about the last holder."""
        try:
            text = self.path.read_text().split()
        except OSError:
            text = []
        if len(text) < 3:
            return "another process (it wrote no pid yet)", ""
        pid, host, start = text[:3]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(start))) if start.isdigit() else start
        return f"pid {pid} on host {host} (since {when})", host

    def _refuse(self, fd: int):
        os.close(fd)
        raise RunDirInUse(f"run_dir {self.path.parent} is in use by {self._holder()[0]}: wait for that run to "
                          f"end (or stop it), or give another run_dir=") from None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:  # a folder or a file not ours in its place: the user's to remove
            raise UserError(f"run_dir: cannot take the lock file {self.path} ({e.strerror}); remove it if no run "
                            f"is using {self.path.parent}, or give another run_dir=") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):  # POSIX allows either for "held by another"
                self._refuse(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            self._check_pid_file(fd)
        previous = os.read(fd, 4096).decode(errors="replace").split()
        if previous:  # a holder that ended without releasing: killed, or its machine died
            print(f"[laplace] run_dir: took over the lock of pid {previous[0]} on host "
                  f"{previous[1] if len(previous) > 1 else '?'} (that run is gone)", flush=True)
        os.ftruncate(fd, 0)  # the holder's line, for the refusal's message and the pid fall-back
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {int(time.time())}\n".encode(), 0)
        self.fd = fd
        return self

    def _check_pid_file(self, fd: int):
        """No lock support here: refuse only a holder known to be alive (same host, live pid)."""
        text = os.pread(fd, 4096, 0).decode(errors="replace").split()
        who, host = self._holder()
        if len(text) >= 2 and text[0].isdigit():
            if host == socket.gethostname() and int(text[0]) != os.getpid() and _alive(int(text[0])):
                self._refuse(fd)
            if host != socket.gethostname():
                print(f"[laplace] warning: {self.path} names {who} and this file system has no locks: "
                      f"if that run is alive, stop one of them", flush=True)

    def release(self):
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # empty: the next run knows this one ended cleanly
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
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
