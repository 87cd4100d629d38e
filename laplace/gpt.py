"""nanochat-style GPT with Laplacian heads (the paper's 561M language model at depth 20).

nanochat's design (Oct 2025 - Jan 2026): width 64 x depth, heads of 128, rotary embeddings,
QK-norm, parameter-free RMSNorm, ReLU^2 MLP, no biases, untied embedding and output layer, logits
soft-capped at 15, zero-initialised output layers; each choice is commented where it is made.
The depth-20 model with vocab 65,536 has exactly 560,988,160 parameters. Under autocast the
residual stream, the rotary tables and the KV cache are bf16 as nanochat keeps them, the logits
float32; without autocast (CPU) everything is float32.

nanochat's 2026 GPT (92d63d4, the first author's fork) is the same class with options (the zoo's
`gpt26_d{depth}_{k}L`: laplace.zoo.GPT26): value embeddings, sliding windows, q and k x 1.2, RoPE base
100,000, per-layer residual and x0 scalars, smear, backout, GQA, a padded vocabulary and its init.
Its parameters keep nanochat's names (value_embeds.<i>, blocks.<i>.attn.ve_gate, resid_lambdas,
x0_lambdas, smear_gate, smear_lambda, backout_lambda); laplace.nanochat loads its checkpoints.
"""
import functools
import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .attention import RMSNorm, attn_layer, laplacian_counts
from .errors import ConfigError
from .sampling import check_sampling, sample_next  # the one token-picking rule and its checks (the streamer's too)


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
        self.prev_embedding = None  # the smear's input: the last token's embedding so far

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


class ScaledRMSNorm(nn.Module):
    """Parameter-free RMSNorm times a constant: nanochat 2026's QK-norm, q and k x 1.2 (sharper attention)."""

    def __init__(self, dim: int, scale: float = 1.2, **_):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return rms_norm(x) * self.scale


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_laplacian_heads: int, laplacian_mode: str,
                 fused_attn: bool, num_kv_heads: int, value_embed: bool, qk_scale: float,
                 attention: str = "softmax", depth: int = 0):
        super().__init__()
        # nanochat's attention: no biases, QK-norm by a parameter-free RMSNorm (after rotary); the arm's
        # class (laplace.attention.ARMS), depth: this block's index (DIFF's lambda starts by it)
        norm = RMSNorm if qk_scale == 1.0 else functools.partial(ScaledRMSNorm, scale=qk_scale)
        gqa_ve = dict(num_kv_heads=num_kv_heads, value_embed=value_embed) if num_kv_heads or value_embed else {}
        if attention == "diff" and gqa_ve:  # timm's DIFF splits q and k in halves; no GQA or value embedding
            raise ConfigError("attention=diff takes neither num_kv_heads nor value embeddings (use_ve): "
                              "switch them off, or use attention=softmax, xsa or gated")
        self.attn = attn_layer(num_laplacian_heads, laplacian_mode, attention)(
            dim, num_heads, qkv_bias=False, proj_bias=False, qk_norm=True, norm_layer=norm, depth=depth, **gqa_ve)
        self.attn.fused_attn = fused_attn
        self.mlp = MLP(dim)

    def forward(self, x, rope, kv_cache=None, layer_idx=0, ve=None, mask=None):
        # pre-norm blocks, the norm without parameters (nanochat's `norm`); a window's mask, else causal
        x = x + self.attn(rms_norm(x), attn_mask=mask, is_causal=mask is None, rope=rope, kv_cache=kv_cache,
                          layer_idx=layer_idx, ve=ve)
        return x + self.mlp(rms_norm(x))


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Autocast's dtype where it is on for t's device, else t's own."""
    dev = t.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):  # not on "meta"
        return torch.get_autocast_dtype(dev)
    return t.dtype


def gpt_dims(depth: int, aspect_ratio: int = 64, head_dim: int = 128, round_width: bool = False) -> tuple[int, int]:
    """(width, num_heads) of nanochat's depth-parametrised model (2026: width rounded up to whole heads)."""
    width = depth * aspect_ratio  # nanochat: the depth sets the width (d20: 1280)
    if round_width:  # nanochat 2026: heads of exactly 128 (d3: 256 wide, 2 heads)
        width = -(-width // head_dim) * head_dim
    return width, max(1, math.ceil(width / head_dim))  # heads of 128 (d20: 10)


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
    nanochat 2026's options (off: the 2025 model, unchanged):
        num_kv_heads: key/value heads (GQA; None: one per head). round_width: width up to whole heads of 128.
        window_pattern: "L" long / "S" short (a quarter of max_seq_len, rounded up to 128) tiled over
            the layers, the last one long. qk_scale: q and k x this after QK-norm (1.2).
        use_ve, use_resid_lambdas, use_x0, use_smear, use_backout: the fork's ablation switches.
        pad_vocab_to: embedding and output rows padded to a multiple (64); logits cropped.
        init: "2025" or "2026" (nanochat 92d63d4's init_weights).
    """

    def __init__(self, vocab_size: int = 65536, depth: int = 20,
                 num_laplacian_heads: int | Sequence[int] = 0, laplacian_mode: str = "fixed", attention: str = "softmax",
                 max_seq_len: int = 2048, softcap: float = 15.0, width: Optional[int] = None,
                 num_heads: Optional[int] = None, rope_base: float = 10000.0,
                 fused_attn: bool = True, grad_checkpointing: bool = False,
                 num_kv_heads: Optional[int] = None, round_width: bool = False, window_pattern: str = "L",
                 qk_scale: float = 1.0, use_ve: bool = False, use_resid_lambdas: bool = False,
                 use_x0: bool = False, use_smear: bool = False, use_backout: bool = False,
                 pad_vocab_to: int = 1, init: str = "2025"):
        super().__init__()
        d_width, d_heads = gpt_dims(depth, round_width=round_width)
        width, num_heads = width or d_width, num_heads or d_heads
        self.vocab_size, self.depth, self.width, self.num_heads = vocab_size, depth, width, num_heads
        self.head_dim = width // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.softcap = softcap
        self.grad_checkpointing = grad_checkpointing
        self.num_laplacian_heads = laplacian_counts(num_laplacian_heads, depth, num_heads)
        if init not in ("2025", "2026") or set(window_pattern.upper()) - set("SL") or not window_pattern:
            raise ConfigError(f"init={init!r}, window_pattern={window_pattern!r}: init is 2025 or 2026, "
                              f"the pattern a string of S (short) and L (long), e.g. SSSL")
        self.init = init
        # Per layer: None (all keys, causal) or the keys a token sees besides itself (nanochat's FA3
        # window (w, 0)); the short one is a quarter of the context rounded up to 128, the last layer long.
        short = -(-max_seq_len // 4 // 128) * 128
        self.windows = [short if window_pattern.upper()[i % len(window_pattern)] == "S" else None
                        for i in range(depth - 1)] + [None]
        padded = -(-vocab_size // pad_vocab_to) * pad_vocab_to  # nanochat 2026: rows to a multiple of 64
        self.wte = nn.Embedding(padded, width)
        # value embeddings on alternating layers, the last one included (nanochat's has_ve)
        has_ve = [use_ve and i % 2 == (depth - 1) % 2 for i in range(depth)]
        self.blocks = nn.ModuleList([Block(width, num_heads, k, laplacian_mode, fused_attn, num_kv_heads, ve,
                                           qk_scale, attention, i)
                                     for i, (k, ve) in enumerate(zip(self.num_laplacian_heads, has_ve))])
        self.lm_head = nn.Linear(width, padded, bias=False)  # untied from wte (nanochat)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(padded, self.num_kv_heads * self.head_dim)
                                           for i in range(depth) if has_ve[i]})
        # 2026's scalars (x = r_i x + a_i x0 before block i; smear; backout), None when switched off so
        # that they leave the state dict (the fork's switches); values from init_weights.
        self.register_parameter("resid_lambdas", nn.Parameter(torch.ones(depth)) if use_resid_lambdas else None)
        self.register_parameter("x0_lambdas", nn.Parameter(torch.zeros(depth)) if use_x0 else None)
        self.smear_gate = nn.Linear(24, 1, bias=False) if use_smear else None
        self.register_parameter("smear_lambda", nn.Parameter(torch.zeros(1)) if use_smear else None)
        self.register_parameter("backout_lambda", nn.Parameter(torch.zeros(1)) if use_backout else None)
        # Rotary table (base 10,000; no learned positions): non-persistent, so neither a parameter
        # nor in the state dict; 10x the context, so generation can run past it.
        self.rope_base = rope_base
        self.rope_len = 10 * max_seq_len
        # Empty until built (init_weights, or _rope on first use); on the CPU also when the model is
        # built on the meta device (laplace.nanochat), so that moving it has nothing to copy off it.
        self.register_buffer("rope_cos", torch.empty(0, device="cpu"), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0, device="cpu"), persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """nanochat's init: fan-in scaled normal, unit-variance embedding, zero output layers.
        Call it after moving a meta-device model to a real device with `to_empty`."""
        self._build_rope(self.wte.weight.device)  # no random numbers: before either init
        if self.init == "2026":
            return self._init_2026()
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

    @torch.no_grad()
    def _init_2026(self):
        """nanochat 92d63d4's init_weights: uniform matrices of std 1/sqrt(width) (c_fc 0.4x), zero
        projections, embedding std 0.8, output layer 0.001, small positive gates, per-layer scalars."""
        s, n = 3 ** 0.5 * self.width ** -0.5, max(self.depth - 1, 1)  # uniform bound of that std
        nn.init.normal_(self.wte.weight, std=0.8)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for blk in self.blocks:
            nn.init.uniform_(blk.attn.qkv.weight, -s, s)
            nn.init.uniform_(blk.mlp.c_fc.weight, -0.4 * s, 0.4 * s)
            nn.init.zeros_(blk.attn.proj.weight)
            nn.init.zeros_(blk.mlp.c_proj.weight)
            if blk.attn.ve_gate is not None:
                nn.init.uniform_(blk.attn.ve_gate.weight, 0.0, 0.02)
            blk.attn.reset_laplacian()
        for ve in self.value_embeds.values():
            nn.init.uniform_(ve.weight, -s, s)
        i = torch.arange(self.depth, dtype=torch.float32, device=self.wte.weight.device)
        # residual scale stronger early, weaker late; more of the input embedding early; smear off; backout 0.2
        scalars = {"resid_lambdas": 1.15 - 0.10 * i / n, "x0_lambdas": 0.20 - 0.15 * i / n, "smear_lambda": 0.0,
                   "backout_lambda": 0.2}
        for name, value in scalars.items():
            p = getattr(self, name)
            if p is not None:  # switched on
                p.copy_(torch.as_tensor(value).expand(p.shape))
        if self.smear_gate is not None:
            nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)

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

    def _smear(self, x: torch.Tensor, kv_cache: Optional[KVCache]) -> torch.Tensor:
        """nanochat 2026's smear: each token adds its predecessor's embedding, gated (bigram information)."""
        prev = kv_cache.prev_embedding if kv_cache is not None else None
        if kv_cache is not None:
            kv_cache.prev_embedding = x[:, -1:]
        if prev is None:  # the first token has no predecessor
            first, cur, before = x[:, :1], x[:, 1:], x[:, :-1]
        else:  # generating: the predecessor of the first new token is the cache's
            first, cur, before = x[:, :0], x, torch.cat((prev, x[:, :-1]), dim=1)
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(cur[..., :24]))
        return torch.cat((first, cur + gate * before), dim=1)

    def _masks(self, start: int, n: int, device) -> list[Optional[torch.Tensor]]:
        """Per layer: None (causal) or a sliding window's mask [n, start + n] (True: attend)."""
        q = torch.arange(start, start + n, device=device)[:, None]
        keys = torch.arange(start + n, device=device)
        masks = {w: (keys <= q) & (q - keys <= w) for w in set(self.windows) if w is not None and w < start + n - 1}
        return [masks.get(w) for w in self.windows]

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
        if self.smear_gate is not None:
            x = self._smear(x, kv_cache)
        x0, backout = x, None  # the normed embedding, mixed back in before every block (x0_lambdas)
        masks = self._masks(start, idx.shape[1], idx.device)
        # grad_checkpointing: each block recomputed in backward, only its input kept (~1/3 more compute)
        recompute = self.grad_checkpointing and kv_cache is None and torch.is_grad_enabled()
        feats = {}
        for i, blk in enumerate(self.blocks):
            if self.resid_lambdas is not None:
                x = self.resid_lambdas[i] * x
            if self.x0_lambdas is not None:
                x = x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx).to(x.dtype) if str(i) in self.value_embeds else None
            args = (x, rope, None if recompute else kv_cache, i, ve, masks[i])
            x = checkpoint(blk, *args, use_reentrant=False) if recompute else blk(*args)
            if collect is not None and i in collect:
                feats[f"blocks.{i}"] = x
            if i == self.depth // 2 and self.backout_lambda is not None:
                backout = x  # the residual at the middle layer, taken off before the final norm
        if backout is not None:
            x = x - self.backout_lambda.to(x.dtype) * backout
        if kv_cache is not None:
            kv_cache.advance(idx.shape[1])
        return rms_norm(x), feats

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        z = self.lm_head(h)[..., :self.vocab_size].float()  # float32 logits, also under autocast; no padded rows
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
        h, feats = self._run(idx, collect=block_indices(layers, self.depth))
        if norm:
            feats["norm"] = h
        return feats

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, nanochat's estimate (what the logged MFU divides by): 6 x the
        parameters outside the embedding, plus the attention's 12 x layers x heads x head size x context."""
        lookups = [self.wte.weight, *self.value_embeds.parameters(), self.resid_lambdas, self.x0_lambdas,
                   self.smear_lambda, self.backout_lambda]  # embeddings and scalars: no matmul
        n = sum(p.numel() for p in self.parameters()) - sum(p.numel() for p in lookups if p is not None)
        context = [min(w, seq_len) if w is not None else seq_len for w in self.windows]  # nanochat's count
        return 6 * n + sum(12 * self.num_heads * self.head_dim * t for t in context)

    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty cache in the compute dtype: autocast's if it is on here, else the weights'."""
        w = self.wte.weight
        return KVCache(self.depth, batch_size, self.num_kv_heads, self.head_dim, max_len,
                       device=w.device, dtype=compute_dtype(w))

    @torch.inference_mode()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, use_cache: bool = True,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Sample `max_new_tokens` after the prompt idx [B, T]; temperature 0 is greedy,
        `top_k` None or 0 samples from the whole vocabulary. With `use_cache` the prompt is
        encoded once and each step feeds one token."""
        check_sampling(temperature, top_k)  # a ConfigError, i.e. a ValueError
        cache = self.new_kv_cache(idx.shape[0], idx.shape[1] + max_new_tokens) if use_cache else None
        out, step_in = idx, idx
        for _ in range(max_new_tokens):
            nxt = sample_next(self.forward(step_in, kv_cache=cache)[:, -1, :], temperature, top_k, generator)
            out = torch.cat((out, nxt), dim=1)
            step_in = nxt if use_cache else out
        return out
