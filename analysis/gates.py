"""Where the learned Laplacian gates go. laplacian_mode=learned gives every head a gate
a = sigmoid(g): 1 is a fully Laplacian head (V - PV), 0 a standard one (PV). Per block and head of
every experiment with learned gates: the start (the init rule, laplace.attention.gate_start_logits;
a fine-tuned run: its pre-training's gates), the trajectory (the engine's `gate.blocks.<i>.h<h>`
records in metrics.jsonl) and the end (the checkpoint), pooled over seeds as analysis.runs pools
runs: the mean and its 95% t interval (analysis.stats). Written by

    python -m analysis.tables runs=runs/deit3    gates_<exp>.{md,csv}: block x head, start -> end
                                                 [95% interval], and a summary (which heads end above
                                                 0.5, which moved most, how many moved toward Laplacian)
    python -m analysis.figures runs=runs/deit3   gates_<exp>.{png,pdf}: gate vs step, a panel per
                                                 block, a line per head (mean, 95% interval band)

<exp> = <trainer>_<dataset>_<family>_k<k>, k the Laplacian heads the gates started from.
"""
import statistics
from pathlib import Path
from typing import Optional

import pandas as pd

from analysis.runs import GROUP_KEYS, sort_key
from analysis.stats import summarize
from laplace.io import atomic_write


def _start(record: dict, depth: int, heads: int) -> tuple[list[list[float]], list[str]]:
    """Where a run's gates started ([block][head]), and a note when that is not known exactly."""
    import torch

    from laplace.attention import gate_start_logits, laplacian_counts, learned_gates
    from laplace.checkpoint import load_model
    from laplace.errors import UserError

    notes = []
    if record.get("init_from"):  # fine-tuning starts where the pre-training left its gates
        try:
            loaded, why = learned_gates(load_model(record["init_from"])), "it has no learned gates"
        except UserError as e:  # moved or deleted since, or timm weights (no gates): the init rule, said
            loaded, why = {}, str(e)
        if loaded:
            return list(loaded.values()), notes
        notes.append(f"{record['run_dir']}: start from the init rule: its init_from is not read ({why})")
    k = record["k"]
    # the init rule, per block: the k Laplacian heads start above 0.5, the others below
    counts = laplacian_counts(list(k) if isinstance(k, tuple) else k, depth, heads)
    return [torch.sigmoid(gate_start_logits(heads, c)).tolist() for c in counts], notes


def run_gates(record: dict) -> Optional[tuple[pd.DataFrame, list[str]]]:
    """One run's gates a as a tidy table, a row per (point, step, block, head): point "start" (step
    0), "logged" (every step the engine logged them) and "end" (the checkpoint's, at the run's
    last step); and notes. None without a checkpoint or learned gates.

    Args:
        record: a run from `analysis.runs.collect`.
    """
    from laplace.attention import learned_gates
    from laplace.checkpoint import load_model
    from train.logger import logged

    if not Path(record["checkpoint"]).is_file():
        return None
    # the end from the checkpoint itself (the logged trajectory may stop short of the last step): {layer: [a
    # per head]}, the sigmoid of the logits as the engine logs them
    end = list(learned_gates(load_model(record["checkpoint"])).values())
    if not end:
        return None
    start, notes = _start(record, len(end), len(end[0]))
    keys = [[f"gate.blocks.{b}.h{h}" for h in range(len(row))] for b, row in enumerate(end)]
    # the engine logs every gate at every log step; a record without them (another trainer) is skipped
    logs = [r for r in logged(record["run_dir"], "train") if all(k in r for ks in keys for k in ks)]
    if not logs:  # a trainer that did not log them: the trajectory is its two known points
        notes.append(f"{record['run_dir']}/metrics.jsonl: no gate.<layer>.h<head> records; its trajectory "
                     f"is the start and the end only")
        logs = [{"step": record["steps"], **{k: a for ks, row in zip(keys, end) for k, a in zip(ks, row)}}]
    # one row per gate and point in time: pandas pools seeds, pivots blocks x heads and draws from it
    points = [("start", 0, start), *[("logged", r["step"], [[r[k] for k in ks] for ks in keys]) for r in logs],
              ("end", record["steps"], end)]
    return pd.DataFrame([{"point": p, "step": s, "block": b, "head": h, "a": a} for p, s, gates in points
                         for b, row in enumerate(gates) for h, a in enumerate(row)]), notes


def gate_groups(records: list[dict], skipped: Optional[list] = None) -> list[dict]:
    """The finished learned-gate runs, pooled over seeds (runs sharing analysis.runs' GROUP_KEYS).
    Each group: name, trainer, k_label, recipe, n, seeds, run_dirs, layers, notes; gates (a row per
    block and head: layer, block, head, and start, end, move = end - start, each mean over seeds
    with its 95% interval <what>_lo, <what>_hi, NaN with one seed) and traj (a row per step every
    seed logged, block and head: mean, lo, hi). `skipped` (if given) gets a line per learned run
    left out (its checkpoint is gone)."""
    by: dict = {}
    for r in records:
        # learned-gate runs only; seeds of one recipe pool (analysis.runs.GROUP_KEYS)
        if r["mode"] == "learned" and r["finished"]:
            by.setdefault(tuple(r.get(f) for f in GROUP_KEYS), []).append(r)
    groups, names = [], set()
    for key in sorted(by, key=lambda k: tuple(sort_key(v) for v in k)):
        recs = sorted(by[key], key=lambda r: sort_key(r["seed"]))
        # seeds in order; a run whose checkpoint is gone is left out and said (skipped)
        found = [(r, got) for r in recs for got in [run_gates(r)] if got]
        if skipped is not None:
            done = {r["run_dir"] for r, _ in found}
            skipped += [f"{r['checkpoint']}: not found (or no learned gates in it); {r['run_dir']} left out"
                        for r in recs if r["run_dir"] not in done]
        if not found:
            continue
        first = found[0][0]
        # the trainer in the name: DINO and DeiT-III train the same family on the same data
        name = f"{first['trainer']}_{first['dataset']}_{first['family']}_k{first['k_label']}"
        name = name if name not in names else f"{name}_{first['recipe_id']}"  # a second recipe
        names.add(name)
        df = pd.concat([g.assign(seed=r["seed"], run_dir=r["run_dir"]) for r, (g, _) in found], ignore_index=True)
        # each seed's move end - start, then pooled: its interval says whether a head moved beyond the seeds' spread
        wide = df[df["point"] != "logged"].pivot_table(index=["seed", "run_dir", "block", "head"], columns="point",
                                                       values="a").reset_index().sort_values(["block", "head", "seed"])
        wide["move"] = wide["end"] - wide["start"]
        # start, end and move each pooled as every table pools: the mean and its 95% t interval
        parts = [summarize(wide, ["block", "head"], value=w).set_index(["block", "head"])[["mean", "lo", "hi"]]
                 .rename(columns={"mean": w, "lo": f"{w}_lo", "hi": f"{w}_hi"}) for w in ("start", "end", "move")]
        gates = pd.concat(parts, axis=1).reset_index()
        gates.insert(0, "layer", [f"blocks.{b}" for b in gates["block"]])
        # the trajectory at the steps every seed logged: a mean over seeds at each of them
        traj = df[df["point"] != "end"]
        traj = traj[traj.groupby("step")["run_dir"].transform("nunique") == len(found)]
        groups.append({"name": name, "trainer": first["trainer"], "k_label": first["k_label"],
                       "recipe": first["recipe"], "n": len(found), "seeds": [r["seed"] for r, _ in found],
                       "run_dirs": [r["run_dir"] for r, _ in found], "layers": list(dict.fromkeys(gates["layer"])),
                       "gates": gates, "notes": [n for _, (_, notes) in found for n in notes],
                       "traj": summarize(traj.sort_values(["step", "block", "head", "seed"], kind="stable"),
                                         ["step", "block", "head"], value="a")})
    return groups


# ----------------------------------------------------------------------------- text

def summary(g: dict) -> list[str]:
    """Does training make heads Laplacian, and which ones: a few lines over every gate."""
    t, n = g["gates"], len(g["gates"])
    up, down = t[t["move"] > 0], t[t["move"] < 0]

    def beyond(part):  # moves told apart from the seeds' spread: their 95% interval excludes 0
        return int(((part["move_lo"] > 0) | (part["move_hi"] < 0)).sum())

    def names(part):
        return ", ".join(f"{layer} h{h}" for layer, h in zip(part["layer"], part["head"]))

    spread = f"{beyond(up)} with a 95% interval above 0" if g["n"] > 1 else "no interval with one seed"
    lines = [f"moved toward Laplacian (end > start): {len(up)} of {n} heads ({100 * len(up) / n:.0f}%; "
             f"{spread}); away from it: {len(down)}" + (f" ({beyond(down)} below 0)" if g["n"] > 1 else "")]
    # a > 0.5: a head more Laplacian than standard at the end
    above = t[t["end"] > 0.5]
    lines.append(f"ended above 0.5: {len(above)} of {n} heads (started above 0.5: {int((t['start'] > 0.5).sum())})"
                 + (": " + ", ".join(f"{layer} h{h} {e:.3f}" for layer, h, e in
                                     zip(above["layer"], above["head"], above["end"])) if len(above) else ""))
    for way, crossed in (("toward Laplacian", up[(up["start"] <= 0.5) & (up["end"] > 0.5)]),
                         ("toward standard", down[(down["end"] <= 0.5) & (down["start"] > 0.5)])):
        if len(crossed):
            lines.append(f"crossed 0.5 {way}: {names(crossed)}")
    top = t.loc[t["move"].abs().idxmax()]  # the largest move either way, with its interval
    ci = "" if g["n"] < 2 else f" [{top['move_lo']:+.3g}, {top['move_hi']:+.3g}]"
    lines.append(f"moved most: {top['layer']} h{top['head']} {top['start']:.3f} -> {top['end']:.3f} "
                 f"({top['move']:+.3g}{ci})")
    for what, part in (("started Laplacian", t[t["start"] > 0.5]), ("started standard", t[t["start"] <= 0.5])):
        if len(part):
            lines.append(f"mean move of the {len(part)} heads that {what}: {statistics.fmean(part['move']):+.3g}")
    return lines


def to_markdown(g: dict) -> str:
    """A group as a Markdown table (block x head: start → end [95% interval]), its runs and summary."""
    t = g["gates"]
    # start → end [the end's 95% interval over seeds]: where a head went, and how sure
    text = [f"{s:.3f} → {e:.3f}" + ("" if g["n"] < 2 else f" [{lo:.3f}, {hi:.3f}]")
            for s, e, lo, hi in zip(t["start"], t["end"], t["end_lo"], t["end_hi"])]
    # long -> wide: a row per block, a column per head
    grid = t.assign(text=text).pivot(index="block", columns="head", values="text")
    grid = grid.rename(columns=lambda h: f"h{h}").reset_index()
    out = [f"### gates_{g['name']}: learned gates a = sigmoid(g), start → end [95% interval]", "",
           grid.to_markdown(index=False, disable_numparse=True), "",
           f"a = 1: the head is fully Laplacian (V − PV); 0: standard attention (PV). Mean over seeds "
           f"{', '.join(map(str, g['seeds']))} (n = {g['n']}; the 95% t interval of the mean when n > 1) of runs "
           f"{g['recipe']}.", ""]
    out += [f"- {line}" for line in summary(g)] + [f"- note: {n}" for n in g["notes"]]
    return "\n".join(out) + "\n"


def write_gate_tables(records: list[dict], out, echo: bool = True) -> list[Path]:
    """out/gates_<exp>.{md,csv} for every learned-gate experiment of `records`; the paths."""
    paths, skipped = [], []
    for g in gate_groups(records, skipped):
        md = to_markdown(g)
        if echo:
            print(md, flush=True)
        # the CSV: one line per gate, full precision; a missing interval is an empty field
        cols = ["layer", "head", "start", "end", "end_lo", "end_hi", "move", "move_lo", "move_hi"]
        sheet = g["gates"][cols].assign(n=g["n"], seeds=" ".join(map(str, g["seeds"])))
        paths += [atomic_write(Path(out) / f"gates_{g['name']}.{ext}", text.encode())
                  for ext, text in (("md", md), ("csv", sheet.to_csv(index=False, lineterminator="\n")))]
    for line in skipped:
        print(f"[tables] gates: {line}", flush=True)
    return paths
