"""Learning curves of the miniature's arms: each paradigm's validation metric against the step,
one line per arm (mean over seeds, a band of 2 standard errors), as a figure, a table and the
change over the last quarter of training (has the metric flattened?).

    deit3  val top-1 of the trainer's evaluations (metrics.jsonl)
    gpt    val bits per byte of the trainer's evaluations (metrics.jsonl)
    dino   the teacher's 20-NN top-1 at every kept checkpoint (trainer.keep_every) and the last:
           DINO has no validation loss, so `eval.knn`'s protocol runs on each checkpoint here,
           its results kept under <out>/curves/ (outside the run directories)
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from analysis.curves import draw_curves, mean_se

METRICS = {"val_acc1": "val top-1 (%)", "val_bpb": "val bits per byte", "knn": "20-NN top-1 of the teacher (%)"}


def _knn_at(ckpt: Path, run_out: Path) -> float:
    """20-NN top-1 (%) of a checkpoint's backbone by `python -m eval.knn`'s defaults, cached."""
    res = run_out / "results.json"
    if not res.exists():
        from eval.knn import evaluate_knn
        from train.recipe import compose_config

        cfg = compose_config([f"checkpoint={ckpt}", f"run_dir={run_out}", "num_workers=0", "cache=false"],
                             config_name="knn")
        evaluate_knn(cfg)
    return float(json.loads(res.read_text())["knn"]["top1"])


def run_curve(run_dir: Path, metric: str, cache: Path) -> dict[int, float]:
    """{step: value} of one run."""
    if metric != "knn":
        from analysis.curves import logged_curve

        return {int(s): v for s, v in logged_curve(run_dir, metric).items()}
    points = {}
    for ckpt in sorted(run_dir.glob("ckpt/step_*.pt"), key=lambda p: int(p.stem.split("_")[1])):
        step = int(ckpt.stem.split("_")[1])
        points[step] = _knn_at(ckpt, cache / run_dir.parent.name / run_dir.name / f"step_{step}")
    results = json.loads((run_dir / "results.json").read_text())
    if results.get("steps") not in points:
        points[int(results["steps"])] = _knn_at(run_dir / "ckpt/last.pt",
                                                cache / run_dir.parent.name / run_dir.name / "last")
    return points


def arm_of(run_dir: Path) -> str:
    """vits_3L_learned_s2 -> vits_3L_learned."""
    return run_dir.name.rsplit("_s", 1)[0]


def curves(runs: dict[str, list[Path]], metrics: dict[str, str], cache: Path) -> dict:
    """{paradigm: {arm: {step: [value per seed]}}} of the finished runs."""
    out = {}
    for paradigm, dirs in runs.items():
        metric = metrics.get(paradigm)
        if metric is None:
            continue
        for d in dirs:
            if (d / "results.json").exists():
                arm = out.setdefault(paradigm, {}).setdefault(arm_of(d), {})
                for step, v in run_curve(d, metric, cache).items():
                    arm.setdefault(step, []).append(v)
    return out


def curves_markdown(data: dict, metrics: dict[str, str]) -> list[str]:
    """Per paradigm: a table (rows = step, columns = arms, mean ± 2 se (n)) and, per arm, the
    change over the last quarter of the steps."""
    lines = []
    for paradigm, arms in data.items():
        names = list(arms)
        steps = sorted({s for a in arms.values() for s in a})
        lines += [f"**{paradigm}**: {METRICS[metrics[paradigm]]}", "",
                  "| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for s in steps:
            cells = []
            for a in names:
                xs = arms[a].get(s)
                if not xs:
                    cells.append("")
                    continue
                m, se = mean_se(xs)
                cells.append(f"{m:.4g}" + ("" if math.isnan(se) else f" ± {2 * se:.2g}") + f" ({len(xs)})")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines += ["", "Change over the last quarter of training (the value at the last step minus the value at "
                  "the first evaluated step at or after 75% of it; mean over seeds), and over the quarter "
                  "before it (from the first evaluated step at or after 50%): flat, or slowing down?", ""]
        for a in names:
            (late, last), (mid, _) = last_quarters(arms[a])
            mean = {s: statistics.mean(arms[a][s]) for s in (mid, late, last)}
            before = f" (before: {mean[late] - mean[mid]:+.4g} from step {mid} to {late})" if mid < late else ""
            lines.append(f"- {a}: {mean[last] - mean[late]:+.4g} from step {late} to {last}{before}")
        lines.append("")
    return lines


def last_quarters(points: dict[int, list[float]]) -> tuple[tuple[int, int], tuple[int, int]]:
    """((late, last), (mid, late)): the evaluated steps that bound the last quarter of training and
    the quarter before it (first evaluated step at or after 75% / 50% of the last; never empty
    while there are two evaluations)."""
    st = sorted(points)
    late = next((s for s in st if s >= 0.75 * st[-1]), st[-1])
    if late == st[-1] and len(st) > 1:
        late = st[-2]
    mid = min(next((s for s in st if s >= 0.5 * st[-1]), late), late)
    return (late, st[-1]), (mid, late)


def plot_curves(data: dict, metrics: dict[str, str], path_stem: Path) -> list[Path]:
    """One panel per paradigm, one line per arm (mean over seeds, band of ± 2 se); .png and .pdf."""
    if not data:
        return []
    panels = {paradigm: (METRICS[metrics[paradigm]], arms) for paradigm, arms in data.items()}
    return draw_curves(panels, path_stem, "se2")[1]
