"""One checkpoint format for every trainer, eval and analysis.

A checkpoint is plain data, loadable with `torch.load(weights_only=True)`:

    {"format": "laplace-checkpoint", "version": 1,
     "model": state dict (no `_orig_mod.` / `module.` prefixes),
     "optimizer": optimizer state dict or None,
     "loop": {"step", "epoch", "micro_in_epoch", ...}   # where the data loop stands
     "rng": [per-rank RNG states],                        # python, numpy, torch, cuda
     "config": the resolved run config as a plain dict,
     "git_rev": the code revision that wrote it}

Writes are atomic (temp file in the same folder, fsync, rename), so a kill during a save never
leaves a broken `last.pt`. `load_model(path)` rebuilds the model from the checkpoint alone.
"""
from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn

FORMAT = "laplace-checkpoint"
VERSION = 1
_PREFIXES = ("_orig_mod.", "module.")


class CheckpointError(ValueError):
    """A file that is not a laplace checkpoint, or is truncated / corrupt."""


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def clean_state_dict(sd: dict) -> dict:
    """Strip compile / DDP prefixes so keys match the bare model."""
    out = {}
    for k, v in sd.items():
        for p in _PREFIXES:
            k = k.replace(p, "")
        out[k] = v
    return out


def git_revision() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def rng_state() -> dict:
    """This process's RNG states as plain tensors / tuples (weights_only-safe)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike, *, model: nn.Module, config: dict,
                    optimizer: Optional[torch.optim.Optimizer] = None,
                    loop: Optional[dict] = None, rng: Optional[list] = None,
                    extra: Optional[dict] = None) -> Path:
    """Write a checkpoint atomically. Call on one rank only (the states are gathered)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT, "version": VERSION,
        "model": clean_state_dict(unwrap(model).state_dict()),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "loop": dict(loop or {}),
        "rng": rng,
        "config": config,
        "git_rev": git_revision(),
        **(extra or {}),
    }
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new file
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Read and validate a checkpoint; a foreign or corrupt file raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for truncated / foreign pickles
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt, truncated or "
                              f"not saved by laplace): {first[:200]}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a laplace checkpoint (no format={FORMAT!r} tag); "
                              f"for timm weights use laplace.vit.load_timm_state_dict")
    if ckpt.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has checkpoint version {ckpt['version']}, newer than this "
                              f"code ({VERSION}); update laplace")
    return ckpt


def model_kwargs(config: dict) -> dict:
    """The `create_model` arguments recorded in a run config's `model` node."""
    return {k: v for k, v in config["model"].items()}


def load_model(path: str | os.PathLike, map_location: Any = "cpu", eval_mode: bool = True,
               **overrides) -> nn.Module:
    """Rebuild the model of a checkpoint from the checkpoint alone and load its weights strictly.

    `overrides` change constructor arguments that do not alter the weights' shapes
    (e.g. fused_attn=False for attention maps, drop_path_rate=0.0).
    """
    from .zoo import create_model  # late import: zoo imports models, models need no checkpoint

    ckpt = load_checkpoint(path, map_location)
    kwargs = model_kwargs(ckpt["config"])
    kwargs.update(overrides)
    model = create_model(**kwargs)
    try:
        model.load_state_dict(ckpt["model"], strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match model {kwargs['name']!r}: "
                              f"{str(e).splitlines()[0]}") from None
    model.to(map_location if isinstance(map_location, (str, torch.device)) else "cpu")
    return model.eval() if eval_mode else model
