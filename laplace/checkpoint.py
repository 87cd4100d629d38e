"""One checkpoint format for every trainer, eval and analysis.

A checkpoint is plain data, loadable with `torch.load(weights_only=True)`:

    {"format": "laplace-checkpoint", "version": 2,
     "model": state dict of the network `load_model` rebuilds (no `_orig_mod.` / `module.`
              prefixes): the trained model, or what its trainer exports (DINO: the teacher
              backbone),
     "config": the resolved run config as a plain dict (its `model` node describes "model"),
     "git_rev": the code revision that wrote it,
     # written by the training engine, for exact resume:
     "train_model": state dict of the trained module when it is not "model" itself
              (DINO: student, EMA teacher and the loss centre),
     "optimizer": {name: optimizer state dict},
     "loop": {"step", "feed": the data position, "world_size"},
     "rng": [per-rank RNG states]}

Writes are atomic (temp file in the same folder, fsync, rename), so a kill during a save never
leaves a broken `last.pt`; the temp file of a killed writer is removed by the next save.
`load_model(path)` rebuilds the model from the checkpoint alone; `load_pretrained` loads a
checkpoint or a timm / DeiT state dict into a model for fine-tuning.
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

from .errors import UserError, name_storage_error

FORMAT = "laplace-checkpoint"
VERSION = 2
_PREFIXES = ("_orig_mod.", "module.")


class CheckpointError(UserError, ValueError):
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


def _plain_state(obj):
    """Optimizers (one, or a {name: optimizer} dict) as state dicts; anything else as it is."""
    if isinstance(obj, torch.optim.Optimizer):
        return obj.state_dict()
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.optim.Optimizer) for v in obj.values()):
        return {k: v.state_dict() for k, v in obj.items()}
    return obj


def save_checkpoint(path: str | os.PathLike, *, model: nn.Module, config: dict, **entries) -> Path:
    """Write a checkpoint atomically. Call on one rank only (gather per-rank states first).

    Args:
        path: the file to (over)write.
        model: the network `load_model` must rebuild (wrappers are removed).
        config: the resolved run config as a plain dict (with the `model` node).
        **entries: plain data stored beside it (optimizer: an optimizer or {name: optimizer}
            is stored as state dicts; loop, rng, trainer, ...).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION,
               "model": clean_state_dict(unwrap(model).state_dict()), "config": config,
               "git_rev": git_revision(), **{k: _plain_state(v) for k, v in entries.items()}}
    # A writer killed mid-save (SIGKILL, node failure) leaves its full-size temp file behind:
    # one writer per run directory, so any temp file of this name is stale.
    for stale in path.parent.glob(f".{path.name}.tmp*"):
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new file
    except BaseException as e:
        name_storage_error(e, path)
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def resume_candidates(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints a run can resume from, best first: last.pt, then step_<N>.pt newest first."""
    ckpt_dir = Path(ckpt_dir)
    steps = sorted(ckpt_dir.glob("step_*.pt"),
                   key=lambda p: int(p.stem[5:]) if p.stem[5:].isdigit() else -1, reverse=True)
    return [p for p in [ckpt_dir / "last.pt", *steps] if p.is_file()]


def _read(path: Path, what: str, map_location: Any = "cpu") -> Any:
    """torch.load(weights_only=True) (or safetensors), every failure as one CheckpointError line."""
    if not path.is_file():
        raise CheckpointError(f"no {what} at {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device=str(map_location))
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for truncated / foreign pickles
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path} is not a readable {what} (corrupt, truncated or not "
                              f"saved by laplace / timm): {first[:200]}") from None


def _validate(ckpt, path: Path) -> dict:
    if ckpt.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has checkpoint version {ckpt['version']}, newer than this "
                              f"code ({VERSION}); update laplace")
    if not isinstance(ckpt.get("config"), dict):
        _incomplete(path, "config")
    if not isinstance(ckpt.get("model"), dict):
        _incomplete(path, "model weights")
    return ckpt


def _incomplete(path, part: str):
    raise CheckpointError(f"{path} is a laplace checkpoint without its {part}, so its model cannot be "
                          f"rebuilt; use the run's ckpt/last.pt as the trainer wrote it (or re-save with "
                          f"laplace.checkpoint.save_checkpoint(path, model=..., config=<the run's config>))")


def _model_node(ckpt: dict, path) -> dict:
    node = ckpt["config"].get("model")
    if not (isinstance(node, dict) and node.get("name")):
        _incomplete(path, "config.model (the model's name and shape)")
    return node


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Read and validate a checkpoint; a foreign or corrupt file raises CheckpointError."""
    path = Path(path)
    ckpt = _read(path, "checkpoint", map_location)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a laplace checkpoint (no format={FORMAT!r} tag); "
                              f"for timm weights use laplace.vit.load_timm_state_dict")
    return _validate(ckpt, path)


def load_weights(path: str | os.PathLike) -> tuple[dict, Optional[dict]]:
    """(state dict, model node or None) of a laplace checkpoint or a timm / DeiT weights file
    (.pth, .bin, .safetensors; DeiT's `{"model": ...}` with `gamma_1`/`gamma_2` LayerScale
    names too): what fine-tuning (`trainer.init_from`) starts from."""
    path = Path(path)
    obj = _read(path, "weights file")
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return _validate(obj, path)["model"], _model_node(obj, path)
    sd = obj
    for key in ("model", "state_dict"):  # DeiT's main.py saves {"model": ..., "optimizer": ...}
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not (isinstance(sd, dict) and sd and all(torch.is_tensor(v) for v in sd.values())):
        raise CheckpointError(f"{path} holds no state dict (expected a laplace checkpoint, a "
                              f"timm state dict or DeiT's {{'model': state_dict}})")
    # DeiT's own models name LayerScale `gamma_1`/`gamma_2`; timm (and we) say `ls1.gamma`.
    return {k.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma"): v
            for k, v in clean_state_dict(sd).items()}, None


def model_from_checkpoint(ckpt: dict, device: Any = "cpu", eval_mode: bool = True,
                          **overrides) -> nn.Module:
    """Build the model recorded in a loaded checkpoint and load its weights strictly.

    `overrides` change constructor arguments that do not alter the weights' shapes
    (e.g. fused_attn=False for attention maps, drop_path_rate=0.0).
    """
    from .zoo import create_model  # late import: zoo imports models, models need no checkpoint

    kwargs = {**_model_node(ckpt, ckpt.get("path", "the checkpoint")), **overrides}
    model = create_model(**kwargs)
    try:
        model.load_state_dict(ckpt["model"], strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"weights do not match model {kwargs['name']!r}: "
                              f"{str(e).splitlines()[0]}") from None
    model.to(device)
    return model.eval() if eval_mode else model


def load_model(path: str | os.PathLike, map_location: Any = "cpu", eval_mode: bool = True,
               **overrides) -> nn.Module:
    """Rebuild the model of a checkpoint from the checkpoint alone (see model_from_checkpoint)."""
    return model_from_checkpoint(load_checkpoint(path), map_location, eval_mode, **overrides)


_HEADS = ("head.", "lm_head.")  # the classifier of a ViT, the output layer of a GPT


def load_pretrained(model: nn.Module, path: str | os.PathLike, model_cfg, head: str = "auto") -> str:
    """Load pre-trained weights into a freshly built zoo model (fine-tuning, `trainer.init_from`);
    returns a one-line summary.

    All tensors load strictly except two: a ViT's position embedding is resampled (bicubic)
    when the patch grid differs, and the head (`head.` / `lm_head.`) is kept only when its
    shape fits the model and `head="auto"`; otherwise it keeps its fresh initialisation.

    Args:
        model: the freshly built model.
        path: a laplace checkpoint, or (ViT) a timm / DeiT-III state dict file.
        model_cfg: the run's `model` node (its Laplacian heads must match a laplace checkpoint's).
        head: "auto" keeps the loaded head when its shape fits the model, "reset" never does.
    """
    from .errors import ConfigError
    from .vit import VisionTransformer, load_timm_state_dict

    if head not in ("auto", "reset"):
        raise ConfigError(f"trainer.init_head={head!r}: choose auto or reset")
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"trainer.init_from: no file at {path}")
    try:
        sd, src_cfg = load_weights(path)
    except CheckpointError as e:  # name the config key that pointed at the file
        raise CheckpointError(f"trainer.init_from: {e}") from None
    if src_cfg is not None:
        got = (src_cfg.get("num_laplacian_heads"), src_cfg.get("laplacian_mode", "fixed"))
        k = model_cfg.num_laplacian_heads
        want = (k if isinstance(k, int) else list(k), model_cfg.laplacian_mode)
        if got != want:  # Laplacian heads add no parameters: a mismatch would load silently
            raise CheckpointError(f"{path} was trained as {src_cfg['name']} ({got[0]} {got[1]} "
                                  f"Laplacian heads) but the model is {model_cfg.name} ({want[0]} "
                                  f"{want[1]}); fine-tune each model from its own pre-training")
    own = model.state_dict()
    for k in [k for k in sd if k.startswith(_HEADS) and k not in own]:
        del sd[k]  # the checkpoint has a head, the model (num_classes=0) does not
    head_keys = [k for k in own if k.startswith(_HEADS)]
    fits = all(k in sd and sd[k].shape == own[k].shape for k in head_keys)
    reset = bool(head_keys) and (head == "reset" or not fits)
    if reset:
        sd.update({k: own[k] for k in head_keys})  # keep the fresh initialisation
    try:
        if isinstance(model, VisionTransformer):
            load_timm_state_dict(model, sd)  # strict; resamples pos_embed to the model's grid
        else:
            model.load_state_dict(sd, strict=True)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"trainer.init_from: {path} does not fit model {model_cfg.name}: "
                              f"{' '.join(str(e).split())[:300]}") from None
    kind = "laplace checkpoint" if src_cfg is not None else "timm/DeiT state dict"
    return f"initialised from {kind} {path}" + ("; head re-initialised" if reset else "; head loaded")
