"""Pre-trained weights into a model built otherwise: fine-tuning's `trainer.init_from`
(`load_pretrained`) and the frozen backbones of the evaluations (`load_backbone`: k-NN, linear
probe, segmentation), from a laplace checkpoint, run or export, or a timm / DeiT-III state dict.
Both read through `weights_source`, and the backbone is built by the one loader, `load_model`.
"""
import os
from pathlib import Path
from typing import Any, Optional

import torch.nn as nn
from omegaconf import OmegaConf

from .checkpoint import (EXPORT_WEIGHTS, HEADS, CheckpointError, checkpoint_file, load_model, load_weights,
                         model_source, read_weights)
from .errors import ConfigError
from .zoo import model_label


def weights_source(path: Path, setting: str, model_node=None) -> dict:
    """model_source's description of a laplace export at `path`, else read_weights' of the file;
    `model_node`: a state dict's architecture (the `model=` group's node); `setting` names the
    config key in a one-line error."""
    if path.is_dir():  # an export
        return model_source(path)
    node = OmegaConf.to_container(model_node, resolve=True) if OmegaConf.is_config(model_node) else model_node
    try:
        return read_weights(path, node)
    except CheckpointError as e:  # name the setting that pointed at the file
        raise CheckpointError(f"{setting}: {e}") from None


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
    src = weights_source(path, "trainer.init_from")
    if src["ckpt"] is not None:
        # (a checkpoint from before the arms was softmax)
        src_cfg = src["node"]
        got = (src_cfg.get("num_laplacian_heads"), src_cfg.get("laplacian_mode", "fixed"), src_cfg.get("attention", "softmax"))
        k = model_cfg.num_laplacian_heads
        want = (k if isinstance(k, int) else list(k), model_cfg.laplacian_mode, model_cfg.get("attention", "softmax"))
        if got != want:  # Laplacian heads and XSA add no parameters: a mismatch would load silently
            raise CheckpointError(f"{path} was trained as {model_label(src_cfg)} ({got[0]} {got[1]} "
                                  f"Laplacian heads, {got[2]} attention) but the model is {model_label(model_cfg)} "
                                  f"({want[0]} {want[1]}, {want[2]}); fine-tune each model from its own pre-training")
    sd = src["ckpt"]["model"] if src["ckpt"] is not None else src["sd"]
    # A head of another shape (ImageNet's 1000 classes into CIFAR's 100) cannot load; one of the
    # same shape loads unless asked not to (a new task with as many classes is still a new head).
    own = model.state_dict()
    head_keys = [k for k in own if k.startswith(HEADS)]
    fits = all(k in sd and sd[k].shape == own[k].shape for k in head_keys)
    reset = bool(head_keys) and (head == "reset" or not fits)
    if reset:
        sd = {**sd, **{k: own[k] for k in head_keys}}  # keep the fresh initialisation
    load_weights(model, sd, f"trainer.init_from={path} does not fit model {model_cfg.name}")
    kind = "laplace checkpoint" if src["ckpt"] is not None else "timm/DeiT state dict"
    return f"initialised from {kind} {path}" + ("; head re-initialised" if reset else "; head loaded")


def backbone_source(checkpoint, model_node=None, img_size: Optional[int] = None, head: bool = False) -> dict:
    """weights_source of `checkpoint` (a run folder: its checkpoint), its node the frozen backbone's
    (see load_backbone): what a run that trains on the backbone records, `load_model` builds."""
    path = checkpoint_file(str(checkpoint))
    if not path.exists():
        raise ConfigError(f"checkpoint={path}: no such file or folder; pass a laplace checkpoint (runs/.../ckpt/"
                          f"last.pt), a run or export folder, or to eval.knn / eval.linear a timm state dict with "
                          f"model=<zoo name>")
    src = weights_source(path, "checkpoint", model_node)
    if src["node"] is None:
        raise ConfigError(f"checkpoint={path} is a state dict, not a laplace checkpoint: name its architecture, "
                          f"e.g. model=vits_0L (eval.knn / eval.linear), or pass a laplace checkpoint")
    if "embed_dim" not in src["node"]:
        raise ConfigError(f"checkpoint={path} holds a {src['node'].get('name')} model: a frozen-backbone evaluation "
                          f"needs a ViT")
    # frozen features: no stochastic depth; another input size resamples the position embedding
    src["node"] = {**src["node"], "drop_path_rate": 0.0, **({"img_size": int(img_size)} if img_size else {}),
                   **({} if head else {"num_classes": 0})}
    return src


def load_backbone(checkpoint, model_node=None, img_size: Optional[int] = None, head: bool = False,
                  device: Any = "cpu") -> tuple[nn.Module, dict]:
    """(frozen ViT in eval mode at `img_size`, info): the one way from a checkpoint to the backbone
    of the frozen-feature evaluations (k-NN, linear probe, segmentation).

    Args:
        checkpoint: a laplace checkpoint, run or export (its own model node is used; `model_node`
            is ignored), or a timm / DeiT-III state dict file (.pth / .bin / .safetensors).
        model_node: the architecture of a state dict file (the `model=` group's node).
        img_size: the input size (the position embedding is resampled); None keeps the checkpoint's.
        head: keep the classifier (num_classes as trained); False builds the ViT without it.
        device: where the model goes.
    Returns info = {node: the node it was built from, model, checkpoint, step, source}; source
    is "laplace" or "timm", step None for a state dict.
    """
    src = backbone_source(checkpoint, model_node, img_size, head)
    model = load_model(src, device).requires_grad_(False)
    ckpt, path = src["ckpt"], src["path"]
    # an export's weights file is what the feature cache's key stats; evaluations write beside it
    path = path / EXPORT_WEIGHTS if path.is_dir() else path
    return model, {"node": src["node"], "model": model_label(src["node"]), "checkpoint": str(path),
                   "step": None if ckpt is None else (ckpt.get("loop") or {}).get("step"),
                   "source": "timm" if ckpt is None else "laplace"}
