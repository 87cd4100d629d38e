"""The three trainers, selected by `trainer=` (deit3 | gpt | dino), on one shared engine."""
from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def get_trainer(name: str):
    """The Trainer class for `trainer.name` (imported lazily: each pulls its own data stack)."""
    if name == "deit3":
        from .supervised import SupervisedTrainer

        return SupervisedTrainer
    if name == "gpt":
        from .gpt import GPTTrainer

        return GPTTrainer
    raise ValueError(f"trainer={name!r} is not available; choose one of: deit3, gpt")


# Overrides that do not change what is trained, so they do not change the run directory
# (running with more workers or another logger must resume the same run).
_NAME_IGNORES = ("run_dir", "paths.", "logger", "data.root", "data.cache_dir", "data.download",
                 "trainer.device", "trainer.num_workers",
                 "trainer.progress", "trainer.stop_after", "trainer.log_every", "hydra.")


def run_dir_from_overrides(cfg: DictConfig, overrides: list[str]) -> str:
    """<runs_dir>/<trainer>/<experiment or data>/<model>_s<seed>[_<other overrides>]."""
    keep = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in ("model", "data", "trainer", "seed", "experiment") or key.startswith(_NAME_IGNORES):
            continue
        keep.append(re.sub(r"[^A-Za-z0-9_.,=+-]", "-", o))
    exp = next((o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")), None)
    name = f"{cfg.model.name}_s{cfg.seed}" + ("_" + ",".join(sorted(keep)) if keep else "")
    return str(Path(cfg.paths.runs_dir) / cfg.trainer.name / (exp or cfg.data.name) / name)


def run(cfg: DictConfig) -> dict:
    """Train with a composed config (also the entry used by tests and sweeps)."""
    from laplace import dist

    trainer = get_trainer(cfg.trainer.name)(cfg)
    if trainer.dist.is_main:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, Path(cfg.run_dir) / "config.yaml", resolve=True)
    try:
        return trainer.fit()
    finally:
        dist.cleanup()
