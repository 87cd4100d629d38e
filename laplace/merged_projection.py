"""The attention's last step, heads merged and projected, in less memory (Attention(save_memory=True)).

    y = proj(merge_laplacian(out, v, k))      out = P V, v: [B, H, N, D]

With plain autograd the merged heads [B, N, H * D] are one more saved activation (for the
projection's weight gradient): +20% of a ViT attention layer's saved bytes, +5% of a ViT training
step (`python -m bench`), at k = 0 too, where the merge is the head-merging copy of SDPA's output.
`merged_projection` keeps only `out` and `v`, which SDPA keeps anyway, and recomputes the merge in
backward. Why by hand: autograd cannot be told to recompute one op (activation checkpointing of
the layer would recompute SDPA too). tests/test_attention.py holds it equal to plain autograd.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def laplacian(out: torch.Tensor, v: torch.Tensor, k: int) -> torch.Tensor:
    """P V [B, H, N, D] with its last k heads replaced by V - P V (the Laplacian heads): README's line."""
    H = out.shape[1]
    if k == 0:
        return out
    if k == H:
        return v - out
    return torch.cat((out[:, : H - k], v[:, H - k:] - out[:, H - k:]), dim=1)


def merge(x: torch.Tensor) -> torch.Tensor:
    """Heads [B, H, N, D] -> tokens [B, N, H * D]."""
    B, H, N, D = x.shape
    return x.transpose(1, 2).reshape(B, N, H * D)


def merge_laplacian(out: torch.Tensor, v: torch.Tensor, k: int) -> torch.Tensor:
    """merge(laplacian(out, v, k)) in one copy: the subtraction on the last k heads is done inside
    the head-merging copy that k = 0 makes anyway (the same values)."""
    B, H, N, D = out.shape
    if k == 0 or k == H:
        return merge(laplacian(out, v, k))  # one copy: the merge (k = 0) or the subtraction (k = H)
    o, w = out.transpose(1, 2), v.transpose(1, 2)  # [B, N, H, D] views
    return torch.cat((o[:, :, : H - k], w[:, :, H - k:] - o[:, :, H - k:]), dim=2).reshape(B, N, H * D)


def merged_projection(out: torch.Tensor, v: torch.Tensor, k: int, proj: nn.Linear) -> torch.Tensor:
    """proj(merge_laplacian(out, v, k)), saving for backward only out and v (and the weight)."""
    return _MergedProjection.apply(out, v, proj.weight, proj.bias, k)


class _MergedProjection(torch.autograd.Function):
    """Autocast: the compute dtype is autocast's when it is on, as F.linear's would be; the bf16
    weight copy is not kept either (the weight is cast again in backward)."""

    @staticmethod
    def forward(ctx, out, v, weight, bias, k: int):
        dev = out.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else out.dtype
        with torch.autocast(dev, enabled=False):
            y = F.linear(merge_laplacian(out.to(dt), v.to(dt), k), weight.to(dt), None if bias is None else bias.to(dt))
        ctx.save_for_backward(out, v, weight)
        ctx.k, ctx.dt, ctx.has_bias = k, dt, bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        out, v, weight = ctx.saved_tensors
        k, dt = ctx.k, ctx.dt
        H = out.shape[1]
        need_out, need_v, need_w, need_b = ctx.needs_input_grad[:4]
        g_out = g_v = g_w = g_b = None
        with torch.autocast(gy.device.type, enabled=False):
            gy = gy.to(dt)
            gy2 = gy.reshape(-1, gy.shape[-1])
            if need_w:
                merged = merge_laplacian(out.to(dt), v.to(dt), k)
                g_w = (gy2.t() @ merged.reshape(gy2.shape[0], -1)).to(weight.dtype)
            if need_b and ctx.has_bias:
                g_b = gy2.sum(0).to(weight.dtype)
            if need_out or need_v:
                B, N = gy.shape[:2]
                g_m = (gy @ weight.to(dt)).view(B, N, H, -1)  # d loss / d merged heads, [B, N, H, D]
                if need_v and k:  # the identity term: the Laplacian heads' slice (zero elsewhere)
                    if k < H:
                        g_v = g_m.new_zeros(g_m.shape)
                        g_v[:, :, H - k:] = g_m[:, :, H - k:]
                    else:
                        g_v = g_m.clone() if need_out else g_m
                    g_v = g_v.transpose(1, 2).to(v.dtype)
                if need_out:  # -P V on the Laplacian heads; g_m is ours, negated in place
                    g_m[:, :, H - k:].neg_()
                    g_out = g_m.transpose(1, 2).to(out.dtype)
        return g_out, g_v, g_w, g_b, None
