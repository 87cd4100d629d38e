"""Optimizer and learning-rate schedule builders shared by the trainers."""
from __future__ import annotations

import math

import torch
from timm.optim import create_optimizer_v2


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """Build the optimizer named by `cfg.name` with timm's factory (adamw, lamb, sgd, ...).

    timm's factory already keeps biases, norms and the model's `no_weight_decay()` set (class
    token, position embedding) out of weight decay, as DeiT does.
    """
    kwargs = {}
    if cfg.get("betas") is not None:
        kwargs["betas"] = tuple(cfg.betas)
    if cfg.get("eps") is not None:
        kwargs["eps"] = cfg.eps
    return create_optimizer_v2(model, opt=cfg.name, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               **kwargs)


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int = 0,
          warmup_lr: float = 0.0, min_lr: float = 0.0, schedule: str = "cosine") -> float:
    """Learning rate at optimizer step `step`: linear warm-up from `warmup_lr`, then cosine
    (or constant) decay to `min_lr` at `total_steps`.

    A pure function of the step (no scheduler object), so a resumed run needs only the step
    to continue the schedule exactly.
    """
    if step < warmup_steps:
        return warmup_lr + (lr - warmup_lr) * step / warmup_steps
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"optim.schedule={schedule!r}: choose 'cosine' or 'constant'")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float):
    """Set every param group's lr, honouring a per-group `lr_scale` (layer decay)."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
