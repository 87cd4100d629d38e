"""Laplacian heads: timm's attention with the last k heads outputting (I - P) V (arXiv:2602.09297).

A standard layer updates tokens with X <- X + sum_i P_i X Wv_i Wo_i; a Laplacian head uses I - P_i
instead of the row-softmax P_i. Per head the output is V - P V, one line after the fused kernel:

    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)           # P V, [B, H, N, D]
    out = torch.cat((out[:, :H - k], v[:, H - k:] - out[:, H - k:]), dim=1)  # last k heads: (I - P) V

No N x N matrix, no new parameter; with a causal mask (I - P) V stays causal. `LaplacianAttention`
is timm's `Attention` (same arguments, same parameter names) with that line, so it drops into any
timm ViT: `timm.create_model("vit_small_patch16_224", attn_layer=laplace.attn_layer(3))`. The GPT
(laplace/gpt.py) uses the same class with rotary embeddings and a KV cache.
"""
from __future__ import annotations

import functools
import numbers

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention

from .errors import ConfigError

LAPLACIAN_MODES = ("fixed", "learned")
# Learned gates start at logit +1 on the last k heads (a = 0.73) and -1 on the others (0.27).
# Not nearer 0 / 1: Adam moves a logit by about lr per step, so a gate moves by sigmoid'(logit) x lr,
# and at +-4 (0.98 / 0.02) that slope is 0.018 against 0.20 at +-1 (docs/LOG.md, "Learned gates that
# move"). Not 0: a = 0.5 outputs 0.5 V, no attention at all, and every head would start alike.
GATE_START_LOGIT = 1.0


def laplacian_mask(num_heads: int, num_laplacian_heads: int, device=None) -> torch.Tensor:
    """[H]: 1.0 on the last k heads (the Laplacian ones), 0.0 on the others."""
    return (torch.arange(num_heads, device=device) >= num_heads - num_laplacian_heads).float()


def gate_start_logits(num_heads: int, num_laplacian_heads: int, device=None) -> torch.Tensor:
    """[H]: the logits learned gates start from, +GATE_START_LOGIT on the last k heads, - on the others."""
    return GATE_START_LOGIT * (2.0 * laplacian_mask(num_heads, num_laplacian_heads, device) - 1.0)


def laplacian_counts(num_laplacian_heads, depth: int, num_heads: int) -> list[int]:
    """An int (every layer) or a per-layer list as a validated list of ints: the one range check of k."""
    if isinstance(num_laplacian_heads, numbers.Integral):
        counts = [int(num_laplacian_heads)] * depth
    else:
        counts = [int(k) for k in num_laplacian_heads]
        if len(counts) != depth:
            raise ConfigError(f"num_laplacian_heads has {len(counts)} entries but the model has "
                              f"{depth} layers: give one count per layer or a single int")
    for i, k in enumerate(counts):
        if not 0 <= k <= num_heads:
            where = "" if isinstance(num_laplacian_heads, numbers.Integral) else f" in layer {i}"
            raise ConfigError(f"num_laplacian_heads={k}{where} is outside 0..{num_heads} "
                              f"(this model has {num_heads} heads per layer)")
    return counts


# nanochat's parameter-free RMSNorm as the GPT attention's `q_norm` / `k_norm` (timm builds them as
# norm_layer(head_dim, device=..., dtype=...)): torch's own, without its affine weight.
RMSNorm = functools.partial(nn.RMSNorm, elementwise_affine=False)


class LaplacianAttention(Attention):
    """timm's `Attention` whose last `num_laplacian_heads` heads output V - P V.

    Args:
        dim, num_heads, **timm_kwargs: timm's Attention (qkv_bias, qk_norm, norm_layer, proj_bias,
            attn_drop, proj_drop, ...).
        num_laplacian_heads: k; None: the class's (`attn_layer(k)` makes a class with its own k).
        laplacian_mode: "fixed" (the paper: a head is P or I - P) or "learned" (each head outputs
            (1 - a) P V + a (V - P V), a = sigmoid of the parameter `laplacian_gate`; k sets the start).
    The fused path (timm's `fused_attn`, on by default) never forms P; `fused_attn = False`, or
    `return_attn=True` in the forward, takes the reference path that forms P explicitly.
    """

    num_laplacian_heads: int = 0
    laplacian_mode: str = "fixed"

    def __init__(self, dim: int, num_heads: int = 8, num_laplacian_heads: int | None = None,
                 laplacian_mode: str | None = None, **timm_kwargs):
        super().__init__(dim, num_heads, **timm_kwargs)
        self.laplacian_mode = laplacian_mode or self.laplacian_mode
        if self.laplacian_mode not in LAPLACIAN_MODES:
            raise ConfigError(f"laplacian_mode={self.laplacian_mode!r}: choose one of {LAPLACIAN_MODES}")
        if self.laplacian_mode == "learned":  # the paper's fixed heads add no parameter
            self.laplacian_gate = nn.Parameter(torch.empty(num_heads))  # the gates' logits
        self.set_laplacian_heads(self.num_laplacian_heads if num_laplacian_heads is None else num_laplacian_heads)

    def set_laplacian_heads(self, k: int):
        """Make the last k heads Laplacian (a learned gate restarts from k's start)."""
        self.num_laplacian_heads, = laplacian_counts(k, 1, self.num_heads)
        self.reset_laplacian()

    @torch.no_grad()
    def reset_laplacian(self):
        """Gate logits to their start: +GATE_START_LOGIT on the last k heads, - on the others.
        Also after `to_empty` from the meta device (the GPT's init_weights calls it)."""
        if self.laplacian_mode == "learned" and not self.laplacian_gate.is_meta:
            self.laplacian_gate.copy_(gate_start_logits(self.num_heads, self.num_laplacian_heads, self.laplacian_gate.device))

    def gates(self) -> torch.Tensor:
        """[H]: each head's weight a of V - P V: sigmoid(laplacian_gate) when learned, else 1 on
        the last k heads and 0 on the others."""
        if self.laplacian_mode == "learned":
            return torch.sigmoid(self.laplacian_gate)
        return laplacian_mask(self.num_heads, self.num_laplacian_heads, self.qkv.weight.device)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, kv_cache=None, layer_idx: int = 0,
                return_attn: bool = False):
        """x [B, N, C] -> [B, N, C] (and P [B, H, N, N_keys] with return_attn). The GPT passes
        `rope` (cos, sin of these positions) and, when generating, `kv_cache` (x: the new tokens)."""
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)
        if rope is None:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, N, D]
            q, k = self.q_norm(q), self.k_norm(k)
        else:  # nanochat: rotary, then QK-norm, on [B, N, H, D]; v its own copy
            # In this layout SDPA's output is token-major, so at k = 0 the head merge below is a view
            # and the projection keeps nothing SDPA does not keep already. v's copy frees the qkv
            # output, which a view would keep whole (3x v) for SDPA's backward.
            cos, sin = (t.unsqueeze(-2) for t in rope)  # [N, 1, D/2]: every head
            q = self.q_norm(apply_rotary(qkv[:, :, 0], cos, sin))
            k = self.k_norm(apply_rotary(qkv[:, :, 1], cos, sin))
            q, k, v = (t.transpose(1, 2) for t in (q, k, qkv[:, :, 2].contiguous()))

        keys, values = k, v
        if kv_cache is not None:
            keys, values, attn_mask, is_causal = kv_cache.attend(layer_idx, k, v, is_causal)
        drop = self.attn_drop.p if self.training else 0.0
        attn = None
        if self.fused_attn and not return_attn:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, dropout_p=drop,
                                                 is_causal=is_causal)
        else:
            out, attn = self._reference(q, keys, values, attn_mask, is_causal, drop)

        # `v` is each query's own value, the identity term of (I - P) V (also under a KV cache).
        H, kl = self.num_heads, self.num_laplacian_heads
        if self.laplacian_mode == "learned":  # (1 - a) P V + a (V - P V), a per head in (0, 1)
            out = torch.lerp(out, v - out, self.gates().view(-1, 1, 1).to(out.dtype))
        elif kl:  # the last k heads: (I - P) V
            out = torch.cat((out[:, :H - kl], v[:, H - kl:] - out[:, H - kl:]), dim=1)
        out = self.proj_drop(self.proj(self.norm(out.transpose(1, 2).reshape(B, N, C))))
        return (out, attn) if return_attn else out

    def _reference(self, q, k, v, mask, is_causal, drop):
        """Softmax attention with P formed explicitly: the ground truth for the fused path."""
        scores = (q @ k.transpose(-2, -1)) * self.scale  # [B, H, N, N_keys]
        if is_causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = scores.softmax(dim=-1)
        return (F.dropout(attn, drop) if drop else attn) @ v, attn

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, laplacian_heads={self.num_laplacian_heads}, mode={self.laplacian_mode}"


def attn_layer(num_laplacian_heads: int = 0, mode: str = "fixed") -> type[LaplacianAttention]:
    """The attention class to give a timm ViT, its last k heads Laplacian in every layer:

        timm.create_model("vit_small_patch16_224", attn_layer=laplace.attn_layer(3))

    A class, not a functools.partial: timm asks `issubclass(attn_layer, DiffAttention)`. Counts that
    differ per layer: `set_laplacian_heads(model, [0, 0, 3, ...])` after construction. timm 1.0's
    VisionTransformer (vit_*, deit*, flexivit_*, vitamin_*, hybrids) and NaFlexVit take it; its other
    ViTs (Eva, BEiT, Swin, CaiT, XCiT, LeViT, ...) build their own attention and refuse the argument."""
    if mode not in LAPLACIAN_MODES:
        raise ConfigError(f"laplacian_mode={mode!r}: choose one of {LAPLACIAN_MODES}")
    return type(f"LaplacianAttention{num_laplacian_heads}{mode.capitalize()}", (LaplacianAttention,),
                {"num_laplacian_heads": num_laplacian_heads, "laplacian_mode": mode})


def set_laplacian_heads(model: nn.Module, counts) -> list[int]:
    """Give the Laplacian attentions of `model`, in order, k heads each (an int or one per layer)."""
    layers = [m for m in model.modules() if isinstance(m, LaplacianAttention)]
    if not layers:  # else nothing would change, silently
        raise ConfigError(f"{type(model).__name__} has no Laplacian attention: build it with attn_layer="
                          f"laplace.attn_layer(k), which timm's VisionTransformer and NaFlexVit take (see attn_layer)")
    counts = laplacian_counts(counts, len(layers), layers[0].num_heads if layers else 0)
    for attn, k in zip(layers, counts):
        attn.set_laplacian_heads(k)
    return counts


@torch.no_grad()
def learned_gates(model: nn.Module) -> dict[str, list[float]]:
    """{layer: [a per head]} of every attention with learned gates ("blocks.0" for "blocks.0.attn")."""
    return {name.removesuffix(".attn"): torch.sigmoid(m.laplacian_gate.float()).tolist()
            for name, m in model.named_modules()
            if isinstance(m, LaplacianAttention) and m.laplacian_mode == "learned"}


def gate_metrics(model: nn.Module) -> dict[str, float]:
    """Learned gates as flat metrics, "gate.<layer>.h<head>": a (what the engine logs)."""
    return {f"gate.{layer}.h{h}": a for layer, heads in learned_gates(model).items() for h, a in enumerate(heads)}


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2), the two halves of the head dim (nanochat); cos and sin broadcast to x's
    [..., D/2] (the GPT: x [B, N, H, D], cos and sin [N, 1, D/2])."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)
