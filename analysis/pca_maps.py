"""PCA maps of ViT patch features (the paper's figure of sharper object boundaries with Laplacian
heads, after DINO / DINOv2's PCA visualisations), drawn by `python -m analysis pca_maps=<n>` and
by `python -m analysis.figures`:

    python -m analysis checkpoint=[runs/a/ckpt/last.pt,runs/b/ckpt/last.pt] pca_maps=8 metrics=[]
    python -m analysis checkpoint=... pca_maps=8 metrics=[] pca_foreground=false pca_upsample=bilinear

Per image and checkpoint: (1) a PCA of the image's patch tokens; the foreground is the patches
with a positive first-component score (pca_threshold=sign, the paper's rule: "patches with a
negative score of the first PCA component" removed), or, with t in [0, 1), those above t on the
first component min-max scaled to [0, 1]; (2) a second PCA of the foreground patches, whose first
3 components (min-max scaled over the foreground) are the RGB, the background black (DINOv2's
notebook fits its PCA over several images: ours is per image). pca_foreground=false: the first 3
components of all patches. Written (stem = <out>/pca_maps, or <out>/pca_maps_<exp>):
    <stem>.{png,pdf}          a row per image: the image, then a column per checkpoint; each cell
                              the image's size times an integer factor (no resampling blur)
    <stem>/image_<i>.png, <stem>/<model>_<i>.png   the images and maps at the image's resolution
"""
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from laplace.errors import ConfigError
from laplace.zoo import features

matplotlib.use("Agg")  # files only; no display on servers / CI
import matplotlib.pyplot as plt  # noqa: E402

DPI = 150          # of the PNG grid; cell sizes are computed in pixels at this dpi
MIN_CELL_PX = 240  # small images are enlarged by an integer factor to about this many pixels
UPSAMPLE = ("nearest", "bilinear")
SIGN = "sign"      # foreground rule: a positive first-component score (the paper's)
THRESHOLD = SIGN   # the default foreground rule (configs/analysis.yaml pca_threshold)


def check_options(foreground: bool, threshold, upsample: str) -> float | str | None:
    """The threshold pca_rgb takes ("sign", a float, or None: pca_foreground=false); a bad
    pca_threshold or pca_upsample is a ConfigError (call it before any model runs)."""
    if upsample not in UPSAMPLE:
        raise ConfigError(f"pca_upsample={upsample}: one of {', '.join(UPSAMPLE)}")
    if not foreground:
        return None
    if threshold == SIGN:
        return SIGN
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise ConfigError(f"pca_threshold={threshold}: use sign (a positive first-component score) or a number "
                          f"in [0, 1) on the min-max scaled first component (or pca_foreground=false)")
    return float(threshold)


def _pca(x: torch.Tensor, k: int) -> torch.Tensor:
    """Centred projections [P, k] on the top-k components; rank-deficient ones are exact zeros
    (their rounding noise would otherwise be min-max scaled into full-range colour)."""
    x = x - x.mean(0)
    # the SVD of the centred patches: their principal directions without forming the D x D covariance
    _, S, Vh = torch.linalg.svd(x, full_matrices=False)
    proj = x @ Vh[:k].T
    proj[:, S[:k] <= 1e-6 * S[0].clamp_min(1e-30)] = 0
    # fewer patches or dims than k: zero columns (a 2x2 grid of 4 patches still gives 3 colour channels)
    proj = F.pad(proj, (0, k - proj.shape[1]))
    # a component's sign is arbitrary, so it is fixed (TokenCut's rule): its largest-magnitude value is
    # positive, so the same features, or their negation, give the same map
    return torch.where(proj.gather(0, proj.abs().argmax(0, keepdim=True)) < 0, -proj, proj)


def _minmax(proj: torch.Tensor, flat: float) -> torch.Tensor:
    """Each column to [0, 1]; a constant column becomes `flat`."""
    lo, hi = proj.min(0).values, proj.max(0).values
    return torch.where(hi > lo, (proj - lo) / (hi - lo).clamp_min(1e-30), torch.full_like(proj, flat))


def foreground_mask(patches: torch.Tensor, grid: tuple[int, int], threshold: float | str = SIGN) -> torch.Tensor:
    """[gh, gw] bool: patches whose centred first-component score, oriented away from the
    border, is positive (threshold "sign"), or above `threshold` once min-max scaled to
    [0, 1]. patches: [P, D] row-major over the grid."""
    s = _pca(patches.double(), 1)[:, 0]
    border = torch.ones(grid, dtype=torch.bool, device=s.device)  # the patches on the edge of the grid
    border[1:-1, 1:-1] = False
    edge = s[border.flatten()].mean()
    # the first component points away from the image border (its mean there negative): objects sit
    # inside the frame, as the "background prior" of saliency methods assumes
    if edge.abs() > 1e-9 * s.abs().max():  # else a tie: keep the largest-magnitude rule's sign
        s = s if edge < 0 else -s
    if threshold == SIGN:
        return (s > 0).reshape(grid)
    return (_minmax(s[:, None], 0.0)[:, 0] > threshold).reshape(grid)


def pca_rgb(patches: torch.Tensor, grid: tuple[int, int], threshold: float | str | None = None) -> np.ndarray:
    """Patch features [P, D] of one image -> [gh, gw, 3] floats in [0, 1].

    Args:
        patches: one image's patch tokens, row-major over the patch grid.
        grid: (rows, cols) of the patch grid, rows * cols == P.
        threshold: None: the first 3 components of all patches; "sign" or a float: the
            foreground rule of step 1 then step 2 (module docstring), background black.
    """
    x = patches.double()
    if threshold is None:
        return _minmax(_pca(x, 3), 0.0).reshape(*grid, 3).float().numpy()
    fg = foreground_mask(x, grid, threshold).flatten()
    rgb = x.new_zeros(x.shape[0], 3)
    if fg.any():  # a constant component is mid-grey, so the foreground stays apart from black
        rgb[fg] = _minmax(_pca(x[fg], 3), 0.5)
    return rgb.reshape(*grid, 3).float().numpy()


@torch.no_grad()
def model_maps(model, images: torch.Tensor, layer: str = "norm", threshold: float | str | None = THRESHOLD,
               upsample: str = "nearest") -> list[np.ndarray]:
    """PCA maps [H, W, 3] of a batch of normalised images [K, 3, H, W] at `layer`.

    Args:
        model: a VisionTransformer from `load_model`.
        images: already transformed (resized, normalised) as the model expects.
        layer: "norm" or "blocks.<i>".
        threshold: pca_rgb's (None: no foreground step).
        upsample: "nearest" or "bilinear", from the patch grid to the image's pixels.
    """
    dev = next(model.parameters()).device
    # only the blocks up to the asked one run (laplace.features skips the rest)
    block = None if layer == "norm" else [int(layer.split(".")[1])]
    feats = features(model, images.to(dev), layers=block)
    if layer not in feats:
        raise ConfigError(f"pca_layer={layer}: use norm or blocks.<i> with i < {len(model.blocks)}")
    grid = tuple(model.patch_embed.grid_size)
    H, W = images.shape[-2:]
    maps = []
    for f in feats[layer][:, 1:].float().cpu():  # patch tokens only
        rgb = pca_rgb(f, grid, threshold)
        maps.append(np.stack([upsample_map(rgb[..., c], (H, W), upsample) for c in range(3)], -1).clip(0, 1))
    return maps


def upsample_map(m: np.ndarray, size: tuple[int, int], mode: str = "nearest") -> np.ndarray:
    """A [rows, cols] map over the patch grid at the image's `size` (nearest keeps the grid visible;
    bilinear draws a smooth map)."""
    # (bilinear: align_corners=False, torch's default)
    return F.interpolate(torch.from_numpy(m)[None, None].float(), size=size, mode=mode)[0, 0].numpy()


def denormalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """Normalised [K, 3, H, W] -> displayable [K, H, W, 3] in [0, 1]."""
    m, s = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]
    return (images.cpu() * s + m).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def grid_figure(images: np.ndarray, maps: dict[str, list[np.ndarray]], labels: Sequence[int] = (),
                layer: str = "norm", threshold: float | str | None = None):
    """The grid as a matplotlib figure (draw_pca_grid's arguments); each cell's axes is placed
    by hand so that it spans exactly scale * (W, H) pixels at DPI."""
    K, H, W = images.shape[:3]
    cols = [("image", list(images))] + list(maps.items())
    # an integer scale: every image pixel is scale x scale screen pixels, no resampling blur
    scale = max(1, round(MIN_CELL_PX / max(H, W)))
    cw, ch, gap, left = scale * W / DPI, scale * H / DPI, 0.06, 0.3  # inches
    titles = [textwrap.fill(t, max(12, int(cw * 72 / 4.8))) for t, _ in cols]  # ~4.8 pt a character at 8 pt
    fw = left + len(cols) * (cw + gap)
    how = ("first 3 PCs" if threshold is None else "foreground PC1 > 0, then 3 PCs" if threshold == SIGN
           else f"foreground > {threshold:g} on PC1, then 3 PCs")
    sup = textwrap.fill(f"PCA of patch features at {layer}: {how} as RGB", max(20, int(fw * 72 / 5.4)))
    # room above the cells for the wrapped title and column titles (inches)
    top = 0.15 + 0.17 * (sup.count("\n") + 1) + 0.15 * max(t.count("\n") + 1 for t in titles)
    fh = top + K * (ch + gap) + 0.05
    fig = plt.figure(figsize=(fw, fh), dpi=DPI)
    for j, (_, imgs) in enumerate(cols):
        for i in range(K):
            x0, y0 = left + j * (cw + gap), fh - top - (i + 1) * ch - i * gap
            ax = fig.add_axes((x0 / fw, y0 / fh, cw / fw, ch / fh))
            ax.imshow(imgs[i], interpolation="none")  # "none": the PDF embeds the pixels unresampled
            ax.set(xticks=[], yticks=[])
            ax.spines[:].set_visible(False)
            if i == 0:
                ax.set_title(titles[j], fontsize=8)
            if j == 0 and len(labels) > i:
                ax.set_ylabel(f"class {labels[i]}", fontsize=7)
    fig.suptitle(sup, fontsize=9, y=1 - 0.06 / fh, va="top")
    return fig


def _file_names(titles: Sequence[str], names: Sequence[str] | None) -> list[str]:
    """File-safe, unique stems for the map files."""
    out = []
    for j, n in enumerate(names or titles):
        # file-safe: a legend title like "vitt_3L (3/3 Laplacian)" holds a slash
        n = re.sub(r"[^A-Za-z0-9._-]+", "_", str(n)).strip("_") or "model"
        out.append(n if n not in out and n != "image" else f"{n}_{j}")
    return out


def save_pngs(images: np.ndarray, maps: dict[str, list[np.ndarray]], folder: Path,
              names: Sequence[str] | None = None) -> None:
    """image_<i>.png and <name>_<i>.png at the image's own resolution."""
    folder.mkdir(parents=True, exist_ok=True)
    cols = [("image", images)] + list(zip(_file_names(list(maps), names), maps.values()))
    for name, imgs in cols:
        for i, img in enumerate(imgs):
            Image.fromarray((np.asarray(img) * 255).round().astype(np.uint8)).save(folder / f"{name}_{i}.png")


def draw_pca_grid(images: np.ndarray, maps: dict[str, list[np.ndarray]], stem: Path,
                  labels: Sequence[int] = (), layer: str = "norm", names: Sequence[str] | None = None,
                  threshold: float | str | None = None) -> list[Path]:
    """Write <stem>.{png,pdf} (the grid) and the full-resolution files under <stem>/.

    Args:
        images: [K, H, W, 3] displayable images.
        maps: {column title: K maps [H, W, 3]} in column order.
        stem: output path without suffix.
        labels: class of each image, shown beside the row.
        layer: named in the title; threshold: the foreground threshold used (None: none).
        names: file stems of the columns (default: the titles, made file-safe).
    Returns the grid's two paths (the per-image files are written by `save_pngs`).
    """
    stem.parent.mkdir(parents=True, exist_ok=True)
    fig = grid_figure(images, maps, labels, layer, threshold)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    for p in paths:  # no bbox_inches="tight": it would move the cells off whole pixels
        fig.savefig(p, dpi=DPI)
    plt.close(fig)
    save_pngs(images, maps, stem, names)
    return paths


def checkpoint_maps(checkpoints: dict, stem: Path, n: int, layer: str = "norm", threshold=THRESHOLD,
                    upsample: str = "nearest", device: str = "auto", seed: int = 0, data=None,
                    names: Sequence[str] | None = None) -> list[Path]:
    """The grid of `checkpoints` {column title: checkpoint} on the first `n` images of the fixed
    analysis order (`analysis.geometry.eval_split` with `seed`: the same images in every column);
    `data` as in load_for_analysis. One model in memory at a time. Returns the grid's paths."""
    from analysis.geometry import eval_split, load_for_analysis

    maps, images = {}, None
    for title, path in checkpoints.items():
        model, _, node = load_for_analysis(path, data, device)
        if images is None:
            # no max_tokens: the maps' images are the first of the fixed order, whatever the cut
            ds, _ = eval_split(model, node, seed, None)
            items = [ds[i] for i in range(min(n, len(ds)))]
            x, labels = torch.stack([im for im, _ in items]), [int(y) for _, y in items]
            images = denormalize(x, node["mean"], node["std"])
        maps[title] = model_maps(model, x, layer, threshold, upsample)
        del model  # a sweep of ViT-B checkpoints on a laptop adds up
    return draw_pca_grid(images, maps, stem, labels, layer, names, threshold)
