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
choice). Beyond the paper, `laplacian_mode="learned"` gives every head a gate a_h = sigmoid(g_h),
g_h its logit (the parameter `laplacian_gate`), and outputs (1 - a_h) P V + a_h (V - P V), so
training decides how much each head smooths. The gates start at sigmoid(+-1) = 0.73 / 0.27
(`GATE_START_LOGIT`, see `gate_start_logits`).
In training, the heads are merged and projected by laplace.merged_projection, which saves less
for backward than plain autograd (`save_memory`, on by default; the same values).

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
from .merged_projection import merge, merge_laplacian, merged_projection

LAPLACIAN_MODES = ("fixed", "learned")
#: Learned gates start at logit +1 (the last k heads: a = 0.73) or -1 (the others: a = 0.27).
#: Why not nearer 0 / 1: Adam moves a logit by about lr per step, so a gate moves by about
#: sigmoid'(logit) x lr; at +-4 (0.98 / 0.02) that slope is 0.018, at +-1 it is 0.20, 11 times
#: larger (what the gates did from each start: docs/LOG.md, "Learned gates that move"). Why not 0:
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


def laplacian_mask(num_heads: int, num_laplacian_heads: int, device=None) -> torch.Tensor:
    """[H]: 1.0 on the last k heads (the Laplacian ones), 0.0 on the others."""
    return (torch.arange(num_heads, device=device) >= num_heads - num_laplacian_heads).float()


def gate_start_logits(num_heads: int, num_laplacian_heads: int, device=None) -> torch.Tensor:
    """The gate logits g a learned attention starts from: +GATE_START_LOGIT on the last k heads,
    - on the others."""
    return GATE_START_LOGIT * (2.0 * laplacian_mask(num_heads, num_laplacian_heads, device) - 1.0)


@torch.no_grad()
def learned_gates(model: nn.Module) -> dict[str, list[float]]:
    """{layer: [gate a_h = sigmoid(g_h) per head]} of every attention with learned gates ("blocks.0" for the
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
    for i, k in enumerate(counts):  # the one range check of k (the zoo's names and every model come here)
        if not 0 <= k <= num_heads:
            where = "" if isinstance(num_laplacian_heads, numbers.Integral) else f" in layer {i}"
            raise ConfigError(f"num_laplacian_heads={k}{where} is outside 0..{num_heads} "
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
        save_memory: merge and project the heads keeping no extra activation for backward
            (laplace.merged_projection); False: plain autograd.
    """

    def __init__(self, dim: int, num_heads: int, num_laplacian_heads: int = 0,
                 laplacian_mode: str = "fixed", qkv_bias: bool = False, proj_bias: bool = True,
                 qk_norm: bool = False, norm_layer: Optional[Callable[[int], nn.Module]] = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, fused: bool = True, save_memory: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ConfigError(f"dim={dim} is not divisible by num_heads={num_heads}")
        num_laplacian_heads, = laplacian_counts(num_laplacian_heads, 1, num_heads)
        if laplacian_mode not in LAPLACIAN_MODES:
            raise ConfigError(f"laplacian_mode={laplacian_mode!r}: choose one of {LAPLACIAN_MODES}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.num_laplacian_heads = num_laplacian_heads
        self.laplacian_mode = laplacian_mode
        self.fused, self.save_memory = fused, save_memory
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        norm_layer = norm_layer or RMSNorm
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        if laplacian_mode == "learned":  # the paper's fixed heads add no parameter
            self.laplacian_gate = nn.Parameter(torch.empty(num_heads))  # the gates' logits g
        self.reset_laplacian()

    @torch.no_grad()
    def reset_laplacian(self):
        """(Re)set the gate logits to their start (`gate_start_logits`); also after `to_empty` from meta."""
        if self.laplacian_mode == "learned" and not self.laplacian_gate.is_meta:
            self.laplacian_gate.copy_(gate_start_logits(self.num_heads, self.num_laplacian_heads, self.laplacian_gate.device))

    def gates(self) -> torch.Tensor:
        """[H]: each head's gate a, the weight of V - P V in its output: learned, sigmoid(g) of the
        logits `laplacian_gate`; fixed, 1 on the last k heads and 0 on the others."""
        if self.laplacian_mode == "learned":
            return torch.sigmoid(self.laplacian_gate)
        return laplacian_mask(self.num_heads, self.num_laplacian_heads, self.qkv.weight.device)

    def forward(self, x: torch.Tensor, is_causal: bool = False,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                kv_cache: Optional[KVCache] = None, layer_idx: int = 0,
                return_attn: bool = False):
        """x: [B, N, C]. rope: (cos, sin) for these N positions. With `kv_cache`, x holds the
        new tokens only and attends to the cached prefix. Returns [B, N, C], and P
        [B, H, N, N_keys] as well when return_attn (reference path only)."""
        B, N, _ = x.shape
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
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=drop, is_causal=is_causal)
        else:
            out, attn = self._reference(q, keys, values, mask, is_causal, drop)

        # `v` is each query token's own value: the identity term of (I - P) V, also under a KV cache.
        if self.laplacian_mode == "learned":  # (1 - a) P V + a (V - P V), a per head in (0, 1)
            out = self.proj(merge(torch.lerp(out, v - out, self.gates().view(-1, 1, 1).to(out.dtype))))
        elif self.save_memory and attn is None and torch.is_grad_enabled() and torch.amp.is_autocast_available(x.device.type):
            out = merged_projection(out, v, self.num_laplacian_heads, self.proj)  # as below, less saved
        else:
            out = self.proj(merge_laplacian(out, v, self.num_laplacian_heads))  # V - P V on the last k heads
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

