"""Figures of `python -m analysis`: token geometry vs layer, one line per checkpoint.

Several checkpoints share the axes (baseline vs Laplacian heads), as in the paper's figures.
Each figure is written as PNG (for a quick look) and PDF (for a paper):

    anova.{png,pdf}     ANOVA shares vs layer (ViT: within-image, within-class, between-class
                        shares of the patch-token variance; GPT: within / between window) and the
                        total variance (log scale)
    collapse.{png,pdf}  ViT: Neural Collapse NC1-NC4 and CDNV vs layer, class token (solid) and
                        image means of the patch tokens (dashed); GPT: linguistic collapse (lc_*)
    spectrum.{png,pdf}  eigen-spectrum at one layer on log axes, the cumulative explained
                        variance with the 99% line, and n_pcs_0.99 vs layer

    from analysis.plots import draw_all
    draw_all([json.load(open("analysis.json"))], "figures/")
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers / CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from laplace.errors import ConfigError  # noqa: E402

_COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
FIGURES = ("anova", "collapse", "spectrum")


def save(fig, stem: Path) -> list[Path]:
    """Write stem.png and stem.pdf; return both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def run_label(res: dict) -> str:
    """Legend text: the model name and its Laplacian heads, e.g. 'vitt_3L (3/3 Laplacian)'."""
    k = res["num_laplacian_heads"]
    k = k if isinstance(k, int) else "/".join(map(str, k))
    return res.get("label") or f"{res['model']} ({k}/{res['num_heads']} Laplacian)"


def _x(layers: Sequence[str]):
    """x positions and tick labels: block index, "norm" one step after the last block."""
    xs, ticks = [], []
    for i, name in enumerate(layers):
        if name == "norm":
            xs.append((xs[-1] + 1) if xs else 0)
            ticks.append("norm")
        else:
            xs.append(int(name.split(".")[1]))
            ticks.append(str(xs[-1]))
    return xs, ticks


def _series(res, kind, group, key):
    """Values of one metric over the layers of a result (None where absent)."""
    per_layer = res["results"].get(kind, {})
    ys = [per_layer.get(n, {}).get(group, {}).get(key) for n in res["layers"]]
    return [math.nan if v is None else v for v in ys]


def _panel(ax, runs, kind, group, key, title, log=False, ls="-", marker="o", legend=True):
    """One metric vs layer, a line per run. log=True uses a log axis when the values span more
    than a factor 10 (a near-constant series on a log axis gets unreadable ticks)."""
    for c, res in enumerate(runs):
        ys = _series(res, kind, group, key)
        if all(math.isnan(v) for v in ys):
            continue
        xs, ticks = _x(res["layers"])
        ax.plot(xs, ys, ls, color=_COLORS[c % len(_COLORS)], marker=marker, ms=3,
                label=run_label(res) if legend else "_nolegend_")
        ax.set_xticks(xs, ticks, fontsize=7 if len(xs) > 14 else 8)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("layer", fontsize=8)
    ys = [v for line in ax.get_lines() for v in line.get_ydata() if math.isfinite(v)]
    if ys and log and min(ys) > 0 and max(ys) / min(ys) > 10:
        ax.set_yscale("log")
    elif ys:
        ax.ticklabel_format(axis="y", useOffset=False)
        lo, hi = min(ys), max(ys)
        if hi - lo < 1e-6 * max(abs(hi), abs(lo), 1e-12):  # constant up to rounding: show it flat
            pad = 0.05 * max(abs(hi), 1e-3)
            ax.set_ylim(lo - pad, hi + pad)
    ax.grid(alpha=0.3)


def _grid(n: int, cols: int, size=(3.2, 2.6)):
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    return fig, axes.ravel()


def _legend(fig, axes, extra_handles=()):
    handles, labels = axes[0].get_legend_handles_labels()
    handles, labels = list(handles) + [h for h, _ in extra_handles], list(labels) + [t for _, t in extra_handles]
    # below the axes whatever the figure height; bbox_inches="tight" grows the saved image to fit
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 3), fontsize=8,
               bbox_to_anchor=(0.5, 0.0))


def draw_anova(runs: list[dict], stem: Path) -> list[Path]:
    vit = runs[0]["arch"] == "vit"
    kind = "patch" if vit else "tokens"
    panels = ([("within_seq_share", "within-image share"), ("within_class_share", "within-class share\n(image means around class means)"),
               ("between_class_share", "between-class share")] if vit else
              [("within_seq_share", "within-window share"), ("between_seq_share", "between-window share")])
    panels.append(("total", "total variance"))
    fig, axes = _grid(len(panels), len(panels))
    for ax, (key, title) in zip(axes, panels):
        _panel(ax, runs, kind, "anova", key, title, log=key == "total")
    fig.suptitle(f"ANOVA of {'patch-token' if vit else 'token'} representations", fontsize=10)
    fig.tight_layout()
    _legend(fig, axes)
    return save(fig, stem)


def _styles(solid: str, dashed: str):
    """Legend entries that explain the line styles (colours stand for checkpoints)."""
    from matplotlib.lines import Line2D

    return [(Line2D([], [], color="k", ls="-", marker="o", ms=3), solid),
            (Line2D([], [], color="k", ls="--", marker="s", ms=3), dashed)]


def draw_collapse(runs: list[dict], stem: Path) -> list[Path]:
    if runs[0]["arch"] == "vit":
        panels = [("nc", "nc1", "NC1", True), ("nc", "nc2_equinorm", "NC2 equinorm", False),
                  ("nc", "nc2_equiangular", "NC2 equiangular", False), ("nc", "nc2_maxangle", "NC2 max-angle", False),
                  ("nc", "nc3", "NC3 (vs classifier)", False), ("nc", "nc4", "NC4 (head != NCC)", False),
                  ("cdnv", "cdnv_mean", "CDNV", True)]
        fig, axes = _grid(8, 4)
        for ax, (group, key, title, log) in zip(axes, panels):
            _panel(ax, runs, "cls", group, key, title, log=log)
            # patch NC is on image means; patch CDNV on the tokens themselves
            _panel(ax, runs, "patch", group, key, title, log=log, ls="--", marker="s", legend=False)
        axes[-1].axis("off")
        styles = _styles("class token", "patch tokens (NC: image means; CDNV: tokens)")
        title = "Neural Collapse vs layer (classes = image classes)"
    else:
        panels = [("lc_cdnv_mean", "CDNV", True), ("lc_equinorm", "equinorm", False),
                  ("lc_coherence_std", "equiangularity (std cos)", False),
                  ("lc_abs_coherence_mean", "mean |cos| of class means", False),
                  ("lc_self_duality", "self-duality 1 - cos(mu_c, w_c)", False),
                  ("lc_uniform_duality", "uniform duality (std cos)", False)]
        fig, axes = _grid(len(panels), 3)
        for ax, (key, title, log) in zip(axes, panels):
            _panel(ax, runs, "tokens", "lc", key, title, log=log)
        styles = []
        title = "Linguistic collapse vs layer (classes = next-token ids)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _legend(fig, axes, styles)
    return save(fig, stem)


def _threshold(res) -> float:
    ts = res["settings"]["thresholds"]
    return 0.99 if 0.99 in ts else max(ts)


def draw_spectrum(runs: list[dict], stem: Path, layer: str = "norm") -> list[Path]:
    vit = runs[0]["arch"] == "vit"
    kind = "patch" if vit else "tokens"
    t = _threshold(runs[0])
    fig, axes = _grid(3, 3, size=(3.6, 2.9))
    ax_s, ax_c, ax_l = axes
    for c, res in enumerate(runs):
        spec = res["results"][kind].get(layer, {}).get("spectral")
        if spec is None:
            raise ConfigError(f"spectrum_layer={layer}: not among the measured layers {res['layers']}")
        p = spec["spectrum"]
        ks = range(1, len(p) + 1)
        color = _COLORS[c % len(_COLORS)]
        # numerically zero eigenvalues (e.g. LayerNorm's centring removes one direction) are
        # left out rather than drawn as a cliff down to the clamp
        nz = [(k, v) for k, v in zip(ks, p) if v > 1e-12]
        ax_s.plot([k for k, _ in nz], [v for _, v in nz], color=color, label=run_label(res))
        cum, s = [], 0.0
        for v in p:
            s += v
            cum.append(s)
        n = spec[f"n_pcs_{t:g}"]
        ax_c.plot(ks, cum, color=color, label=f"{run_label(res)}: {n:.0f} PCs")
        ax_c.axvline(n, color=color, ls=":", lw=1)
    ax_s.set(xscale="log", yscale="log", xlabel="principal component k", ylabel="eigenvalue / total")
    ax_s.set_title(f"eigen-spectrum at {layer}", fontsize=9)
    ax_c.axhline(t, color="grey", ls="--", lw=1)
    ax_c.text(1, t - 0.01, f" {t:.0%}", va="top", fontsize=7, color="grey")
    ax_c.set(xscale="log", xlabel="principal components k", ylabel="explained variance")
    ax_c.set_title(f"cumulative explained variance at {layer}", fontsize=9)
    ax_c.legend(fontsize=7, loc="lower right")
    key = f"n_pcs_{t:g}"
    _panel(ax_l, runs, kind, "spectral", key, f"PCs for {t:.0%} of the variance")
    ax_l.yaxis.set_major_locator(MaxNLocator(integer=True))
    if vit:
        _panel(ax_l, runs, "patch", "spectral_within", key, f"PCs for {t:.0%} of the variance", ls="--",
               marker="s", legend=False)
    for ax in axes:
        ax.grid(alpha=0.3, which="both" if ax is not ax_l else "major")
    fig.suptitle(f"Spectral decay of {'patch-token' if vit else 'token'} representations", fontsize=10)
    fig.tight_layout()
    _legend(fig, [ax_s], _styles("global centring", "per-image centring (right panel)") if vit else ())
    return save(fig, stem)


def draw_all(runs: list[dict], out_dir, spectrum_layer: str = "norm") -> list[Path]:
    """Every figure the results hold; figures of metrics not measured are skipped (and an old
    copy of them in out_dir is removed)."""
    out_dir = Path(out_dir)
    have = set()
    for kinds in runs[0]["results"].values():
        for groups in kinds.values():
            have |= set(groups)
    paths = []
    if "anova" in have:
        paths += draw_anova(runs, out_dir / "anova")
    if have & {"nc", "lc", "cdnv"}:
        paths += draw_collapse(runs, out_dir / "collapse")
    if "spectral" in have:
        paths += draw_spectrum(runs, out_dir / "spectrum", spectrum_layer)
    for name in FIGURES:  # a figure of an earlier call with other metrics would now mislead
        for ext in (".png", ".pdf"):
            stale = (out_dir / name).with_suffix(ext)
            if stale not in paths and stale.exists():
                stale.unlink()
    return paths


def layer_positions(layers: Sequence[str]):
    """x positions and tick labels of layer names ("blocks.<i>", then "norm" one step on)."""
    return _x(layers)


def color(i: int) -> str:
    """The i-th colour of the shared cycle (the same k gets the same colour in every figure)."""
    return _COLORS[i % len(_COLORS)]


def mean_band(ax, xs, series: Sequence[Sequence[float]], color: str, label: str, marker: str = "o"):
    """The mean over runs (e.g. seeds) as a line and +-1 sample sd as a band around it (no band
    for one run; analysis.stats.describe). NaN entries are left out of their position's mean."""
    from analysis.stats import describe

    cols = [[v for v in col if not math.isnan(v)] for col in zip(*series)]
    stats = [describe(c) if c else None for c in cols]
    mean = [s.mean if s else math.nan for s in stats]
    ax.plot(xs, mean, "-", color=color, marker=marker, ms=3, label=label)
    if len(series) > 1:
        sd = [s.sd if s and s.n > 1 else 0.0 for s in stats]
        ax.fill_between(xs, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)], color=color,
                        alpha=0.2, lw=0)
    return mean
