"""DINO's network pieces (facebookresearch/dino, vision_transformer.py and utils.py).

    DINOHead          MLP in -> hidden -> hidden -> bottleneck (GELU; BatchNorm before each
                      GELU with use_bn, DINO's --use_bn_in_head), L2-normalised
                      bottleneck, weight-normalised last layer to out_dim (weight_g fixed to 1
                      when norm_last_layer, DINO's default)
    MultiCropWrapper  backbone + head over a list of crops, one backbone pass per run of
                      consecutive crops of the same resolution, one head pass for all

The backbone is a zoo ViT without classifier: its forward is the final-norm class token at any
crop size (laplace.vit resamples the position embeddings to the crop's grid).
"""
import itertools

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
        self.out_dim = out_dim
        layers, d = [], in_dim
        for _ in range(max(nlayers, 1) - 1):  # the hidden layers: Linear, [BatchNorm], GELU
            layers += [nn.Linear(d, hidden_dim), *([nn.BatchNorm1d(hidden_dim)] if use_bn else []), nn.GELU()]
            d = hidden_dim
        # DINO's one-layer head is a bare Linear (its weights are mlp.weight, not mlp.0.weight)
        self.mlp = nn.Sequential(*layers, nn.Linear(d, bottleneck_dim)) if layers else nn.Linear(d, bottleneck_dim)
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
        # One backbone pass per run of equal resolution (the global crops, then the local ones)
        runs = itertools.groupby(crops, key=lambda c: c.shape[-2:])
        return self.head(torch.cat([self.backbone(torch.cat(list(run))) for _, run in runs]))
