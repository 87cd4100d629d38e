"""Run logging: `metrics.jsonl` always (one JSON object a line, as DINO/DeiT's log.txt), wandb
on rank 0 when `logger=wandb`."""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

from laplace.errors import UserError
from laplace.io import append_line, atomic_write


def wandb_run_id(run_dir: str | os.PathLike) -> str:
    """A W&B run id unique to the run directory and stable across resumes: its last component
    (readable) plus a hash of the whole absolute path, so that two stages of one experiment
    (deit3_in1k/vitb_12L_s0 and deit3_in1k_ft224/vitb_12L_s0) never share a W&B run."""
    path = str(Path(run_dir).resolve())
    readable = re.sub(r"[^A-Za-z0-9_-]", "-", Path(path).name)[:48]
    return f"{readable}-{hashlib.sha1(path.encode()).hexdigest()[:10]}"


class MetricsLogger:
    """Append metrics to <run_dir>/metrics.jsonl and optionally to wandb (rank 0 only).

    Args:
        run_dir: the run directory.
        enabled: False on ranks other than 0: every call is then a no-op.
        wandb_cfg: None, or the `logger` config with project / entity / mode / name / id.
        config: the resolved run config, sent to wandb.
        resume_step: on resume, lines logged after this step (written after the last
            checkpoint by the interrupted run) are dropped, so the file reads as one run.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True,
                 wandb_cfg: Optional[dict] = None, config: Optional[dict] = None,
                 resume_step: Optional[int] = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            kept = [json.dumps(r) for r in read_metrics(run_dir) if r.get("step", 0) <= resume_step]
            atomic_write(self.path, "".join(ln + "\n" for ln in kept).encode())
        if wandb_cfg:
            import wandb  # only when asked: wandb's import is slow

            os.environ.setdefault("WANDB_MODE", wandb_cfg.get("mode") or "offline")
            self.wandb = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                                    name=wandb_cfg.get("name") or Path(run_dir).name,
                                    id=wandb_cfg.get("id") or wandb_run_id(run_dir),
                                    resume="allow", dir=str(run_dir), config=config)

    def log(self, step: int, metrics: dict, **tags):
        if not self.enabled:
            return
        rec = {"step": step, **tags, **{k: _plain(v) for k, v in metrics.items()}}
        append_line(self.path, json.dumps(rec))
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of a run's metrics.jsonl.

    A torn last line (the process was killed mid-write) is skipped with a warning; a broken
    line anywhere else means the file was damaged and raises, naming the file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines()
    records = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            records.append(json.loads(ln))
        except json.JSONDecodeError:
            if i < len(lines):
                raise UserError(f"{path}:{i} is not a JSON line; repair or remove that line") from None
            print(f"[laplace] {path}:{i}: skipped a torn last line (a kill during a write)", file=sys.stderr)
    return records


def logged(run_dir: str | os.PathLike, split: str) -> list[dict]:
    """The records of one split ("train", "val") of a run's metrics.jsonl, oldest first; none
    before the first line is logged. What a trainer reads back at fit end for results.json."""
    if not (Path(run_dir) / "metrics.jsonl").exists():
        return []
    return [r for r in read_metrics(run_dir) if r.get("split") == split]


class _Tee:
    """A text stream that writes to `stream` and to an open log file (progress-bar redraws,
    which carry a carriage return, go to the terminal only)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, s: str) -> int:
        if "\r" not in s and self.log is not None:
            try:
                self.log.write(s)
            except OSError as e:  # a full disk: the copy stops, the run goes on (and its next
                self._lost(e)     # checkpoint or metrics line says which file in one line)
        return self.stream.write(s)

    def flush(self):
        if self.log is not None:
            try:
                self.log.flush()
            except OSError as e:
                self._lost(e)
        self.stream.flush()

    def _lost(self, e: OSError):
        name, self.log = self.log.name, None
        self.stream.write(f"[laplace] {name}: {e.strerror or e}; no longer copying the output there\n")

    def __getattr__(self, name):  # isatty, fileno, encoding, ... of the real stream
        return getattr(self.stream, name)


class RunLog:
    """Copy this process's stdout and stderr into <run_dir>/train.log (appending, so a resumed
    or requeued run continues the same file), until `close`.

    The file is line-buffered: a process that ends in os._exit (laplace.errors.hard_exit) has
    written every complete line. `exception` records a failure's traceback in the file.
    """

    def __init__(self, run_dir: str | os.PathLike):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(run_dir) / "train.log", "a", buffering=1)
        self.saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.file), _Tee(sys.stderr, self.file)

    def exception(self, e: BaseException):
        import traceback

        try:
            self.file.write("".join(traceback.format_exception(e)))
        except OSError:  # the disk that failed the run: the terminal still shows the error
            pass

    def close(self):
        sys.stdout, sys.stderr = self.saved
        try:
            self.file.close()
        except OSError:
            pass
