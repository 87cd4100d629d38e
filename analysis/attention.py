"""Per-head attention maps of a ViT checkpoint on one image (after DINO's visualize_attention.py).

    python -m analysis.attention checkpoint=runs/deit3/digits/vitt_1L_s0/ckpt/last.pt image=cat.png
    python -m analysis.attention checkpoint=... image=cat.jpg layers=all patch=[3,5] threshold=0.6

The image goes through the checkpoint's evaluation transform (laplace.data.vision.build_transform
of its data node). Per block of `layers`, two rows of maps, a column per head: the class token's
row of the attention probabilities P over the patches (DINO's map), then the row of one patch
(`patch`, default the centre; marked by a square), upsampled to the image (`upsample`). P is what
every head forms, standard or Laplacian: a standard head outputs P V, a Laplacian one (the last k
of a layer) V - P V, i.e. it mixes by I - P; a learned gate a gives (1 - a) P V + a (V - P V).
Each cell has its own colour scale (min to max, printed), as DINO saves each head apart;
`threshold=t` outlines the patches holding a fraction t of the map's patch mass (DINO's
--threshold). Written to <checkpoint dir>/<name>_analysis/ (out=DIR: as `python -m analysis`
names it): attention_<image stem>.{png,pdf} and .npz (the maps at the patch grid, the class-token
weights, the heads' gates, blocks, patch_rc).
"""
import textwrap
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from analysis.pca_maps import UPSAMPLE, denormalize, upsample_map
from train.cli import hydra_entry
from laplace.errors import ConfigError
from laplace.zoo import model_label


def attention_hooks(model, blocks: Iterable[int], fold: Callable) -> list:
    """Hooks that ask the attention of `blocks` for its probabilities (return_attn=True: the
    reference path forms P only when asked) and call fold(i, x, out, P) with the block index, the
    attention's input and output; the block gets its usual output, its own code runs unchanged.
    Returns the handles (remove them after the forward)."""
    def ask(module, args, kwargs):
        return args, {**kwargs, "return_attn": True}

    handles = []
    for i in blocks:
        # i=i: each hook keeps its own block's index (a closure would see the loop's last)
        def keep(module, args, output, i=i):
            fold(i, args[0], *output)
            return output[0]

        attn = model.blocks[i].attn
        handles += [attn.register_forward_pre_hook(ask, with_kwargs=True), attn.register_forward_hook(keep)]
    return handles


def capture_attention(model, images: torch.Tensor, blocks: Sequence[int]) -> dict[int, torch.Tensor]:
    """{block index: P [B, heads, N, N]} of one forward of `images` through `model` (a ViT)."""
    store = {}
    # the hooks keep P; the model's own forward runs unchanged (the block gets its usual output)
    handles = attention_hooks(model, blocks, lambda i, x, out, P: store.__setitem__(i, P))
    try:
        with torch.no_grad():
            model(images)
    finally:
        for h in handles:
            h.remove()
    return store


def head_label(h: int, a: float, mode: str) -> str:
    if mode == "learned":
        return f"head {h}: gate a={a:.2f}"
    return f"head {h}: Laplacian" if a == 1.0 else f"head {h}: standard"


def attention_maps(model, image: torch.Tensor, blocks: Sequence[int], patch: Optional[tuple[int, int]]) -> dict:
    """The maps of one normalised image [3, H, W]: grid, blocks, patch_rc, cls and patch
    [blocks, heads, rows, cols] (P's entries on the patches), cls_to_cls and patch_to_cls
    [blocks, heads] (the query's weight on the class token: with it a row sums to 1), weights
    [blocks, heads] (each head's gate a: 0 standard, 1 Laplacian) and labels (the heads' titles)."""
    ph, pw = model.patch_embed.patch_size
    grid = (image.shape[-2] // ph, image.shape[-1] // pw)  # the patch grid of this image
    # default the centre patch: on a centred object it sits inside it
    r, c = (grid[0] // 2, grid[1] // 2) if patch is None else patch
    if not (0 <= r < grid[0] and 0 <= c < grid[1]):
        raise ConfigError(f"patch=[{r},{c}]: outside the {grid[0]}x{grid[1]} patch grid of this image; "
                          f"use rows 0..{grid[0] - 1} and columns 0..{grid[1] - 1}")
    # one forward of one image: P is [heads, N, N] per block, small even for ViT-B at 224 px
    P = capture_attention(model, image[None].to(next(model.parameters()).device), blocks)
    q = 1 + r * grid[1] + c  # the patch's token: row-major over the grid, after the class token
    p = torch.stack([P[i][0] for i in blocks]).float().cpu().numpy()  # [blocks, heads, N, N]
    # the module's own gates: one definition of a head's kind for the figure and the mechanism
    attns = [model.blocks[i].attn for i in blocks]
    weights = np.array([a.gates().detach().float().cpu().tolist() for a in attns])
    # the class token's and the patch's rows over the patches; their weight on the class token apart
    return {"grid": grid, "blocks": list(blocks), "patch_rc": (r, c), "weights": weights,
            "cls": p[:, :, 0, 1:].reshape(*p.shape[:2], *grid), "cls_to_cls": p[:, :, 0, 0],
            "patch": p[:, :, q, 1:].reshape(*p.shape[:2], *grid), "patch_to_cls": p[:, :, q, 0],
            "labels": [[head_label(h, a, attn.laplacian_mode) for h, a in enumerate(ws)]
                       for attn, ws in zip(attns, weights.tolist())]}


def mass_mask(m: np.ndarray, keep: float) -> np.ndarray:
    """The patches that hold a fraction `keep` of a map's mass, largest first (DINO's threshold)."""
    flat = m.flatten().astype(np.float64)
    order = np.argsort(flat)
    # ascending cumulative mass: the patches above 1 - keep hold the top `keep` of it
    cum = np.cumsum(flat[order] / max(flat.sum(), 1e-30))
    mask = np.empty_like(flat, dtype=bool)
    mask[order] = cum > 1 - keep
    return mask.reshape(m.shape)


def draw_maps(maps: dict, image: np.ndarray, title: str, stem: Path, upsample: str = "nearest",
              threshold: Optional[float] = None):
    """Per block a class-token row and a patch row; column 0 the image, then a column per head.
    Writes stem.{png,pdf}; returns (the axes, the paths)."""
    from matplotlib.patches import Rectangle

    from analysis.figures import plt, save

    H, W = image.shape[:2]
    (gh, gw), (r, c) = maps["grid"], maps["patch_rc"]
    # rows: per block, the class token's attention then the query patch's; columns: the image, then the heads
    heads, cell = maps["cls"].shape[1], 1.7  # inches
    fig, axes = plt.subplots(2 * len(maps["blocks"]), heads + 1, squeeze=False,
                             figsize=(cell * (heads + 1), cell * 2 * len(maps["blocks"]) + 0.9))
    # the query patch outlined in red on the image and on every patch-row map
    square = dict(xy=(c * W / gw - 0.5, r * H / gh - 0.5), width=W / gw, height=H / gh, fill=False, ec="red", lw=1.2)
    for b, block in enumerate(maps["blocks"]):
        for j, (kind, what) in enumerate((("cls", "class token"), ("patch", f"patch ({r}, {c})"))):
            row = axes[2 * b + j]
            row[0].imshow(image, interpolation="none")
            row[0].set_ylabel(f"block {block}\n{what}", fontsize=8)
            for h in range(heads):
                m, ax = maps[kind][b, h], row[h + 1]
                ax.imshow(upsample_map(m, (H, W), upsample), cmap="viridis", interpolation="none")  # min-max, as DINO's
                keep = mass_mask(m, threshold) if threshold is not None else None
                if keep is not None and 0 < keep.sum() < keep.size:  # every patch (or none) kept: no outline
                    ax.contour(upsample_map(keep.astype(np.float32), (H, W), "nearest"), levels=[0.5], colors="white",
                               linewidths=0.8)
                # Laplacian heads' titles in red: the columns to compare with the standard ones
                ax.set_title(maps["labels"][b][h], fontsize=8, color="C3" if maps["weights"][b][h] > 0.5 else "k")
                ax.text(0.02, 0.02, f"{m.min():.2f}-{m.max():.2f}, cls {maps[kind + '_to_cls'][b, h]:.2f}",
                        transform=ax.transAxes, fontsize=6, color="white", va="bottom")
            for ax in row if kind == "patch" else ():
                ax.add_patch(Rectangle(**square))
        for ax in axes[2 * b:2 * b + 2].ravel():
            ax.set(xticks=[], yticks=[])
    fig.suptitle(textwrap.fill(title, max(40, int(cell * (heads + 1) * 72 / 5.4))), fontsize=9)
    fig.tight_layout()
    return axes, save(fig, stem)


def title_of(model_name: str, maps: dict, mode: str, threshold: Optional[float]) -> str:
    # per block, the number of Laplacian heads (a per-layer list may differ between blocks)
    k = [int(sum(w == 1.0 for w in ws)) for ws in maps["weights"]]
    lap = ("learned gates a per head (titles in red: a > 0.5): the output is (1 - a) PV + a (V - PV)"
           if mode == "learned" else f"{'/'.join(map(str, sorted(set(k))))} of {maps['cls'].shape[1]} heads "
           f"Laplacian (titles in red): a Laplacian head outputs V - PV, it mixes by I - P")
    th = f"; white: the patches holding {threshold:.0%} of a map's mass" if threshold is not None else ""
    return (f"{model_name}: attention probabilities P of the class token and of the red patch over the "
            f"patches; {lap}; shown is P{th}")


def run(cfg: DictConfig) -> dict:
    """Draw the attention maps of cfg.checkpoint on cfg.image; returns the maps, the axes and the paths."""
    from PIL import Image, UnidentifiedImageError

    from analysis.geometry import analysis_dir, layer_names, load_for_analysis
    from laplace.data.vision import build_transform
    from train.rundir import check_writable
    from laplace.vit import VisionTransformer

    ckpt_path, image_path, th = Path(str(cfg.checkpoint)), Path(str(cfg.image)), cfg.threshold
    if not ckpt_path.exists():
        raise ConfigError(f"checkpoint={ckpt_path}: no such file; pass checkpoint=PATH to a laplace ViT checkpoint, "
                          f"e.g. runs/<trainer>/<data>/<run>/ckpt/last.pt")
    if not image_path.is_file():
        raise ConfigError(f"image={image_path}: no such file; pass image=PATH to a .png or .jpg")
    if cfg.upsample not in UPSAMPLE:
        raise ConfigError(f"upsample={cfg.upsample}: one of {', '.join(UPSAMPLE)}")
    if th is not None and (isinstance(th, bool) or not isinstance(th, (int, float)) or not 0 < th < 1):
        raise ConfigError(f"threshold={th}: a fraction of the mass in (0, 1), e.g. threshold=0.6; null: none")
    try:
        with Image.open(image_path) as im:
            pil = im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ConfigError(f"image={image_path}: not a readable image ({type(e).__name__}); pass a .png or "
                          f".jpg") from None
    # the model rebuilt from the checkpoint alone (or an export); its data node gives the transform
    model, ckpt, data = load_for_analysis(ckpt_path, None, cfg.device)
    name = model_label(ckpt["config"]["model"])
    if not isinstance(model, VisionTransformer):  # a GPT has no patches to draw attention over
        raise ConfigError(f"checkpoint={ckpt_path}: model {name} is not a ViT; attention maps over image patches "
                          f"need a ViT checkpoint")
    blocks = layer_names(model, cfg.layers)[0]
    blocks = list(range(len(model.blocks))) if blocks is None else blocks  # layers=all: every block
    # the checkpoint's own evaluation transform: the image the model would see at test time
    x = build_transform(OmegaConf.create(data), train=False)(pil)  # [3, H, W], normalised
    patch = cfg.patch
    if patch is not None and not (isinstance(patch, (list, ListConfig)) and len(patch) == 2
                                  and all(isinstance(v, int) for v in patch)):
        raise ConfigError(f"patch={patch}: give [row,col] of a patch on the grid, e.g. patch=[0,0]; null: the centre")
    # where python -m analysis puts this checkpoint's results, checked before the forward
    out_dir = check_writable(analysis_dir(ckpt_path, cfg.out), "out")
    maps = attention_maps(model, x, blocks, None if patch is None else (int(patch[0]), int(patch[1])))
    title = title_of(name, maps, model.blocks[0].attn.laplacian_mode, th)
    stem = out_dir / f"attention_{image_path.stem}"
    axes, paths = draw_maps(maps, denormalize(x[None], data["mean"], data["std"])[0], title, stem, cfg.upsample, th)
    # the numbers behind the figure, for a figure of one's own
    arrays = {k: maps[k] for k in ("cls", "cls_to_cls", "patch", "patch_to_cls", "weights")}
    np.savez(stem.with_suffix(".npz"), **arrays, blocks=np.array(blocks), patch_rc=np.array(maps["patch_rc"]))
    paths.append(stem.with_suffix(".npz"))
    for p in paths:
        print(f"[attention] wrote {p}", flush=True)
    return {**maps, "axes": axes, "paths": paths, "title": title}


main = hydra_entry("attention")(run)


if __name__ == "__main__":
    main()
