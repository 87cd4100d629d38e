"""Pre-trained weights into a model built otherwise: fine-tuning's `trainer.init_from`
(`load_pretrained`) and the frozen backbones of the evaluations (`load_backbone`: k-NN, linear
probe, segmentation), from a laplace checkpoint, run or export, or a timm / DeiT-III state dict.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch.nn as nn
from omegaconf import OmegaConf

from .checkpoint import EXPORT_WEIGHTS, CheckpointError, checkpoint_file, load_model, model_node_of, model_source, read_weights
from .errors import ConfigError
from .zoo import model_label

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
        sd, ckpt = read_weights(path)
    except CheckpointError as e:  # name the config key that pointed at the file
        raise CheckpointError(f"trainer.init_from: {e}") from None
    src_cfg = None if ckpt is None else model_node_of(ckpt, path)
    if src_cfg is not None:
        # (a checkpoint from before the arms was softmax)
        got = (src_cfg.get("num_laplacian_heads"), src_cfg.get("laplacian_mode", "fixed"), src_cfg.get("attention", "softmax"))
        k = model_cfg.num_laplacian_heads
        want = (k if isinstance(k, int) else list(k), model_cfg.laplacian_mode, model_cfg.get("attention", "softmax"))
        if got != want:  # Laplacian heads and XSA add no parameters: a mismatch would load silently
            raise CheckpointError(f"{path} was trained as {model_label(src_cfg)} ({got[0]} {got[1]} "
                                  f"Laplacian heads, {got[2]} attention) but the model is {model_label(model_cfg)} "
                                  f"({want[0]} {want[1]}, {want[2]}); fine-tune each model from its own pre-training")
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
    return _backbone_source(checkpoint_file(str(checkpoint)), model_node, img_size, head)[0]


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
    from .zoo import create_model

    path = checkpoint_file(str(checkpoint))  # a run folder: its checkpoint
    node, sd, step, source = _backbone_source(path, model_node, img_size, head)
    model = create_model(**node)
    _load_into(model, sd, f"checkpoint={path}", node["name"])
    model.requires_grad_(False).eval().to(device)
    # an export's weights file is what the feature cache's key stats; evaluations write beside it
    path = path / EXPORT_WEIGHTS if path.is_dir() else path
    return model, {"node": node, "model": model_label(node), "checkpoint": str(path), "step": step, "source": source}


def _backbone_source(path: Path, model_node, img_size, head: bool) -> tuple[dict, dict, Optional[int], str]:
    """(model node to build, state dict, step, source) of a backbone file (see load_backbone)."""
    if path.is_dir():  # an export, built by the one loader
        src = model_source(path)
        node, step, source = dict(src["node"]), src["ckpt"]["loop"]["step"], "laplace"
        sd = load_model(src).state_dict()
    elif not path.is_file():
        raise ConfigError(f"checkpoint={path}: no such file or folder; pass a laplace checkpoint (runs/.../ckpt/"
                          f"last.pt), a run or export folder, or to eval.knn / eval.linear a timm state dict with "
                          f"model=<zoo name>")
    else:
        try:
            sd, ckpt = read_weights(path)
        except CheckpointError as e:  # name the setting that pointed at the file
            raise CheckpointError(f"checkpoint: {e}") from None
        if ckpt is None and model_node is None:
            raise ConfigError(f"checkpoint={path} is a state dict, not a laplace checkpoint: name its architecture, "
                              f"e.g. model=vits_0L (eval.knn / eval.linear), or pass a laplace checkpoint")
        # a state dict's architecture is the `model=` group's node (resolved within its config)
        node = dict(model_node_of(ckpt, path) if ckpt is not None else OmegaConf.to_container(model_node, resolve=True)
                    if OmegaConf.is_config(model_node) else model_node)
        step, source = ((ckpt.get("loop") or {}).get("step"), "laplace") if ckpt is not None else (None, "timm")
    if "embed_dim" not in node:
        raise ConfigError(f"checkpoint={path} holds a {node.get('name')} model: a frozen-backbone evaluation "
                          f"needs a ViT")
    # frozen features: no stochastic depth; another input size resamples the position embedding
    node.update(drop_path_rate=0.0, **({"img_size": int(img_size)} if img_size else {}))
    if not head:
        node["num_classes"] = 0
    return node, sd, step, source
