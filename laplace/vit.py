"""DeiT-III Vision Transformer with Laplacian heads.

Design (DeiT III, "Revenge of the ViT", and timm's `deit3_*` models):
- patch embedding by a strided conv; class token with NO position embedding on it
  (position embeddings cover the patches only, added before the class token is prepended);
- pre-norm blocks, LayerNorm eps 1e-6, qkv bias, GELU MLP (4x), LayerScale (init 1e-6 for
  DeiT-III), stochastic depth uniform over depth (DeiT-III's choice; `drop_path_schedule=
  "linear"` is timm's rule, 0 in the first block rising to the rate in the last);
- optional QK-norm (`qk_norm=True`): a LayerNorm over each head's queries and keys, as the
  paper's first author trained every ImageNet model (timm `qk_norm=True`; see configs/reference/
  deit3_in1k_author.yaml);
- the class token after the final norm feeds the linear head;
- any input size divisible by the patch: the patch position embeddings are resampled
  (bicubic) to the input's grid in the forward, by `pos_embed_resample`'s rule (see
  `resample_pos_embed`); at the model's own size the table is used as it is.
Parameter names and shapes equal timm's VisionTransformer, so `load_timm_state_dict` loads a
timm DeiT-III / ViT state dict strictly and users can fine-tune from published weights.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import (DropPath, LayerScale, Mlp, PatchEmbed, calculate_drop_path_rates, resample_abs_pos_embed,
                         trunc_normal_)

from .attention import Attention, block_indices, laplacian_counts
from .errors import ConfigError


class Block(nn.Module):
    """Pre-norm transformer block: x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x)))."""

    def __init__(self, dim: int, num_heads: int, num_laplacian_heads: int, laplacian_mode: str,
                 mlp_ratio: float, init_values: Optional[float], drop_path: float,
                 fused_attn: bool, norm_layer, qk_norm: bool = False):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads, num_laplacian_heads, laplacian_mode, qkv_bias=True,
                              proj_bias=True, qk_norm=qk_norm, norm_layer=norm_layer, fused=fused_attn)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class VisionTransformer(nn.Module):
    """ViT with a class token and Laplacian heads (the last k heads of each layer).

    Args:
        img_size: input resolution (square).
        patch_size: patch side; the token grid is img_size // patch_size squared.
        in_chans: image channels.
        num_classes: head outputs (0 = no head, features only).
        embed_dim, depth, num_heads, mlp_ratio: the architecture (ViT-B: 768, 12, 12, 4).
        num_laplacian_heads: int (every layer) or a per-layer list of Laplacian head counts.
        laplacian_mode: "fixed" (the paper) or "learned" (a sigmoid gate per head).
        init_values: LayerScale init (DeiT-III: 1e-6; None disables LayerScale).
        drop_path_rate: stochastic-depth rate: of every block ("uniform") or of the last one.
        drop_path_schedule: "uniform" (DeiT-III: the same rate in every block) or "linear"
            (timm's VisionTransformer: 0 in the first block, rising linearly to the rate).
        qk_norm: LayerNorm (eps 1e-6) over each head's queries and keys (timm's `qk_norm`).
        global_pool: what the head reads: "token" (the class token, DeiT-III's and the paper's)
            or "avg" (the mean of the final-norm patch tokens; the class token stays in the
            sequence). timm's "avg" normalises after pooling (fc_norm); here the final norm acts
            per token before the mean, so the analysed "norm" layer is what the head averages.
        fused_attn: SDPA kernels (True) or the explicit-softmax reference path.
        pos_embed_resample: how the position embeddings follow an input of another size:
            "plain" (bicubic to the grid, as fine-tuning at another size resamples them) or
            "dino" (DINO's interpolate_pos_encoding; what trainer=dino's crops see).
    """

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3,
                 num_classes: int = 1000, embed_dim: int = 768, depth: int = 12,
                 num_heads: int = 12, mlp_ratio: float = 4.0,
                 num_laplacian_heads: int | Sequence[int] = 0, laplacian_mode: str = "fixed",
                 init_values: Optional[float] = 1e-6, drop_path_rate: float = 0.0,
                 drop_path_schedule: str = "uniform", qk_norm: bool = False,
                 global_pool: str = "token", fused_attn: bool = True, pos_embed_resample: str = "plain"):
        super().__init__()
        if pos_embed_resample not in _RESAMPLE_RULES:
            raise ValueError(f"pos_embed_resample={pos_embed_resample!r}: choose {' or '.join(_RESAMPLE_RULES)}")
        if drop_path_schedule not in _DROP_PATH_SCHEDULES:
            raise ConfigError(f"drop_path_schedule={drop_path_schedule!r}: choose "
                              f"{' or '.join(_DROP_PATH_SCHEDULES)}")
        if global_pool not in _POOLS:
            raise ConfigError(f"global_pool={global_pool!r}: choose {' or '.join(_POOLS)} "
                              f"(model.global_pool=token: the class token)")
        self.pos_embed_resample = pos_embed_resample
        self.global_pool = global_pool
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.num_laplacian_heads = laplacian_counts(num_laplacian_heads, depth, num_heads)
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        # Not strict about the input size: `embed` checks divisibility and resamples pos_embed.
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, strict_img_size=False)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, embed_dim))  # patches only
        rates = (calculate_drop_path_rates(drop_path_rate, depth) if drop_path_schedule == "linear"
                 else [drop_path_rate] * depth)
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, k, laplacian_mode, mlp_ratio, init_values, rate,
                  fused_attn, norm_layer, qk_norm)
            for k, rate in zip(self.num_laplacian_heads, rates)])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self):
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters kept out of weight decay (besides biases and norms), as timm."""
        return {"pos_embed", "cls_token"}

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] (H, W multiples of the patch) -> tokens [B, 1 + N_patches, D],
        class token first."""
        (H, W), (ph, pw) = x.shape[-2:], self.patch_embed.patch_size
        if H % ph or W % pw:
            raise ValueError(f"a {H}x{W} image is not divisible by the patch size {ph}x{pw}")
        pos = resample_pos_embed(self.pos_embed, self.patch_embed.grid_size, (H // ph, W // pw),
                                 self.pos_embed_resample)
        x = self.patch_embed(x) + pos
        return torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)

    def forward_features(self, x: torch.Tensor, layers: Optional[Sequence[int]] = None,
                         norm: bool = True) -> dict[str, torch.Tensor]:
        """Token representations [B, 1 + N_patches, D] of the asked layers.

        Returns {"blocks.i": output of block i (the residual stream) for i in `layers`
        (default: all; negative indices count from the end), "norm": final-norm output}.
        Blocks after the last one needed are skipped when `norm` is False.
        """
        depth = len(self.blocks)
        wanted = block_indices(layers, depth)
        last = depth - 1 if norm else max(wanted, default=-1)
        feats, x = {}, self.embed(x)
        for i, blk in enumerate(self.blocks[:last + 1]):
            x = blk(x)
            if i in wanted:
                feats[f"blocks.{i}"] = x
        if norm:
            feats["norm"] = self.norm(x)
        return feats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.pool(self.norm(x)))

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Final-norm tokens [B, 1 + N, D] -> what the head reads [B, D] (`global_pool`)."""
        return x[:, 0] if self.global_pool == "token" else x[:, 1:].mean(dim=1)


_RESAMPLE_RULES = ("plain", "dino")
_POOLS = ("token", "avg")
_DROP_PATH_SCHEDULES = ("uniform", "linear")


def resample_pos_embed(pos_embed: torch.Tensor, old_grid, new_grid, rule: str = "plain") -> torch.Tensor:
    """Patch position embeddings [1, H0*W0, D] resampled (bicubic) to [1, H*W, D].

    "plain": to the size H x W (torch's a = -0.75 kernel, no antialiasing), as deit's
    --finetune and mmseg's resize do. "dino": DINO's interpolate_pos_encoding, which gives
    `scale_factor` (H + 0.1) / H0 instead of the size, so the sampling positions follow that
    factor (14 -> 6 on a random trunc-normal 0.02 table: up to 0.023 from plain's).
    The model's own grid returns the table itself.
    """
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if old_grid == new_grid:
        return pos_embed
    if rule == "plain":
        # timm's default antialias=True switches to the a = -0.5 kernel even when enlarging.
        return resample_abs_pos_embed(pos_embed, new_size=list(new_grid), old_size=list(old_grid),
                                      num_prefix_tokens=0, antialias=False)
    d = pos_embed.shape[-1]
    grid = pos_embed.reshape(1, *old_grid, d).permute(0, 3, 1, 2)
    scale = tuple((n + 0.1) / o for n, o in zip(new_grid, old_grid))
    grid = F.interpolate(grid.float(), scale_factor=scale, mode="bicubic", align_corners=False)
    if tuple(grid.shape[-2:]) != new_grid:  # floor((n + 0.1) / o * o) is n: DINO asserts it too
        raise ValueError(f"position embeddings {old_grid} -> {tuple(grid.shape[-2:])}, not {new_grid}")
    return grid.to(pos_embed.dtype).permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], d)


def load_timm_state_dict(model: VisionTransformer, state_dict: dict) -> None:
    """Load a timm DeiT-III / ViT state dict strictly into `model`.

    Position embeddings are resampled (bicubic) when the checkpoint's patch grid differs from
    the model's, e.g. DeiT-III's 192 px pre-training -> 224 px fine-tuning. A state dict with
    QK-norm weights (timm's `qk_norm=True`, every model of the first author's timm fork) needs
    a model built with `qk_norm=True`, and one without them a model without. A timm ViT whose
    position embedding also covers the class token (no_embed_class=False) is refused: its
    geometry differs from DeiT-III's.
    """
    sd = dict(state_dict)
    has, wants = "blocks.0.attn.q_norm.weight" in sd, "blocks.0.attn.q_norm.weight" in model.state_dict()
    if has != wants:  # the usual mismatch with the first author's models: say the fix
        raise ValueError(f"the state dict {'has' if has else 'has no'} QK-norm weights (blocks.<i>.attn.q_norm / "
                         f"k_norm) but the model {'has none' if has else 'has them'}: build it with "
                         f"qk_norm={has} (model.qk_norm={str(has).lower()})")
    pos = sd.get("pos_embed")
    want = model.pos_embed.shape
    if pos is not None and pos.shape != want:
        old_n = pos.shape[1]
        if int(old_n ** 0.5) ** 2 != old_n:
            raise ValueError(f"pos_embed of shape {tuple(pos.shape)} covers a class token or a "
                             f"non-square grid; expected DeiT-III style {tuple(want)}")
        side = int(old_n ** 0.5)
        sd["pos_embed"] = resample_pos_embed(pos, (side, side), model.patch_embed.grid_size)
    model.load_state_dict(sd, strict=True)
