"""The trainers, selected by `trainer.name` (deit3 | gpt | module:Class), on one shared engine."""
from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from laplace.errors import ConfigError
from laplace.rundir import MAX_NAME, RunDirLock, check_writable, short_name  # noqa: F401  (MAX_NAME: train.MAX_NAME)

# name -> "module:Class", imported lazily (each trainer pulls its own data stack). A trainer
# outside this table is named by its import path: trainer.name=my_pkg.my_module:MyTrainer.
TRAINERS = {"deit3": "train.supervised:SupervisedTrainer", "gpt": "train.gpt:GPTTrainer",
            "seg_linear": "eval.segmentation:SegLinearTrainer",
            "dino": "train.dino:DINOTrainer"}

# Config keys that say how a run executes, not what it trains: they do not change the run
# directory's name (more workers or another logger must resume the same run) and a resume
# does not compare them with the checkpoint's config.
EXECUTION_KEYS = ("run_dir", "paths.", "logger", "hydra.", "data.root", "data.tokenizer", "data.cache_dir", "data.download",
                  "trainer.device", "trainer.num_workers", "trainer.progress", "trainer.stop_after",
                  "trainer.log_every", "trainer.eval_every", "trainer.ckpt_every", "trainer.keep_every",
                  "trainer.micro_batch_size", "trainer.amp", "trainer.compile", "trainer.resume")


def get_trainer(name: str):
    """The Trainer class for `trainer.name`."""
    target = TRAINERS.get(name, name if ":" in name else None)
    if target is None:
        raise ConfigError(f"trainer.name={name!r} is not a trainer; choose one of: {', '.join(TRAINERS)} "
                          f"(or give module:Class)")
    module, cls = target.split(":", 1)
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        if name in TRAINERS:
            raise  # our own trainer failing to import is a bug: keep the traceback
        raise ConfigError(f"trainer.name={name!r}: cannot import it ({e})") from None
    from .engine import Trainer

    if not (isinstance(found, type) and issubclass(found, Trainer)):
        raise ConfigError(f"trainer.name={name!r} is {type(found).__name__} {found!r}, not a subclass of "
                          f"train.engine.Trainer; choose one of: {', '.join(TRAINERS)} (or your own module:Class)")
    return found


# Engine keys that count steps: null where the config allows it (a default), else these minima.
STEP_KEYS = {"max_steps": 1, "epochs": 1, "log_every": 1, "eval_every": 1, "ckpt_every": 1, "keep_every": 1,
             "stop_after": 1}


def check_engine_config(cls, cfg: DictConfig):
    """One-line errors for engine settings no trainer can run with (before anything is built)."""
    for key, least in STEP_KEYS.items():
        value = cfg.trainer.get(key)
        if value is None and key != "log_every":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            default = " (or null for the default)" if key != "log_every" else ""
            raise ConfigError(f"trainer.{key}={value}: give a whole number >= {least}{default}")
    from .engine import Trainer

    if cfg.optim.get("name") == "muon" and cls.configure_optimizers is Trainer.configure_optimizers:
        raise ConfigError(f"optim=muon splits a GPT's parameters between Muon and AdamW; trainer={cfg.trainer.name} "
                          f"builds one optimizer from optim: use optim=adamw (or optim=lamb)")


def run_dir_from_overrides(cfg: DictConfig, overrides: list[str]) -> str:
    """<runs_dir>/<trainer>/<experiment or data>/<model>_s<seed>[_<other overrides>].

    A name longer than MAX_NAME keeps its readable start and ends in a hash of the whole,
    so it stays unique and the same command finds the same directory again."""
    keep = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in ("model", "data", "trainer", "seed", "experiment") or key.startswith(EXECUTION_KEYS):
            continue
        keep.append(re.sub(r"[^A-Za-z0-9_.,=+-]", "-", o))
    exp = next((o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")), None)
    name = f"{cfg.model.name}_s{cfg.seed}" + ("_" + ",".join(sorted(keep)) if keep else "")
    name = short_name(name, MAX_NAME)
    trainer = re.sub(r"[^A-Za-z0-9_.-]", "-", cfg.trainer.name)
    return str(Path(cfg.paths.runs_dir) / trainer / (exp or cfg.data.name) / name)


def run(cfg: DictConfig) -> dict:
    """Train with a composed config (also the entry used by tests and sweeps)."""
    from laplace import dist

    from .logger import RunLog
    from .signals import Preempted, StopRequest

    cls = get_trainer(cfg.trainer.name)
    check_engine_config(cls, cfg)
    cls.check_config(cfg)  # before anything resolves: wrong combinations get one line
    # Rank 0 (torchrun's RANK, srun's SLURM_PROCID) copies its output into the run directory.
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)) or 0)
    # One run per directory, for the run's life: before anything reads or writes in it.
    if rank == 0:  # a read-only or full run directory: one line now, not after the first epoch
        check_writable(cfg.run_dir, "run_dir")
    lock = RunDirLock(cfg.run_dir).acquire() if rank == 0 else None
    log = RunLog(cfg.run_dir) if rank == 0 else None
    try:
        # Signal handlers from the start: a preemption warning during set-up (data, compile)
        # is kept and honoured after the first step instead of killing the process.
        with StopRequest() as stop:
            trainer = cls(cfg).setup()  # before config.yaml: set-up completes the config (tokenizer)
            if trainer.dist.is_main:
                OmegaConf.save(cfg, Path(cfg.run_dir) / "config.yaml", resolve=True)
            metrics = trainer.fit(stop)
    except BaseException as e:
        if log is not None and not isinstance(e, Preempted):
            log.exception(e)  # the whole traceback, also when the terminal shows one line
        raise
    finally:
        if log is not None:
            log.close()
        if lock is not None:
            lock.release()
    # Only after success: after a failure a peer may be gone, and tearing the group down
    # could wait for it (the command line exits at once instead, see laplace.errors).
    dist.cleanup()
    return metrics
