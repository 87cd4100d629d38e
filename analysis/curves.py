"""Learning curves of training runs: what every trainer logs to <run>/metrics.jsonl, against the step.

    python -m analysis.curves runs=runs/deit3/digits
    python -m analysis.curves runs='runs/deit3/digits/vitt_*' metrics=[loss,val_acc1] out=reports/curves
    python -m analysis.curves runs=[runs/a,runs/b] x=epoch band=minmax

Runs are found and read as by `python -m analysis.tables` (analysis/runs.py) and split into
experiments (trainer x dataset x model family x recipe). A panel per metric; in each, a line per
experiment and arm (k, mode): the mean over its seeds with a band (`band`): sd = +-1 sample sd
(the default), minmax = the lowest to the highest seed, ci = the 95% t interval of the mean
(analysis.stats); one seed: no band. A seed that did not log a step is left out of that step's
mean; a run that never logged a metric (another trainer's) is left out of that metric's panel.

Written: <out>.png, <out>.pdf and <out>.json (the numbers drawn: per metric and line, x, mean,
lo, hi, n and every seed's values); out defaults to reports/curves. stdout: a line
per run left out, then `[curves] wrote <path>`.
"""
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from analysis.runs import arm_key, arms, collect, experiments, frame, runs_roots, sort_key
from analysis.stats import describe
from train.cli import hydra_entry
from laplace.errors import ConfigError
from laplace.io import write_json
from train.rundir import check_writable

BANDS = {"sd": "band: +-1 sample sd over seeds", "minmax": "band: min-max over seeds",
         "ci": "band: the 95% t interval of the mean over seeds"}
X_KEYS = ("step", "epoch")
# The y-axis of the metrics the trainers log: unit and which way is better (loss: nats per target).
UNITS = {"loss": "nats, lower is better", "val_loss": "nats, lower is better", "val_bpb": "bits per byte, lower "
         "is better", **{f"val_{m}": "%, higher is better" for m in ("acc1", "acc5", "mIoU", "aAcc", "mAcc")}}


def band_of(xs: list[float], band: str) -> tuple[float, float, float]:
    """(mean, lo, hi) of the seeds' values at one x (analysis.stats: the tables' mean, sd and t
    interval): lo..hi is +-1 sample sd, the seeds' range or the 95% interval; lo = hi = mean for one."""
    s = describe(xs)
    # minmax shows every seed's reach; sd the seeds' spread; ci where the mean may be (it shrinks
    # with more seeds, the spread does not)
    if band == "minmax":
        return s.mean, min(xs), max(xs)
    if s.n < 2:  # one seed: no spread to show, and no band rather than a zero-width one
        return s.mean, s.mean, s.mean
    return (s.mean, s.mean - s.sd, s.mean + s.sd) if band == "sd" else (s.mean, s.lo, s.hi)


def line_stats(points: dict[float, list[float]], band: str) -> dict:
    """One line's numbers (what <out>.json holds): x (sorted), mean, lo, hi, n (seeds) and values."""
    xs = sorted(points)
    # the numbers drawn, also written to <out>.json: a figure's data for one's own plot
    mean, lo, hi = zip(*(band_of(points[x], band) for x in xs)) if xs else ((), (), ())
    return {"x": xs, "mean": list(mean), "lo": list(lo), "hi": list(hi), "n": [len(points[x]) for x in xs],
            "values": [points[x] for x in xs]}


def draw_curves(panels: dict, stem: Path, band: str, xlabel: str = "step", title: Optional[str] = None):
    """A panel per entry of `panels` {title: (ylabel, {label: {x: [value per seed]}})}, a line per
    label with its band, one colour per label (its text before " (") in every panel, at most 3
    panels a row (5 metrics stay readable on a page); writes stem.{png,pdf}. Returns (the axes, the paths)."""
    from analysis.figures import panels as grid, save

    # a line's colour by its label, not its place in a panel: a panel without some line (a metric
    # one arm never logged) shifted matplotlib's cycle, and one model read in two colours
    arms = list(dict.fromkeys(label.split(" (")[0] for _, lines in panels.values() for label in lines))
    fig, axes = grid(len(panels), min(len(panels), 3), 4.6, 3.6)
    for ax, (name, (ylabel, lines)) in zip(axes, panels.items()):
        for label, points in lines.items():
            s, c = line_stats(points, band), f"C{arms.index(label.split(' (')[0])}"
            # the line is the mean; its band shares its colour
            ax.plot(s["x"], s["mean"], marker="o", ms=3, label=label, color=c)
            ax.fill_between(s["x"], s["lo"], s["hi"], color=c, alpha=0.15)
        ax.set(title=name, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return axes[:len(panels)], save(fig, stem)


def points(rows, x: str = "step") -> dict:
    """{arm label: {x: [value per seed]}} of rows of the tidy table (analysis.runs.frame) of one
    metric: each run's last value at each x (an epoch's last step; a resumed run's rerun; a final
    evaluation over a kept checkpoint's of the same step)."""
    rows = rows[rows[x].notna()].sort_values("final", kind="stable").drop_duplicates(["run_dir", x], keep="last")
    return {label: {at: list(a["value"]) for at, a in arm.sort_values("seed", kind="stable").groupby(x)}
            for label, arm in arms(rows)}


def collect_curves(records: list[dict], metrics: list[str], x: str, logged) -> tuple[dict, list[str]]:
    """{metric: {line label: {x: [value per seed]}}} of `records` from their frame(logs=True)
    `logged`, and a note per run left out. A line is one experiment's arm; the experiment is named
    in the label only when the runs hold several (the usual one-folder call keeps short labels)."""
    # runs of different trainers share a folder: a metric one never logged (a DINO run has no
    # val_loss) adds nothing to that panel, and the run is not a line there
    logged = logged[logged["metric"].isin([f"log.{m}" for m in metrics]) & logged[x].notna()]
    data, notes, exps = {m: {} for m in metrics}, [], experiments(records)
    for exp, recs in exps.items():
        mine = logged[logged["run_dir"].isin([r["run_dir"] for r in recs])]
        for r in sorted(recs, key=lambda r: (arm_key(r["k"], r["mode"]), sort_key(r["seed"]))):
            if not (mine["run_dir"] == r["run_dir"]).any():
                why = "no metrics.jsonl" if not (Path(r["run_dir"]) / "metrics.jsonl").exists() else \
                    f"none of {metrics} logged against {x}"
                notes.append(f"{r['run_dir']}: {why}; left out")
        for m in metrics:
            data[m].update({(f"{exp} " if len(exps) > 1 else "") + label: pts
                            for label, pts in points(mine[mine["metric"] == f"log.{m}"], x).items()})
    return {m: lines for m, lines in data.items() if lines}, notes


def run(cfg: DictConfig) -> dict:
    """Read the runs of cfg.runs, draw their learning curves; returns {"axes", "paths", "data"}."""
    if cfg.band not in BANDS:
        raise ConfigError(f"band={cfg.band}: choose one of {', '.join(BANDS)}")
    if cfg.x not in X_KEYS:
        raise ConfigError(f"x={cfg.x}: choose one of {', '.join(X_KEYS)} (the fields every metrics.jsonl line has)")
    # unfinished runs too: a learning curve is most useful while a run trains
    records = collect(runs_roots(cfg, "analysis.curves"))
    if not records:
        raise ConfigError(f"runs={cfg.runs}: no run directories (folders with a run's config.yaml) found there")
    # the tidy table's "log." rows: every run's metrics.jsonl, read once for every panel
    logged = frame(records, logs=True)
    logged = logged[logged["metric"].str.startswith("log.")]
    # by default the loss, then every validation metric: what a reader checks before any verdict
    keys = {m[len("log."):] for m in logged["metric"]}
    val = sorted(k for k in keys if k.startswith("val_") and k != "val_loss")
    metrics = list(cfg.metrics) if cfg.metrics is not None else [k for k in ("loss", "val_loss") if k in keys] + val
    if not metrics:
        raise ConfigError(f"runs={cfg.runs}: the runs logged no loss or val_* metric; name some with metrics=[...]")
    stem = Path(cfg.out)
    check_writable(stem.parent, "out")
    data, notes = collect_curves(records, metrics, cfg.x, logged)
    for note in notes:
        print(f"[curves] {note}", flush=True)
    if not data:
        raise ConfigError(f"metrics={metrics}: no run logged any of them; see the keys of a run's metrics.jsonl")
    for m in metrics:
        if m not in data:  # a metric nobody logged: a note, not an empty panel
            print(f"[curves] {m}: logged by none of the runs; no panel", flush=True)
    # each label with its seeds: the most at any x (a seed that did not log a step is left out there only)
    panels = {m: (f"{m} ({UNITS[m]})" if m in UNITS else m, {f"{label} ({n} seed{'s' if n > 1 else ''})": points
                      for label, points in lines.items() for n in [max(map(len, points.values()))]})
              for m, lines in data.items()}
    n = len(records) - len(notes)  # the runs drawn, for the title
    axes, paths = draw_curves(panels, stem, cfg.band, cfg.x,
                              f"{n} run{'s' if n > 1 else ''}: mean over seeds, {BANDS[cfg.band]}")
    numbers = {m: {label: line_stats(points, cfg.band) for label, points in lines.items()}
               for m, (_, lines) in panels.items()}
    paths.append(write_json(stem.with_suffix(".json"), {"band": cfg.band, "x": cfg.x, "metrics": numbers}, indent=1))
    for p in paths:
        print(f"[curves] wrote {p}", flush=True)
    return {"axes": axes, "paths": paths, "data": numbers}


main = hydra_entry("curves")(run)


if __name__ == "__main__":
    main()
