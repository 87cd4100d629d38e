"""The paper's figures, PNG (a quick look) + PDF (a paper): token geometry vs layer for the
checkpoints of `python -m analysis`, and per experiment from a folder of runs:

    python -m analysis.figures runs=runs/deit3/digits
    python -m analysis.figures runs=[runs/deit3,runs/gpt] out=reports/figures pca_maps=8 device=cuda

Runs are found and pooled over seeds as by `python -m analysis.tables` (analysis/runs.py); the
per-layer figures read each run's ckpt/last_analysis/analysis.json (run `python -m analysis
checkpoint=<run>/ckpt/last.pt` first). Written to `out` (default reports/figures), an
experiment (trainer x dataset x model family x recipe) named <dataset>_<family>:

    vs_k            accuracy (GPT: val bits per byte) vs k, a panel per experiment: seeds as dots, mean +- sd
    anova_<exp>     ANOVA shares vs layer and the total variance, a line per arm (mean, +-1 sd band)
    collapse_<exp>  ViT: NC1-NC4 and CDNV of the class token, NC1 of the image means; GPT: linguistic collapse
    spectrum_<exp>  eigen-spectrum and cumulative explained variance at the final norm, PCs for 99% vs layer
    blocks_<exp>    the per_block table's headline geometry at every block, its 95% interval as a band
    pca_maps_<exp>  ViT: PCA maps of `pca_maps` images, one checkpoint (the lowest seed) per arm
    gates_<trainer>_<exp>_k<k>  learned gates vs step (analysis/gates.py)

A figure without data is skipped with a printed note; stdout ends with a `[figures] wrote` line per file.
"""
import json
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

matplotlib.use("Agg")  # files only; no display on servers / CI
import matplotlib.pyplot as plt  # noqa: E402

from analysis.runs import (BLOCK_METRICS, aggregate, arm_key, arm_label, collect,  # noqa: E402
                           experiments, layer_geometry, layer_order, per_block, runs_roots, sort_key)
from analysis.gates import gate_groups  # noqa: E402
from analysis.stats import summarize  # noqa: E402
from train.cli import hydra_entry  # noqa: E402

FIGURES = ("anova", "collapse", "spectrum")
# The per-layer panels of each figure and architecture: (key of analysis.runs.geometry, title, log
# axis where the values span decades over depth).
PANELS = {
    ("anova", "vit"): [("within_seq_share", "within-image share", False),
                       ("within_class_share", "within-class share", False),
                       ("between_class_share", "between-class share", False), ("total_var", "total variance", True)],
    ("anova", "gpt"): [("within_seq_share", "within-window share", False),
                       ("between_seq_share", "between-window share", False), ("total_var", "total variance", True)],
    ("collapse", "vit"): [("nc1", "NC1 (class token)", True), ("nc2_equinorm", "NC2 equinorm", False),
                          ("nc2_equiangular", "NC2 equiangular", False), ("nc2_maxangle", "NC2 max-angle", False),
                          ("nc3", "NC3 (vs classifier)", False), ("nc4", "NC4 (head != NCC)", False),
                          ("cdnv_mean", "CDNV (class token)", True),
                          ("patch_nc1", "NC1 (image means of patches)", True)],
    ("collapse", "gpt"): [("lc_cdnv_mean", "CDNV (next-token classes)", True), ("lc_equinorm", "equinorm", False),
                          ("lc_coherence_std", "equiangularity (std cos)", False),
                          ("lc_abs_coherence_mean", "mean |cos| of class means", False),
                          ("lc_self_duality", "self-duality 1 - cos(mu_c, w_c)", False),
                          ("lc_uniform_duality", "uniform duality (std cos)", False)]}
# The panels' y-axis: a figure's unit, or its direction (every collapse metric is 0 at full collapse),
# and a metric's own where it differs from its figure's (the per-block figure mixes them).
SHARE, COLLAPSE, COUNT = "share of the token variance", "lower = more collapse", "principal components"
YLABELS = {"anova": SHARE, "collapse": COLLAPSE, "total_var": "variance (trace of the covariance)",
           "within_seq_share": SHARE, "between_class_share": SHARE, "nc1": COLLAPSE, "patch_nc1": COLLAPSE,
           "lc_cdnv_mean": COLLAPSE, "n_pcs_0.99": COUNT, "per_seq_n_pcs_0.99": COUNT}
TITLES = {"anova": "ANOVA of token representations vs layer", ("collapse", "vit"): "Neural Collapse vs layer "
          "(classes = image classes)", ("collapse", "gpt"): "linguistic collapse vs layer (classes = next-token ids)"}


def save(fig, stem: Path) -> list[Path]:
    """Write stem.png and stem.pdf, close the figure; return both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    # a tight box grows the image to fit legends placed below the axes
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def panels(n: int, cols: int, width: float, height: float):
    """A figure of n panels, `cols` a row, each width x height inches: (figure, the axes in a flat
    list); the unused ones off."""
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    return fig, list(axes.ravel())


def run_label(res: dict) -> str:
    """Legend text: the model name and its Laplacian heads, e.g. 'vitt_3L (3/3 Laplacian)'."""
    k = res["num_laplacian_heads"]
    k = k if isinstance(k, int) else "/".join(map(str, k))  # a per-layer list of k is written 0/0/6/6
    return res.get("label") or f"{res['model']} ({k}/{res['num_heads']} Laplacian)"


def by_arm(records: list[dict]) -> dict[str, list[dict]]:
    """{arm label: its records, the lowest seed first}, the arms in `arm_key` order (analysis.runs.arms
    for records): a figure's lines, its PCA maps' checkpoints, the report's checkpoints per arm."""
    out: dict = {}
    for r in sorted(records, key=lambda r: (arm_key(r["k"], r["mode"], r["attention"]), sort_key(r["seed"]))):
        out.setdefault(arm_label(r["k_label"], r["mode"], r["attention"]), []).append(r)
    return out


def layer_stats(lines, keys) -> pd.DataFrame:
    """lines [(label, [analysis.json of its seeds])] -> a row per (line, metric, layer) with the
    mean, sd and 95% interval over the seeds (analysis.stats.summarize); a layer a seed did not
    measure is left out of that layer's mean."""
    # one row per (line, seed, layer, key): the tidy shape analysis.stats pools, as for the tables
    rows = [{"line": label, "seed": i, "layer": layer, "metric": key, "value": v}
            for label, seeds in lines for i, res in enumerate(seeds)
            for layer, g in layer_geometry(res).items() for key, v in g.items() if key in keys]
    return summarize(pd.DataFrame(rows, columns=["line", "seed", "layer", "metric", "value"]),
                     ["line", "metric", "layer"])


def draw_layers(ax, stats: pd.DataFrame, metric: str, layers, band: str = "sd", style: str = "-o",
                legend: bool = True) -> None:
    """A line per stats["line"] (in order of appearance): the mean vs layer, a band of +-1 sd
    (band="sd") or the 95% interval ("ci"); one seed: no band."""
    # x: blocks at their index, the final norm one step after the last block (it reads that block's output)
    xs = {n: int(n.split(".")[1]) for n in layers if n != "norm"}
    pos = {n: xs[n] if n != "norm" else max(xs.values(), default=-1) + 1 for n in layers}
    pooled = stats["n"].max() > 1  # n in the legend only when lines pool seeds
    # colour "C<c>": matplotlib's default cycle by name (wrapping after C9), the same line in every panel
    for c, (label, s) in enumerate(stats.groupby("line", sort=False)):
        s = s[(s["metric"] == metric) & s["layer"].isin(pos)].sort_values("layer", key=lambda ls: ls.map(pos))
        if s.empty:  # an arm analysed without this metric: no line, the others drawn
            continue
        x, mean = s["layer"].map(pos), s["mean"]
        # the legend names the seeds behind a line when some line pools several
        ax.plot(x, mean, style, ms=3, color=f"C{c}",
                label=(label + (f" (n={s['n'].max()})" if pooled else "")) if legend else "_nolegend_")
        # sd: the seeds' spread (the per-layer figures); ci: where the mean may be (the per_block numbers)
        lo, hi = (s["lo"], s["hi"]) if band == "ci" else (mean - s["sd"], mean + s["sd"])
        ax.fill_between(x, lo.fillna(mean), hi.fillna(mean), color=f"C{c}", alpha=0.2, lw=0)
    ax.set_xticks(list(pos.values()), [n if n == "norm" else n.split(".")[1] for n in pos],
                  fontsize=7 if len(pos) > 14 else 8)


def layer_figure(stats: pd.DataFrame, specs, layers, title: str, stem: Path, band: str = "sd",
                 cols: int = 3, ylabel: str = "") -> list[Path]:
    """A panel per (key, title, log) of `specs`, drawn by `draw_layers` (y-axis: `ylabel`, or
    YLABELS[key]); the legend once, below."""
    fig, axes = panels(len(specs), cols, 3.4, 2.7)
    for ax, (key, sub, log) in zip(axes, specs):
        draw_layers(ax, stats, key, layers, band)
        ys = stats.loc[stats["metric"] == key, "mean"].dropna()
        # a log axis where asked and the values allow it (a near-constant series gets unreadable ticks)
        if log and len(ys) and ys.min() > 0 and ys.max() / ys.min() > 10:
            ax.set_yscale("log")
        ax.set_title(sub, fontsize=9)
        ax.set(xlabel="block (norm = the final norm)", ylabel=YLABELS.get(key, ylabel))
        ax.xaxis.label.set_fontsize(8), ax.yaxis.label.set_fontsize(8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    handles, labels = axes[0].get_legend_handles_labels()
    # below the axes whatever the figure height; save()'s tight bounding box grows to fit it
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4), fontsize=8, bbox_to_anchor=(0.5, 0.0))
    return save(fig, stem)


def draw_panels(figure: str, lines, stem: Path, name: str = "") -> list[Path]:
    """The anova or collapse figure of `lines` [(label, [analysis.json of its seeds])]."""
    arch = lines[0][1][0]["arch"]
    specs = PANELS[figure, arch]
    # only the keys drawn are pooled: an analysis holds some forty per layer
    stats = layer_stats(lines, {k for k, *_ in specs})
    cols = len(specs) if figure == "anova" else 4 if arch == "vit" else 3
    title = TITLES.get(figure) or TITLES[figure, arch]
    return layer_figure(stats, specs, lines[0][1][0]["layers"], f"{name}: {title}".lstrip(": "), stem, cols=cols,
                        ylabel=YLABELS[figure])


def draw_spectrum(lines, stem: Path, name: str = "", layer: str = "norm") -> list[Path]:
    """The eigen-spectrum and the cumulative explained variance at `layer` (mean over seeds), and
    PCs for 99% of the variance vs layer (ViT: dashed, of the image-centred tokens)."""
    kind = "patch" if lines[0][1][0]["arch"] == "vit" else "tokens"
    fig, (ax_s, ax_c, ax_l) = plt.subplots(1, 3, figsize=(11, 3))
    for c, (label, seeds) in enumerate(lines):
        # the seeds that measured the spectrum at this layer (python -m analysis checks spectrum_layer first)
        specs = [s for s in (s["results"][kind].get(layer, {}).get("spectral") for s in seeds) if s]
        if not specs or len({len(s["spectrum"]) for s in specs}) > 1:  # not measured, or widths differ
            continue
        P = np.array([s["spectrum"] for s in specs])  # [seeds, components], each row sums to 1
        k, p = np.arange(1, P.shape[1] + 1), P.mean(0)
        # numerically zero eigenvalues (LayerNorm's centring removes one direction) are left out
        # rather than drawn as a cliff down to the clamp
        ax_s.plot(k[p > 1e-12], p[p > 1e-12], color=f"C{c}", label=label)
        cum, n99 = np.cumsum(P, 1), np.mean([s["n_pcs_0.99"] for s in specs])
        ax_c.plot(k, cum.mean(0), color=f"C{c}", label=f"{label}: {n99:.1f} PCs")
        if len(specs) > 1:  # each seed's cumulative explained variance, +-1 sd over seeds
            sd = cum.std(0, ddof=1)
            ax_c.fill_between(k, cum.mean(0) - sd, cum.mean(0) + sd, color=f"C{c}", alpha=0.2, lw=0)
        ax_c.axvline(n99, color=f"C{c}", ls=":", lw=1)
    # the third panel: PCs for 99% vs layer, as the other per-layer figures draw their lines
    stats = layer_stats(lines, {"n_pcs_0.99", "within_n_pcs_0.99"})
    draw_layers(ax_l, stats, "n_pcs_0.99", lines[0][1][0]["layers"])
    if kind == "patch":
        draw_layers(ax_l, stats, "within_n_pcs_0.99", lines[0][1][0]["layers"], style="--s", legend=False)
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


def draw_all(lines, out_dir: Path, spectrum_layer: str = "norm", name: str = "", suffix: str = "") -> list[Path]:
    """Every per-layer figure `lines` [(label, [analysis.json of its seeds])] support, written to
    out_dir/<figure><suffix>; a figure of metrics not measured is skipped (an old copy removed)."""
    # the metric groups the analysis measured: a figure only for what is there
    have = {g for kinds in lines[0][1][0]["results"].values() for groups in kinds.values() for g in groups}
    paths = []
    if "anova" in have:
        paths += draw_panels("anova", lines, out_dir / f"anova{suffix}", name)
    if have & {"nc", "lc", "cdnv"}:
        paths += draw_panels("collapse", lines, out_dir / f"collapse{suffix}", name)
    if "spectral" in have:
        paths += draw_spectrum(lines, out_dir / f"spectrum{suffix}", name, spectrum_layer)
    for stale in (out_dir / f"{f}{suffix}.{ext}" for f in FIGURES for ext in ("png", "pdf")):
        if stale not in paths and stale.exists():  # drawn by an earlier call with other metrics: it would mislead
            stale.unlink()
    return paths


def draw_blocks(records: list[dict], stem: Path, name: str) -> list[Path]:
    """The headline geometry at every block (the per_block table's numbers): a panel per metric,
    a line per arm (k, mode), the mean over seeds with its 95% interval as a band."""
    rows = per_block(records)  # the per_block table's numbers: mean and 95% interval per arm, layer and key
    # a log axis for NC1 and CDNV, which span decades over depth
    specs = [(key, label, key in ("nc1", "patch_nc1", "lc_cdnv_mean")) for key, label in BLOCK_METRICS
             if (rows["metric"] == key).any()]
    if not specs:  # analysed without any headline metric (e.g. metrics=[cdnv])
        return []
    # a line per arm, fixed arms by k then learned ones, then the relatives (attention): the same colour
    # for the same arm in every panel
    rows = rows.assign(line=rows["arm"], _o=list(map(arm_key, rows["k"], rows["mode"], rows["attention"])))
    return layer_figure(rows.sort_values("_o", kind="stable"), specs, layer_order(records),
                        f"{name}: token geometry at every block (mean, 95% interval over seeds)", stem, band="ci")


def draw_vs_k(records: list[dict], metrics: dict, stem: Path) -> list[Path]:
    """Metric vs k, a panel per experiment: seeds as dots, the mean with +-1 sd bars, a line per
    mode. `metrics`: {trainer: {metric, label}}; per-layer lists of k have no place on a k axis."""
    found = []
    for name, recs in experiments(records).items():
        spec = metrics.get(recs[0]["trainer"])
        rows = aggregate(recs, spec["metric"]) if spec else pd.DataFrame()
        # per-layer lists of k (e.g. [0,0,6,6]) have no place on a k axis: left out of this figure
        rows = rows[[isinstance(k, int) for k in rows["k"]]] if len(rows) else rows
        if len(rows):
            found.append((name, spec, rows.sort_values("k")))
    if not found:
        return []
    fig, axes = panels(len(found), min(len(found), 4), 3.4, 2.9)
    for ax, (name, spec, rows) in zip(axes, found):
        for c, (mode, g) in enumerate(rows.groupby("mode")):
            # every seed, so a mean of two far-apart runs is not mistaken for a trend
            for k, n, values in zip(g["k"], g["n"], g["values"]):
                ax.plot([k] * n, values, "o", color=f"C{c}", alpha=0.45, ms=4, mec="none")
            ax.errorbar(g["k"], g["mean"], yerr=g["sd"].where(g["n"] > 1, 0.0), color=f"C{c}", marker="s", ms=4,
                        capsize=3, label=f"{mode}: mean ± sd over seeds")
        ax.set_xticks(sorted(set(rows["k"])))  # the k trained, not a range: 0, 1, 3 of 3
        ax.set(xlabel="Laplacian heads per layer k", ylabel=spec["label"])
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, stem)


def draw_gates(g: dict, stem: Path) -> list[Path]:
    """Gate vs step per block (a line per head: the mean over seeds, 95% interval band; the heads
    that started Laplacian dashed), and below each block its change from the start: moves of a
    few hundredths, typical here, are flat lines on the 0-1 axis."""
    nb, cols = len(g["layers"]), min(len(g["layers"]), 4)
    rows = 2 * -(-nb // cols)  # two rows per row of blocks: the gate, and its change from the start
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.3 * rows), squeeze=False)
    # pair[b] = (block b's gate axes, its change's axes): blocks fill the grid row by row
    pair = axes.reshape(rows // 2, 2, cols).transpose(0, 2, 1).reshape(-1, 2)
    start = g["gates"].set_index(["block", "head"])["start"]
    # the mean over seeds per head; below each block the same less its start
    for (b, h), line in g["traj"].groupby(["block", "head"]):
        ax_a, ax_d = pair[b]
        lap = start[b, h] > 0.5  # dashed: the heads that started Laplacian
        for ax, shift in ((ax_a, 0.0), (ax_d, start[b, h])):
            ax.plot(line["step"], line["mean"] - shift, "--" if lap else "-", color=f"C{h}", lw=1.4,
                    label=f"h{h}" + (" (started Laplacian)" if lap else ""))
            if g["n"] > 1:  # the 95% interval of the mean over seeds
                ax.fill_between(line["step"], line["lo"] - shift, line["hi"] - shift, color=f"C{h}", alpha=0.2, lw=0)
    for (ax_a, ax_d), layer in zip(pair, g["layers"]):
        ax_a.set_ylim(0, 1)
        ax_a.set_title(layer, fontsize=9)
        ax_d.set_xlabel("step", fontsize=8)
        for ax, level, ylabel in ((ax_a, 0.5, "gate a = sigmoid(g)"), (ax_d, 0.0, "a - start")):
            ax.axhline(level, color="grey", ls=":", lw=1)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3)
    for ax in pair[nb:].ravel():
        ax.axis("off")
    fig.suptitle(f"{g['name']}: learned gates, mean over {g['n']} seed{'s' * (g['n'] > 1)}"
                 + (", 95% interval" if g["n"] > 1 else ""), fontsize=10)
    fig.tight_layout()
    # every block's legend: a head that started Laplacian in one block may not in another
    labels = {label: handle for ax in axes[::2].ravel() for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(labels.values()), list(labels), loc="upper center", ncol=min(len(labels), 4), fontsize=8,
               bbox_to_anchor=(0.5, 0.0))
    return save(fig, stem)


def draw_figures(records: list[dict], out, vs_k: dict, pca_maps: int = 0, pca_layer: str = "norm",
                 device: str = "auto", seed: int = 0) -> list[Path]:
    """Every figure the records (finished runs from `collect`) support, in `out`; the paths.
    vs_k: {trainer: {metric, label}}; pca_maps: images per PCA-map grid (0: none) at pca_layer,
    run on `device` in the fixed image order of `seed`."""
    from analysis.pca_maps import THRESHOLD, checkpoint_maps

    out = Path(out)
    # each figure is skipped with a note when the runs do not hold its data
    paths = draw_vs_k(records, vs_k, out / "vs_k")
    if not paths:
        print(f"[figures] skipped vs_k: no finished run of a trainer in vs_k ({', '.join(vs_k)}) has its metric",
              flush=True)
    for name, recs in experiments(records).items():
        # a line per arm (k, mode, attention): its seeds' analyses (a run not analysed has no line)
        arms = {label: [json.loads(Path(r["analysis"]).read_text()) for r in rs]
                for label, rs in by_arm([r for r in recs if r.get("analysis")]).items()}
        if not arms:
            print(f"[figures] skipped the layer figures of {name}: no analysis.json (run python -m analysis "
                  f"checkpoint=<run>/ckpt/last.pt on its runs)", flush=True)
        else:
            # per-layer figures need python -m analysis's output; the PCA maps below only the checkpoints
            paths += draw_all(list(arms.items()), out, "norm", name, f"_{name}")
            paths += draw_blocks(recs, out / f"blocks_{name}", name)
        if pca_maps and recs[0]["arch"] == "vit":
            # one checkpoint per arm, its lowest seed: a map is of one model (a mean of maps would blur
            # exactly what it shows)
            found = by_arm([r for r in recs if Path(r["checkpoint"]).is_file()])
            picks = {label: rs[0] for label, rs in found.items()}
            cols = {f"{r['model']} ({label} Laplacian, seed {r['seed']})": r["checkpoint"]
                    for label, r in picks.items()}
            names = [f"{r['model']}_{label}_s{r['seed']}" for label, r in picks.items()]
            got = checkpoint_maps(cols, out / f"pca_maps_{name}", pca_maps, pca_layer, THRESHOLD, device=device,
                                  seed=seed, names=names) if cols else []
            if not got:
                print(f"[figures] skipped pca_maps_{name}: no checkpoint found", flush=True)
            paths += got
    # out/gates_<exp>.{png,pdf} for every learned-gate experiment
    return paths + [p for g in gate_groups(records) for p in draw_gates(g, out / f"gates_{g['name']}")]


def run(cfg: DictConfig) -> list[Path]:
    """Collect the runs of cfg.runs and draw every figure; returns the written paths."""
    roots = runs_roots(cfg, "analysis.figures")
    records = [r for r in collect(roots) if r["finished"]]  # a run still training would pass for a finished one
    print(f"[figures] {len(records)} finished runs under {', '.join(map(str, roots))}", flush=True)
    paths = draw_figures(records, Path(cfg.out),
                         OmegaConf.to_container(cfg.vs_k, resolve=True), int(cfg.pca_maps), cfg.pca_layer, cfg.device,
                         int(cfg.seed))
    for p in paths:
        print(f"[figures] wrote {p}", flush=True)
    return paths


main = hydra_entry("figures")(run)


if __name__ == "__main__":
    main()
