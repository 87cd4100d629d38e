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
     "rng": [per-rank RNG states: Python, NumPy, torch's CPU and the rank's own CUDA device]}

Writes go through `laplace.io.atomic_write` (temp file in the same folder, fsync, rename, folder
fsync), so a kill during a save never leaves a broken `last.pt`; the temp file of a killed
writer is removed by the next save. A resume reads memory-mapped (`load_checkpoint(mmap=True)`).
`load_model(path)` rebuilds the model from the checkpoint alone, or from a folder that
`python -m laplace.export` wrote (config.json + model.safetensors); `load_pretrained` loads a
checkpoint or a timm / DeiT state dict into a model for fine-tuning.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn
from timm.models import clean_state_dict  # strips DDP's `module.` and torch.compile's `_orig_mod.`
from timm.utils import unwrap_model as unwrap  # the plain module under DDP and torch.compile, in any order

from .errors import ConfigError, UserError, one_line
from .io import atomic_write
from .zoo import model_label

FORMAT = "laplace-checkpoint"
VERSION = 2


class CheckpointError(UserError, ValueError):
    """A file that is not a laplace checkpoint, or is truncated / corrupt."""


def git_revision() -> str:
    # The code that wrote a checkpoint, so that a result can be traced to it ("unknown" outside git)
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def rng_state() -> dict:
    """This process's RNG states as plain tensors / tuples (weights_only-safe)."""
    # NumPy's key array as an int64 tensor: weights_only=True loads tensors and plain Python
    # types, never ndarrays (a checkpoint must not need unpickling arbitrary classes)
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This process's device only: a resume may see another number of GPUs (one per task
        # under Slurm's --gpus-per-task, all of the node under torchrun).
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, (list, tuple)):  # laplace before 2026-12-01: every visible device's state
        i = torch.cuda.current_device() if torch.cuda.is_available() else 0
        cuda = cuda[i] if i < len(cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _plain_state(obj):
    """Optimizers (one, or a {name: optimizer} dict) as state dicts; anything else as it is."""
    # state dicts, not the objects: a pickled optimizer class would need weights_only=False
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
    payload = {"format": FORMAT, "version": VERSION,
               "model": clean_state_dict(unwrap(model).state_dict()), "config": config,
               "git_rev": git_revision(), **{k: _plain_state(v) for k, v in entries.items()}}
    # One writer per run directory: a temp file beside `path` is a killed writer's (SIGKILL, node
    # failure), full size, and goes first.
    return atomic_write(path, lambda f: torch.save(payload, f), sole_writer=True)


def resume_candidates(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints a run can resume from, best first: last.pt, then step_<N>.pt newest first."""
    ckpt_dir = Path(ckpt_dir)
    # A torn last.pt (a full disk, a kill the atomic write did not cover) falls back to the newest
    # kept step_<N>.pt; a name that is not step_<number>.pt sorts last.
    steps = sorted(ckpt_dir.glob("step_*.pt"),
                   key=lambda p: int(p.stem[5:]) if p.stem[5:].isdigit() else -1, reverse=True)
    return [p for p in [ckpt_dir / "last.pt", *steps] if p.is_file()]


def _read(path: Path, what: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """torch.load(weights_only=True) (or safetensors), every failure as one CheckpointError line.
    mmap: the file's tensors stay mapped (see load_checkpoint)."""
    if not path.is_file():
        raise CheckpointError(f"no {what} at {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device=str(map_location))
        # timm's train.py saves its argparse Namespace beside the weights (`args`): the one
        # non-tensor class allowed, so the first author's last.pth.tar / model_best.pth.tar load.
        with torch.serialization.safe_globals([argparse.Namespace]):
            try:
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
            except RuntimeError as e:  # a file torch < 1.6 wrote (no zip archive) cannot be mapped: read it
                if not mmap or "mmap can only be used" not in str(e):
                    raise
                return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for truncated / foreign pickles
        raise CheckpointError(f"{path} is not a readable {what} (corrupt, truncated or not "
                              f"saved by laplace / timm): {one_line(e)[:200]}") from None


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


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """Read and validate a checkpoint; a foreign or corrupt file raises CheckpointError.

    mmap=True (a resume): the tensors are views of the file mapped into memory, read from disk
    when used (copied to their device); the ranks of a node share those pages in the page
    cache, so the file is read once per node instead of once per rank. Valid as long as nothing
    writes into the file: laplace's saves rename a new file over it (atomic_write), but a
    `torch.save` onto the same path while the tensors live makes reading them a bus error."""
    path = Path(path)
    ckpt = _read(path, "checkpoint", map_location, mmap)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a laplace checkpoint (no format={FORMAT!r} tag); "
                              f"for timm weights use laplace.vit.load_timm_state_dict")
    return _validate(ckpt, path)


def _weights(path: Path) -> tuple[dict, Optional[dict]]:
    """(state dict, the validated checkpoint) of a laplace checkpoint, or (state dict, None) of a
    timm / DeiT weights file (.pth, .bin, .safetensors; DeiT's `{"model": ...}` with `gamma_1` /
    `gamma_2` LayerScale names; timm train.py's `{"state_dict": ..., "args": Namespace}` .pth.tar):
    what fine-tuning (`trainer.init_from`) and the frozen backbones start from."""
    obj = _read(path, "weights file")
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return _validate(obj, path)["model"], obj
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
    """Rebuild the model of a checkpoint, or of a folder `python -m laplace.export` wrote, from
    it alone (see model_from_checkpoint)."""
    if Path(path).is_dir():
        return _load_export(Path(path), map_location, eval_mode, **overrides)
    return model_from_checkpoint(load_checkpoint(path), map_location, eval_mode, **overrides)


# An exported folder (laplace/export.py): Hugging Face's file names, so the Hub and timm find
# the files; config.json's "laplace" node says what it is and rebuilds the model.
EXPORT_FORMAT, EXPORT_VERSION = "laplace-export", 1
EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_CARD = "config.json", "model.safetensors", "README.md"


def read_export_config(folder: str | os.PathLike) -> dict:
    """The "laplace" node of an exported folder's config.json, validated; a foreign or corrupt
    folder raises CheckpointError."""
    import json

    from .schema import check_model

    folder = Path(folder)
    cfg_path = folder / EXPORT_CONFIG
    if not cfg_path.is_file():
        # export writes only into a folder of its own: the way out names a new one, never this one
        run = folder / "ckpt" / "last.pt"
        source = f"pass checkpoint={run} or export it" if run.is_file() else "write one"
        what = "a run folder" if run.is_file() else f"a folder without {EXPORT_CONFIG}"
        raise CheckpointError(f"{folder} is {what}, not an exported laplace model; {source} with `python -m "
                              f"laplace.export checkpoint={run if run.is_file() else '<run>/ckpt/last.pt'} "
                              f"out=exports/{folder.resolve().name}`")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path} is not readable JSON (corrupt or truncated): {str(e)[:200]}") from None
    node = cfg.get("laplace") if isinstance(cfg, dict) else None
    if not (isinstance(node, dict) and node.get("format") == EXPORT_FORMAT):
        raise CheckpointError(f"{cfg_path} is not a laplace export's (no laplace.format={EXPORT_FORMAT!r}); "
                              f"a timm folder loads with timm.create_model('local-dir:{folder}')")
    if not isinstance(node.get("version"), int) or node["version"] > EXPORT_VERSION:
        raise CheckpointError(f"{cfg_path} has export version {node.get('version')!r}, not one this code "
                              f"reads (<= {EXPORT_VERSION}); update laplace")
    if not (isinstance(node.get("model"), dict) and node["model"].get("name")):
        raise CheckpointError(f"{cfg_path} has no laplace.model node (the model's name and shape), so its "
                              f"model cannot be rebuilt; export the checkpoint again")
    check_model(node["model"], f"{cfg_path}: laplace.model")  # reliability: a hand-edited value is one line
    return node


def _load_export(folder: Path, map_location: Any, eval_mode: bool, **overrides) -> nn.Module:
    from safetensors.torch import load_model as load_safetensors

    from .zoo import create_model

    node = read_export_config(folder)
    weights = folder / EXPORT_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{folder} has {EXPORT_CONFIG} but no {EXPORT_WEIGHTS}; copy the whole exported folder")
    kwargs = {**node["model"], **overrides}
    model = create_model(**kwargs)
    try:
        # safetensors' load_model, not load_file + load_state_dict: it restores tensors that the
        # export stored once because the model shares them (save_model drops the aliases).
        load_safetensors(model, str(weights), strict=True)
    except RuntimeError as e:  # missing / unexpected keys or shapes (torch's load_state_dict message)
        raise CheckpointError(f"{weights} does not match model {kwargs['name']!r} of its {EXPORT_CONFIG}: "
                              f"{' '.join(str(e).split())[:300]}") from None
    except Exception as e:  # safetensors' own error for a corrupt or truncated file
        raise CheckpointError(f"{weights} is not a readable safetensors file (corrupt or truncated): "
                              f"{one_line(e)[:200]}") from None
    model.to(map_location)
    return model.eval() if eval_mode else model


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
    if head not in ("auto", "reset"):
        raise ConfigError(f"trainer.init_head={head!r}: choose auto or reset")
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"trainer.init_from: no file at {path}")
    try:
        sd, ckpt = _weights(path)
    except CheckpointError as e:  # name the config key that pointed at the file
        raise CheckpointError(f"trainer.init_from: {e}") from None
    src_cfg = None if ckpt is None else _model_node(ckpt, path)
    if src_cfg is not None:
        got = (src_cfg.get("num_laplacian_heads"), src_cfg.get("laplacian_mode", "fixed"))
        k = model_cfg.num_laplacian_heads
        want = (k if isinstance(k, int) else list(k), model_cfg.laplacian_mode)
        if got != want:  # Laplacian heads add no parameters: a mismatch would load silently
            raise CheckpointError(f"{path} was trained as {model_label(src_cfg)} ({got[0]} {got[1]} "
                                  f"Laplacian heads) but the model is {model_label(model_cfg)} ({want[0]} "
                                  f"{want[1]}); fine-tune each model from its own pre-training")
    # A head of another shape (ImageNet's 1000 classes into CIFAR's 100) cannot load; one of the
    # same shape loads unless asked not to (a new task with as many classes is still a new head).
    own = model.state_dict()
    head_keys = [k for k in own if k.startswith(_HEADS)]
    fits = all(k in sd and sd[k].shape == own[k].shape for k in head_keys)
    reset = bool(head_keys) and (head == "reset" or not fits)
    if reset:
        sd.update({k: own[k] for k in head_keys})  # keep the fresh initialisation
    _load_into(model, sd, f"trainer.init_from={path}", model_cfg.name)
    kind = "laplace checkpoint" if src_cfg is not None else "timm/DeiT state dict"
    return f"initialised from {kind} {path}" + ("; head re-initialised" if reset else "; head loaded")


def _load_into(model: nn.Module, sd: dict, source: str, name: str) -> None:
    """Load `sd` strictly into `model`, but for head weights the model lacks (num_classes=0) and
    a ViT's position embedding, resampled (bicubic) to the model's patch grid. `source` names
    the setting and file ("checkpoint=PATH") in the one-line error."""
    from .vit import VisionTransformer, load_timm_state_dict

    own = model.state_dict()
    # a head the model does not have (num_classes=0: a backbone) is left out, every other key strict
    sd = {k: v for k, v in sd.items() if k in own or not k.startswith(_HEADS)}
    try:
        if isinstance(model, VisionTransformer):
            load_timm_state_dict(model, sd)
        else:
            model.load_state_dict(sd, strict=True)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{source} does not fit model {name}: {' '.join(str(e).split())[:300]}") from None


def backbone_node(checkpoint, model_node=None, img_size: Optional[int] = None, head: bool = False) -> dict:
    """The model node `load_backbone` builds (what a run that trains on the backbone records)."""
    return _backbone_source(Path(str(checkpoint)), model_node, img_size, head)[0]


def load_backbone(checkpoint, model_node=None, img_size: Optional[int] = None, head: bool = False,
                  device: Any = "cpu") -> tuple[nn.Module, dict]:
    """(frozen ViT in eval mode at `img_size`, info): the one way from a checkpoint to the backbone
    of the frozen-feature evaluations (k-NN, linear probe, segmentation).

    Args:
        checkpoint: a laplace checkpoint (its own model node is used; `model_node` is ignored),
            or a timm / DeiT-III state dict file (.pth / .bin / .safetensors).
        model_node: the architecture of a state dict file (the `model=` group's node).
        img_size: the input size (the position embedding is resampled); None keeps the checkpoint's.
        head: keep the classifier (num_classes as trained); False builds the ViT without it.
        device: where the model goes.
    Returns info = {node: the node it was built from, model, checkpoint, step, source}; source
    is "laplace" or "timm", step None for a state dict.
    """
    from .zoo import create_model

    path = Path(str(checkpoint))
    node, sd, step, source = _backbone_source(path, model_node, img_size, head)
    model = create_model(**node)
    _load_into(model, sd, f"checkpoint={path}", node["name"])
    model.requires_grad_(False).eval().to(device)
    return model, {"node": node, "model": model_label(node), "checkpoint": str(path), "step": step, "source": source}


def _backbone_source(path: Path, model_node, img_size, head: bool) -> tuple[dict, dict, Optional[int], str]:
    """(model node to build, state dict, step, source) of a backbone file (see load_backbone)."""
    if not path.is_file():
        raise ConfigError(f"checkpoint={path}: no such file; pass a laplace checkpoint (runs/.../ckpt/last.pt), "
                          f"or to eval.knn / eval.linear a timm state dict with model=<zoo name>")
    try:
        sd, ckpt = _weights(path)
    except CheckpointError as e:  # name the setting that pointed at the file
        raise CheckpointError(f"checkpoint: {e}") from None
    if ckpt is not None:
        node, step, source = dict(_model_node(ckpt, path)), (ckpt.get("loop") or {}).get("step"), "laplace"
    elif model_node is None:
        raise ConfigError(f"checkpoint={path} is a state dict, not a laplace checkpoint: name its "
                          f"architecture, e.g. model=vits_0L (eval.knn / eval.linear), or pass a laplace checkpoint")
    else:
        from omegaconf import OmegaConf

        node = OmegaConf.to_container(model_node, resolve=True) if OmegaConf.is_config(model_node) else dict(model_node)
        step, source = None, "timm"
    if "embed_dim" not in node:
        raise ConfigError(f"checkpoint={path} holds a {node.get('name')} model: a frozen-backbone evaluation "
                          f"needs a ViT")
    # frozen features: no stochastic depth; another input size resamples the position embedding
    node.update(drop_path_rate=0.0, **({"img_size": int(img_size)} if img_size else {}))
    if not head:
        node["num_classes"] = 0
    return node, sd, step, source


def run_dir_of(checkpoint: str | os.PathLike) -> Path:
    """The run directory a checkpoint belongs to (`<run>/ckpt/last.pt` -> `<run>`; a loose
    weights file -> its folder): where evaluations of it write, beside the run."""
    p = Path(checkpoint)
    return p.parent.parent if p.parent.name == "ckpt" else p.parent


def results_header(model: dict, dataset: Optional[str], checkpoint, **fields) -> dict:
    """The fields every results.json opens with (trainers, k-NN, linear, segmentation, lm-eval):
    what `analysis.tables` groups runs by. `model` is the model node; `fields` follow."""
    k = model["num_laplacian_heads"]
    # checkpoints from before learned modes have no laplacian_mode: theirs was fixed
    return {"model": model_label(model), "num_laplacian_heads": list(k) if isinstance(k, (list, tuple)) else k,
            "laplacian_mode": model.get("laplacian_mode", "fixed"), "dataset": dataset,
            "checkpoint": str(checkpoint), **fields}
