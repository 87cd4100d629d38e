"""Our ViTs are timm's VisionTransformer built with the Laplacian attention (laplace.attention).

`vit(...)` sets DeiT-III's choices on timm's class: the class token without position embedding
(`no_embed_class`), LayerScale (`init_values`, 1e-6), LayerNorm eps 1e-6, qkv bias, the final norm
before the head (also under `global_pool="avg"`: `fc_norm=False`), stochastic depth the same in
every block unless `drop_path_schedule="linear"` (timm's rule); `qk_norm=True` gives the first
author's models (his timm fork builds every ViT with it). Parameter names are timm's, so timm /
DeiT-III state dicts load as they are. The one subclass below only keeps our rules for resampling
the position embeddings to another input size.
"""
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath, resample_abs_pos_embed
from timm.models import vision_transformer as timm_vit

from .attention import attn_layer, set_laplacian_heads
from .errors import ConfigError

RESAMPLE_RULES = ("plain", "dino")
POOLS = ("token", "avg")
DROP_PATH_SCHEDULES = ("uniform", "linear")


class VisionTransformer(timm_vit.VisionTransformer):
    """timm's VisionTransformer at any input size divisible by the patch, its patch position
    embeddings resampled (bicubic) by `pos_embed_resample`: "plain" (to the grid's size, torch's
    a = -0.75 kernel without antialiasing, as DeiT's --finetune and mmseg do; timm's dynamic size
    antialiases) or "dino" (DINO's interpolate_pos_encoding, what trainer=dino's crops see)."""

    def __init__(self, *args, pos_embed_resample: str = "plain", **kwargs):
        if pos_embed_resample not in RESAMPLE_RULES:
            raise ConfigError(f"pos_embed_resample={pos_embed_resample!r}: choose {' or '.join(RESAMPLE_RULES)}")
        # dynamic_img_size: any input size divisible by the patch; patches come as [B, H, W, C]
        super().__init__(*args, dynamic_img_size=True, **kwargs)
        self.pos_embed_resample = pos_embed_resample
        # what an export's timm equivalent and model card say (timm's class keeps neither)
        self.qk_norm, self.layer_scale = bool(kwargs.get("qk_norm")), bool(kwargs.get("init_values"))  # 0: none

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        pos = resample_pos_embed(self.pos_embed, self.patch_embed.grid_size, (H, W), self.pos_embed_resample)
        x = x.reshape(B, H * W, C) + pos  # DeiT-III: no position embedding on the class token
        return self.pos_drop(torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1))

    @property
    def num_laplacian_heads(self) -> list[int]:
        return [blk.attn.num_laplacian_heads for blk in self.blocks]


def vit(img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
        embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
        num_laplacian_heads: int | Sequence[int] = 0, laplacian_mode: str = "fixed", attention: str = "softmax",
        init_values: Optional[float] = 1e-6, drop_path_rate: float = 0.0, drop_path_schedule: str = "uniform",
        qk_norm: bool = False, global_pool: str = "token", fused_attn: bool = True,
        pos_embed_resample: str = "plain") -> VisionTransformer:
    """A DeiT-III ViT with Laplacian heads (timm's VisionTransformer).

    Args:
        img_size, patch_size, in_chans, num_classes (0: no head), embed_dim, depth, num_heads,
            mlp_ratio: timm's.
        num_laplacian_heads: k in every layer, or a list with one count per layer.
        laplacian_mode: "fixed" (the paper) or "learned" (a sigmoid gate per head).
        attention: the other heads' arm: "softmax", "xsa", "gated" or "diff" (laplace.attention.ARMS).
        init_values: LayerScale's start (DeiT-III 1e-6; None: no LayerScale).
        drop_path_rate, drop_path_schedule: the rate of every block ("uniform", DeiT-III) or rising
            linearly from 0 in the first block to the rate in the last ("linear", timm).
        qk_norm: timm's LayerNorm over each head's queries and keys.
        global_pool: what the head reads: "token" (the class token) or "avg" (the mean of the
            final-norm patch tokens: normed per token, then averaged).
        fused_attn: SDPA (True) or the reference path that forms P.
        pos_embed_resample: "plain" or "dino" (VisionTransformer above).
    """
    if drop_path_schedule not in DROP_PATH_SCHEDULES:
        raise ConfigError(f"drop_path_schedule={drop_path_schedule!r}: choose {' or '.join(DROP_PATH_SCHEDULES)}")
    if global_pool not in POOLS:
        raise ConfigError(f"global_pool={global_pool!r}: choose {' or '.join(POOLS)} (model.global_pool=token: the class token)")
    # DeiT-III on timm's class: qkv bias, LayerScale, the class token without position embedding,
    # the final norm before the pooling (timm's `fc_norm` would normalise after a mean pool)
    model = VisionTransformer(
        img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes,
        embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=True,
        qk_norm=qk_norm, init_values=init_values, no_embed_class=True, global_pool=global_pool,
        fc_norm=False, drop_path_rate=drop_path_rate, attn_layer=attn_layer(0, laplacian_mode, attention),
        pos_embed_resample=pos_embed_resample)
    set_laplacian_heads(model, num_laplacian_heads)  # one count per layer: set after construction
    for blk in model.blocks:
        blk.attn.fused_attn = fused_attn
        if drop_path_schedule == "uniform":  # timm's class knows only the linear rule
            blk.drop_path1, blk.drop_path2 = (DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()
                                              for _ in range(2))
    return model


def resample_pos_embed(pos_embed: torch.Tensor, old_grid, new_grid, rule: str = "plain") -> torch.Tensor:
    """Patch position embeddings [1, H0*W0, D] resampled (bicubic) to [1, H*W, D]; the model's own
    grid returns the table itself. "plain": to the size H x W. "dino": DINO's
    interpolate_pos_encoding, which passes `scale_factor` (H + 0.1) / H0 rather than the size, so
    the sampling positions follow that factor (14 -> 6 on a random trunc-normal 0.02 table: up to
    0.023 from plain's)."""
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if old_grid == new_grid:
        return pos_embed
    if rule == "plain":  # timm's default antialias=True switches to the a = -0.5 kernel even when enlarging
        return resample_abs_pos_embed(pos_embed, new_size=list(new_grid), old_size=list(old_grid),
                                      num_prefix_tokens=0, antialias=False)
    d = pos_embed.shape[-1]
    grid = pos_embed.reshape(1, *old_grid, d).permute(0, 3, 1, 2)
    scale = tuple((n + 0.1) / o for n, o in zip(new_grid, old_grid))
    # the output grid is floor(o * (n + 0.1) / o), i.e. n (DINO asserts it)
    grid = F.interpolate(grid.float(), scale_factor=scale, mode="bicubic", align_corners=False)
    return grid.to(pos_embed.dtype).permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], d)


def load_timm_state_dict(model: VisionTransformer, state_dict: dict) -> None:
    """Load a timm DeiT-III / ViT state dict strictly, its position embedding resampled ("plain")
    when its patch grid differs (DeiT-III's 192 px pre-training -> 224 px fine-tuning)."""
    sd = dict(state_dict)
    has, wants = "blocks.0.attn.q_norm.weight" in sd, "blocks.0.attn.q_norm.weight" in model.state_dict()
    if has != wants:  # the usual mismatch with the first author's models: say the fix
        raise ValueError(f"the state dict {'has' if has else 'has no'} QK-norm weights (blocks.<i>.attn.q_norm / "
                         f"k_norm) but the model {'has none' if has else 'has them'}: build it with "
                         f"qk_norm={has} (model.qk_norm={str(has).lower()})")
    pos, want = sd.get("pos_embed"), model.pos_embed.shape
    if pos is not None and pos.shape != want:
        side = int(pos.shape[1] ** 0.5)
        if side * side != pos.shape[1]:  # a timm ViT whose table covers the class token: another geometry
            raise ValueError(f"pos_embed of shape {tuple(pos.shape)} covers a class token or a "
                             f"non-square grid; expected DeiT-III style {tuple(want)}")
        sd["pos_embed"] = resample_pos_embed(pos, (side, side), model.patch_embed.grid_size)
    model.load_state_dict(sd, strict=True)
