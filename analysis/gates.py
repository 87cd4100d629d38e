"""Where the learned Laplacian gates go. laplacian_mode=learned gives every head a gate
a = sigmoid(g): 1 is a fully Laplacian head (V - PV), 0 a standard one (PV). Per block and
head of every experiment with learned gates: the start (the init rule,
laplace.attention.gate_start_logits; a fine-tuned run: its pre-training's gates), the trajectory (the
engine's `gate.blocks.<i>.h<h>` records in metrics.jsonl) and the end (the checkpoint), pooled
over seeds as analysis.runs pools runs: the mean and its 95% t interval (analysis.stats).

The commands that render every table and figure from the run folders write them:

    python -m analysis.tables runs=runs/deit3    gates_<exp>.{md,csv}: block x head, start -> end
                                                 [95% interval], and a summary (which heads end above
                                                 0.5, which moved most, how many moved toward Laplacian)
    python -m analysis.figures runs=runs/deit3   gates_<exp>.{png,pdf}: gate vs step, a panel per
                                                 block, a line per head (mean, 95% interval band)

<exp> = <trainer>_<dataset>_<family>_k<k>, k the Laplacian heads the gates started from.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import pandas as pd

from analysis.runs import GROUP_KEYS, sort_key
from analysis.stats import describe
from laplace.io import atomic_write


def checkpoint_gates(path) -> dict[str, list[float]]:
    """{layer: [a per head]} of a checkpoint's model, read as the engine logs them."""
    from laplace.attention import learned_gates
    from laplace.checkpoint import load_model

    # the gates as the engine logs them (sigmoid of the logits), read from the model the run saved
    return learned_gates(load_model(path))


def _start(record: dict, depth: int, heads: int) -> tuple[list[list[float]], list[str]]:
    """Where a run's gates started, and a note when that is not known exactly."""
    import torch

    from laplace.attention import gate_start_logits, laplacian_counts
    from laplace.errors import UserError

    notes = []
    # (their start is where the pre-training left them, not the init rule)
    if record.get("init_from"):  # fine-tuning loads the pre-training's gates
        try:
            loaded = checkpoint_gates(record["init_from"])
        # (the note says so, and the start falls back to the init rule)
        except UserError as e:  # moved or deleted since, or timm weights (no gates)
            loaded, why = {}, str(e)
        else:
            why = "it has no learned gates"
        if loaded:
            return list(loaded.values()), notes
        notes.append(f"{record['run_dir']}: start from the init rule: its init_from is not read ({why})")
    k = record["k"]
    # the init rule, per block: the k Laplacian heads start above 0.5, the others below
    counts = laplacian_counts(list(k) if isinstance(k, tuple) else k, depth, heads)
    return [torch.sigmoid(gate_start_logits(heads, c)).tolist() for c in counts], notes


def run_gates(record: dict) -> Optional[dict]:
    """One run's gates as [block][head] lists of a: start, end, and the trajectory
    ([step][block][head], step 0 = the start) with its steps; None without learned gates.

    Args:
        record: a run from `analysis.runs.collect`.
    """
    from train.logger import logged

    if not Path(record["checkpoint"]).is_file():
        return None
    # the end from the checkpoint itself (the logged trajectory may stop short of the last step)
    end = checkpoint_gates(record["checkpoint"])
    if not end:
        return None
    layers = list(end)
    heads = len(end[layers[0]])
    start, notes = _start(record, len(layers), heads)
    keys = [[f"gate.{layer}.h{h}" for h in range(heads)] for layer in layers]
    # the engine logs every gate at every log step; a record without them (another trainer) is skipped
    logs = [r for r in logged(record["run_dir"], "train") if all(k in r for ks in keys for k in ks)]
    # (a trajectory of two points: the start and the checkpoint's end)
    if not logs:  # a run of a trainer that did not log them: its two known points
        notes.append(f"{record['run_dir']}/metrics.jsonl: no gate.<layer>.h<head> records; its trajectory "
                     f"is the start and the end only")
        logs = [{"step": record["steps"], **{k: a for ks, row in zip(keys, end.values()) for k, a in zip(ks, row)}}]
    return {"layers": layers, "start": start, "end": list(end.values()), "steps": [0] + [r["step"] for r in logs],
            "trajectory": [start] + [[[r[k] for k in ks] for ks in keys] for r in logs], "notes": notes}


def _pool(per_run: list[list[list[float]]]) -> tuple[list, list, list]:
    """[run][block][head] -> [block][head] means, and the lows and highs of their 95% intervals
    (NaN with one seed)."""
    # (analysis.stats: the same mean and t interval as every other table)
    stats = [[describe(vals) for vals in zip(*blocks)] for blocks in zip(*per_run)]
    return tuple([[getattr(s, f) for s in row] for row in stats] for f in ("mean", "lo", "hi"))


def gate_groups(records: list[dict], skipped: Optional[list] = None) -> list[dict]:
    """The finished learned-gate runs, pooled over seeds (runs that share analysis.runs'
    GROUP_KEYS). Each group: name, trainer, k_label, recipe, n, seeds, run_dirs, layers, heads,
    start / end / move as [block][head] means with their 95% intervals (start_lo, start_hi, ...;
    NaN with one seed), steps (those every seed logged) with traj / traj_lo / traj_hi
    ([step][block][head]), notes.
    `skipped` (if given) gets a line for each learned run left out (its checkpoint is gone).
    """
    by: dict = {}
    for r in records:
        # learned-gate runs only; seeds of one recipe pool (analysis.runs.GROUP_KEYS)
        if r["mode"] == "learned" and r["finished"]:
            by.setdefault(tuple(r.get(f) for f in GROUP_KEYS), []).append(r)
    groups, names = [], set()
    for key in sorted(by, key=lambda k: tuple(sort_key(v) for v in k)):
        # seeds in order; a run whose checkpoint is gone is left out and said (skipped)
        pairs = [(r, g) for r in sorted(by[key], key=lambda r: sort_key(r["seed"])) for g in [run_gates(r)] if g]
        if skipped is not None:
            done = {r["run_dir"] for r, _ in pairs}
            skipped += [f"{r['checkpoint']}: not found (or no learned gates in it); {r['run_dir']} left out"
                        for r in by[key] if r["run_dir"] not in done]
        if not pairs:
            continue
        recs, runs = [r for r, _ in pairs], [g for _, g in pairs]
        first = recs[0]
        # the trainer too: DINO and DeiT-III train the same family on the same data
        # the trainer in the name: DINO and DeiT-III train the same family on the same data
        name = f"{first['trainer']}_{first['dataset']}_{first['family']}_k{first['k_label']}"
        name = name if name not in names else f"{name}_{first['recipe_id']}"  # a second recipe
        names.add(name)
        # the steps every seed logged: a mean over seeds at each of them
        steps = sorted(set.intersection(*(set(g["steps"]) for g in runs)))
        # [run][step][block][head] at the common steps
        at = [[g["trajectory"][g["steps"].index(s)] for s in steps] for g in runs]
        group = {"name": name, "trainer": first["trainer"], "k_label": first["k_label"], "recipe": first["recipe"],
                 "n": len(runs), "seeds": [r["seed"] for r in recs], "run_dirs": [r["run_dir"] for r in recs],
                 "layers": runs[0]["layers"], "heads": len(runs[0]["end"][0]), "steps": steps,
                 "notes": [n for g in runs for n in g["notes"]]}
        # each seed's move end - start, then pooled: its interval says whether a head moved beyond the seeds' spread
        moves = [[[e - s for s, e in zip(s_row, e_row)] for s_row, e_row in zip(g["start"], g["end"])] for g in runs]
        for what, per_run in (("start", [g["start"] for g in runs]), ("end", [g["end"] for g in runs]),
                              ("move", moves)):
            group[what], group[f"{what}_lo"], group[f"{what}_hi"] = _pool(per_run)
        pooled = [_pool([traj[i] for traj in at]) for i in range(len(steps))]
        group["traj"], group["traj_lo"], group["traj_hi"] = (list(x) for x in zip(*pooled))
        groups.append(group)
    return groups


# ----------------------------------------------------------------------------- text

def _heads(g: dict):
    """(layer, head, start, end, move, move lo, move hi) of every gate of a group."""
    for b, layer in enumerate(g["layers"]):
        for h in range(g["heads"]):
            yield layer, h, g["start"][b][h], g["end"][b][h], g["move"][b][h], g["move_lo"][b][h], g["move_hi"][b][h]


def summary(g: dict) -> list[str]:
    """Does training make heads Laplacian, and which ones: a few lines over every gate."""
    # every gate of the group: (layer, head, start, end, move, move lo, move hi)
    cells = list(_heads(g))
    n = len(cells)
    # a move is told apart from the seeds' spread when its 95% interval excludes 0
    beyond = lambda cs: sum(lo > 0 or hi < 0 for *_, lo, hi in cs)  # noqa: E731
    up, down = [c for c in cells if c[4] > 0], [c for c in cells if c[4] < 0]
    spread = f"{beyond(up)} with a 95% interval above 0" if g["n"] > 1 else "no interval with one seed"
    lines = [f"moved toward Laplacian (end > start): {len(up)} of {n} heads ({100 * len(up) / n:.0f}%; "
             f"{spread}); away from it: {len(down)}" + (f" ({beyond(down)} below 0)" if g["n"] > 1 else "")]
    # a > 0.5: a head more Laplacian than standard at the end
    above = [c for c in cells if c[3] > 0.5]
    lines.append(f"ended above 0.5: {len(above)} of {n} heads (started above 0.5: "
                 f"{sum(c[2] > 0.5 for c in cells)})" + (": " + ", ".join(f"{c[0]} h{c[1]} {c[3]:.3f}" for c in above)
                                                        if above else ""))
    for way, crossed in (("toward Laplacian", [c for c in up if c[2] <= 0.5 < c[3]]),
                         ("toward standard", [c for c in down if c[3] <= 0.5 < c[2]])):
        if crossed:
            lines.append(f"crossed 0.5 {way}: " + ", ".join(f"{c[0]} h{c[1]}" for c in crossed))
    # the largest move either way, with its interval
    top = max(cells, key=lambda c: abs(c[4]))
    ci = "" if g["n"] < 2 else f" [{top[5]:+.3g}, {top[6]:+.3g}]"
    lines.append(f"moved most: {top[0]} h{top[1]} {top[2]:.3f} -> {top[3]:.3f} ({top[4]:+.3g}{ci})")
    for what, part in (("started Laplacian", [c for c in cells if c[2] > 0.5]),
                       ("started standard", [c for c in cells if c[2] <= 0.5])):
        if part:
            lines.append(f"mean move of the {len(part)} heads that {what}: "
                         f"{statistics.fmean(c[4] for c in part):+.3g}")
    return lines


def gate_table(g: dict) -> pd.DataFrame:
    """A row per gate: layer, head, start, end with its interval, move with its interval, n, seeds."""
    return pd.DataFrame([{"layer": layer, "head": h, "start": g["start"][b][h], "end": g["end"][b][h],
                          "end_lo": g["end_lo"][b][h], "end_hi": g["end_hi"][b][h], "move": g["move"][b][h],
                          "move_lo": g["move_lo"][b][h], "move_hi": g["move_hi"][b][h], "n": g["n"],
                          "seeds": " ".join(map(str, g["seeds"]))}
                         for b, layer in enumerate(g["layers"]) for h in range(g["heads"])])


def to_markdown(g: dict) -> str:
    """A group as a Markdown table (block x head: start → end [95% interval]), its runs and summary."""
    t = gate_table(g)
    # start → end [the end's 95% interval over seeds]
    t["text"] = [f"{s:.3f} → {e:.3f}" + ("" if g["n"] < 2 else f" [{lo:.3f}, {hi:.3f}]")
                 for s, e, lo, hi in zip(t["start"], t["end"], t["end_lo"], t["end_hi"])]
    # long -> wide: a row per block, a column per head
    grid = t.pivot(index="layer", columns="head", values="text").reindex(g["layers"])
    grid = grid.rename(index=lambda n: n.rsplit(".", 1)[-1], columns=lambda h: f"h{h}").reset_index()
    seeds = ", ".join(map(str, g["seeds"]))
    out = [f"### gates_{g['name']}: learned gates a = sigmoid(g), start → end [95% interval]", "",
           grid.rename(columns={"layer": "block"}).to_markdown(index=False, disable_numparse=True), "",
           f"a = 1: the head is fully Laplacian (V − PV); 0: standard attention (PV). Mean over seeds {seeds} "
           f"(n = {g['n']}; the 95% t interval of the mean when n > 1) of runs {g['recipe']}.", ""]
    out += [f"- {line}" for line in summary(g)] + [f"- note: {n}" for n in g["notes"]]
    return "\n".join(out) + "\n"


def to_csv(g: dict) -> str:
    """One line per gate, full precision; a missing interval is an empty field."""
    return gate_table(g).to_csv(index=False, lineterminator="\n")


def write_gate_tables(records: list[dict], out, echo: bool = True) -> list[Path]:
    """out/gates_<exp>.{md,csv} for every learned-gate experiment of `records`; the paths."""
    # a table per experiment with learned gates: gates_<trainer>_<data>_<family>_k<k>.{md,csv}
    paths, skipped = [], []
    for g in gate_groups(records, skipped):
        md = to_markdown(g)
        if echo:
            print(md, flush=True)
        for ext, text in (("md", md), ("csv", to_csv(g))):
            path = Path(out) / f"gates_{g['name']}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, text.encode())
            paths.append(path)
    for line in skipped:
        print(f"[tables] gates: {line}", flush=True)
    return paths


# ----------------------------------------------------------------------------- figure

def draw_gates(g: dict, stem: Path) -> list[Path]:
    """Gate vs step per block (a line per head: the mean over seeds, 95% interval band; the heads
    that started Laplacian dashed), and below each block its change from the start: moves of
    a few hundredths, typical here, are flat lines on the 0-1 axis."""
    import numpy as np

    from analysis import plots

    nb = len(g["layers"])
    cols = min(nb, 4)
    # two rows per row of blocks: the gate, and its change from the start below it
    rows = 2 * -(-nb // cols)
    fig, axes = plots.plt.subplots(rows, cols, figsize=(3.2 * cols, 2.3 * rows), squeeze=False)
    steps, mean = np.array(g["steps"]), np.array(g["traj"])
    lo, hi = np.array(g["traj_lo"]), np.array(g["traj_hi"])
    start = np.array(g["start"])
    for b in range(nb):
        ax_a, ax_d = axes[2 * (b // cols), b % cols], axes[2 * (b // cols) + 1, b % cols]
        for h in range(g["heads"]):
            # dashed: the heads that started Laplacian
            lap = start[b, h] > 0.5
            for ax, shift in ((ax_a, 0.0), (ax_d, start[b, h])):
                ax.plot(steps, mean[:, b, h] - shift, "--" if lap else "-", color=plots.color(h), lw=1.4,
                        label=f"h{h}" + (" (started Laplacian)" if lap else ""))
                if g["n"] > 1:  # the 95% interval of the mean over seeds
                    ax.fill_between(steps, lo[:, b, h] - shift, hi[:, b, h] - shift, color=plots.color(h),
                                    alpha=0.2, lw=0)
        ax_a.axhline(0.5, color="grey", ls=":", lw=1)
        ax_a.set_ylim(0, 1)
        ax_d.axhline(0.0, color="grey", ls=":", lw=1)
        ax_a.set_title(g["layers"][b], fontsize=9)
        ax_a.set_ylabel("gate a = sigmoid(g)", fontsize=8)
        ax_d.set_ylabel("a - start", fontsize=8)
        ax_d.set_xlabel("step", fontsize=8)
        for ax in (ax_a, ax_d):
            ax.grid(alpha=0.3)
    for b in range(nb, (rows // 2) * cols):
        for ax in (axes[2 * (b // cols), b % cols], axes[2 * (b // cols) + 1, b % cols]):
            ax.axis("off")
    fig.suptitle(f"{g['name']}: learned gates, mean over {g['n']} seed{'s' * (g['n'] > 1)}"
                 + (", 95% interval" if g["n"] > 1 else ""), fontsize=10)
    fig.tight_layout()
    # every block's legend: a head that started Laplacian in one block may not in another
    labels = {}
    for b in range(nb):
        for handle, label in zip(*axes[2 * (b // cols), b % cols].get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(list(labels.values()), list(labels), loc="upper center", ncol=min(len(labels), 4), fontsize=8,
               bbox_to_anchor=(0.5, 0.0))
    return plots.save(fig, stem)


def draw_gate_figures(records: list[dict], out) -> list[Path]:
    """out/gates_<exp>.{png,pdf} for every learned-gate experiment of `records`; the paths."""
    return [p for g in gate_groups(records) for p in draw_gates(g, Path(out) / f"gates_{g['name']}")]
