"""DINO's network pieces (facebookresearch/dino, vision_transformer.py and utils.py).

    DINOHead          MLP in -> hidden -> hidden -> bottleneck (GELU; BatchNorm before each
                      GELU with use_bn, DINO's --use_bn_in_head), L2-normalised
                      bottleneck, weight-normalised last layer to out_dim (weight_g fixed to 1
                      when norm_last_layer, DINO's default)
    vit_class_token   a zoo ViT's final-norm class token at ANY input size divisible by the
                      patch: the patch position embeddings are resampled bicubically to the
                      crop's grid (DINO's interpolate_pos_encoding: its scale_factor rule), so 224 px global and 96 px
                      local crops go through the same 224 px model
    MultiCropWrapper  backbone + head over a list of crops, one backbone pass per run of
                      consecutive crops of the same resolution, one head pass for all
    DINOModel         the meta-architecture: student and teacher (a frozen deep copy)

laplace.vit.VisionTransformer's PatchEmbed is strict about the input size (timm's default) and
its `pos_embed` covers the model's own grid, so a crop of another size cannot go through
`vit(x)`. `vit_class_token` runs the same modules (patch projection, class token, blocks,
final norm) with the resampled table instead; at the model's own size it IS `vit(x)`.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn


class DINOHead(nn.Module):
    """DINO's projection head.

    Args:
        in_dim: backbone feature width (the class token's).
        out_dim: prototypes (DINO: 65,536).
        hidden_dim, bottleneck_dim: MLP widths (DINO: 2048, 256).
        nlayers: linear layers of the MLP (DINO: 3).
        norm_last_layer: fix the weight-norm magnitude g to 1 (not trained; DINO's default).
        use_bn: BatchNorm1d after each hidden linear layer (DINO's --use_bn_in_head; off by
            default there and here; the small-data recipe experiment=dino_digits needs it, see
            that config).
    """

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 nlayers: int = 3, norm_last_layer: bool = True, use_bn: bool = False):
        super().__init__()
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            def hidden(d_in):
                return [nn.Linear(d_in, hidden_dim), *([nn.BatchNorm1d(hidden_dim)] if use_bn else []), nn.GELU()]
            layers = hidden(in_dim)
            for _ in range(nlayers - 2):
                layers += hidden(hidden_dim)
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        self.apply(self._init_weights)  # before the last layer exists, as DINO (it keeps torch's init)
        self.last_layer = nn.utils.parametrizations.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        g = self.last_layer.parametrizations.weight.original0  # [out_dim, 1]
        with torch.no_grad():
            g.fill_(1.0)
        if norm_last_layer:
            g.requires_grad_(False)

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        # The prototypes' logits in float32 even under bf16 autocast: divided by the teacher's
        # 0.04 temperature, bf16's 8-bit mantissa would blur them by ~0.1 (DINO ran fp16).
        with torch.autocast(x.device.type, enabled=False):
            return self.last_layer(x.float())


def interpolate_pos_embed(pos_embed: torch.Tensor, old_grid, new_grid) -> torch.Tensor:
    """Patch position embeddings [1, H0*W0, D] resampled (bicubic) to [1, H*W, D] by DINO's
    rule: `scale_factor` (H + 0.1) / H0, not `size`, so the sampling positions follow that
    factor (14 -> 6 on a random trunc-normal 0.02 table: up to 0.023 from size=6's)."""
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if old_grid == new_grid:
        return pos_embed
    d = pos_embed.shape[-1]
    grid = pos_embed.reshape(1, *old_grid, d).permute(0, 3, 1, 2)
    scale = tuple((n + 0.1) / o for n, o in zip(new_grid, old_grid))
    grid = F.interpolate(grid.float(), scale_factor=scale, mode="bicubic", align_corners=False)
    if tuple(grid.shape[-2:]) != new_grid:  # floor((n + 0.1) / o * o) is n: DINO asserts it too
        raise ValueError(f"position embeddings {old_grid} -> {tuple(grid.shape[-2:])}, not {new_grid}")
    return grid.to(pos_embed.dtype).permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], d)


def vit_class_token(vit: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The final-norm class token [B, D] of a laplace ViT for images [B, C, H, W] of any size
    divisible by its patch size (the position embeddings follow the crop's grid)."""
    pe = vit.patch_embed
    ph, pw = pe.patch_size
    H, W = x.shape[-2:]
    if H % ph or W % pw:
        raise ValueError(f"a {H}x{W} crop is not divisible by the patch size {ph}x{pw}")
    grid = (H // ph, W // pw)
    if grid == tuple(pe.grid_size):
        return vit.forward_features(x)["norm"][:, 0]
    tokens = pe.norm(pe.proj(x).flatten(2).transpose(1, 2))  # what PatchEmbed does, minus its size check
    tokens = tokens + interpolate_pos_embed(vit.pos_embed, pe.grid_size, grid)
    tokens = torch.cat((vit.cls_token.expand(x.shape[0], -1, -1), tokens), dim=1)
    for blk in vit.blocks:
        tokens = blk(tokens)
    return vit.norm(tokens)[:, 0]


class MultiCropWrapper(nn.Module):
    """Backbone + head over a list of crop batches (DINO's MultiCropWrapper): the crops of
    each run of equal resolution go through the backbone together, all through the head once.
    Returns [sum of crop batch sizes, out_dim], crop after crop."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops) -> torch.Tensor:
        if isinstance(crops, torch.Tensor):
            crops = [crops]
        feats, start = [], 0
        while start < len(crops):
            end = start + 1
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            feats.append(vit_class_token(self.backbone, torch.cat(list(crops[start:end]))))
            start = end
        return self.head(torch.cat(feats))


class DINOModel(nn.Module):
    """Student (backbone + head) and teacher (a deep copy: same initial weights, no gradients).
    The teacher's backbone stays in eval mode, so a drop-path backbone runs deterministically
    as DINO's teacher that is built without drop-path; its head follows the student's mode, so a
    BatchNorm head (use_bn) normalises with batch statistics in training, as DINO's teacher,
    which is never put in eval mode."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.student = MultiCropWrapper(backbone, head)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.teacher.backbone.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.backbone.eval()
        return self
