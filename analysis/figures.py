"""The paper's figures from a folder of runs: one command, PNG + PDF.

    python -m analysis.figures runs=runs/deit3/digits
    python -m analysis.figures runs=[runs/deit3,runs/gpt] out=reports/figures pca_maps=8 device=cuda

Runs are found and pooled over seeds as by `python -m analysis.tables` (analysis/runs.py);
the per-layer figures read each run's ckpt/last_analysis/analysis.json, so run
`python -m analysis checkpoint=<run>/ckpt/last.pt` on the runs first. Written to `out`
(default <first runs folder>/figures), one experiment = trainer x dataset x model family x
recipe, named <dataset>_<family>:

    vs_k                  accuracy (GPT: val bits per byte) vs the number of Laplacian heads k,
                          one panel per experiment: each seed a dot, the mean a line, +-1 sd bars
    anova_<exp>           ANOVA shares vs layer (within-sequence, between-class) and the total
                          variance, a line per k (mean over seeds, +-1 sd band; analysis/plots.py)
    spectrum_<exp>        the eigen-spectrum and cumulative explained variance at the final norm,
                          and n_pcs_0.99 vs layer, a line per k
    collapse_<exp>        ViT: NC1-NC4 of the class token vs layer; GPT: linguistic collapse (CDNV, ...)
    blocks_<exp>          the headline geometry at every block (the per_block table's numbers:
                          analysis.runs.BLOCK_METRICS), a panel per metric, a line per k, its 95%
                          interval as a band
    pca_maps_<exp>        ViT: PCA maps of `pca_maps` images, one checkpoint (the lowest seed) per k
    gates_<trainer>_<exp>_k<k>
                          learned gates vs step and their change, a panel per block, a line per
                          head (analysis/gates.py)

A figure without data is skipped with a printed note; stdout ends with one `[figures] wrote`
line per file.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from analysis import plots
from analysis.gates import draw_gate_figures
from analysis.plots import plt, save
from analysis.runs import BLOCK_METRICS, aggregate, arm_label, collect, experiments, layer_order, per_block, \
    runs_roots, sort_key
from laplace.cli import hydra_entry


def _lines(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """(label, analysis.json contents of its seeds) per (k, mode), in k order: the lines."""
    by: dict = {}
    for r in records:
        # a run not analysed has no line (the figure says which are missing)
        if r.get("analysis"):
            by.setdefault((r["k"], r["mode"]), []).append((r, json.loads(Path(r["analysis"]).read_text())))
    # one line per arm (k, mode): its seeds' analyses, pooled by the drawers
    lines = []
    for k, mode in sorted(by, key=lambda km: (sort_key(km[0]), km[1])):
        runs = by[(k, mode)]
        label = arm_label(runs[0][0]["k_label"], mode)
        lines.append((label, [res for _, res in runs]))
    return lines


def draw_blocks(records: list[dict], stem: Path, name: str) -> list[Path]:
    """The headline geometry at every block (the numbers of the per_block table): a panel per
    metric, a line per arm (k, mode), the mean over seeds with its 95% interval as a band."""
    rows = per_block(records)
    layers = layer_order(records)
    # every layer any run measured, on one x axis
    xs, ticks = plots.layer_positions(layers)
    labels = {(r["k"], r["mode"]): r["k_label"] for r in records}
    # fixed arms by k, then learned ones: the same colour for the same arm in every panel
    arms = sorted(set(zip(rows["k"], rows["mode"])), key=lambda a: (a[1] != "fixed", sort_key(a[0])))
    # (a log axis for NC1 and CDNV, which span decades over depth)
    panels = [(key, label, key in ("nc1", "patch_nc1", "lc_cdnv_mean")) for key, label in BLOCK_METRICS
              if (rows["metric"] == key).any()]
    if not panels:  # analysed without any headline metric (e.g. metrics=[cdnv])
        return []

    def draw(ax, panel):
        for c, (k, mode) in enumerate(arms):
            at = rows[(rows["metric"] == panel[0]) & (rows["k"] == k) & (rows["mode"] == mode)].set_index("layer")
            # (an arm analysed at fewer layers has fewer points, not a line through missing ones)
            pts = [(x, at.loc[n]) for x, n in zip(xs, layers) if n in at.index]
            if not pts:
                continue
            x, g = [x for x, _ in pts], pd.DataFrame([g for _, g in pts])
            ax.plot(x, g["mean"], "-o", ms=3, color=plots.color(c),
                    label=f"{arm_label(labels[k, mode], mode)} (n={g['n'].max()})")
            ax.fill_between(x, g["lo"].fillna(g["mean"]), g["hi"].fillna(g["mean"]), color=plots.color(c),
                            alpha=0.2, lw=0)  # one seed: no band
        ax.set_xticks(xs, ticks, fontsize=7 if len(xs) > 14 else 8)
    return plots.panels_figure(panels, f"{name}: token geometry at every block (mean, 95% interval over seeds)", stem,
                               draw)


def draw_vs_k(records: list[dict], metrics: dict, stem: Path) -> list[Path]:
    """Metric vs k, one panel per experiment: seeds as dots, the mean as a line with +-1 std
    bars, a line per mode. `metrics`: {trainer: {metric, label}}. Per-layer lists of k are
    left out (no single x)."""
    panels = []
    for name, recs in experiments(records).items():
        spec = metrics.get(recs[0]["trainer"])
        # per-layer lists of k have no place on a k axis: left out of this figure
        rows = [g for g in aggregate(recs, spec["metric"]).to_dict("records") if isinstance(g["k"], int)] if spec else []
        if rows:
            panels.append((name, spec, rows))
    if not panels:
        return []
    cols = min(len(panels), 4)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.4 * cols, 2.9 * nrows), squeeze=False)
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    for ax, (name, spec, rows) in zip(axes.ravel(), panels):
        for c, mode in enumerate(sorted({g["mode"] for g in rows})):
            g_m = sorted((g for g in rows if g["mode"] == mode), key=lambda g: g["k"])
            ks = [g["k"] for g in g_m]
            col = plots.color(c)
            # (the seeds as dots beside the mean +-1 sd)
            for g in g_m:  # every seed, so a mean of two far-apart runs is not mistaken for a trend
                ax.plot([g["k"]] * g["n"], g["values"], "o", color=col, alpha=0.45, ms=4, mec="none")
            ax.errorbar(ks, [g["mean"] for g in g_m], yerr=[0.0 if g["n"] < 2 else g["sd"] for g in g_m], color=col,
                        marker="s", ms=4, capsize=3, label=f"{mode}: mean ± sd over seeds")
        # (the k trained, not a range: 0, 1, 3 of 3)
        ax.set_xticks(sorted({g["k"] for g in rows}))
        ax.set(xlabel="Laplacian heads per layer k", ylabel=spec["label"])
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, stem)


def draw_pca_maps(records: list[dict], n: int, layer: str, device: str, stem: Path, seed: int = 0) -> list[Path]:
    """PCA maps of the first `n` images of the split (the order `python -m analysis` uses),
    one column per k: the lowest-seed checkpoint of each."""
    import torch

    from analysis.geometry import eval_split, load_for_analysis
    from analysis.pca_maps import THRESHOLD, denormalize, draw_pca_grid, model_maps

    # one checkpoint per arm: a map is of one model (a mean of maps would blur exactly what it shows)
    picks: dict = {}  # (k, mode) -> its lowest-seed run with a checkpoint
    for r in sorted(records, key=lambda r: (sort_key(r["k"]), r["mode"], sort_key(r["seed"]))):
        if Path(r["checkpoint"]).is_file():
            picks.setdefault((r["k"], r["mode"]), r)
    if not picks:
        return []
    maps, names, images = {}, [], None
    for (k, mode), r in picks.items():
        # one model in memory at a time: ViT-B checkpoints on a laptop add up
        model, _, data = load_for_analysis(r["checkpoint"], device=device)
        if images is None:  # the same images in every column
            ds, _ = eval_split(model, data, seed, None)
            items = [ds[i] for i in range(min(n, len(ds)))]
            x, labels = torch.stack([im for im, _ in items]), [int(y) for _, y in items]
            images = denormalize(x, data["mean"], data["std"])
        tag = arm_label(r["k_label"], mode)
        # the paper's foreground rule (sign of the first component), as python -m analysis draws it
        maps[f"{r['model']} ({tag} Laplacian, seed {r['seed']})"] = model_maps(model, x, layer, THRESHOLD)
        names.append(f"{r['model']}_{tag}_s{r['seed']}")
        del model
    return draw_pca_grid(images, maps, stem, labels, layer, names, THRESHOLD)  # the paper's foreground rule


def draw_figures(records: list[dict], out, vs_k: dict, pca_maps: int = 0, pca_layer: str = "norm",
                 device: str = "auto", seed: int = 0) -> list[Path]:
    """Every figure the records support (see the module docstring); returns the paths.

    Args:
        records: finished runs from `analysis.runs.collect`.
        out: output folder.
        vs_k: {trainer: {metric, label}} for the metric-vs-k figure.
        pca_maps: images per PCA-map grid (0: none); pca_layer: the layer they show.
        device: where the PCA-map models run; seed: the fixed image order.
    """
    out = Path(out)
    # each figure is skipped with a note when the runs do not hold its data
    paths = draw_vs_k(records, vs_k, out / "vs_k")
    if not paths:
        print(f"[figures] skipped vs_k: no finished run of a trainer in vs_k ({', '.join(vs_k)}) has its metric",
              flush=True)
    for name, recs in experiments(records).items():
        # per-layer figures need python -m analysis's output; PCA maps only the checkpoints
        lines = _lines(recs)
        if not lines:
            print(f"[figures] skipped the layer figures of {name}: no analysis.json (run python -m analysis "
                  f"checkpoint=<run>/ckpt/last.pt on its runs)", flush=True)
        else:
            for draw in (plots.draw_anova, plots.draw_spectrum, plots.draw_collapse):
                paths += draw(lines, out / f"{draw.__name__[5:]}_{name}", name)
            paths += draw_blocks(recs, out / f"blocks_{name}", name)
        if pca_maps and recs[0]["arch"] == "vit":
            got = draw_pca_maps(recs, pca_maps, pca_layer, device, out / f"pca_maps_{name}", seed)
            if not got:
                print(f"[figures] skipped pca_maps_{name}: no checkpoint found", flush=True)
            paths += got
    return paths + draw_gate_figures(records, out)


def run(cfg: DictConfig) -> list[Path]:
    """Collect the runs of cfg.runs and draw every figure; returns the written paths."""
    roots = runs_roots(cfg, "analysis.figures")
    # (a run still training would pass for a finished one)
    records = [r for r in collect(roots) if r["finished"]]
    print(f"[figures] {len(records)} finished runs under {', '.join(map(str, roots))}", flush=True)
    out = Path(cfg.out) if cfg.out else roots[0] / "figures"
    paths = draw_figures(records, out, OmegaConf.to_container(cfg.vs_k, resolve=True), int(cfg.pca_maps),
                         cfg.pca_layer, cfg.device, int(cfg.seed))
    for p in paths:
        print(f"[figures] wrote {p}", flush=True)
    return paths


main = hydra_entry("figures")(run)


if __name__ == "__main__":
    main()
