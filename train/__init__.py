"""The trainers, selected by `trainer.name` (deit3 | gpt | dino | seg_linear | module:Class), on one
shared engine (train/engine.py); `run(cfg)` trains with a composed config (train.py's entry)."""
import os
import pkgutil
import re
import shutil
from contextlib import suppress
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from laplace import model_defaults, model_label, schema
from laplace.errors import ConfigError, UserError
from laplace.io import atomic_write

from . import dist
from .config import TrainConfig, check_required
from .logger import RunLog  # (importing it registers ${run_group:...} before Hydra resolves the config)
from .rundir import EXECUTION_KEYS, MAX_NAME, RunDirLock, check_writable, short_name
from .signals import Preempted, StopRequest

# name -> "module:Class", imported lazily (each trainer pulls its own data stack). A trainer
# outside this table is named by its import path: trainer.name=my_pkg.my_module:MyTrainer.
# Only the loop's own trainers: a floor above (eval) builds on the engine but is not named here.
TRAINERS = {"deit3": "train.deit3:DeiT3Trainer", "gpt": "train.gpt:GPTTrainer",
            "seg_linear": "train.seg_linear:SegLinearTrainer",
            "dino": "train.dino:DINOTrainer", "lora": "train.lora:LoRATrainer"}
ARCH_NAMES = {"vit": "ViT", "gpt": "GPT"}


def get_trainer(name: str):
    """The Trainer class for `trainer.name`."""
    target = TRAINERS.get(name, name if ":" in name else None)
    if target is None:
        raise ConfigError(f"trainer.name={name!r} is not a trainer; choose one of: {', '.join(TRAINERS)} "
                          f"(or give module:Class)")
    try:
        found = pkgutil.resolve_name(target)
    except (ImportError, AttributeError, ValueError) as e:
        if name in TRAINERS:
            raise  # our own trainer failing to import is a bug: keep the traceback
        raise ConfigError(f"trainer.name={name!r}: cannot import it ({e})") from None
    from .engine import Trainer

    if not (isinstance(found, type) and issubclass(found, Trainer)):
        raise ConfigError(f"trainer.name={name!r} is {type(found).__name__} {found!r}, not a subclass of "
                          f"train.engine.Trainer; choose one of: {', '.join(TRAINERS)} (or your own module:Class)")
    return found


def check_engine_config(cls, cfg: DictConfig):
    """Every check a run makes before anything is built, one line for the first that fails: a
    mandatory value left unset, a model or data the trainer does not take (before anything
    resolves, so an interpolation the wrong data node lacks is never reached), engine settings no
    trainer can run with, then any value of the schema's (train/config.py) out of its range."""
    check_required(cfg)  # a `???` left unset: one line now, not a traceback after the data is built
    arch = model_defaults(cfg.model.name)["arch"]  # the zoo's one-line error if unknown
    modality, name = cfg.data.get("modality"), cfg.trainer.name
    if cls.modality and modality and modality != cls.modality:  # a node without one: trusted
        raise ConfigError(f"data={cfg.data.name} holds {modality} data but trainer={name} "
                          f"trains on {cls.modality}; {_fitting(modality=modality)}")
    if cls.archs and arch not in cls.archs:
        raise ConfigError(f"model={model_label(cfg.model)} is a {ARCH_NAMES[arch]} but trainer={name} trains "
                          f"{'/'.join(ARCH_NAMES[a] for a in cls.archs)}s; {_fitting(arch=arch)}")
    if cfg.optim.get("name") == "muon" and arch != "gpt":  # train.optim.build_muon_adamw routes a GPT's parameters
        raise ConfigError(f"optim=muon splits a GPT's parameters between Muon and AdamW; model={model_label(cfg.model)} "
                          f"is a {ARCH_NAMES[arch]}: use optim=adamw (or optim=lamb)")
    schema.check_config(cfg, TrainConfig)  # reliability: types, ranges and choices, declared once


def _fitting(arch: str | None = None, modality: str | None = None) -> str:
    """'use trainer=X (e.g. ...)' for the registered trainers that accept this model / data."""
    fits = []
    for name in TRAINERS:
        cls = get_trainer(name)
        if (arch is None or arch in cls.archs) and (modality is None or modality == cls.modality):
            fits.append(f"trainer={name} (e.g. {cls.example})" if cls.example else f"trainer={name}")
    return f"use {' or '.join(fits)}" if fits else "no trainer here fits it"


def run_dir_from_overrides(cfg: DictConfig, overrides: list[str]) -> str:
    """<runs_dir>/<trainer>/<experiment or data>/<model label>_s<seed>[_<other overrides>], each
    override's `=` (and any character but letters, digits and _ . + -) a `-`: a path that every
    command line takes unquoted (Hydra's grammar refuses `=`, `,` and `~` in a value).

    A name longer than MAX_NAME keeps its readable start and ends in a hash of the whole,
    so it stays unique and the same command finds the same directory again. The name is made of
    the values (the label reads k): `run` checks them first."""
    # Left out: what the folders and the label say (k among it) and how the run executes.
    named = ("model", "data", "trainer", "seed", "experiment", "model.num_laplacian_heads")
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    keep = [o for o, key in zip(overrides, keys) if key not in named and not key.startswith(EXECUTION_KEYS)]
    exp = next((o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")), None)
    # shape=False: the folder named as before the label said a ViT's shape, so old runs resume
    base = f"{model_label(cfg.model, shape=False)}_s{cfg.seed}"
    name = short_name("_".join([base, *sorted(re.sub(r"[^A-Za-z0-9_.+-]", "-", o) for o in keep)]), MAX_NAME, "-")
    trainer = re.sub(r"[^A-Za-z0-9_.-]", "-", cfg.trainer.name)
    folder = Path(cfg.paths.runs_dir) / trainer / (exp or cfg.data.name)
    # Until this rule, names kept `=` and `,` (and `~` before the hash): the same command still
    # finds, and so resumes, a run it named so.
    old = short_name(base + ("_" + ",".join(sorted(re.sub(r"[^A-Za-z0-9_.,=+-]", "-", o) for o in keep)) if keep
                             else ""), MAX_NAME)
    return str(folder / (old if (folder / old).is_dir() and not (folder / name).exists() else name))


def _remove_fresh(run_dir: Path, created: Path):
    """A fresh run refused before it started leaves no folder behind: its lock and log go, and the
    folders it created (up to `created`) while they hold nothing else (a sweep's sibling run)."""
    if {p.name for p in run_dir.iterdir()} <= {".lock", "train.log"}:
        shutil.rmtree(run_dir)
        with suppress(OSError):  # a folder not empty holds another run too: it stays
            for folder in run_dir.parents[:len(run_dir.parents) - len(created.parents)]:
                folder.rmdir()


def run(cfg: DictConfig, overrides: list[str] = ()) -> dict:
    """Train with a composed config (train.py's entry, also tests' and sweeps'); a null `run_dir` is
    named from the command line's `overrides`."""
    cls = get_trainer(cfg.trainer.name)
    check_engine_config(cls, cfg)  # before anything resolves: bad values get one line
    if cfg.run_dir is None:
        with open_dict(cfg):
            cfg.run_dir = run_dir_from_overrides(cfg, list(overrides))
    # Rank 0 (torchrun's RANK, srun's SLURM_PROCID) copies its output into the run directory.
    main = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)) or 0) == 0
    run_dir = Path(cfg.run_dir)
    created = next((p for p in [*reversed(run_dir.parents), run_dir] if not p.exists()), None)  # its first new folder
    if main:  # a read-only or full run directory: one line now, not after the first epoch
        check_writable(run_dir, "run_dir")
    # One run per directory, for the run's life: before anything reads or writes in it.
    lock = RunDirLock(run_dir).acquire() if main else None
    log = RunLog(run_dir) if main else None
    started = refused = False
    try:
        # Signal handlers from the start: a preemption warning during set-up (data, compile)
        # is kept and honoured after the first step instead of killing the process.
        with StopRequest() as stop:
            trainer = cls(cfg).setup()  # before config.yaml: set-up completes the config (tokenizer)
            started = True
            if trainer.dist.is_main:
                atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode())
            metrics = trainer.fit(stop)
    except BaseException as e:
        # Refused before it started: a bad value, data that is not there, a checkpoint that does not fit.
        refused = isinstance(e, UserError) and not started
        if log is not None and not isinstance(e, Preempted):
            log.exception(e)  # the whole traceback, also when the terminal shows one line
        lost = dist.lost_peer(e) if isinstance(e, Exception) else None
        if lost is not None:  # a rank is gone: say which, not gloo's or NCCL's traceback
            raise lost from e
        raise
    finally:
        if log is not None:
            log.close()
        if lock is not None:
            lock.release()
        if refused and created is not None and lock is not None:
            _remove_fresh(run_dir, created)
    # Only after success: after a failure a peer may be gone, and tearing the group down
    # could wait for it (the command line exits at once instead, see laplace.errors).
    dist.cleanup()
    return metrics
