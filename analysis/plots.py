"""Figures of token geometry vs layer, one line per checkpoint or per arm (its seeds' mean, +-1 sd):
what `python -m analysis` draws for its checkpoints and `python -m analysis.figures` per experiment.

    anova      ANOVA shares vs layer (ViT: within-image, within-class, between-class shares of the
               patch-token variance; GPT: within / between window) and the total variance
    collapse   ViT: Neural Collapse NC1-NC4 and CDNV of the class token, NC1 of the image means of
               the patch tokens; GPT: linguistic collapse (lc_*)
    spectrum   the eigen-spectrum and the cumulative explained variance at one layer, PCs for 99%
               vs layer (ViT: also of the image-centred tokens)

    from analysis.plots import draw_all
    draw_all([json.load(open("analysis.json"))], "figures/")
Each figure is written as PNG (a quick look) and PDF (a paper).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers / CI
import matplotlib.pyplot as plt  # noqa: E402

_COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
FIGURES = ("anova", "collapse", "spectrum")


def save(fig, stem: Path) -> list[Path]:
    """Write stem.png and stem.pdf; return both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    # a tight box grows the image to fit legends placed below the axes
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def color(i: int) -> str:
    """The i-th colour of the shared cycle (the same k gets the same colour in every figure)."""
    return _COLORS[i % len(_COLORS)]


def run_label(res: dict) -> str:
    """Legend text: the model name and its Laplacian heads, e.g. 'vitt_3L (3/3 Laplacian)'."""
    # (a per-layer list of k is written 0/0/6/6)
    k = res["num_laplacian_heads"]
    k = k if isinstance(k, int) else "/".join(map(str, k))
    return res.get("label") or f"{res['model']} ({k}/{res['num_heads']} Laplacian)"


def layer_positions(layers: Sequence[str]):
    """x positions and tick labels of layer names ("blocks.<i>", then "norm" one step on)."""
    xs, ticks = [], []
    for name in layers:
        if name == "norm":
            # the final norm one step after the last block: it reads that block's output
            xs.append((xs[-1] + 1) if xs else 0)
            ticks.append("norm")
        else:
            xs.append(int(name.split(".")[1]))
            ticks.append(str(xs[-1]))
    return xs, ticks


def mean_band(ax, xs, series: Sequence[Sequence[float]], color: str, label: str, marker: str = "o", ls: str = "-"):
    """The mean over runs (e.g. seeds) as a line and +-1 sample sd as a band around it (no band
    for one run; analysis.stats.describe). NaN entries are left out of their position's mean."""
    from analysis.stats import describe

    cols = [[v for v in col if not math.isnan(v)] for col in zip(*series)]
    stats = [describe(c) if c else None for c in cols]
    mean = [s.mean if s else math.nan for s in stats]
    ax.plot(xs, mean, ls, color=color, marker=marker, ms=3, label=label)
    if len(series) > 1:
        sd = [s.sd if s and s.n > 1 else 0.0 for s in stats]
        ax.fill_between(xs, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)], color=color,
                        alpha=0.2, lw=0)
    return mean


def series(res: dict, kind: str, group: str, key: str) -> list[float]:
    """One metric over the layers of an analysis.json (NaN where absent)."""
    per_layer = res["results"].get(kind, {})
    vals = [per_layer.get(n, {}).get(group, {}).get(key) for n in res["layers"]]
    return [math.nan if v is None else v for v in vals]


def panels_figure(panels, title: str, stem: Path, draw, cols: int = 3) -> list[Path]:
    """One panel per spec (..., sub title, log y): `draw(ax, spec)` draws its lines vs layer; the
    legend once, below the panels."""
    rows = -(-len(panels) // cols)
    # squeeze=False: one panel is still a grid of axes
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.7 * rows), squeeze=False)
    axes = axes.ravel()
    for ax, spec in zip(axes, panels):
        draw(ax, spec)
        ys = [v for line in ax.get_lines() for v in line.get_ydata() if math.isfinite(v)]
        # a log axis where asked (NC1 and CDNV span decades over depth) and the values allow it
        # (a near-constant series on a log axis gets unreadable ticks)
        if spec[-1] and ys and min(ys) > 0 and max(ys) / min(ys) > 10:
            ax.set_yscale("log")
        ax.set_title(spec[-2], fontsize=9)
        ax.set_xlabel("layer", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    handles, labels = axes[0].get_legend_handles_labels()
    # below the axes whatever the figure height; save()'s tight bounding box grows to fit it
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4), fontsize=8, bbox_to_anchor=(0.5, 0.0))
    return save(fig, stem)


def layer_figure(lines, panels, title: str, stem: Path, cols: int = 3) -> list[Path]:
    """One panel per (kind, group, key, title, log): a line per entry of `lines` [(label, [analysis
    results of its seeds])], mean +-1 sd over the seeds."""
    def draw(ax, panel):
        kind, group, key = panel[:3]
        for c, (label, seeds) in enumerate(lines):
            # seeds analysed over other layers (layers=[...]) cannot share a mean: left out
            layers = seeds[0]["layers"]
            xs, ticks = layer_positions(layers)
            # (a layer a seed did not measure is NaN: left out of that position's mean)
            ys = [series(s, kind, group, key) for s in seeds if s["layers"] == layers]
            if not all(math.isnan(v) for y in ys for v in y):
                # n in the legend only when lines pool seeds (one checkpoint per line needs none)
                n = f" (n={len(ys)})" if len(lines[0][1]) > 1 or len(ys) > 1 else ""
                mean_band(ax, xs, ys, color(c), label + n)
            ax.set_xticks(xs, ticks, fontsize=7 if len(xs) > 14 else 8)
    return panels_figure(panels, title, stem, draw, cols)


def _kind(lines) -> str:
    return "patch" if lines[0][1][0]["arch"] == "vit" else "tokens"


def draw_anova(lines, stem: Path, name: str = "") -> list[Path]:
    p = _kind(lines)
    panels = ([(p, "anova", "within_seq_share", "within-image share", False),
               (p, "anova", "within_class_share", "within-class share", False),
               (p, "anova", "between_class_share", "between-class share", False)] if p == "patch" else
              [(p, "anova", "within_seq_share", "within-window share", False),
               (p, "anova", "between_seq_share", "between-window share", False)])
    panels.append((p, "anova", "total", "total variance", True))
    return layer_figure(lines, panels, f"{name}: ANOVA of token representations vs layer".lstrip(": "), stem,
                        cols=len(panels))


def draw_collapse(lines, stem: Path, name: str = "") -> list[Path]:
    if _kind(lines) == "patch":
        panels = [("cls", "nc", "nc1", "NC1 (class token)", True), ("cls", "nc", "nc2_equinorm", "NC2 equinorm", False),
                  ("cls", "nc", "nc2_equiangular", "NC2 equiangular", False),
                  ("cls", "nc", "nc2_maxangle", "NC2 max-angle", False),
                  ("cls", "nc", "nc3", "NC3 (vs classifier)", False), ("cls", "nc", "nc4", "NC4 (head != NCC)", False),
                  ("cls", "cdnv", "cdnv_mean", "CDNV (class token)", True),
                  ("patch", "nc", "nc1", "NC1 (image means of patches)", True)]
        title, cols = f"{name}: Neural Collapse vs layer (classes = image classes)", 4
    else:
        panels = [("tokens", "lc", "lc_cdnv_mean", "CDNV (next-token classes)", True),
                  ("tokens", "lc", "lc_equinorm", "equinorm", False),
                  ("tokens", "lc", "lc_coherence_std", "equiangularity (std cos)", False),
                  ("tokens", "lc", "lc_abs_coherence_mean", "mean |cos| of class means", False),
                  ("tokens", "lc", "lc_self_duality", "self-duality 1 - cos(mu_c, w_c)", False),
                  ("tokens", "lc", "lc_uniform_duality", "uniform duality (std cos)", False)]
        title, cols = f"{name}: linguistic collapse vs layer (classes = next-token ids)", 3
    return layer_figure(lines, panels, title.lstrip(": "), stem, cols)


def draw_spectrum(lines, stem: Path, name: str = "", layer: str = "norm") -> list[Path]:
    """The eigen-spectrum and the cumulative explained variance at `layer` (mean over seeds), and
    PCs for 99% of the variance vs layer (ViT: dashed, of the image-centred tokens)."""
    kind = _kind(lines)
    fig, (ax_s, ax_c, ax_l) = plt.subplots(1, 3, figsize=(11, 3))
    for c, (label, seeds) in enumerate(lines):
        specs = [s["results"][kind].get(layer, {}).get("spectral") for s in seeds]
        if None in specs and layer != "norm":
            from laplace.errors import ConfigError

            raise ConfigError(f"spectrum_layer={layer}: not among the measured layers {seeds[0]['layers']}")
        # (the seeds that measured the spectrum at this layer)
        specs = [s for s in specs if s]
        if not specs or len({len(s["spectrum"]) for s in specs}) > 1:  # not measured, or widths differ
            continue
        # the seeds' mean normalised spectrum (all of one width: checked above)
        p = [sum(v) / len(v) for v in zip(*(s["spectrum"] for s in specs))]
        # numerically zero eigenvalues (LayerNorm's centring removes one direction) are left out
        # rather than drawn as a cliff down to the clamp
        nz = [(k, v) for k, v in enumerate(p, 1) if v > 1e-12]
        ax_s.plot([k for k, _ in nz], [v for _, v in nz], color=color(c), label=label)
        # each seed's cumulative explained variance, banded over seeds
        cum = [[sum(s["spectrum"][:k + 1]) for k in range(len(p))] for s in specs]
        n99 = sum(s["n_pcs_0.99"] for s in specs) / len(specs)
        mean_band(ax_c, range(1, len(p) + 1), cum, color(c), f"{label}: {n99:.1f} PCs", marker="")
        ax_c.axvline(n99, color=color(c), ls=":", lw=1)
        xs, ticks = layer_positions(seeds[0]["layers"])
        mean_band(ax_l, xs, [series(s, kind, "spectral", "n_pcs_0.99") for s in seeds], color(c), label)
        if kind == "patch":
            mean_band(ax_l, xs, [series(s, kind, "spectral_within", "n_pcs_0.99") for s in seeds], color(c),
                      "_nolegend_", marker="s", ls="--")
        ax_l.set_xticks(xs, ticks, fontsize=8)
    ax_s.set(xscale="log", yscale="log", xlabel="principal component k", ylabel="eigenvalue / total")
    ax_s.set_title(f"eigen-spectrum at {layer}", fontsize=9)
    ax_c.axhline(0.99, color="grey", ls="--", lw=1)
    ax_c.set(xscale="log", xlabel="principal components k", ylabel="explained variance")
    ax_c.set_title(f"cumulative explained variance at {layer}", fontsize=9)
    ax_c.legend(fontsize=7, loc="lower right")
    ax_l.set(xlabel="layer", ylabel="PCs for 99% of the variance")
    ax_l.set_title("PCs for 99% vs layer" + (" (dashed: image-centred)" if kind == "patch" else ""), fontsize=9)
    for ax in (ax_s, ax_c, ax_l):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{name}: spectral decay of token representations".lstrip(": "), fontsize=10)
    fig.tight_layout()
    return save(fig, stem)


def draw_all(runs: list[dict], out_dir, spectrum_layer: str = "norm") -> list[Path]:
    """Every figure the analysis.json results `runs` hold, a line per checkpoint; figures of
    metrics not measured are skipped (and an old copy of them in out_dir is removed)."""
    out_dir = Path(out_dir)
    # the metric groups the analysis measured: a figure only for what is there
    have = {g for kinds in runs[0]["results"].values() for groups in kinds.values() for g in groups}
    # a line per checkpoint (one "seed" each): the same drawers as per-experiment figures
    lines = [(run_label(r), [r]) for r in runs]
    paths = []
    if "anova" in have:
        paths += draw_anova(lines, out_dir / "anova")
    if have & {"nc", "lc", "cdnv"}:
        paths += draw_collapse(lines, out_dir / "collapse")
    if "spectral" in have:
        paths += draw_spectrum(lines, out_dir / "spectrum", layer=spectrum_layer)
    for name in FIGURES:  # a figure of an earlier call with other metrics would now mislead
        for ext in (".png", ".pdf"):
            stale = (out_dir / name).with_suffix(ext)
            if stale not in paths and stale.exists():
                stale.unlink()
    return paths
