"""The project's own input errors: the only exceptions the command lines shorten to one line.

A bad model name, config key, data path or checkpoint is the user's to fix, so `train.py`,
`python -m analysis` and the evaluations print `error: <message>` and exit; any other
exception is a bug (ours or a library's) and keeps its full traceback. Raise a subclass of
`UserError` only where the message names the offending key or path and how to fix it.
"""
import contextlib
import errno
import functools
import os
import re
import sys
import traceback
from collections.abc import Iterator


class UserError(Exception):
    """Bad input: a config value, a path, a file. The message is one line."""


class DatasetNotFoundError(UserError, FileNotFoundError):
    """A dataset is not where the config says. The message is one line: what was looked for,
    where, and how to get it (which config key to set)."""


class ConfigError(UserError, ValueError):
    """A config value (or a combination of values) that cannot work; names the key."""


def hard_exit(code: int) -> None:
    """Flush stdout / stderr and end the process now, skipping interpreter shutdown."""
    # After a failure, shutdown can hang: joining data-loader workers, torch.compile's worker
    # pool or a process group whose peers are gone. On a cluster a hung job burns its slot and
    # is never requeued, so every non-zero exit of a command line goes through here.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken pipe: nothing more to say
            stream.flush()
    _kill_children()
    os._exit(code)


def _kill_children() -> None:
    """SIGKILL this process's children (data-loader workers, torch.compile's worker pool)."""
    # Orphaned workers notice their parent is gone only every few seconds, and until then they
    # hold the job's stdout / stderr open, so a launcher waiting on those waits for them too.
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # gone meanwhile, or not ours to kill
            child.kill()


# Errors of the storage, not of the program: full, over quota, read-only, not ours to write.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)
# numpy's ndarray.tofile (np.save of a large array) on a full disk or quota: a short fwrite,
# reported as OSError("N requested and M written") with no errno.
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")
SHORT_WRITE = "short write: the disk is full or over quota"


def causes(e: BaseException | None) -> Iterator[BaseException]:
    """`e`, then what it was raised from or during, and so on (each once)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def storage_error(e: BaseException | None) -> OSError | None:
    """The storage OSError behind `e` (itself, or what it was raised from or during, as torch.save
    wraps a full disk in a RuntimeError), else None."""
    for c in causes(e):
        if isinstance(c, OSError) and (c.errno in STORAGE_ERRNOS or _short_write(c)):
            return c
    return None


def _short_write(e: OSError) -> bool:
    return e.errno is None and bool(e.args) and bool(_SHORT_WRITE.match(str(e.args[0])))


def name_storage_error(e: BaseException, path) -> None:
    """Give the storage error behind `e` the file being written: a full disk does not say which."""
    full = storage_error(e)
    if full is not None and full.filename is None:
        full.filename = str(path)


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none). torch re-raises
    a data-loader worker's exception as `type(e)("Caught <type> in DataLoader worker process N.\n
    Original Traceback ...")`: there the message is the traceback's last line, after its "module.Type: "."""
    lines = str(e).strip().splitlines()
    if len(lines) > 1 and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
        return lines[-1].split(": ", 1)[-1]
    return lines[0] if lines else type(e).__name__


def cli_errors(fn):
    """Wrap a command-line entry point: a `UserError` prints as `error: <one line>`, any
    other exception keeps its traceback (a bug to report), and every failure exits non-zero
    at once through `hard_exit`. `HYDRA_FULL_ERROR=1` shows user errors' tracebacks too."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:  # sys.exit(status) inside, e.g. a preempted run's requeue status
            if e.code in (0, None):
                raise
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            hard_exit(e.code if isinstance(e.code, int) else 1)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            hard_exit(130)
        except BaseException as e:
            line = _input_error(e)
            if line is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                traceback.print_exc()  # a bug: the whole traceback, then out
            else:
                print(f"error: {line}", file=sys.stderr)
            hard_exit(1)

    return wrapped


def _input_error(e: BaseException) -> str | None:
    """The one line of a failure that is the user's to fix (bad input, a full or read-only disk);
    None for a bug."""
    if isinstance(e, UserError):
        return one_line(e)
    full = storage_error(e)
    if full is None:
        return None
    hint = ("check its permissions" if full.errno in (errno.EACCES, errno.EPERM) else
            "free space there, or write elsewhere (run_dir= / out=)")
    return f"{full.filename or 'the output'}: {full.strerror or SHORT_WRITE}; {hint}"
