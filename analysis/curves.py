"""Learning curves of training runs: what every trainer logs to <run>/metrics.jsonl, against the step.

    python -m analysis.curves runs=runs/deit3/digits
    python -m analysis.curves runs='runs/deit3/digits/vitt_*' metrics=[loss,val_acc1] out=reports/curves
    python -m analysis.curves runs=[runs/a,runs/b] x=epoch band=minmax

Runs are found and read as by `python -m analysis.tables` (analysis/runs.py: every folder with
a run's config.yaml, its k and mode from that config) and split into experiments (trainer x
dataset x model family x recipe, `analysis.runs.experiments`). One panel per metric; in each, one
line per experiment and number of Laplacian heads k (and mode, when learned): the mean over the
seeds that share them, with a band (`band`): sd = +-1 sample standard deviation (the default, as
the other figures), minmax = the lowest to the highest seed, ci = the 95% t interval of the mean
(analysis.stats). One seed: a line without a band. The legend gives each line's number of seeds.
A seed that did not log a step is left out of that step's mean; a run that never logged a metric
(another trainer's) is left out of that metric's panel only.

Written: <out>.png, <out>.pdf and <out>.json (the numbers drawn: per metric and line, x, mean,
lo, hi, n and every seed's values); out defaults to <first runs folder>/curves. stdout: one
line per run left out (no metrics.jsonl, or no metric asked for), then `[curves] wrote <path>`.
"""
from __future__ import annotations

import glob
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from omegaconf import DictConfig

from analysis.stats import describe
from laplace.cli import hydra_entry
from laplace.config import required_list
from laplace.errors import ConfigError
from laplace.io import write_json
from laplace.rundir import check_writable

BANDS = ("sd", "minmax", "ci")
X_KEYS = ("step", "epoch")


def default_metrics(logged) -> list[str]:
    """The loss, then every val_* metric the runs logged (sorted): what metrics=null draws."""
    # the loss first, then every validation metric: what a reader checks before any verdict
    keys = {m[len("log."):] for m in logged["metric"].unique()}
    return [k for k in ("loss", "val_loss") if k in keys] + sorted(
        k for k in keys if k.startswith("val_") and k != "val_loss")


def band_of(xs: list[float], band: str) -> tuple[float, float, float]:
    """(mean, lo, hi) of the seeds' values at one x: lo..hi is +-1 sample sd (sd), the seeds'
    range (minmax) or the 95% t interval of the mean (ci); lo = hi = mean for one value."""
    # (analysis.stats: the same mean, sd and t interval as the tables)
    s = describe(xs)
    # (minmax: the seeds' range; sd: their spread; ci: where the mean may be)
    if band == "minmax":
        return s.mean, min(xs), max(xs)
    if s.n < 2:
        return s.mean, s.mean, s.mean
    return (s.mean, s.mean - s.sd, s.mean + s.sd) if band == "sd" else (s.mean, s.lo, s.hi)


def line_stats(points: dict[float, list[float]], band: str) -> dict:
    """One line's numbers: x (sorted), mean, lo, hi and n (seeds) at each x."""
    # the numbers drawn, also written to <out>.json (a figure's data for one's own plot)
    xs = sorted(points)
    stats = [band_of(points[x], band) for x in xs]
    return {"x": xs, "mean": [s[0] for s in stats], "lo": [s[1] for s in stats], "hi": [s[2] for s in stats],
            "n": [len(points[x]) for x in xs], "values": [points[x] for x in xs]}


def draw_curves(panels: dict, stem: Path, band: str, xlabel: str = "step", title: Optional[str] = None):
    """One panel per entry of `panels` {title: (ylabel, {label: {x: [value per seed]}})}, one line
    per label (the mean, a band by `band_of`), at most 3 panels a row; writes stem.png and
    stem.pdf. Returns (the figure's axes, the paths): the figure is closed."""
    from analysis.plots import plt, save

    # at most 3 panels a row: a figure of 5 metrics stays readable on a page
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    axes = list(axes.ravel())
    for ax, (name, (ylabel, lines)) in zip(axes, panels.items()):
        for label, points in lines.items():
            s = line_stats(points, band)
            # the line the mean, its colour shared by the band
            line, = ax.plot(s["x"], s["mean"], marker="o", ms=3, label=label)
            # (one seed: lo = hi = mean, no band)
            ax.fill_between(s["x"], s["lo"], s["hi"], color=line.get_color(), alpha=0.15)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    paths = save(fig, stem)  # (also closes the figure)
    return axes[:len(panels)], paths


# ----------------------------------------------------------------------------- the command

def _roots(cfg) -> list[Path]:
    """runs= as folders: a path, a list, or glob patterns (each must match a folder)."""
    from analysis.runs import runs_roots

    items = required_list(cfg, "runs", "python -m analysis.curves runs=DIR (or runs=[DIR1,DIR2], or a quoted "
                          "glob runs='runs/deit3/digits/vitt_*'), folders holding run directories")
    folders = []
    for item in items:
        if glob.has_magic(item):
            # a quoted glob picks runs by name (runs='runs/deit3/digits/vitt_*'): one line per k still
            found = sorted(p for p in glob.glob(item) if Path(p).is_dir())
            if not found:
                raise ConfigError(f"runs={item}: the pattern matches no folder; check it (quoted, e.g. "
                                  f"runs='runs/deit3/digits/vitt_*')")
            folders += found
        else:
            folders.append(item)
    return runs_roots(SimpleNamespace(runs=folders), "analysis.curves")


def collect_curves(records: list[dict], metrics: list[str], x: str = "step", logged=None) -> tuple[dict, list[str]]:
    """{metric: {line label: {x: [value per seed]}}} of `records` (analysis.runs.collect's), and
    a note per run left out. A line is one experiment's (k, mode); the experiment is named in the
    label only when the runs hold several. `logged`: the runs' frame(logs=True) when read already."""
    from analysis.runs import arm_label, experiments, frame, sort_key

    logged = frame(records, logs=True) if logged is None else logged
    # a line per (experiment, k, mode); a run that never logged a metric adds nothing to its panel
    # (runs of different trainers share a folder: a DINO run has no val_loss)
    logged = logged[logged["metric"].isin([f"log.{m}" for m in metrics]) & logged[x].notna()]
    # a point per x: the last value logged there (an epoch's last step; a resumed run's rerun)
    logged = logged.drop_duplicates(["run_dir", "metric", x], keep="last")
    data, notes = {m: {} for m in metrics}, []
    exps = experiments(records)
    for exp, recs in exps.items():
        for r in sorted(recs, key=lambda r: (r["mode"] != "fixed", sort_key(r["k"]), sort_key(r["seed"]))):
            mine = logged[logged["run_dir"] == r["run_dir"]]
            if mine.empty:
                why = "no metrics.jsonl" if not (Path(r["run_dir"]) / "metrics.jsonl").exists() else \
                    f"none of {metrics} logged against {x}"
                notes.append(f"{r['run_dir']}: {why}; left out")
                continue
            label = arm_label(r["k_label"], r["mode"])
            # the experiment named only when there are several: the usual one-folder call keeps short labels
            label = f"{exp} {label}" if len(exps) > 1 else label
            for m, at, v in zip(mine["metric"], mine[x], mine["value"]):
                data[m[len("log."):]].setdefault(label, {}).setdefault(at, []).append(v)
    return {m: lines for m, lines in data.items() if lines}, notes


def _seeds(lines: dict) -> dict:
    """Line labels with their number of seeds: "k=1 (2 seeds)"."""
    out = {}
    for label, points in lines.items():
        # the most seeds at any step: a seed that did not log a step is left out of that step's mean only
        n = max(len(v) for v in points.values())
        out[f"{label} ({n} seed{'s' if n > 1 else ''})"] = points
    return out


SPREAD = {"sd": "band: +-1 sample sd over seeds", "minmax": "band: min-max over seeds",
          "ci": "band: the 95% t interval of the mean over seeds"}


def run(cfg: DictConfig) -> dict:
    """Read the runs of cfg.runs, draw their learning curves; returns {"axes", "paths", "data"}."""
    from analysis.runs import find_runs, frame, read_run

    if cfg.band not in BANDS:
        raise ConfigError(f"band={cfg.band}: choose one of {', '.join(BANDS)}")
    if cfg.x not in X_KEYS:
        raise ConfigError(f"x={cfg.x}: choose one of {', '.join(X_KEYS)} (the fields every metrics.jsonl line has)")
    roots = _roots(cfg)
    # unfinished runs too: a learning curve is most useful while a run trains
    records = [r for r in (read_run(d) for d in find_runs(roots)) if r is not None]
    if not records:
        raise ConfigError(f"runs={cfg.runs}: no run directories (folders with a run's config.yaml) found there")
    # (the tidy table of analysis.runs; the curves are its "log." rows)
    logged = frame(records, logs=True)  # the runs' metrics.jsonl, read once
    logged = logged[logged["metric"].str.startswith("log.")]
    metrics = list(cfg.metrics) if cfg.metrics is not None else default_metrics(logged)
    if not metrics:
        raise ConfigError(f"runs={cfg.runs}: the runs logged no loss or val_* metric; name some with metrics=[...]")
    stem = Path(cfg.out) if cfg.out else roots[0] / "curves"
    check_writable(stem.parent, "out")
    data, notes = collect_curves(records, metrics, cfg.x, logged)
    for note in notes:
        print(f"[curves] {note}", flush=True)
    # a metric nobody logged: a note, not an empty panel
    missing = [m for m in metrics if m not in data]
    if not data:
        raise ConfigError(f"metrics={metrics}: no run logged any of them; see the keys of a run's metrics.jsonl")
    for m in missing:
        print(f"[curves] {m}: logged by none of the runs; no panel", flush=True)
    panels = {m: (m, _seeds(lines)) for m, lines in data.items()}
    n = len(records) - len(notes)
    axes, paths = draw_curves(panels, stem, cfg.band, cfg.x, f"{n} run{'s' if n > 1 else ''}: mean over seeds, "
                                                             f"{SPREAD[cfg.band]}")
    # the numbers behind every line, as drawn
    numbers = {m: {label: line_stats(points, cfg.band) for label, points in lines.items()}
               for m, (_, lines) in panels.items()}
    paths.append(write_json(stem.with_suffix(".json"), {"band": cfg.band, "x": cfg.x, "metrics": numbers}, indent=1))
    for p in paths:
        print(f"[curves] wrote {p}", flush=True)
    return {"axes": axes, "paths": paths, "data": numbers}


main = hydra_entry("curves")(run)


if __name__ == "__main__":
    main()
