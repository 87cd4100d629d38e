"""Per-head attention maps of a ViT checkpoint on one image (after DINO's visualize_attention.py).

    python -m analysis.attention checkpoint=runs/deit3/digits/vitt_1L_s0/ckpt/last.pt image=cat.png
    python -m analysis.attention checkpoint=... image=cat.jpg layers=all patch=[3,5] threshold=0.6

The image goes through the checkpoint's evaluation transform (its data node: img_size, crop,
mean, std; laplace.data.vision.build_transform) and the model rebuilt by
`laplace.checkpoint.load_model`'s loader. The attention probabilities P of each head come from
the model's own `return_attn` path (laplace/attention.py), asked for through hooks on the
blocks' attention modules: P[h] is the row-softmax matrix every head forms, standard or
Laplacian. A standard head outputs P V; a Laplacian head (the last k of the layer) outputs
V - P V, i.e. it mixes its tokens by I - P: the maps show P, what the head averages and then
subtracts. Learned gates (laplacian_mode=learned) output (1 - a) P V + a (V - P V): a is given.

Per block of `layers`, two rows of maps, one column per head: the class token's row of P over
the patches (DINO's map), then the row of one patch (`patch`, default the centre; marked by a
square), each reshaped to the patch grid and upsampled to the image (`upsample`). A map holds
the probabilities as they are: with the weight the query gives the class token ("cls" in each
cell) they sum to 1. Each cell has its own colour scale, its min to its max (printed in the
cell), as DINO saves each head's map apart. `threshold=t` outlines the patches that hold a fraction t of the map's
patch mass (DINO's --threshold, 0.6 in its paper's figures).

Written to <checkpoint dir>/<name>_analysis/ (with out=DIR: DIR/<run>_<name>_analysis/, as
`python -m analysis` names it): attention_<image stem>.{png,pdf} and .npz (the maps at the patch
grid, the class-token weights, the heads' Laplacian weights, blocks, patch_rc). Bad input (a GPT checkpoint, a
missing or unreadable image, a patch off the grid) exits with one `error: ...` line.
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, ListConfig, OmegaConf

from laplace.cli import hydra_entry
from laplace.errors import ConfigError
from laplace.zoo import model_label

UPSAMPLE = ("nearest", "bilinear")


def capture_attention(model, images: torch.Tensor, blocks: Sequence[int]) -> dict[int, torch.Tensor]:
    """{block index: P [B, heads, N, N]} of one forward of `images` through `model` (a ViT).

    The attention modules are asked for return_attn=True by a pre-hook; a forward hook keeps P
    and hands the block its usual output, so the block's own code runs unchanged."""
    store, handles = {}, []

    # the reference path forms P only when asked; the fused path never materialises it
    def ask(module, args, kwargs):
        return args, {**kwargs, "return_attn": True}

    for i in blocks:
        # i=i: each hook keeps its own block's index (a closure would see the loop's last)
        def keep(module, args, output, i=i):
            out, store[i] = output
            return out

        attn = model.blocks[i].attn
        handles += [attn.register_forward_pre_hook(ask, with_kwargs=True), attn.register_forward_hook(keep)]
    try:
        with torch.no_grad():
            model(images)
    finally:
        for h in handles:
            h.remove()
    return store


def head_weights(attn) -> list[float]:
    """Per head, the gate a (the weight of V - P V in its output): 0 (standard) or 1 (Laplacian)
    in the fixed mode, the learned gate otherwise (laplace.attention.Attention.gates)."""
    # (the module's own gates: one definition of a head's kind for the figure and the mechanism)
    return attn.gates().detach().float().cpu().tolist()


def head_label(h: int, weight: float, mode: str) -> str:
    if mode == "learned":
        return f"head {h}: gate a={weight:.2f}"
    return f"head {h}: Laplacian" if weight == 1.0 else f"head {h}: standard"


def attention_maps(model, image: torch.Tensor, blocks: Sequence[int], patch: tuple[int, int]) -> dict:
    """The maps of one normalised image [3, H, W]: per block, the class token's and the patch's
    row of every head's P over the patches.

    Returns grid (rows, cols of patches), blocks, cls and patch [len(blocks), heads, rows, cols]
    (P's entries on the patches), cls_to_cls and patch_to_cls [len(blocks), heads] (the weight the
    query gives the class token: with it a row sums to 1), weights [len(blocks), heads] (see
    `head_weights`) and labels (per block, the heads' titles)."""
    ph, pw = model.patch_embed.patch_size
    grid = (image.shape[-2] // ph, image.shape[-1] // pw)
    r, c = patch
    if not (0 <= r < grid[0] and 0 <= c < grid[1]):
        raise ConfigError(f"patch=[{r},{c}]: outside the {grid[0]}x{grid[1]} patch grid of this image; "
                          f"use rows 0..{grid[0] - 1} and columns 0..{grid[1] - 1}")
    dev = next(model.parameters()).device
    # one forward of one image: P is [heads, N, N] per block, small even for ViT-B at 224 px
    P = capture_attention(model, image[None].to(dev), blocks)
    # (row-major over the grid, as the patch embedding flattens it)
    q = 1 + r * grid[1] + c  # the patch's token (the class token is token 0)
    out = {"grid": grid, "blocks": list(blocks), "patch_rc": (r, c)}
    rows = {key: [] for key in ("cls", "cls_to_cls", "patch", "patch_to_cls", "weights", "labels")}
    for i in blocks:
        p = P[i][0].float().cpu()  # [heads, N, N]
        attn = model.blocks[i].attn
        # the class token's row over the patches (its weight on itself is kept apart in cls_to_cls)
        rows["cls"].append(p[:, 0, 1:].reshape(-1, *grid))
        rows["cls_to_cls"].append(p[:, 0, 0])
        rows["patch"].append(p[:, q, 1:].reshape(-1, *grid))
        rows["patch_to_cls"].append(p[:, q, 0])
        rows["weights"].append(head_weights(attn))
        rows["labels"].append([head_label(h, w, attn.laplacian_mode) for h, w in enumerate(rows["weights"][-1])])
    for key in ("cls", "cls_to_cls", "patch", "patch_to_cls"):
        out[key] = torch.stack(rows[key]).numpy()
    out["weights"], out["labels"] = np.array(rows["weights"]), rows["labels"]
    return out


def mass_mask(m: np.ndarray, keep: float) -> np.ndarray:
    """The patches that hold a fraction `keep` of a map's mass, largest first (DINO's threshold:
    the map normalised over the patches, the ascending cumulative sum above 1 - keep)."""
    flat = m.flatten().astype(np.float64)
    # DINO's rule: the smallest set of patches holding `keep` of the map's mass
    order = np.argsort(flat)
    # ascending cumulative mass: the patches above 1 - keep hold the top `keep` of it
    cum = np.cumsum(flat[order] / max(flat.sum(), 1e-30))
    mask = np.empty_like(flat, dtype=bool)
    mask[order] = cum > 1 - keep
    return mask.reshape(m.shape)


def _upsample(m: np.ndarray, size: tuple[int, int], mode: str) -> np.ndarray:
    # (nearest keeps the patch grid visible; bilinear draws a smooth map)
    kw = {} if mode == "nearest" else {"align_corners": False}
    return F.interpolate(torch.from_numpy(m)[None, None].float(), size=size, mode=mode, **kw)[0, 0].numpy()


def draw_maps(maps: dict, image: np.ndarray, title: str, stem: Path, upsample: str = "nearest",
              threshold: Optional[float] = None):
    """The grid: per block a class-token row and a patch row; column 0 the image, then a column per
    head. Writes stem.png and stem.pdf; returns (the figure's axes as rows, the paths)."""
    from matplotlib.patches import Rectangle

    from analysis.plots import plt, save

    H, W = image.shape[:2]
    (gh, gw), (r, c) = maps["grid"], maps["patch_rc"]
    heads = maps["cls"].shape[1]
    # rows: per block, the class token's attention then the query patch's; columns: image, heads
    cell = 1.7  # inches
    fig, axes = plt.subplots(2 * len(maps["blocks"]), heads + 1, figsize=(cell * (heads + 1), cell * 2 * len(maps["blocks"]) + 0.9),
                             squeeze=False)
    # the query patch outlined in red on the image and on every patch-row map
    square = dict(xy=(c * W / gw - 0.5, r * H / gh - 0.5), width=W / gw, height=H / gh, fill=False, ec="red", lw=1.2)
    for b, block in enumerate(maps["blocks"]):
        for j, (kind, to_cls, what) in enumerate((("cls", "cls_to_cls", "class token"),
                                                  ("patch", "patch_to_cls", f"patch ({r}, {c})"))):
            row = axes[2 * b + j]
            row[0].imshow(image, interpolation="none")
            row[0].set_ylabel(f"block {block}\n{what}", fontsize=8)
            if kind == "patch":
                row[0].add_patch(Rectangle(**square))
            for h in range(heads):
                m = maps[kind][b, h]
                ax = row[h + 1]
                ax.imshow(_upsample(m, (H, W), upsample), cmap="viridis", interpolation="none")  # min-max, as DINO's
                keep = mass_mask(m, threshold) if threshold is not None else None
                if keep is not None and 0 < keep.sum() < keep.size:  # every patch (or none) kept: no outline
                    ax.contour(_upsample(keep.astype(np.float32), (H, W), "nearest"), levels=[0.5], colors="white",
                               linewidths=0.8)
                if kind == "patch":
                    ax.add_patch(Rectangle(**square))
                # Laplacian heads' titles in red: the columns to compare with the standard ones
                ax.set_title(maps["labels"][b][h], fontsize=8, color="C3" if maps["weights"][b][h] > 0.5 else "k")
                ax.text(0.02, 0.02, f"{m.min():.2f}-{m.max():.2f}, cls {maps[to_cls][b, h]:.2f}", transform=ax.transAxes,
                        fontsize=6, color="white", va="bottom")
        for ax in axes[2 * b:2 * b + 2].ravel():
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(textwrap.fill(title, max(40, int(cell * (heads + 1) * 72 / 5.4))), fontsize=9)
    fig.tight_layout()
    return axes, save(fig, stem)


# ----------------------------------------------------------------------------- the command

def _image(cfg) -> Path:
    p = Path(str(cfg.image))
    if not p.is_file():
        raise ConfigError(f"image={p}: no such file; pass image=PATH to a .png or .jpg")
    return p


def _patch(value, grid: tuple[int, int]) -> tuple[int, int]:
    if value is None:
        # the centre patch: on a centred object it sits inside it
        return grid[0] // 2, grid[1] // 2
    if not (isinstance(value, (list, ListConfig)) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise ConfigError(f"patch={value}: give [row,col] of a patch on the grid, e.g. patch=[0,0]; null: the centre")
    return int(value[0]), int(value[1])


def title_of(model_name: str, maps: dict, mode: str, threshold: Optional[float]) -> str:
    # per block, the number of Laplacian heads (a per-layer list may differ between blocks)
    k = [int(sum(w == 1.0 for w in ws)) for ws in maps["weights"]]
    heads = maps["cls"].shape[1]
    lap = ("learned gates a per head (titles in red: a > 0.5): the output is (1 - a) PV + a (V - PV)" if mode == "learned" else
           f"{'/'.join(map(str, sorted(set(k))))} of {heads} heads Laplacian (titles in red): a Laplacian "
           f"head outputs V - PV, it mixes by I - P")
    th = f"; white: the patches holding {threshold:.0%} of a map's mass" if threshold is not None else ""
    return (f"{model_name}: attention probabilities P of the class token and of the red patch over the "
            f"patches; {lap}; shown is P{th}")


def run(cfg: DictConfig) -> dict:
    """Draw the attention maps of cfg.checkpoint on cfg.image; returns the maps, the axes and the paths."""
    from PIL import Image, UnidentifiedImageError

    from analysis.__main__ import analysis_dir
    from analysis.geometry import layer_names, load_for_analysis
    from analysis.pca_maps import denormalize
    from laplace.data.vision import build_transform
    from laplace.rundir import check_writable
    from laplace.vit import VisionTransformer

    ckpt_path = Path(str(cfg.checkpoint))
    if not ckpt_path.is_file():
        raise ConfigError(f"checkpoint={ckpt_path}: no such file; pass checkpoint=PATH to a laplace ViT checkpoint, "
                          f"e.g. runs/<trainer>/<data>/<run>/ckpt/last.pt")
    image_path = _image(cfg)
    if cfg.upsample not in UPSAMPLE:
        raise ConfigError(f"upsample={cfg.upsample}: one of {', '.join(UPSAMPLE)}")
    th = cfg.threshold
    if th is not None and (isinstance(th, bool) or not isinstance(th, (int, float)) or not 0 < th < 1):
        raise ConfigError(f"threshold={th}: a fraction of the mass in (0, 1), e.g. threshold=0.6; null: none")
    try:
        with Image.open(image_path) as im:
            pil = im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ConfigError(f"image={image_path}: not a readable image ({type(e).__name__}); pass a .png or .jpg") from None
    model, ckpt, data = load_for_analysis(ckpt_path, None, cfg.device)
    name = model_label(ckpt["config"]["model"])
    # (a GPT has no patches to draw attention over)
    if not isinstance(model, VisionTransformer):
        raise ConfigError(f"checkpoint={ckpt_path}: model {name} is not a ViT; attention maps over image patches "
                          f"need a ViT checkpoint")
    blocks = layer_names(model, cfg.layers)[0]
    # layers="all": every block
    blocks = list(range(len(model.blocks))) if blocks is None else blocks
    # the checkpoint's own evaluation transform: the image the model would see at test time
    x = build_transform(OmegaConf.create(data), train=False)(pil)  # [3, H, W], normalised
    ph, pw = model.patch_embed.patch_size
    out_dir = check_writable(analysis_dir(ckpt_path, cfg.out), "out")
    maps = attention_maps(model, x, blocks, _patch(cfg.patch, (x.shape[1] // ph, x.shape[2] // pw)))
    mode = model.blocks[0].attn.laplacian_mode
    stem = out_dir / f"attention_{image_path.stem}"
    axes, paths = draw_maps(maps, denormalize(x[None], data["mean"], data["std"])[0], title_of(name, maps, mode, th),
                            stem, cfg.upsample, th)
    # the numbers behind the figure, for a figure of one's own
    np.savez(stem.with_suffix(".npz"), **{k: maps[k] for k in ("cls", "cls_to_cls", "patch", "patch_to_cls", "weights")},
             blocks=np.array(blocks), patch_rc=np.array(maps["patch_rc"]))
    paths.append(stem.with_suffix(".npz"))
    for p in paths:
        print(f"[attention] wrote {p}", flush=True)
    return {**maps, "axes": axes, "paths": paths, "title": title_of(name, maps, mode, th)}


main = hydra_entry("attention")(run)


if __name__ == "__main__":
    main()
