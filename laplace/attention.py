"""Laplacian heads: timm's attention with the last k heads outputting (I - P) V (arXiv:2602.09297).

A standard layer updates tokens with X <- X + sum_i P_i X Wv_i Wo_i; a Laplacian head uses I - P_i
instead of the row-softmax P_i. Per head the output is V - P V, one line after the fused kernel:

    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)           # P V, [B, H, N, D]
    out = torch.cat((out[:, :H - k], v[:, H - k:] - out[:, H - k:]), dim=1)  # last k heads: (I - P) V

No N x N matrix, no new parameter; with a causal mask (I - P) V stays causal. `LaplacianAttention`
is timm's `Attention` (same arguments, same parameter names) with that line, so it drops into any
timm ViT: `timm.create_model("vit_small_patch16_224", attn_layer=laplace.attn_layer(3))`. The GPT
(laplace/gpt.py) uses the same class with rotary embeddings and a KV cache.

Its relatives, the arms of `attn_layer(attention=...)` and of a model node's `attention` key
(docs/arms.md): "xsa" (arXiv:2603.09078, every head's P V less its part along the token's own
value: `xsa` below), "gated" (timm's `gated=True`: an elementwise sigmoid gate of the input on the
heads' output), "diff" (timm's DiffAttention: P1 V - lambda P2 V and a per-head RMSNorm).
"""
import functools
import numbers

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention
from timm.layers import DiffAttention as TimmDiffAttention

from .errors import ConfigError

LAPLACIAN_MODES = ("fixed", "learned")
# The attention of every head that is not Laplacian. Laplacian heads combine with "gated": the gate
# scales whatever a head outputs, (I - P) V as well as P V. Not with "xsa" or "diff": each rewrites
# the head's P V itself (XSA takes out the token's own value, which a Laplacian head adds back), and
# neither paper defines the mix.
ARMS = ("softmax", "xsa", "gated", "diff")
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


def check_arm(attention: str, num_laplacian_heads: int = 0, mode: str = "fixed") -> None:
    """The one check of a mode and an arm against a layer's Laplacian heads (ARMS says which combine)."""
    if mode not in LAPLACIAN_MODES:
        raise ConfigError(f"laplacian_mode={mode!r}: choose one of {LAPLACIAN_MODES}")
    if attention not in ARMS:
        raise ConfigError(f"attention={attention!r}: choose one of {', '.join(ARMS)}")
    if attention in ("xsa", "diff") and (num_laplacian_heads or mode != "fixed"):
        raise ConfigError(f"attention={attention} takes no Laplacian heads: set num_laplacian_heads=0 (and "
                          f"laplacian_mode=fixed), or use attention=softmax or gated with them")


def xsa(y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exclusive self attention (arXiv:2603.09078): y_i - (y_i . v_i) v_i / |v_i|^2 per head and token,
    y = P V. F.normalize's eps keeps a zero value's row as it is."""
    v = F.normalize(v, dim=-1)
    return y - (y * v).sum(-1, keepdim=True) * v


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
        attention: the other heads' arm, "softmax", "xsa" or "gated" (ARMS; "diff" is DiffAttention).
        depth: the block's index, which timm gives DIFF alone; taken so a block builds every arm alike.
        num_kv_heads: key/value heads (GQA; None: one per head); value_embed: nanochat 2026's gated
            value embedding (the GPT passes `ve` to the forward).
    The fused path (timm's `fused_attn`, on by default) never forms P; `fused_attn = False`, or
    `return_attn=True` in the forward, takes the reference path that forms P explicitly.
    """

    num_laplacian_heads: int = 0
    laplacian_mode: str = "fixed"
    attention: str = "softmax"

    def __init__(self, dim: int, num_heads: int = 8, num_laplacian_heads: int | None = None,
                 laplacian_mode: str | None = None, attention: str | None = None, depth: int = 0,
                 num_kv_heads: int | None = None, value_embed: bool = False, **timm_kwargs):
        self.attention = attention or self.attention
        # timm's own gate (an nn.Linear `gate`, None otherwise): its parameter names, its checkpoints
        super().__init__(dim, num_heads, gated=self.attention == "gated", **timm_kwargs)
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        if self.num_kv_heads != num_heads:  # GQA (the GPT's rotary path): qkv's rows [q (H D), k (Hkv D), v (Hkv D)]
            rows = (num_heads + 2 * self.num_kv_heads) * self.head_dim
            self.qkv = nn.Linear(dim, rows, bias=self.qkv.bias is not None)
        # nanochat 2026's value embedding: a gate per kv head in (0, 3), read from the first 12 channels
        self.ve_gate = nn.Linear(12, self.num_kv_heads, bias=False) if value_embed else None
        self.laplacian_mode = laplacian_mode or self.laplacian_mode  # checked by set_laplacian_heads
        if self.laplacian_mode == "learned":  # the paper's fixed heads add no parameter
            self.laplacian_gate = nn.Parameter(torch.empty(num_heads))  # the gates' logits
        self.set_laplacian_heads(self.num_laplacian_heads if num_laplacian_heads is None else num_laplacian_heads)

    def set_laplacian_heads(self, k: int):
        """Make the last k heads Laplacian (a learned gate restarts from k's start)."""
        self.num_laplacian_heads, = laplacian_counts(k, 1, self.num_heads)
        check_arm(self.attention, self.num_laplacian_heads, self.laplacian_mode)
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
                return_attn: bool = False, ve: torch.Tensor | None = None):
        """x [B, N, C] -> [B, N, C] (and P [B, H, N, N_keys] with return_attn). The GPT passes
        `rope` (cos, sin of these positions), its value embedding `ve` [B, N, Hkv D] and, when
        generating, `kv_cache` (x: the new tokens)."""
        B, N, C = x.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        if rope is None:
            qkv = self.qkv(x).view(B, N, 3, H, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, N, D]
            q, k = self.q_norm(q), self.k_norm(k)
        else:  # nanochat: rotary, then QK-norm, on [B, N, H, D]; v its own copy
            # In this layout SDPA's output is token-major, so at k = 0 the head merge below is a view
            # and the projection keeps nothing SDPA does not keep already. v's copy frees the qkv
            # output, which a view would keep whole (3x v) for SDPA's backward.
            qkv = self.qkv(x).view(B, N, H + 2 * Hkv, self.head_dim)
            cos, sin = (t.unsqueeze(-2) for t in rope)  # [N, 1, D/2]: every head
            q = self.q_norm(apply_rotary(qkv[:, :, :H], cos, sin))
            k = self.k_norm(apply_rotary(qkv[:, :, H:H + Hkv], cos, sin))
            v = qkv[:, :, H + Hkv:]
            if ve is not None:  # v + gate x value embedding, per kv head (the identity term below sees it too)
                v = v + 3 * torch.sigmoid(self.ve_gate(x[..., :12])).unsqueeze(-1) * ve.view(B, N, Hkv, -1)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v.contiguous()))

        keys, values = k, v
        if kv_cache is not None:  # a window's mask (the caller's) wins over the cache's causal one
            keys, values, cache_mask, is_causal = kv_cache.attend(layer_idx, k, v, is_causal)
            attn_mask = cache_mask if attn_mask is None else attn_mask
        drop = self.attn_drop.p if self.training else 0.0
        attn = None
        if self.fused_attn and not return_attn:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, dropout_p=drop,
                                                 is_causal=is_causal, enable_gqa=Hkv != H)
        else:
            out, attn = reference_attention(q, keys, values, attn_mask, is_causal, drop)

        # `v` is each query's own value, the identity term of (I - P) V and of XSA (also under a KV
        # cache); under GQA its kv head repeated over the group, as the fork does.
        kl = self.num_laplacian_heads
        if Hkv != H and (kl or self.laplacian_mode == "learned" or self.attention == "xsa"):
            v = v.repeat_interleave(H // Hkv, dim=1)
        if self.attention == "xsa":  # every head (no Laplacian one: check_arm)
            out = xsa(out, v)
        elif self.laplacian_mode == "learned":  # (1 - a) P V + a (V - P V), a per head in (0, 1)
            out = torch.lerp(out, v - out, self.gates().view(-1, 1, 1).to(out.dtype))
        elif kl:  # the last k heads: (I - P) V
            out = torch.cat((out[:, :H - kl], v[:, H - kl:] - out[:, H - kl:]), dim=1)
        out = self.norm(out.transpose(1, 2).reshape(B, N, C))
        if self.gate is not None:  # timm's gated attention: sigmoid(x W_g + b_g), elementwise, after its norm
            out = out * self.gate(x).sigmoid()
        out = self.proj_drop(self.proj(out))
        return (out, attn) if return_attn else out

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, laplacian_heads={self.num_laplacian_heads}, mode={self.laplacian_mode}, "
                f"attention={self.attention}")


def reference_attention(q, k, v, mask, is_causal: bool, drop: float):
    """Softmax attention with P formed explicitly, (dropout(P) V, P): the ground truth for the fused
    path. The scale is SDPA's default, 1 / sqrt(q's last dim)."""
    if k.shape[1] != q.shape[1]:  # GQA: each kv head serves a group of query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # [B, H, N, N_keys]
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    attn = scores.softmax(dim=-1)
    return (F.dropout(attn, drop) if drop else attn) @ v, attn


class DiffAttention(TimmDiffAttention):
    """timm's DIFF attention (arXiv:2410.05258): each head splits its query and key in two halves of
    `head_dim`, mixes its values by P1 - lambda P2, then a per-head RMSNorm (timm's `sub_norm`). Our
    forward adds what timm's has no argument for: the GPT's rotary embeddings (per half-head) and KV
    cache, and `return_attn` (the signed map P1 - lambda P2, for the analysis); without them it
    equals timm's (tests/test_arms.py). No Laplacian heads (check_arm)."""

    num_laplacian_heads, laplacian_mode, attention = 0, "fixed", "diff"
    ve_gate = None  # no value embedding (the GPT's Block refuses one for DIFF)

    def set_laplacian_heads(self, k: int):
        check_arm(self.attention, k)

    def reset_laplacian(self):
        """timm's start of lambda and of the head norm, e.g. after `to_empty` (the GPT's init_weights)."""
        if not self.sub_norm.weight.is_meta:
            self.reset_parameters()
            self.sub_norm.reset_parameters()

    def gates(self) -> torch.Tensor:
        """[H] zeros: no head is Laplacian (the mechanism diagnostic reads every attention's gates)."""
        return self.qkv.weight.new_zeros(self.num_heads)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, kv_cache=None, layer_idx: int = 0,
                return_attn: bool = False, ve=None):  # ve: never given (the GPT's Block refuses DIFF with it)
        B, N, C = x.shape
        H, d = self.num_heads, self.head_dim  # d: half a head (a head's value is 2d wide)
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k = (t.view(B, N, 2 * H, d) for t in (q, k))  # timm's order: head h's halves are 2h and 2h + 1
        if rope is not None:  # nanochat's rotary, then QK-norm; a table for d is every other frequency of 2d's
            cos, sin = (t[..., ::2].unsqueeze(-2) for t in rope)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = (norm(t).transpose(1, 2).unflatten(1, (H, 2)) for norm, t in ((self.q_norm, q), (self.k_norm, k)))
        v = v.view(B, N, H, 2 * d).transpose(1, 2)  # [B, H, N, 2d]; q and k [B, H, 2, N, d]
        if kv_cache is not None:  # the cache holds a head's two key halves side by side, [B, H, T, 2d]
            keys, v, cache_mask, is_causal = kv_cache.attend(layer_idx, k.transpose(2, 3).flatten(3), v, is_causal)
            attn_mask = cache_mask if attn_mask is None else attn_mask  # a window's mask (the caller's) wins
            k = keys.unflatten(3, (2, d)).transpose(2, 3)
        lam, drop = self._compute_lambda().type_as(q), self.attn_drop_p if self.training else 0.0
        pairs = [(q[:, :, i], k[:, :, i]) for i in range(2)]
        if self.fused_attn and not return_attn:
            o1, o2 = (F.scaled_dot_product_attention(a, b, v, attn_mask=attn_mask, dropout_p=drop, is_causal=is_causal)
                      for a, b in pairs)
            out, attn = o1 - lam * o2, None
        else:
            (o1, p1), (o2, p2) = (reference_attention(a, b, v, attn_mask, is_causal, drop) for a, b in pairs)
            out, attn = o1 - lam * o2, p1 - lam * p2
        out = self.sub_norm(out) * (1 - self.lambda_init)
        out = self.proj_drop(self.proj(self.norm(out.transpose(1, 2).reshape(B, N, C))))
        return (out, attn) if return_attn else out


ATTENTIONS = (LaplacianAttention, DiffAttention)  # every arm's class


def attn_layer(num_laplacian_heads: int = 0, mode: str = "fixed", attention: str = "softmax") -> type[nn.Module]:
    """The attention class to give a timm ViT, its last k heads Laplacian in every layer, the others
    of the arm `attention` (ARMS):

        timm.create_model("vit_small_patch16_224", attn_layer=laplace.attn_layer(3))
        timm.create_model("vit_small_patch16_224", attn_layer=laplace.attn_layer(attention="xsa"))

    A class, not a functools.partial: timm asks `issubclass(attn_layer, DiffAttention)` (and gives
    only DIFF the block's depth). Counts that differ per layer: `set_laplacian_heads(model, [0, 0,
    3, ...])` after construction. timm 1.0's VisionTransformer (vit_*, deit*, flexivit_*, vitamin_*,
    hybrids) and NaFlexVit take it; its other ViTs (Eva, BEiT, Swin, CaiT, XCiT, LeViT, ...) build
    their own attention and refuse the argument."""
    check_arm(attention, num_laplacian_heads, mode)
    if attention == "diff":
        return DiffAttention
    arm = "" if attention == "softmax" else attention.capitalize()
    return type(f"LaplacianAttention{num_laplacian_heads}{mode.capitalize()}{arm}", (LaplacianAttention,),
                {"num_laplacian_heads": num_laplacian_heads, "laplacian_mode": mode, "attention": attention})


def set_laplacian_heads(model: nn.Module, counts) -> list[int]:
    """Give the attentions of `model`, in order, k Laplacian heads each (an int or one per layer)."""
    layers = [m for m in model.modules() if isinstance(m, ATTENTIONS)]
    if not layers:  # else nothing would change, silently
        raise ConfigError(f"{type(model).__name__} has no Laplacian attention: build it with attn_layer="
                          f"laplace.attn_layer(k), which timm's VisionTransformer and NaFlexVit take (see attn_layer)")
    counts = laplacian_counts(counts, len(layers), layers[0].num_heads)
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
