"""PCA maps of ViT patch features: the first three principal components of one image's patch
tokens shown as RGB on the patch grid (the paper's figure of sharper object boundaries with
Laplacian heads, after DINO's PCA visualisations).

A grid figure: one row per image, the input image in the first column, then one column per
checkpoint. The images are the first `n` of the analysis subset (the same fixed random order for
every checkpoint). Drawn by `python -m analysis` when `pca_maps=<n>` is set:

    python -m analysis checkpoint=[runs/a/ckpt/last.pt,runs/b/ckpt/last.pt] pca_maps=8 metrics=[]

which writes pca_maps.{png,pdf} next to the other figures (metrics=[] skips the metrics pass).
The PCA is per image and per checkpoint: components are centred on that image's mean patch
token, each component is min-max scaled to [0, 1] and the 3-channel map is upsampled to the
image (nearest, so the patch grid stays visible). A component's sign is arbitrary; it is fixed
so that its largest-magnitude projection is positive, which keeps the colours deterministic.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from analysis.plots import plt, save
from laplace.errors import ConfigError


def pca_rgb(patches: torch.Tensor, grid: tuple[int, int]) -> np.ndarray:
    """Patch features [P, D] of one image -> [gh, gw, 3] floats in [0, 1].

    Args:
        patches: one image's patch tokens, row-major over the patch grid.
        grid: (rows, cols) of the patch grid, rows * cols == P.
    """
    x = patches.double()
    x = x - x.mean(0)
    _, _, Vh = torch.linalg.svd(x, full_matrices=False)
    proj = x @ Vh[:3].T  # [P, <=3]
    peak = proj.gather(0, proj.abs().argmax(0, keepdim=True))  # largest-magnitude value per component
    proj = torch.where(peak < 0, -proj, proj)
    lo, hi = proj.min(0).values, proj.max(0).values
    rgb = (proj - lo) / (hi - lo).clamp_min(1e-12)
    if rgb.shape[1] < 3:  # fewer than 3 patches or dims: pad with black channels
        rgb = torch.cat([rgb, rgb.new_zeros(rgb.shape[0], 3 - rgb.shape[1])], 1)
    return rgb.reshape(*grid, 3).float().numpy()


@torch.no_grad()
def model_maps(model, images: torch.Tensor, layer: str = "norm") -> list[np.ndarray]:
    """PCA maps [H, W, 3] of a batch of normalised images [K, 3, H, W] at `layer`.

    Args:
        model: a VisionTransformer from `load_model`.
        images: already transformed (resized, normalised) as the model expects.
        layer: "norm" or "blocks.<i>".
    """
    dev = next(model.parameters()).device
    block = None if layer == "norm" else [int(layer.split(".")[1])]
    feats = model.forward_features(images.to(dev), layers=block)
    if layer not in feats:
        raise ConfigError(f"pca_layer={layer}: use norm or blocks.<i> with i < {len(model.blocks)}")
    grid = tuple(model.patch_embed.grid_size)
    H, W = images.shape[-2:]
    maps = []
    for f in feats[layer][:, 1:].float().cpu():  # patch tokens only
        rgb = torch.from_numpy(pca_rgb(f, grid)).permute(2, 0, 1)[None]
        maps.append(F.interpolate(rgb, size=(H, W), mode="nearest")[0].permute(1, 2, 0).numpy())
    return maps


def denormalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """Normalised [K, 3, H, W] -> displayable [K, H, W, 3] in [0, 1]."""
    m, s = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]
    return (images.cpu() * s + m).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def draw_pca_grid(images: np.ndarray, maps: dict[str, list[np.ndarray]], stem: Path,
                  labels: Sequence[int] = (), layer: str = "norm") -> list[Path]:
    """Rows = images, columns = the image then one PCA map per checkpoint.

    Args:
        images: [K, H, W, 3] displayable images.
        maps: {column title: K maps [H, W, 3]} in column order.
        stem: output path without suffix (.png and .pdf are written).
        labels: class of each image, shown beside the row.
        layer: named in the title.
    """
    K, cols = len(images), 1 + len(maps)
    fig, axes = plt.subplots(K, cols, figsize=(1.6 * cols + 0.4, 1.6 * K + 0.5), squeeze=False)
    columns = [("image", list(images))] + list(maps.items())
    for j, (title, imgs) in enumerate(columns):
        for i in range(K):
            ax = axes[i, j]
            ax.imshow(imgs[i], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(title, fontsize=8)
            if j == 0 and len(labels) > i:
                ax.set_ylabel(f"class {labels[i]}", fontsize=7)
    fig.suptitle(f"PCA of patch features at {layer}: first 3 components as RGB", fontsize=9)
    fig.tight_layout()
    return save(fig, stem)
