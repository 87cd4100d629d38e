"""Run logging: `metrics.jsonl` always (one JSON object a line, as DINO/DeiT's log.txt), wandb
on rank 0 when `logger=wandb`, `train.log` (rank 0's output), the progress bar of every loop, one
plain line per evaluation, and the evaluations' results sent to the W&B run of the training run
they evaluate (`log_to_training_run`)."""
import contextlib
import hashlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch
from omegaconf import OmegaConf

from laplace import model_label
from laplace.checkpoint import git
from laplace.errors import ConfigError, UserError
from laplace.io import atomic_write, write_json

from .rundir import append_line

WANDB_MODES = ("online", "offline", "disabled")
WANDB_RECORD = "wandb.json"  # <run_dir>/wandb.json: the W&B run of a training run (id, project, mode, ...)
# The run's logs of one record per step (and split): cut back to the checkpoint's step on resume,
# set aside on a fresh start (MetricsLogger). train/gpt.py appends samples.jsonl.
STEP_LOGS = ("metrics.jsonl", "samples.jsonl")


def git_commit() -> str | None:
    """HEAD's commit, "-dirty" when tracked files differ from it (a run of edited code); None outside a
    checkout: a record names the code it measured (runs' results.json and resume records, benchmarks)."""
    return git("describe", "--always", "--dirty") or None


def wandb_run_id(run_dir: str | os.PathLike) -> str:
    """A W&B run id unique to the run directory and stable across resumes."""
    path = str(Path(run_dir).resolve())
    # The last component for a reader, a hash of the whole path for uniqueness: two stages of one
    # experiment (deit3_in1k/vitb_12L_s0 and deit3_in1k_ft224/vitb_12L_s0) never share a W&B run.
    readable = re.sub(r"[^A-Za-z0-9_-]", "-", Path(path).name)[:48]
    return f"{readable}-{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def run_group(run_dir) -> str:
    """The experiment of a run directory (`<runs>/<trainer>/<experiment or data>/<run>`), so that a
    sweep's runs share it; an evaluation run `<run>/eval/<name>` belongs to its training run's."""
    p = Path(str(run_dir))
    return p.parent.parent.parent.name if p.parent.name == "eval" else p.parent.name


# Resolvers of the configs: `${run_group:${run_dir}}` (configs/logger/wandb.yaml) and
# `${model_label:${model}}`, the model's name with the node's own k (laplace.model_label).
OmegaConf.register_new_resolver("run_group", run_group, replace=True)
OmegaConf.register_new_resolver("model_label", model_label, replace=True)


def wandb_mode(configured: str | None) -> tuple[str, str]:
    """(the W&B mode, where it came from): logger.wandb.mode, else $WANDB_MODE, else online."""
    env = os.environ.get("WANDB_MODE")
    # The config wins: a stray `export WANDB_MODE=online` on a login node must not send an
    # offline recipe online. train.config's schema checked logger.wandb.mode against WANDB_MODES.
    if configured is not None:
        ignored = f"; WANDB_MODE={env} in the environment is ignored" if env and env != configured else ""
        return configured, f"logger.wandb.mode{ignored}"
    if not env:
        return "online", "wandb's default (logger.wandb.mode is null and WANDB_MODE unset)"
    mode = {"dryrun": "offline", "run": "online"}.get(env, env)  # wandb's older spellings
    if mode not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={env} (logger.wandb.mode is null): set it to one of "
                          f"{', '.join(WANDB_MODES)}, or set logger.wandb.mode")
    return mode, "WANDB_MODE (logger.wandb.mode is null)"


def read_wandb_record(run_dir) -> dict | None:
    """<run_dir>/wandb.json (what `MetricsLogger` wrote when the run started W&B), or None."""
    path = Path(run_dir) / WANDB_RECORD
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable ({e}); remove it to start a new W&B run") from None


def init_wandb(run_dir, cfg: dict, config: dict | None, source_hint: str = ""):
    """(wandb.init for the run in `run_dir`, its mode), with one line saying which mode and why;
    resume="allow" continues the run of the id."""
    import wandb  # only when asked: wandb's import is slow

    mode, source = wandb_mode(cfg.get("mode"))
    print(f"[laplace] wandb mode {mode} (from {source}{source_hint})", file=sys.stderr, flush=True)
    # The id given, else the one wandb.json recorded (a moved run directory keeps its W&B run).
    run_id = cfg.get("id") or (read_wandb_record(run_dir) or {}).get("id") or wandb_run_id(run_dir)
    tags = [str(t)[:64] for t in (cfg.get("tags") or [])]  # W&B refuses longer tags
    return wandb.init(project=cfg.get("project"), entity=cfg.get("entity"), id=run_id, resume="allow",
                      name=cfg.get("name") or Path(run_dir).name, group=cfg.get("group"), tags=tags or None,
                      mode=mode, dir=str(run_dir), config=config), mode


class LogWindow:
    """The steps since the last train record: their loss sum, how many, the units (images, tokens)
    they took and their seconds; saved in the checkpoint (`state_dict`, one per rank)."""
    # Why it is saved: a stop between two log steps (a signal, trainer.stop_after) would drop the
    # steps before it, and the first record after the resume would average only the steps since,
    # unlike the uninterrupted run's. Restored, the loss sum continues bit for bit; the clock
    # counts this process's seconds on top of the saved ones (timing fields differ, losses not).

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self, loss=None, steps: int = 0, units: int = 0, seconds: float = 0.0):
        # the sum stays on the device (no host sync per step) until a record reads it
        self.loss = torch.zeros((), device=self.device) if loss is None else loss.to(self.device)
        self.steps, self.units, self.saved_s = steps, units, seconds
        self.restart_clock()

    def add(self, loss: torch.Tensor, units: int):
        self.loss, self.steps, self.units = self.loss + loss, self.steps + 1, self.units + units

    def seconds(self) -> float:
        return self.saved_s + time.perf_counter() - self.start

    def restart_clock(self):
        """Time from now (the loop starts): set-up and a resume's restore are no step's time."""
        self.start = time.perf_counter()

    def state_dict(self) -> dict:
        # float32 as summed: the resumed sum is then the same bits as the uninterrupted one
        return {"loss": self.loss.detach().cpu(), "steps": self.steps, "units": self.units, "seconds": self.seconds()}

    def load_state_dict(self, states: list | None, rank: int, world_size: int):
        """This rank's window of a checkpoint's per-rank `states` (None: a checkpoint from before
        windows were saved: start empty). On another world size every rank takes the mean of the
        saved sums, which keeps the logged mean over ranks, though not to the last bit."""
        if not states:
            return self.reset()
        mine = states[rank] if len(states) == world_size else states[0]  # steps, units, seconds: equal on all
        loss = mine["loss"] if len(states) == world_size else torch.stack([s["loss"] for s in states]).mean()
        self.reset(loss, mine["steps"], mine["units"], mine["seconds"])


class MetricsLogger:
    """Append metrics to <run_dir>/metrics.jsonl and optionally to wandb (rank 0 only).

    Args:
        run_dir: the run directory.
        enabled: False on ranks other than 0: every call is then a no-op.
        wandb_cfg: None, or the `logger.wandb` config (project, entity, name, mode, group, tags, id).
        config: the resolved run config, sent to wandb.
        resume_step: on resume, the checkpoint's step (the logs are cut back to it, then a record
            {"step", "split": "resume", "commit"} added); None: a fresh start, which sets aside the
            logs of an earlier attempt (`set_aside_attempt`).
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, wandb_cfg: dict | None = None,
                 config: dict | None = None, resume_step: int | None = None):
        self.enabled, self.path, self.wandb = enabled, Path(run_dir) / "metrics.jsonl", None
        self.wandb_has = -1  # the last step W&B has: on resume, nothing up to it is sent again
        if not enabled:
            return
        before = read_wandb_record(run_dir)
        sent_before = before is not None and before.get("mode") != "disabled"  # W&B got this file's lines
        if resume_step is None:
            attempt = set_aside_attempt(run_dir)
            if attempt and sent_before and wandb_cfg and not wandb_cfg.get("id"):
                # The dead attempt's W&B run keeps its steps (W&B never takes a step back): this
                # run gets its own, so that its history is this run's only.
                wandb_cfg = {**wandb_cfg, "id": f"{wandb_run_id(run_dir)}-{attempt}"}
        else:
            # Lines logged after the checkpoint (by the interrupted run) go, so the file reads as
            # one run. W&B got those steps and keeps them (it drops a step lower than its last,
            # with a warning): steps up to the last one it was sent are not sent again.
            held = {name: cut_back(Path(run_dir) / name, resume_step) for name in STEP_LOGS}
            # the resume point and the code that goes on from it: a run's records say which stretches
            # ran on which commit (results.json's "resumes"); a fresh start adds no record
            append_line(self.path, json.dumps({"step": resume_step, "split": "resume", "commit": git_commit()}))
            if sent_before:
                self.wandb_has = max((r.get("step", 0) for r in held[self.path.name]), default=-1)
        if wandb_cfg:
            self.wandb, mode = init_wandb(run_dir, wandb_cfg, config)
            # What an evaluation of this run's checkpoints needs to find its W&B run again.
            where = {k: wandb_cfg.get(k) for k in ("project", "entity", "group")}
            write_json(Path(run_dir) / WANDB_RECORD, {"id": self.wandb.id, **where,
                                                      "tags": list(wandb_cfg.get("tags") or []), "mode": mode})

    def log(self, step: int, metrics: dict, **tags):
        if not self.enabled:
            return
        # tensors and numpy scalars as plain numbers
        rec = {"step": step, **tags, **{k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}}
        append_line(self.path, json.dumps(rec))
        if self.wandb is not None and step > self.wandb_has:
            self.wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


def cut_back(path: Path, step: int) -> list[dict]:
    """Drop the records after `step` from the log `path` (atomically); returns all it held."""
    if not path.exists():
        return []
    records = read_records(path)
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= step).encode())
    return records


def set_aside_attempt(run_dir: str | os.PathLike) -> int:
    """Rename the logs (and wandb.json) in `run_dir` to `<name>.<n>.old`, n = 1, 2, ... per attempt;
    returns n, or 0 when there was nothing to set aside."""
    # Called on a fresh start (no checkpoint to resume): logs there are an attempt's that died
    # before its first checkpoint (kill -9, OOM, a node failure). Appended to, every step would be
    # logged twice and "best" (results.json) would read the dead attempt's evaluations; deleted,
    # what that attempt saw (how far it got, its losses) would be lost for the post-mortem.
    run_dir = Path(run_dir)
    found = [run_dir / n for n in (*STEP_LOGS, WANDB_RECORD) if (run_dir / n).exists()]
    if not found:
        return 0
    taken = [p.name.split(".")[-2] for p in run_dir.glob("*.old")]  # earlier attempts' numbers
    n = 1 + max((int(t) for t in taken if t.isdigit()), default=0)
    for p in found:
        os.replace(p, p.with_name(f"{p.name}.{n}.old"))
    print(f"[laplace] run_dir: an earlier attempt wrote no checkpoint; its {', '.join(p.name for p in found)} "
          f"set aside as *.{n}.old", flush=True)
    return n


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of a run's metrics.jsonl (see read_records)."""
    return read_records(Path(run_dir) / "metrics.jsonl")


def read_records(path: Path) -> list[dict]:
    """All records of a JSON-lines log. A torn last line (the process was killed mid-write) is
    skipped with a warning; a broken line anywhere else means the file was damaged and raises."""
    lines = [(i, ln) for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    records = []
    for i, ln in lines:
        try:
            records.append(json.loads(ln))
        except json.JSONDecodeError:
            if i < lines[-1][0]:
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
        if "\r" not in s:
            self._copy(lambda: self.log.write(s))
        return self.stream.write(s)

    def flush(self):
        self._copy(lambda: self.log.flush())
        self.stream.flush()

    def _copy(self, fn):
        try:
            if self.log is not None:
                fn()
        except OSError as e:  # a full disk: the copy stops, the run goes on (and its next
            # checkpoint or metrics line says which file in one line)
            name, self.log = self.log.name, None
            self.stream.write(f"[laplace] {name}: {e.strerror or e}; no longer copying the output there\n")

    def __getattr__(self, name):  # isatty, fileno, encoding, ... of the real stream
        return getattr(self.stream, name)


class RunLog:
    """Copy this process's stdout and stderr into <run_dir>/train.log until `close`;
    `exception` records a failure's traceback in the file."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / "train.log"
        # Appending: a resumed or requeued run continues the same file. Line-buffered: a process
        # that ends in os._exit (laplace.errors.hard_exit) has written every complete line.
        self.file = open(self.path, "a", buffering=1)
        self.saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.file), _Tee(sys.stderr, self.file)

    def exception(self, e: BaseException):
        with contextlib.suppress(OSError):  # the disk that failed the run: the terminal still shows the error
            self.file.write("".join(traceback.format_exception(e)))

    def close(self):
        sys.stdout, sys.stderr = self.saved
        with contextlib.suppress(OSError):
            self.file.close()


# ---- what a user reads: progress and one line per evaluation --------------------------------

class _Lines:
    """A stream for tqdm where stderr is no terminal (a Slurm log, `> file`): each redraw becomes
    one plain line, so the log holds a line every `mininterval` seconds instead of carriage-return
    redraws glued onto one line. tqdm formats (rate, ETA, postfix); this only ends its lines."""

    def __init__(self, stream):
        self.stream, self.last = stream, None

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip()
        # tqdm's clears (spaces between two \r) and its closing newline carry no text; closing
        # redraws the last state, which the last update may have printed already
        if s and s != self.last:
            self.stream.write(s + "\n")
            self.last = s

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: int | None, enabled: bool = True, *, interval: float, desc: str | None = None,
                 initial: int = 0, unit: str = "it", leave: bool = True, iterable=None):
    """The progress bar of every loop (training, feature extraction, segmentation validation):
    tqdm's on a terminal; elsewhere (Slurm's log file) a plain line `desc n/total (p%) [elapsed<eta,
    rate]` at most every `interval` seconds (`logger.progress_interval`). `enabled` False (another
    rank, `progress=false`): a bar that shows nothing. With `iterable`, iterating the bar iterates it."""
    # tqdm rather than periodic prints of our own: it already times, rates and estimates; only
    # the carriage returns had to go (_Lines).
    from tqdm import tqdm

    kw = dict(total=total, initial=initial, unit=unit)
    if not enabled:
        return tqdm(iterable, disable=True, **kw)
    if sys.stderr.isatty():
        return tqdm(iterable, desc=desc, dynamic_ncols=True, leave=leave, **kw)
    fmt = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
    return tqdm(iterable, desc=f"[laplace] {desc or 'progress'}", file=_Lines(sys.stderr), mininterval=interval,
                maxinterval=interval, bar_format=fmt if total else None, leave=True, **kw)


def progress_interval(cfg) -> float:
    """`logger.progress_interval` of an entry config. Entry configs without a logger node
    (eval.knn, eval.linear) take the logger group's default file, configs/logger/jsonl.yaml,
    unless the command line adds `+logger.progress_interval=S`."""
    node = cfg.get("logger") or {}
    if node.get("progress_interval") is not None:
        return float(node["progress_interval"])
    from .cli import config_dir

    return float(OmegaConf.load(config_dir() / "logger" / "jsonl.yaml").progress_interval)


def format_metrics(step: int, metrics: dict) -> str:
    """`[laplace] step 120: val_loss=0.4321, val_acc1=81.2500` (floats with 4 decimals)."""
    parts = [f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()]
    return f"[laplace] step {step}: " + ", ".join(parts)


# ---- evaluations and analyses into the training run's W&B run ------------------------------

def log_to_training_run(checkpoint, results: dict, prefix: str) -> str | None:
    """Put an evaluation's numbers (`results`, nested dicts flattened to `<prefix>/a/b`) into the
    summary of the W&B run of the training run that wrote `checkpoint`, when that run used W&B
    (its <run>/wandb.json; otherwise nothing happens and wandb is not imported). A checkpoint
    other than last.pt adds its name: `knn@step_1000/top1`. Returns the W&B run id, or None."""
    # The mode is the training run's (its logger.wandb.mode; WANDB_MODE only where that was null).
    # Online, wandb.init(id=..., resume="allow") continues the run itself. Offline, wandb 0.31 does
    # not resume: it writes another offline folder with the same id under <run>/wandb/, which
    # `wandb sync <run>/wandb/offline-run-*` uploads into the same W&B run after the run's own
    # (it syncs a run's folders in order of start time).
    import pandas as pd

    from laplace.checkpoint import run_dir_of

    run_dir = run_dir_of(checkpoint)
    rec = read_wandb_record(run_dir)
    if rec is None or rec.get("mode") == "disabled":
        return None
    stem = Path(checkpoint).stem
    key = prefix if stem == "last" else f"{prefix}@{stem}"
    # Nested keys joined by "/"; numbers only (W&B's summary takes no lists, and a bool is no metric).
    flat = {f"{key}/{k}": v for k, v in pd.json_normalize(results, sep="/").to_dict("records")[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
    run, _ = init_wandb(run_dir, rec, None, source_hint=f", the training run's, recorded in {run_dir / WANDB_RECORD}")
    run.summary.update(flat)
    run.finish()
    print(f"[laplace] {len(flat)} result(s) {prefix}/... logged to W&B run {rec['id']} ({run_dir})", flush=True)
    return rec["id"]
