"""Multi-head self-attention with Laplacian heads: the one attention of every model here.

A standard layer updates tokens with   X <- X + sum_i P_i X Wv_i Wo_i.
A *Laplacian head* uses I - P_i instead of the row-softmax matrix P_i (arXiv:2602.09297):

    X <- X + sum_{i in A} P_i X Wv_i Wo_i + sum_{i in L} (I - P_i) X Wv_i Wo_i

Per head the output is V - P V, i.e. one line after the fused kernel:

    out = v - F.scaled_dot_product_attention(q, k, v)          # Laplacian heads

so no N x N matrix is formed, flash / memory-efficient SDPA kernels still apply and no
parameter is added. With a causal mask P is the causal attention matrix and (I - P) V stays
causal: row t is v_t minus the attention-weighted average of v_{<=t}.

Which heads are Laplacian: the last `num_laplacian_heads` of the layer (the paper's fixed
choice). Beyond the paper, `laplacian_mode="learned"` gives every head a gate a_h = sigmoid(g_h)
and outputs (1 - a_h) P V + a_h (V - P V), so training decides how much each head smooths.
The gates start at sigmoid(+-1) = 0.73 / 0.27 (`GATE_START_LOGIT`, see `gate_start`).
The fixed mode subtracts on the Laplacian heads inside the head-merging copy, and the fused
path merges and projects in one autograd function (`LaplacianProjection`) that keeps only the
SDPA output and V for backward (SDPA keeps both anyway) and recomputes the merge there: with
plain autograd the merged tensor is one more saved activation (+20% of a ViT attention layer's
saved bytes, +5% of a ViT training step, measured by `python -m bench`).

The same class serves the ViT (bidirectional, qkv bias, timm parameter names, optional QK-norm
as timm's: a LayerNorm over each head's queries and keys) and the GPT (causal, rotary,
parameter-free RMSNorm QK-norm, KV cache); `fused=False` selects a reference path
that forms P explicitly, which tests compare against and `return_attn=True` uses for analysis.
"""
from __future__ import annotations

import numbers
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import ConfigError

LAPLACIAN_MODES = ("fixed", "learned")
#: Learned gates start at logit +1 (the last k heads: a = 0.73) or -1 (the others: a = 0.27).
#: Why not nearer 0 / 1: Adam moves a logit by about lr per step, so a gate moves by about
#: sigmoid'(logit) x lr; at +-4 (0.98 / 0.02) that slope is 0.018 and no gate of the miniature
#: moved by more than 0.001 in 300 steps. At +-1 the slope is 0.20, 11 times larger. Why not 0:
#: a = 0.5 gives 0.5 V and no attention at all ((1 - a) P V + a (V - P V) = a V + (1 - 2a) P V),
#: and every head would start alike; at +-1 each head keeps 0.46 P V of its attention, with the
#: sign the paper's k assigns.
GATE_START_LOGIT = 1.0


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim (nanochat's `norm`)."""
    return F.rms_norm(x, (x.size(-1),))


class RMSNorm(nn.Module):
    """`rms_norm` as a module without parameters: nanochat's QK-norm (a module so that the
    attention holds `q_norm` / `k_norm` whichever norm it uses, as timm's does)."""

    def __init__(self, dim: int):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) = the two halves of the head dim. x: [B, H, N, D]; cos/sin: [N, D/2]."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class KVCache:
    """Pre-allocated keys/values of every layer for autoregressive generation.

    Args:
        num_layers: number of attention layers that share this cache.
        batch_size, num_heads, head_dim: shapes of one layer's keys.
        max_len: longest sequence (prompt + generated tokens) the cache holds.
    """

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int,
                 max_len: int, device=None, dtype=torch.float32):
        shape = (num_layers, 2, batch_size, num_heads, max_len, head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0  # tokens already stored (same for every layer once a forward completes)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, H, T, D] at the current position; return all keys/values so far."""
        t0, t1 = self.pos, self.pos + k.shape[2]
        if t1 > self.max_len:
            raise ValueError(f"KV cache overflow: {t1} tokens > max_len={self.max_len}")
        self.kv[layer, 0, :, :, t0:t1] = k
        self.kv[layer, 1, :, :, t0:t1] = v
        return self.kv[layer, 0, :, :, :t1], self.kv[layer, 1, :, :, :t1]

    def advance(self, n: int):
        self.pos += n


def merge_heads(out: torch.Tensor, v: torch.Tensor, n_std: int) -> torch.Tensor:
    """Heads [B, N, H, D] -> [B, N, H * D], the last H - n_std heads as v - out (Laplacian)."""
    B, N, H, D = out.shape
    if n_std == 0:
        merged = v - out
    elif n_std < H:
        # The cat is the head-merging copy that the standard path makes anyway, so k > 0 costs
        # one elementwise op on k heads.
        merged = torch.cat((out[:, :, :n_std], v[:, :, n_std:] - out[:, :, n_std:]), dim=2)
    else:
        merged = out
    return merged.reshape(B, N, H * D)


class LaplacianProjection(torch.autograd.Function):
    """y = merge_heads(out, v, n_std) @ W^T + b, saving for backward only `out` and `v`.

    Plain autograd keeps the merged tensor for the weight gradient: a new activation as large as
    the attention output (at k = 0 too: there the merge is the head-merging copy of SDPA's
    [B, H, N, D] output).
    Here the merge is recomputed in backward from `out` and `v`, which SDPA keeps anyway, so a
    Laplacian head adds no saved activation (the bf16 weight copy of autocast is not kept either:
    the weight is cast again in backward). Why by hand: autograd cannot be told to recompute one
    op (activation checkpointing of the layer would recompute SDPA too).
    Autocast: the compute dtype is autocast's when it is on, as F.linear's would be.
    """

    @staticmethod
    def forward(ctx, out, v, weight, bias, n_std: int):
        dev = out.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else out.dtype
        with torch.autocast(dev, enabled=False):
            merged = merge_heads(out.to(dt), v.to(dt), n_std)
            y = F.linear(merged, weight.to(dt), None if bias is None else bias.to(dt))
        ctx.save_for_backward(out, v, weight)
        ctx.n_std, ctx.dt, ctx.has_bias = n_std, dt, bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        out, v, weight = ctx.saved_tensors
        n_std, dt = ctx.n_std, ctx.dt
        need_out, need_v, need_w, need_b = ctx.needs_input_grad[:4]
        g_out = g_v = g_w = g_b = None
        with torch.autocast(gy.device.type, enabled=False):
            gy = gy.to(dt)
            gy2 = gy.reshape(-1, gy.shape[-1])
            if need_w:
                merged = merge_heads(out.to(dt), v.to(dt), n_std)
                g_w = (gy2.t() @ merged.reshape(gy2.shape[0], -1)).to(weight.dtype)
            if need_b and ctx.has_bias:
                g_b = gy2.sum(0).to(weight.dtype)
            if need_out or need_v:
                g_m = (gy @ weight.to(dt)).view(out.shape)  # d loss / d merged, [B, N, H, D]
                if need_v and n_std < out.shape[2]:  # the identity term: the Laplacian heads' slice
                    # (zero elsewhere; at k = 0 none)
                    if n_std:
                        g_v = g_m.new_zeros(g_m.shape)
                        g_v[:, :, n_std:] = g_m[:, :, n_std:]
                    else:
                        g_v = g_m
                    g_v = g_v.to(v.dtype)
                if need_out:  # -P V on the Laplacian heads; g_m is ours, negated in place
                    if n_std:
                        g_m[:, :, n_std:].neg_()
                        g_out = g_m
                    else:
                        g_out = -g_m
                    g_out = g_out.to(out.dtype)
        return g_out, g_v, g_w, g_b, None


def gate_start(num_heads: int, num_laplacian_heads: int, device=None) -> torch.Tensor:
    """The learned gates' starting logits: +GATE_START_LOGIT on the last k heads, - on the others."""
    is_lap = torch.zeros(num_heads, device=device)
    is_lap[num_heads - num_laplacian_heads:] = 1.0
    return GATE_START_LOGIT * (2.0 * is_lap - 1.0)


@torch.no_grad()
def learned_gates(model: nn.Module) -> dict[str, list[float]]:
    """{layer: [a_h per head]} of every attention with learned gates ("blocks.0" for the
    attention at "blocks.0.attn"); empty when there are none."""
    return {name.removesuffix(".attn"): torch.sigmoid(m.laplacian_gate.float()).tolist()
            for name, m in model.named_modules()
            if isinstance(m, Attention) and m.laplacian_mode == "learned"}


def gate_metrics(model: nn.Module) -> dict[str, float]:
    """Learned gates as flat metrics, "gate.<layer>.h<head>": a (what the engine logs)."""
    return {f"gate.{layer}.h{h}": a
            for layer, heads in learned_gates(model).items() for h, a in enumerate(heads)}


def laplacian_counts(num_laplacian_heads, depth: int, num_heads: int) -> list[int]:
    """Normalise an int (same in every layer) or a per-layer list to a validated list of ints."""
    if isinstance(num_laplacian_heads, numbers.Integral):
        counts = [int(num_laplacian_heads)] * depth
    else:
        counts = [int(k) for k in num_laplacian_heads]
        if len(counts) != depth:
            raise ConfigError(f"num_laplacian_heads has {len(counts)} entries but the model has "
                              f"{depth} layers: give one count per layer or a single int")
    for i, k in enumerate(counts):
        if not 0 <= k <= num_heads:
            raise ConfigError(f"num_laplacian_heads={k} in layer {i} is outside 0..{num_heads} "
                              f"(this model has {num_heads} heads per layer)")
    return counts


def block_indices(layers, depth: int) -> set[int]:
    """Validated block indices for forward_features: None = all, negatives count from the end."""
    if layers is None:
        return set(range(depth))
    bad = [i for i in layers if not -depth <= i < depth]
    if bad:
        raise IndexError(f"layers={list(layers)}: index {bad[0]} is outside the {depth} blocks")
    return {i % depth for i in layers}


class Attention(nn.Module):
    """Multi-head self-attention whose last `num_laplacian_heads` heads output V - P V.

    Args:
        dim: model width; split into `num_heads` heads of size dim // num_heads.
        num_heads: heads in this layer.
        num_laplacian_heads: k, the last k heads are Laplacian (0 = standard attention).
        laplacian_mode: "fixed" (the paper: heads are P or I - P) or "learned" (every head
            mixes P V and V - P V with a learnable sigmoid gate; k then sets the gate's start:
            the last k heads start at a = 0.73, the others at 0.27, `GATE_START_LOGIT`).
        qkv_bias: bias on the fused qkv projection (ViT: True, GPT: False).
        proj_bias: bias on the output projection.
        qk_norm: normalise each head's queries and keys before the product (after rotary).
        norm_layer: the QK-norm's layer, built as norm_layer(head_dim): None is nanochat's
            parameter-free RMSNorm (the GPT); the ViT passes its LayerNorm (eps 1e-6), whose
            weights are timm's `q_norm` / `k_norm` (the first author's `qk_norm=True` models).
        attn_drop, proj_drop: dropout on attention weights / output (DeiT-III uses 0).
        fused: use F.scaled_dot_product_attention; False forms P explicitly (reference path).
    """

    def __init__(self, dim: int, num_heads: int, num_laplacian_heads: int = 0,
                 laplacian_mode: str = "fixed", qkv_bias: bool = False, proj_bias: bool = True,
                 qk_norm: bool = False, norm_layer: Optional[Callable[[int], nn.Module]] = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, fused: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ConfigError(f"dim={dim} is not divisible by num_heads={num_heads}")
        if not 0 <= num_laplacian_heads <= num_heads:
            raise ConfigError(f"num_laplacian_heads={num_laplacian_heads} is outside "
                              f"0..{num_heads} (num_heads)")
        if laplacian_mode not in LAPLACIAN_MODES:
            raise ConfigError(f"laplacian_mode={laplacian_mode!r}: choose one of {LAPLACIAN_MODES}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.num_laplacian_heads = num_laplacian_heads
        self.laplacian_mode = laplacian_mode
        self.fused = fused
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        norm_layer = norm_layer or RMSNorm
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        if laplacian_mode == "learned":
            self.laplacian_gate = nn.Parameter(torch.empty(num_heads))
        else:
            # A buffer, not a parameter: the paper's heads add no parameters. Not persistent,
            # so checkpoints and timm state dicts carry no extra key.
            self.register_buffer("is_laplacian", torch.empty(num_heads), persistent=False)
        self.reset_laplacian()

    @torch.no_grad()
    def reset_laplacian(self):
        """(Re)set which heads are Laplacian: the last k. Also after `to_empty` from meta."""
        is_lap = torch.zeros(self.num_heads, device=self.qkv.weight.device)
        is_lap[self.num_heads - self.num_laplacian_heads:] = 1.0
        if is_lap.is_meta:
            return
        if self.laplacian_mode == "learned":
            self.laplacian_gate.copy_(gate_start(self.num_heads, self.num_laplacian_heads, is_lap.device))
        else:
            self.is_laplacian.copy_(is_lap)

    def laplacian_weight(self) -> Optional[torch.Tensor]:
        """Per-head weight a_h of V - P V in the output, shape [H, 1, 1]; None if all zero."""
        if self.laplacian_mode == "learned":
            return torch.sigmoid(self.laplacian_gate).view(-1, 1, 1)
        if self.num_laplacian_heads == 0:
            return None
        return self.is_laplacian.view(-1, 1, 1)

    def forward(self, x: torch.Tensor, is_causal: bool = False,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                kv_cache: Optional[KVCache] = None, layer_idx: int = 0,
                return_attn: bool = False):
        """x: [B, N, C]. rope: (cos, sin) for these N positions. With `kv_cache`, x holds the
        new tokens only and attends to the cached prefix. Returns [B, N, C], and P
        [B, H, N, N_keys] as well when return_attn (reference path only)."""
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, N, D]
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
            # q and k are new tensors now: a view v would keep all of qkv's output (3x v) alive
            # for backward; its own copy lets that be freed (nanochat's separate c_v).
            v = v.contiguous()
        q, k = self.q_norm(q), self.k_norm(k)

        keys, values, mask = k, v, None
        if kv_cache is not None:
            prefix = kv_cache.pos
            keys, values = kv_cache.update(layer_idx, k, v)
            if is_causal and prefix > 0 and N > 1:
                # SDPA's is_causal aligns the mask top-left; with a prefix it must be shifted.
                q_pos = torch.arange(prefix, prefix + N, device=x.device)
                mask = q_pos[:, None] >= torch.arange(prefix + N, device=x.device)[None, :]
                is_causal = False
            elif prefix > 0:  # one new token (or no causality): it sees the whole prefix
                is_causal = False

        drop = self.attn_drop if self.training else 0.0
        attn = None
        if self.fused and not return_attn:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 dropout_p=drop, is_causal=is_causal)
        else:
            out, attn = self._reference(q, keys, values, mask, is_causal, drop)

        # `v` is the value of each query token itself: the identity term of (I - P) V, also
        # under a KV cache. Heads are merged in the same copy: [B, H, N, D] -> [B, N, H, D].
        out, v = out.transpose(1, 2), v.transpose(1, 2)
        n_std = self.num_heads - self.num_laplacian_heads
        if self.laplacian_mode == "learned":
            # (1 - a) P V + a (V - P V), a per head in (0, 1).
            out = torch.lerp(out, v - out, self.laplacian_weight().view(-1, 1).to(out.dtype))
            out = self.proj(out.reshape(B, N, C))
        elif (attn is None and torch.is_grad_enabled()
              and torch.amp.is_autocast_available(x.device.type)):  # not on "meta"
            # Fused path: merge + projection keep no extra activation. Also at k = 0, where the
            # merge is the head-merging copy of SDPA's [B, H, N, D] output, kept by plain autograd.
            out = LaplacianProjection.apply(out, v, self.proj.weight, self.proj.bias, n_std)
        else:  # the reference path (plain autograd: the ground truth), or no grad
            out = self.proj(merge_heads(out, v, n_std))
        out = self.proj_drop(out)
        return (out, attn) if return_attn else out

    def _reference(self, q, k, v, mask, is_causal, drop):
        """Softmax attention with P formed explicitly: the ground truth for the fused path."""
        scores = (q @ k.transpose(-2, -1)) * self.scale  # [B, H, N, N_keys]
        if is_causal:
            n_q, n_k = scores.shape[-2:]
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = scores.softmax(dim=-1)
        out = F.dropout(attn, drop) @ v if drop else attn @ v
        return out, attn

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, laplacian_heads={self.num_laplacian_heads}, "
                f"mode={self.laplacian_mode}, fused={self.fused}")

