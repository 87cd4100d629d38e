"""The measured models of the benchmark (`python -m bench`): one attention layer, and a whole training step.

Families: "vits" and "vitb" (zoo vits_{k}L / vitb_{k}L, against timm's deit3_small / deit3_base)
and "gpt" (zoo gpt_d{depth}_{k}L), each at k = 0, half and all Laplacian heads per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

import laplace
from laplace.attention import Attention
from laplace.gpt import gpt_dims
from laplace.zoo import VIT_ARCHS
from train.optim import build_muon_adamw
from train.recipe import compose_config

from .timing import Case

TIMM_NAMES = {"vits": "deit3_small_patch16_224", "vitb": "deit3_base_patch16_224"}
SMOKE_VIT = {"vits": dict(depth=1, embed_dim=48), "vitb": dict(depth=1, embed_dim=96)}


@dataclass
class Family:
    """Shapes of one family as benchmarked (after --smoke shrinking)."""

    family: str
    dim: int
    heads: int
    batch: int
    tokens: int  # per sample: ViT 1 + patches, GPT the sequence length
    overrides: dict = field(default_factory=dict)  # create_model kwargs (--smoke, vocab)
    img_size: Optional[int] = None
    depth: Optional[int] = None  # GPT

    @property
    def ks(self) -> list[int]:
        """k = 0, half and all of the heads (deduplicated for one-head models)."""
        return sorted({0, self.heads // 2, self.heads})

    def zoo_name(self, k: int) -> str:
        return f"gpt_d{self.depth}_{k}L" if self.family == "gpt" else f"{self.family}_{k}L"

    def shape(self, section: str) -> dict:
        s = dict(batch=self.batch, tokens=self.tokens, dim=self.dim, heads=self.heads)
        if self.img_size is not None:
            s["img_size"] = self.img_size
        if self.depth is not None:
            s["depth"] = self.depth
        if section == "step" and self.overrides:
            s["overrides"] = dict(self.overrides)
        return s


def family_spec(family: str, args) -> Family:
    if family == "gpt":
        D = args.gpt_depth
        width, heads = gpt_dims(D)
        over = dict(vocab_size=args.vocab_size)
        if args.smoke:  # one block, 16-wide heads, the zoo name's head count
            width = 16 * heads
            over.update(depth=1, width=width, num_heads=heads)
        return Family("gpt", width, heads, args.gpt_batch_size, args.seq_len, over, depth=D)
    arch = dict(VIT_ARCHS[family])
    over = dict(SMOKE_VIT[family]) if args.smoke else {}
    dim = over.get("embed_dim", arch["embed_dim"])
    patches = (args.img_size // 16) ** 2
    return Family(family, dim, arch["num_heads"], args.batch_size, 1 + patches, over, img_size=args.img_size)


def autocast(args):
    return torch.autocast(args.device_type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")


def rope_table(n: int, head_dim: int, device, base: float = 10000.0):
    """(cos, sin) [n, head_dim / 2] as laplace.gpt.GPT builds them (float32)."""
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    freqs = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def maybe_compile(module, mode: str):
    return torch.compile(module) if mode == "compiled" else module


def layer_cases(family: str, mode: str, args) -> list[Case]:
    """One attention layer, forward + backward of a fixed output gradient (input grads too)."""
    f, dev = family_spec(family, args), args.device
    torch.manual_seed(0)
    x = torch.randn(f.batch, f.tokens, f.dim, device=dev, requires_grad=True)
    gout = torch.randn(f.batch, f.tokens, f.dim, device=dev)
    kwargs = {}
    if family == "gpt":
        kwargs = dict(is_causal=True, rope=rope_table(f.tokens, f.dim // f.heads, dev))
    modules = {}
    for k in f.ks:
        if family == "gpt":
            m = Attention(f.dim, f.heads, k, qkv_bias=False, proj_bias=False, qk_norm=True)
        else:
            m = Attention(f.dim, f.heads, k, qkv_bias=True, proj_bias=True)
        modules[(f.zoo_name(k), "laplace", k)] = m
    if family in TIMM_NAMES:
        from timm.models.vision_transformer import Attention as TimmAttention

        modules[(f"timm {TIMM_NAMES[family].split('_patch')[0]}", "timm", None)] = \
            TimmAttention(f.dim, f.heads, qkv_bias=True)
    cases = []
    for (name, impl, k), m in modules.items():
        m = m.to(dev).train()
        fn = maybe_compile(m, mode)
        grads = {}

        def zero(m=m):
            x.grad = None
            m.zero_grad(set_to_none=True)

        def run(fn=fn, kw=dict(kwargs) if impl == "laplace" else {}, grads=grads):
            with autocast(args):
                out = fn(x, **kw)
            g = grads.get(out.dtype)
            if g is None:
                g = grads[out.dtype] = gout.to(out.dtype)
            out.backward(g)

        cases.append(Case(section="layer", family=family, mode=mode, name=name, impl=impl, k=k,
                          heads=f.heads, shape=f.shape("layer"), module=m, zero=zero, run=run))
    return cases


@lru_cache(maxsize=1)
def gpt_optim_config():
    """The optimizer node of experiment=gpt_d20 (optim=muon), composed as train.py would."""
    return compose_config(["experiment=gpt_d20"]).optim


def gpt_optimizers(model) -> tuple[list[torch.optim.Optimizer], str]:
    """Muon + AdamW from train.optim.build_muon_adamw, as experiment=gpt_d20 trains."""
    return list(build_muon_adamw(model, gpt_optim_config()).values()), \
        "muon+adamw (train.optim.build_muon_adamw, as experiment=gpt_d20)"


def vit_optimizer(model) -> tuple[list[torch.optim.Optimizer], str]:
    """AdamW from timm's factory, as optim=adamw (no weight decay on biases, norms, tokens)."""
    from timm.optim import create_optimizer_v2

    return [create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)], \
        "adamw (timm create_optimizer_v2, as optim=adamw)"


def step_cases(family: str, mode: str, args) -> list[Case]:
    """A whole training step: zero grads, forward, loss, backward, optimizer step."""
    f, dev = family_spec(family, args), args.device
    torch.manual_seed(0)
    models = {}
    if family == "gpt":
        idx = torch.randint(0, args.vocab_size, (f.batch, f.tokens + 1), device=dev)
        batch = (idx[:, :-1], idx[:, 1:])
        for k in f.ks:
            models[(f.zoo_name(k), "laplace", k)] = laplace.create_model(
                f.zoo_name(k), max_seq_len=f.tokens, **f.overrides)

        def loss_fn(model, idx, targets):
            return model(idx, targets=targets)
    else:
        import timm

        S = f.img_size
        batch = (torch.randn(f.batch, 3, S, S, device=dev), torch.randint(0, 1000, (f.batch,), device=dev))
        for k in f.ks:
            models[(f.zoo_name(k), "laplace", k)] = laplace.create_model(f.zoo_name(k), img_size=S, **f.overrides)
        timm_name = TIMM_NAMES[family]
        models[(f"timm {timm_name.split('_patch')[0]}", "timm", None)] = timm.create_model(
            timm_name, pretrained=False, img_size=S, **f.overrides)

        def loss_fn(model, x, y):
            return F.cross_entropy(model(x), y)
    cases = []
    for (name, impl, k), m in models.items():
        m = m.to(dev).train()
        opts, opt_name = gpt_optimizers(m) if family == "gpt" else vit_optimizer(m)
        fn = maybe_compile(m, mode)

        def zero(opts=opts):
            for o in opts:
                o.zero_grad(set_to_none=True)

        def run(fn=fn, opts=opts):
            with autocast(args):
                loss = loss_fn(fn, *batch)
            loss.backward()
            for o in opts:
                o.step()

        cases.append(Case(section="step", family=family, mode=mode, name=name, impl=impl, k=k,
                          heads=f.heads, shape=f.shape("step"), module=m, zero=zero, run=run,
                          optimizer=opt_name))
    return cases
