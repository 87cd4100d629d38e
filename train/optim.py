"""Optimizers, schedules and gradient clipping: what the engine does around `optimizer.step()`.

timm's optimizers and nanochat's Muon + AdamW (`build_optimizers`), schedules of any group
hyper-parameter or trainer value (`Schedule`, from `optim.schedules` / `trainer.schedules`; how a
node is written and why it states all six keys: docs/configs.md) and `clip_gradients`.
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

import torch
from timm.optim import create_optimizer_v2

from laplace.attention import LaplacianAttention
from laplace.errors import ConfigError
from laplace.gpt import GPT

SHAPES = ("cosine", "linear", "constant")
KEYS = ("value", "warmup", "start", "warmdown", "end", "shape")  # the order configs write them


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """The optimizer named by `cfg.name` from timm's factory (adamw, lamb, sgd, ...), which keeps
    biases, norms and the model's `no_weight_decay()` set out of weight decay, as DeiT does."""
    # momentum is not a key of the adamw / lamb nodes (adding one would make every saved run's config
    # differ from the composed one and refuse its resume): an SGD user adds +optim.momentum=0.9.
    given = dict(betas=None if cfg.betas is None else tuple(cfg.betas), eps=cfg.eps, momentum=cfg.get("momentum"))
    kwargs = {k: v for k, v in given.items() if v is not None}  # null: timm's default for the optimizer
    return create_optimizer_v2(model, opt=cfg.name, lr=cfg.lr, weight_decay=cfg.weight_decay, **kwargs)


def build_optimizers(model, cfg) -> dict[str, torch.optim.Optimizer]:
    """{name: optimizer} of the `optim` family: nanochat's {"muon", "adamw"} for optim=muon, else
    {optim.name: timm's}. `model` is a module, or parameter groups of it (DINO's)."""
    if cfg.name == "muon":
        return build_muon_adamw(model, cfg)
    return {cfg.name: build_optimizer(model, cfg)}


def parse_length(value, key: str, steps_per_epoch: int, total_steps: int) -> int:
    """Steps in a length: steps (300), epochs ("5ep") or a share of the run ("20%")."""
    if value is None:
        return 0
    if m := re.fullmatch(r"\s*([0-9.]+)\s*(ep|%)\s*", str(value)):
        n = float(m[1])
        return round(n * steps_per_epoch) if m[2] == "ep" else round(n / 100 * total_steps)
    if not isinstance(value, (bool, float)) and str(value).isdigit():  # an int, or its string
        return int(value)
    raise ConfigError(f"{key}={value!r}: give steps (300), epochs (5ep) or a share of the run (20%)")


@dataclass(frozen=True)
class Schedule:
    """A value as a function of the optimizer step (docs/configs.md)."""

    value: float
    total_steps: int
    warmup: int = 0
    start: float = 0.0
    warmdown: int | None = None  # None: every step after the warm-up
    end: float | None = None  # None: `value`
    shape: str = "constant"

    def __call__(self, step: int) -> float:
        if step < self.warmup:  # `value` is first reached at step `warmup` (timm; DINO: one earlier)
            return self.start + (self.value - self.start) * step / self.warmup
        end = self.value if self.end is None else self.end
        # The decay starts after the warm-up at the earliest (very short test runs).
        begin = self.warmup if self.warmdown is None else max(self.warmup, self.total_steps - self.warmdown)
        if self.shape == "constant" or step < begin:
            return self.value
        p = min(1.0, (step - begin) / max(1, self.total_steps - begin))
        if self.shape == "linear":
            return self.value + (end - self.value) * p
        return end + 0.5 * (self.value - end) * (1.0 + math.cos(math.pi * p))

    @classmethod
    def from_config(cls, node, key: str, total_steps: int, steps_per_epoch: int) -> Schedule:
        """Build from a complete config node; `key` (e.g. "optim.schedules.lr") names it in errors."""
        node = dict(node)
        if unknown := sorted(set(node) - set(KEYS)):
            raise ConfigError(f"{key}.{unknown[0]}: unknown schedule key; use {list(KEYS)}")
        # A missing key would be inherited from the node this one overrides (Hydra merges them).
        if missing := [k for k in KEYS if k not in node]:
            raise ConfigError(f"{key}.{missing[0]} is missing: a schedule states all of {', '.join(KEYS)} "
                              f"(null where unused), so that it replaces the node it overrides")
        if node["value"] is None:
            raise ConfigError(f"{key}.value is required (the value after the warm-up)")
        shape = node["shape"] or ("cosine" if node["end"] is not None else "constant")
        if shape not in SHAPES:
            raise ConfigError(f"{key}.shape={shape!r}: choose one of {', '.join(SHAPES)}")
        length = lambda k: parse_length(node[k], f"{key}.{k}", steps_per_epoch, total_steps)  # noqa: E731
        warmup = length("warmup")
        if warmup and node["start"] is None:
            raise ConfigError(f"{key}.start is null but {key}.warmup={node['warmup']!r}: "
                              f"give the warm-up's first value")
        if warmup and warmup >= total_steps:  # DINO asserts; tiny test runs go on, with one plain line
            print(f"[laplace] warning: {key}.warmup={node['warmup']!r} is {warmup} steps, the run {total_steps}: "
                  f"it never leaves the warm-up (DINO refuses this)", file=sys.stderr)
        return cls(value=float(node["value"]), total_steps=total_steps, warmup=warmup, start=float(node["start"] or 0),
                   warmdown=None if node["warmdown"] is None else length("warmdown"),
                   end=None if node["end"] is None else float(node["end"]), shape=shape)


def schedule_node(value, warmup=None, start=None, warmdown=None, end=None, shape=None) -> dict:
    """A complete schedule node (for code and tests that build one)."""
    return dict(value=value, warmup=warmup, start=start, warmdown=warmdown, end=end, shape=shape)


def build_schedules(nodes, prefix: str, total_steps: int, steps_per_epoch: int) -> dict[str, Schedule]:
    """{name: Schedule} of a `schedules` config node (None or empty: none)."""
    return {name: Schedule.from_config(node, f"{prefix}.{name}", total_steps, steps_per_epoch)
            for name, node in (nodes or {}).items() if node is not None}


def check_group_schedules(optimizers: dict[str, torch.optim.Optimizer], schedules: dict[str, Schedule]):
    """Every scheduled hyper-parameter must exist in some parameter group (a typo otherwise)."""
    for name in schedules:
        if not any(name in g for opt in optimizers.values() for g in opt.param_groups):
            raise ConfigError(f"optim.schedules.{name}: no parameter group of the optimizers "
                              f"({', '.join(optimizers)}) has a {name!r} hyper-parameter")


def apply_group_schedules(optimizers: dict[str, torch.optim.Optimizer], schedules: dict[str, Schedule],
                          step: int) -> dict[str, float]:
    """Set every scheduled hyper-parameter of every group for `step`; returns the values."""
    values = {name: s(step) for name, s in schedules.items()}
    for g in (g for opt in optimizers.values() for g in opt.param_groups):
        for name in values.keys() & g.keys():  # e.g. Muon's momentum is not a key of AdamW's groups
            # 0 for a group built at 0: timm's biases and norms stay out of a weight-decay schedule.
            g[name] = values[name] * g.setdefault(f"{name}_scale", 0.0 if g[name] == 0 else 1.0)
    return values


@torch.no_grad()
def clip_gradients(optimizers: dict[str, torch.optim.Optimizer], max_norm: float | None,
                   mode: str = "global") -> torch.Tensor | None:
    """Clip gradients in place; returns the total gradient norm before clipping.

    mode: "global" (one norm over every parameter, torch's clip_grad_norm_), "group" (each
    parameter group's norm, at the group's `grad_clip` if it has one, else max_norm) or "param"
    (each tensor on its own: DINO's clip_gradients).
    """
    groups = [g for opt in optimizers.values() for g in opt.param_groups]
    if mode == "global":
        params = [p for g in groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm else None
    if mode not in ("group", "param"):
        raise ConfigError(f"optim.grad_clip_mode={mode!r}: choose global, group or param")
    # Written out rather than clip_grad_norm_ per group or tensor: one foreach kernel per group
    # instead of a few per tensor (DINO clips ~150 tensors a step).
    sq = []
    for g in groups:
        grads, limit = [p.grad for p in g["params"] if p.grad is not None], g.get("grad_clip", max_norm)
        if not grads:
            continue
        norms = torch.stack(torch._foreach_norm(grads))
        sq.append(norms.square().sum())
        if limit and mode == "param":
            torch._foreach_mul_(grads, list((limit / (norms + 1e-6)).clamp(max=1.0).unbind()))
        elif limit:  # torch's rule: limit / (norm + 1e-6), at most 1
            torch._foreach_mul_(grads, (limit / (sq[-1].sqrt() + 1e-6)).clamp(max=1.0))
    return torch.stack(sq).sum().sqrt() if sq else None


# Muon's Newton-Schulz and learning-rate adjustment, written here rather than called from
# torch.optim._muon: those are private functions whose signatures change between torch releases.
# Every operation is torch's (torch 2.14's torch/optim/_muon.py), in the same order, so the step
# equals torch.optim.Muon's bit for bit (tests/test_newton_schulz.py holds this against the public
# class).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's default
NS_EPS = 1e-7  # torch.optim.Muon's default: floor of the Frobenius norm the update is divided by
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def zeropower_via_newtonschulz(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                               eps: float) -> torch.Tensor:
    """Muon's orthogonalisation of a 2-D matrix, in bf16: US'V^T with S' ~ 0.5..1.5 rather than UV^T
    (the coefficients maximise the slope at 0)."""
    if grad.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalises a 2-D matrix, not a tensor of shape {list(grad.shape)}")
    a, b, c = coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.bfloat16().T if tall else grad.bfloat16()  # the wide orientation: A = XX^T is the small one
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x.T if tall else x


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """Muon's learning rate for a [rows, cols] matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):  # Keller Jordan's
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":  # Moonshot's: AdamW's RMS, so its lr and decay carry over
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: choose one of {ADJUST_LR_FNS}")


class StackedMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update, where a group with `row_blocks: n` holds matrices that are n
    matrices stacked by rows, each orthogonalised on its own with its own shape scale.

    Hyper-parameters, group keys and state (`momentum_buffer`) are torch's, so optimizer state
    saved by either loads into the other.
    """
    # Why stacked: our attention keeps one fused `qkv` weight [3C, C] (timm's names and checkpoints,
    # one projection kernel) where nanochat has separate c_q, c_k, c_v [C, C]; one Newton-Schulz of
    # the stack orthogonalises the three together and scales by sqrt(3), far from nanochat's update
    # (docs/LOG.md, "Muon on the fused qkv"). Momentum and weight decay are elementwise: only the
    # orthogonalisation and the shape scale go block by block. Not a subclass of torch.optim.Muon:
    # its step calls private functions of torch.optim._muon.

    def __init__(self, params, *, lr: float, momentum: float, nesterov: bool, ns_steps: int,
                 weight_decay: float, adjust_lr_fn: str | None,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS):
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: choose one of {ADJUST_LR_FNS}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn))
        for p in (p for group in self.param_groups for p in group["params"]):
            if p.ndim != 2:
                raise ValueError(f"Muon updates 2-D matrices; a parameter has shape {list(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            n = group.get("row_blocks", 1)  # a parameter group's key, not config: only stacked ones say
            lr, wd, m = group["lr"], group["weight_decay"], group["momentum"]
            for p in (p for p in group["params"] if p.grad is not None):
                if p.shape[0] % n:
                    raise ValueError(f"a [{p.shape[0]}, {p.shape[1]}] matrix has no {n} equal row blocks")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - m)
                update = p.grad.lerp(buf, m) if group["nesterov"] else buf
                p.mul_(1 - lr * wd)  # decoupled weight decay, at the group's lr (torch's)
                # One block (n = 1) is the whole matrix; chunks are row views, updated in place.
                for p_i, u_i in zip(p.chunk(n), update.chunk(n)):
                    o = zeropower_via_newtonschulz(u_i, group["ns_coefficients"], group["ns_steps"], group["eps"])
                    p_i.add_(o, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p_i.shape))
        return loss


def build_muon_adamw(model: torch.nn.Module, cfg) -> dict[str, torch.optim.Optimizer]:
    """nanochat's optimizers for a GPT (the values: configs/optim/muon.yaml).

    Muon at `matrix_lr` for every 2-D parameter of `model.blocks` (the fused qkv as three matrices,
    `row_blocks: 3`, as nanochat's separate c_q, c_k, c_v); AdamW for the token embedding
    (`embedding_lr`), the output layer (`unembedding_lr`), both scaled by (width / 768) ** -0.5 as
    nanochat's, and anything else (learned Laplacian gates: `scalar_lr`, no weight decay). Each
    group's base rate is its `lr_scale`: `optim.schedules.lr` is a multiplier of it.
    """
    if not isinstance(model, GPT):
        raise ConfigError(f"optim.name={cfg.name}: Muon + AdamW routes a GPT's parameters (blocks, wte, "
                          f"lm_head); this model is a {type(model).__name__}: use optim=adamw")
    blocks = model.blocks
    qkv = [m.qkv.weight for m in blocks.modules() if isinstance(m, LaplacianAttention)]
    matrices = [p for p in blocks.parameters() if p.ndim == 2 and all(p is not q for q in qkv)]
    routed = {id(p) for p in [*matrices, *qkv, model.wte.weight, model.lm_head.weight]}
    scalars = [p for p in model.parameters() if id(p) not in routed]
    assert {id(p) for p in scalars} <= {id(p) for p in blocks.parameters()}, "unrouted parameter outside the blocks"
    width_scale = (model.width / 768) ** -0.5 if cfg.lr_width_scale else 1.0
    adam_groups = [("embedding", [model.wte.weight], cfg.embedding_lr * width_scale, cfg.weight_decay),
                   ("unembedding", [model.lm_head.weight], cfg.unembedding_lr * width_scale, cfg.weight_decay),
                   ("scalars", scalars, cfg.scalar_lr, 0.0)]  # gates: decay would pull them to 0.5
    adamw = torch.optim.AdamW([{"params": ps, "lr": lr, "lr_scale": lr, "weight_decay": wd, "name": name}
                               for name, ps, lr, wd in adam_groups if ps], betas=tuple(cfg.betas), eps=cfg.eps)
    muon = StackedMuon([{"params": ps, "lr": cfg.matrix_lr, "lr_scale": cfg.matrix_lr, "name": name, "row_blocks": n}
                        for name, ps, n in [("matrices", matrices, 1), ("qkv", qkv, 3)] if ps],
                       lr=cfg.matrix_lr, momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                       weight_decay=cfg.muon_weight_decay, adjust_lr_fn="original")
    return {"muon": muon, "adamw": adamw}
