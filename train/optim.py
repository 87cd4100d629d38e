"""Optimizers, schedules and gradient clipping: what the engine does around `optimizer.step()`.

timm's optimizers and nanochat's Muon + AdamW (`build_optimizers`), schedules of any group
hyper-parameter or trainer value (`Schedule`, from `optim.schedules` / `trainer.schedules`; how a
node is written and why it states all six keys: docs/configs.md) and `clip_gradients`.
"""
import math
import re
import sys
from dataclasses import dataclass

import torch
from timm.optim import create_optimizer_v2

from laplace.attention import ATTENTIONS
from laplace.errors import ConfigError
from laplace.gpt import GPT

SHAPES = ("cosine", "linear", "constant")
KEYS = ("value", "warmup", "start", "warmdown", "end", "shape")  # the order configs write them


def build_optimizers(model, cfg) -> dict[str, torch.optim.Optimizer]:
    """{name: optimizer} of the `optim` family: nanochat's {"muon", "adamw"} for optim=muon, else
    {optim.name: the optimizer of timm's factory} (adamw, lamb, sgd, ...), which keeps biases, norms
    and the model's `no_weight_decay()` set out of weight decay, as DeiT does. `model` is a module,
    or parameter groups of it (DINO's)."""
    if cfg.name == "muon":
        return build_muon_adamw(model, cfg)
    # momentum is not a key of the adamw / lamb nodes (adding one would make every saved run's config
    # differ from the composed one and refuse its resume): an SGD user adds +optim.momentum=0.9.
    given = dict(betas=None if cfg.betas is None else tuple(cfg.betas), eps=cfg.eps, momentum=cfg.get("momentum"))
    kwargs = {k: v for k, v in given.items() if v is not None}  # null: timm's default for the optimizer
    return {cfg.name: create_optimizer_v2(model, opt=cfg.name, lr=cfg.lr, weight_decay=cfg.weight_decay, **kwargs)}


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
    def from_config(cls, node, key: str, total_steps: int, steps_per_epoch: int) -> "Schedule":
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
            # 0 for a group built at 0: timm's biases and norms stay out of a weight-decay schedule;
            # None: a group that keeps its value (optim=muon26's AdamW weight decays, nanochat's).
            scale = g.setdefault(f"{name}_scale", 0.0 if g[name] == 0 else 1.0)
            if scale is not None:
                g[name] = values[name] * scale
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


class StackedMuon(torch.optim.Muon):
    """torch.optim.Muon, where a group with `row_blocks: n` holds matrices that are n matrices
    stacked by rows, each orthogonalised on its own with its own shape scale (groups and state:
    torch's, so optimizer state saved by either loads into the other)."""
    # Why stacked: our attention keeps one fused `qkv` weight [3C, C] (timm's names and checkpoints,
    # one projection kernel) where nanochat has separate c_q, c_k, c_v [C, C]; one Newton-Schulz of
    # the stack orthogonalises the three together and scales by sqrt(3), far from nanochat's update
    # (docs/LOG.md, "Muon on the fused qkv"). Momentum and weight decay are elementwise: only the
    # orthogonalisation and the shape scale go block by block.

    def _init_group(self, group, params, grads, bufs):
        """torch's step updates the matrices this lists: each parameter's row blocks, as views of it,
        its gradient and its momentum buffer, updated in place. (torch 2.14's hook, the only private
        name used: tests/test_newton_schulz.py fails if a torch release changes it.)"""
        whole = [], [], []
        has_complex = super()._init_group(group, *whole)
        n = group.get("row_blocks", 1)  # a parameter group's key, not config: only stacked ones say
        for p, g, buf in zip(*whole):
            if p.shape[0] % n:
                raise ValueError(f"a [{p.shape[0]}, {p.shape[1]}] matrix has no {n} equal row blocks")
            params += p.chunk(n)
            grads += g.chunk(n)
            bufs += buf.chunk(n)
        return has_complex


def build_muon_adamw(model: torch.nn.Module, cfg) -> dict[str, torch.optim.Optimizer]:
    """nanochat's optimizers for a GPT (the values: configs/optim/muon.yaml).

    Muon at `matrix_lr` for every 2-D parameter of `model.blocks` (the fused qkv as three matrices,
    `row_blocks: 3`, as nanochat's separate c_q, c_k, c_v); AdamW for the token embedding
    (`embedding_lr`), the output layer (`unembedding_lr`), both scaled by (width / 768) ** -0.5 as
    nanochat's, and anything else (learned Laplacian gates, DIFF's lambdas and head norm: `scalar_lr`, no
    weight decay; the gated arm's gate is a matrix: Muon). Each
    group's base rate is its `lr_scale`: `optim.schedules.lr` is a multiplier of it.
    """
    if not isinstance(model, GPT):
        raise ConfigError(f"optim.name={cfg.name}: Muon + AdamW routes a GPT's parameters (blocks, wte, "
                          f"lm_head); this model is a {type(model).__name__}: use optim=adamw")
    blocks = model.blocks
    qkv = [m.qkv.weight for m in blocks.modules() if isinstance(m, ATTENTIONS)]
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


# ---- optim=muon26: nanochat 92d63d4's MuonAdamW (the first author's fork trains with it) ----------
# torch.optim.AdamW is nanochat's AdamW (decoupled decay, bias-corrected moments; per-group betas).
# Its Muon adds to torch.optim.Muon's (2.14: Nesterov, one fixed Newton-Schulz polynomial) five steps
# torch lacks, so `NorMuon` writes it: MuonEq row equilibration, Polar Express coefficients per
# iteration, Muon+ renormalisation, NorMuon variance reduction and cautious weight decay, each as
# nanochat's muon_step_fused does it, in its order (tests/test_muon26.py runs its code beside ours).
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),  # arXiv:2505.16932,
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),  # 5 iterations
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))


def polar_express(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """MuonEq + Polar Express + Muon+ of one matrix: ~ its orthogonal factor, Frobenius norm sqrt(min(m, n))."""
    x = g.to(dtype)
    # MuonEq: every row to the mean row norm, so the spectrum is better conditioned (arXiv:2603.28254)
    target = x.float().norm(dim=(-2, -1), keepdim=True) / x.size(-2) ** 0.5
    x = x * (target / x.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)).to(dtype)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    tall = g.size(-2) > g.size(-1)
    for a, b, c in POLAR_EXPRESS[:steps]:
        gram = x.mT @ x if tall else x @ x.mT  # the small side
        poly = b * gram + c * (gram @ gram)
        x = a * x + (x @ poly if tall else poly @ x)
    x = x.to(g.dtype)
    # Muon+: the norm of an exactly semi-orthogonal matrix, whatever the iteration left (arXiv:2602.21545)
    return x * (min(g.shape[-2:]) ** 0.5 / x.float().norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6)).to(x.dtype)


class NorMuon(torch.optim.Optimizer):
    """nanochat 92d63d4's Muon: Nesterov momentum, `polar_express`, NorMuon's per-row (tall) or
    per-column (wide) second moment (arXiv:2510.05491), and cautious weight decay (only where the
    update and the weight agree in sign), at lr x sqrt(max(1, rows / cols)).

    A group with `row_splits: [q, k, v]` holds fused matrices whose row blocks are updated as separate
    matrices (nanochat's c_q, c_k, c_v; the k and v blocks are smaller under GQA). State per parameter:
    `momentum_buffer` (its shape) and `second_momentum_buffer` (a list, one per block).
    """
    # Per matrix, not nanochat's stacks of same-shape matrices: the stack's operations are per
    # matrix (norms over the last two dims), so the values are the same; its stacking serves ZeRO.

    def __init__(self, params, *, lr: float, momentum: float, beta2: float, ns_steps: int, weight_decay: float,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, ns_steps=ns_steps,
                                      weight_decay=weight_decay, dtype=dtype))
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
            self._update(group, [p for p in group["params"] if p.grad is not None])
        return loss

    def _update(self, group: dict, params: list):
        m, wd = group["momentum"], group["weight_decay"]
        for p in params:
            splits = list(group.get("row_splits") or [p.shape[0]])
            state = self.state[p]
            if "second_momentum_buffer" not in state:
                # a tall (or square) block's rows each get a second moment, a wide one's columns
                state["second_momentum_buffer"] = [p.new_zeros((r, 1) if r >= p.shape[1] else (1, p.shape[1]))
                                                   for r in splits]
            # Nesterov momentum, torch's and nanochat's rule (state "momentum_buffer")
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - m)
            update = p.grad.lerp(buf, m)
            for p_i, u_i, v_i in zip(p.split(splits), update.split(splits), state["second_momentum_buffer"]):
                g = polar_express(u_i, group["ns_steps"], group["dtype"])
                # NorMuon: divide by the running RMS per row / column, then restore the update's norm
                dim, n = (-1, g.size(-1)) if v_i.size(-1) == 1 else (-2, g.size(-2))
                v_mean = g.float().square().mean(dim=dim, keepdim=True)
                v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
                v_i.lerp_(v_mean.to(v_i.dtype), 1 - group["beta2"])
                step_size = v_i.clamp_min(1e-10).rsqrt()
                v_norm_new = ((v_mean * n) * step_size.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt()
                g = g * (step_size * (v_norm / v_norm_new.clamp_min(1e-10))).to(g.dtype)
                lr = group["lr"] * max(1.0, p_i.shape[0] / p_i.shape[1]) ** 0.5
                # cautious decay: only the coordinates the update moves towards zero anyway
                p_i.sub_(lr * g + lr * wd * p_i * ((g * p_i) >= 0))


# nanochat's parameter groups (gpt.py setup_optimizer) by our parameter names; a name matching none
# is an error, never a silent default group. Muon: every matrix of the blocks (upstream: all of
# transformer.h); AdamW: the rest, each at its own lr, betas and (constant) weight decay.
MUON26_GROUPS = {
    "unembedding": r"lm_head\.weight", "embedding": r"wte\.weight", "value_embeds": r"value_embeds\.\d+\.weight",
    "resid_lambdas": r"resid_lambdas", "x0_lambdas": r"x0_lambdas",
    "smear": r"smear_gate\.weight|smear_lambda|backout_lambda",
    "laplacian_gates": r"blocks\.\d+\.attn\.laplacian_gate",  # ours (laplacian_mode=learned); nanochat has none
    "qkv": r"blocks\.\d+\.attn\.qkv\.weight",
    "matrices": r"blocks\.\d+\.(attn\.(proj|ve_gate)|mlp\.c_fc|mlp\.c_proj)\.weight",
}
WIDTH_SCALED = ("unembedding", "embedding", "value_embeds")  # x (width / width_ref) ** -0.5, nanochat's
NOT_BATCH_SCALED = ("smear",)  # nanochat passes its 0.2 past the batch's lr scale


def muon26_groups(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """{group: [(name, parameter)]} of MUON26_GROUPS; raises on a parameter no pattern names."""
    groups = {g: [] for g in MUON26_GROUPS}
    for name, p in model.named_parameters():
        group = next((g for g, pattern in MUON26_GROUPS.items() if re.fullmatch(pattern, name)), None)
        if group is None:
            raise ConfigError(f"optim=muon26: parameter {name!r} of {type(model).__name__} is in no group of "
                              f"nanochat's (train/optim.py MUON26_GROUPS); name it there before training it")
        groups[group].append((name, p))
    return groups


def build_muon26(model: torch.nn.Module, cfg, lr_scale: float = 1.0, muon_weight_decay: float | None = None):
    """{"muon": NorMuon, "adamw": torch AdamW} of nanochat 92d63d4 (values: configs/optim/muon26.yaml).

    lr_scale: every group's lr factor but the smear's (nanochat: sqrt(batch / reference batch));
    optim.lr_factor (default 1) multiplies every group's rate, the smear's too (issue 55's lr grid);
    muon_weight_decay: Muon's decay after the horizon's scaling (None: optim.muon.weight_decay).
    Each group's base rate and Muon's decay are its `lr_scale` / `weight_decay_scale`:
    optim.schedules.lr and .weight_decay are multipliers (the AdamW groups' decay stays constant).
    """
    groups = muon26_groups(model)
    width_scale = (model.width / cfg.width_ref) ** -0.5
    f = cfg.get("lr_factor", 1.0)  # a tuning factor, not nanochat's; Muon's decay coefficient stays
    adam = []
    for name, params in groups.items():
        if name in ("qkv", "matrices") or not params:
            continue
        g = cfg.adamw[name]
        lr = f * g.lr * (width_scale if name in WIDTH_SCALED else 1.0) * (1.0 if name in NOT_BATCH_SCALED else lr_scale)
        adam.append(dict(params=[p for _, p in params], name=name, lr=lr, lr_scale=lr, betas=tuple(g.betas),
                         weight_decay=g.weight_decay, weight_decay_scale=None))
    m = cfg.muon
    wd = m.weight_decay if muon_weight_decay is None else muon_weight_decay
    lr = f * m.lr * lr_scale
    # q, k, v apart: rows [q (width), k, v (equal; smaller under GQA)] of every layer's fused qkv
    qkv = [p for _, p in groups["qkv"]]
    if len({p.shape for p in qkv}) > 1:
        raise ConfigError("optim=muon26: the layers' qkv weights differ in shape; one row split serves them all")
    splits = [qkv[0].shape[1]] + [(qkv[0].shape[0] - qkv[0].shape[1]) // 2] * 2 if qkv else None
    muon = [dict(params=qkv, name="qkv", row_splits=splits),
            dict(params=[p for _, p in groups["matrices"]], name="matrices")]
    muon = [dict(g, lr=lr, lr_scale=lr, weight_decay=wd, weight_decay_scale=wd) for g in muon if g["params"]]
    return {"muon": NorMuon(muon, lr=lr, momentum=m.momentum, beta2=m.beta2, ns_steps=m.ns_steps, weight_decay=wd,
                            dtype=getattr(torch, m.dtype)),
            "adamw": torch.optim.AdamW(adam, lr=adam[0]["lr"], eps=cfg.eps)}
