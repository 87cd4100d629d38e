"""nanochat-style GPT with Laplacian heads (the paper's 561M language model at depth 20).

nanochat's design (Oct 2025 - Jan 2026): width 64 x depth, heads of 128, rotary embeddings,
QK-norm, parameter-free RMSNorm, ReLU^2 MLP, no biases, untied embedding and output layer, logits
soft-capped at 15, zero-initialised output layers; each choice is commented where it is made.
The depth-20 model with vocab 65,536 has exactly 560,988,160 parameters. Under autocast the
residual stream, the rotary tables and the KV cache are bf16 as nanochat keeps them, the logits
float32; without autocast (CPU) everything is float32.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .attention import RMSNorm, attn_layer, laplacian_counts
from .sampling import sample_next  # the one token-picking rule (also the streaming sampler's)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim (nanochat's `norm`)."""
    return F.rms_norm(x, (x.size(-1),))


def block_indices(layers, depth: int) -> set[int]:
    """Validated block indices of `layers` (None: all; negative ones count from the end)."""
    if layers is None:
        return set(range(depth))
    bad = [i for i in layers if not -depth <= i < depth]
    if bad:
        raise IndexError(f"layers={list(layers)}: index {bad[0]} is outside the {depth} blocks")
    return {i % depth for i in layers}


class KVCache:
    """Pre-allocated keys and values of every layer for autoregressive generation.

    Args:
        num_layers: attention layers sharing the cache.
        batch_size, num_heads, head_dim: the shape of one layer's keys.
        max_len: the longest sequence (prompt + generated tokens) it holds.
    """

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int,
                 max_len: int, device=None, dtype=torch.float32):
        self.kv = torch.zeros((num_layers, 2, batch_size, num_heads, max_len, head_dim), device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0  # tokens stored (the same in every layer once a forward completes)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
        """Store the new keys and values [B, H, N, D] of `layer`; return what SDPA attends to:
        (keys and values so far, mask, is_causal)."""
        t0, t1 = self.pos, self.pos + k.shape[2]
        if t1 > self.max_len:
            raise ValueError(f"KV cache overflow: {t1} tokens > max_len={self.max_len}")
        self.kv[layer, 0, :, :, t0:t1] = k
        self.kv[layer, 1, :, :, t0:t1] = v
        mask = None
        if t0 > 0:
            if is_causal and t1 - t0 > 1:  # SDPA's is_causal aligns the mask top-left: shift it past the prefix
                mask = torch.arange(t0, t1, device=k.device)[:, None] >= torch.arange(t1, device=k.device)[None, :]
            is_causal = False  # (one new token sees the whole prefix)
        return self.kv[layer, 0, :, :, :t1], self.kv[layer, 1, :, :, :t1], mask, is_causal

    def advance(self, n: int):
        self.pos += n


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.c_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())  # ReLU^2 (nanochat), 4x wide, no biases


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_laplacian_heads: int, laplacian_mode: str,
                 fused_attn: bool, attention: str = "softmax", depth: int = 0):
        super().__init__()
        # nanochat's attention: no biases, QK-norm by a parameter-free RMSNorm (after rotary); the arm's
        # class (laplace.attention.ARMS), depth: this block's index (DIFF's lambda starts by it)
        self.attn = attn_layer(num_laplacian_heads, laplacian_mode, attention)(
            dim, num_heads, qkv_bias=False, proj_bias=False, qk_norm=True, norm_layer=RMSNorm, depth=depth)
        self.attn.fused_attn = fused_attn
        self.mlp = MLP(dim)

    def forward(self, x, rope, kv_cache=None, layer_idx=0):
        # pre-norm blocks, the norm without parameters (nanochat's `norm`)
        x = x + self.attn(rms_norm(x), is_causal=True, rope=rope, kv_cache=kv_cache,
                          layer_idx=layer_idx)
        return x + self.mlp(rms_norm(x))


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Autocast's dtype where it is on for t's device, else t's own."""
    dev = t.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):  # not on "meta"
        return torch.get_autocast_dtype(dev)
    return t.dtype


def gpt_dims(depth: int, aspect_ratio: int = 64, head_dim: int = 128) -> tuple[int, int]:
    """(width, num_heads) of nanochat's depth-parametrised model."""
    width = depth * aspect_ratio  # nanochat: the depth sets the width (d20: 1280)
    num_heads = max(1, math.ceil(width / head_dim))  # heads of 128 (d20: 10)
    return width, num_heads


class GPT(nn.Module):
    """Causal language model; the last k heads of every layer are Laplacian.

    Args:
        vocab_size: tokens (nanochat's tokenizer: 65,536).
        depth: layers; width = 64 x depth and heads = ceil(width / 128) unless given.
        num_laplacian_heads: int (every layer) or a per-layer list.
        laplacian_mode: "fixed" (the paper) or "learned" (a sigmoid gate per head).
        attention: the other heads' arm: "softmax", "xsa", "gated" or "diff" (laplace.attention.ARMS).
        max_seq_len: longest sequence for the precomputed rotary table (nanochat: 2048);
            the table is sized 10x larger so generation can run past it.
        softcap: logit soft-cap (15); 0 disables it.
        width, num_heads: override the depth-derived shapes (tests, ablations).
        fused_attn: SDPA kernels (True) or the explicit-softmax reference path.
        grad_checkpointing: recompute every block in backward instead of keeping its
            activations (training only; the same losses and gradients).
    """

    def __init__(self, vocab_size: int = 65536, depth: int = 20,
                 num_laplacian_heads: int | Sequence[int] = 0, laplacian_mode: str = "fixed", attention: str = "softmax",
                 max_seq_len: int = 2048, softcap: float = 15.0, width: Optional[int] = None,
                 num_heads: Optional[int] = None, rope_base: float = 10000.0,
                 fused_attn: bool = True, grad_checkpointing: bool = False):
        super().__init__()
        d_width, d_heads = gpt_dims(depth)
        width, num_heads = width or d_width, num_heads or d_heads
        self.vocab_size, self.depth, self.width, self.num_heads = vocab_size, depth, width, num_heads
        self.head_dim = width // num_heads
        self.softcap = softcap
        self.grad_checkpointing = grad_checkpointing
        self.num_laplacian_heads = laplacian_counts(num_laplacian_heads, depth, num_heads)
        self.wte = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList([Block(width, num_heads, k, laplacian_mode, fused_attn, attention, i)
                                     for i, k in enumerate(self.num_laplacian_heads)])
        self.lm_head = nn.Linear(width, vocab_size, bias=False)  # untied from wte (nanochat)
        # Rotary table (base 10,000; no learned positions): non-persistent, so neither a parameter
        # nor in the state dict; 10x the context, so generation can run past it.
        self.rope_base = rope_base
        self.rope_len = 10 * max_seq_len
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """nanochat's init: fan-in scaled normal, unit-variance embedding, zero output layers.
        Call it after moving a meta-device model to a real device with `to_empty`."""
        for m in self.modules():
            if isinstance(m, nn.Linear):  # fan-in scaled, and smaller for a layer that narrows
                fan_out, fan_in = m.weight.shape
                std = 1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=1.0)
        # Zero output layers: every block starts as the identity and the first logits are uniform.
        nn.init.zeros_(self.lm_head.weight)
        for blk in self.blocks:
            nn.init.zeros_(blk.attn.proj.weight)
            nn.init.zeros_(blk.mlp.c_proj.weight)
            blk.attn.reset_laplacian()
        self._build_rope(self.wte.weight.device)

    def _build_rope(self, device):
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.rope_base ** (torch.arange(half, device=device, dtype=torch.float32) / half))
        t = torch.arange(self.rope_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [T, D/2]
        self.rope_cos, self.rope_sin = freqs.cos(), freqs.sin()

    def _rope(self, start: int, n: int, dtype):
        if self.rope_cos.numel() == 0 or self.rope_cos.device != self.wte.weight.device:
            self._build_rope(self.wte.weight.device)
        if start + n > self.rope_len:
            raise ValueError(f"sequence of {start + n} tokens exceeds the rotary table "
                             f"({self.rope_len}); raise max_seq_len")
        return (self.rope_cos[start:start + n].to(dtype), self.rope_sin[start:start + n].to(dtype))

    def _run(self, idx: torch.Tensor, kv_cache: Optional[KVCache] = None,
             collect: Optional[set[int]] = None):
        """Shared trunk: returns the final-norm output and any collected block outputs."""
        start = kv_cache.pos if kv_cache is not None else 0
        x = self.wte(idx)
        # nanochat keeps wte in bf16 on CUDA; here the float32 master weights are cast after the
        # lookup: the forward sees the same bf16 values, the optimizer updates float32 weights, and
        # under autocast every residual addition (and its gradient) is rounded to bf16 as nanochat's.
        x = x.to(compute_dtype(x))
        rope = self._rope(start, idx.shape[1], x.dtype)
        x = rms_norm(x)
        # grad_checkpointing: each block recomputed in backward, only its input kept (~1/3 more compute)
        recompute = self.grad_checkpointing and kv_cache is None and torch.is_grad_enabled()
        feats = {}
        for i, blk in enumerate(self.blocks):
            x = checkpoint(blk, x, rope, use_reentrant=False) if recompute else blk(x, rope, kv_cache, i)
            if collect is not None and i in collect:
                feats[f"blocks.{i}"] = x
        if kv_cache is not None:
            kv_cache.advance(idx.shape[1])
        return rms_norm(x), feats

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        z = self.lm_head(h).float()  # float32 logits, also under autocast
        # nanochat's soft cap, 15 tanh(z / 15): the logits stay within +-15
        return self.softcap * torch.tanh(z / self.softcap) if self.softcap else z

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, ignore_index: int = -1, reduction: str = "mean"):
        """idx [B, T] token ids. Returns logits [B, T, V], or with `targets` the cross-entropy
        (`reduction` "mean" over the counted positions, or "none": [B, T], 0 where skipped);
        positions whose target is `ignore_index` are skipped."""
        h, _ = self._run(idx, kv_cache)
        z = self.logits(h)
        if targets is None:
            return z
        loss = F.cross_entropy(z.view(-1, z.size(-1)), targets.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction)
        return loss if reduction != "none" else loss.view(targets.shape)

    def forward_features(self, idx: torch.Tensor, layers: Optional[Sequence[int]] = None,
                         norm: bool = True) -> dict[str, torch.Tensor]:
        """Token representations [B, T, width]: {"blocks.i": residual stream after block i for
        i in `layers` (default all), "norm": final-norm output (the lm_head's input)}."""
        wanted = block_indices(layers, self.depth)
        h, feats = self._run(idx, collect=wanted)
        if norm:
            feats["norm"] = h
        return feats

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, nanochat's estimate (what the logged MFU divides by): 6 x the
        parameters outside the embedding, plus the attention's 12 x layers x heads x head size x context."""
        n = sum(p.numel() for p in self.parameters()) - self.wte.weight.numel()
        return 6 * n + 12 * self.depth * self.num_heads * self.head_dim * seq_len

    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty cache in the compute dtype: autocast's if it is on here, else the weights'."""
        w = self.wte.weight
        return KVCache(self.depth, batch_size, self.num_heads, self.head_dim, max_len,
                       device=w.device, dtype=compute_dtype(w))

    @torch.inference_mode()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, use_cache: bool = True,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Sample `max_new_tokens` after the prompt idx [B, T]; temperature 0 is greedy,
        `top_k` None or 0 samples from the whole vocabulary. With `use_cache` the prompt is
        encoded once and each step feeds one token."""
        if temperature < 0:
            raise ValueError(f"temperature={temperature}: use 0 (greedy) or a positive value")
        if top_k is not None and top_k < 0:
            raise ValueError(f"top_k={top_k}: use a positive count, or 0 / None for no top-k")
        cache = self.new_kv_cache(idx.shape[0], idx.shape[1] + max_new_tokens) if use_cache else None
        out, step_in = idx, idx
        for _ in range(max_new_tokens):
            nxt = sample_next(self.forward(step_in, kv_cache=cache)[:, -1, :], temperature, top_k, generator)
            out = torch.cat((out, nxt), dim=1)
            step_in = nxt if use_cache else out
        return out
