"""The per-block geometry table of `python -m analysis.tables` (a spec with `kind: per_block`
in configs/tables.yaml): the headline token geometry at every block and the final norm.

One section per experiment (trainer x dataset x model family x recipe, as the figures name
them) and metric: rows = layers ("blocks.<i>": the residual stream after block i; "norm": the
final norm), columns = the arms (number of Laplacian heads k, and the mode when learned),
cells "mean ± 2 se (n)" over the seeds (se = sample std / sqrt(n)); one seed: "mean (1)".
The numbers come from each run's analysis.json through `analysis.runs.per_block`.

    from analysis.blocks import build_per_block, to_markdown
    print(to_markdown(build_per_block("per_block", {"title": "..."}, collect(["runs/miniature"]))))
"""
from __future__ import annotations

import csv
import io

from analysis.runs import BLOCK_METRICS, arm_label, experiments, layer_order, per_block, sort_key
from laplace.errors import ConfigError


def build_per_block(name: str, spec: dict, records: list[dict]) -> dict:
    """The table as plain data: {name, title, fmt, sections}; a section has experiment, recipe,
    metric, label, layers, arms [(k, mode, label)] and cells {(layer, k, mode): per_block row}.

    Args:
        name, spec: the table's name and spec (title, fmt, metrics: keys of BLOCK_METRICS).
        records: finished runs from `collect`, already filtered by the spec's `where`.
    """
    labels = dict(BLOCK_METRICS)
    metrics = list(spec.get("metrics") or labels)
    bad = [m for m in metrics if m not in labels]
    if bad:
        raise ConfigError(f"tables.{name}.metrics: {bad[0]!r} is not a per-block metric; choose from {list(labels)}")
    sections = []
    for exp, recs in experiments([r for r in records if r.get("layer_geometry")]).items():
        rows = per_block(recs, metrics)
        arms = sorted({(g["k"], g["mode"], g["k_label"]) for g in rows}, key=lambda a: (a[1] != "fixed", sort_key(a[0])))
        for key in metrics:
            cells = {(g["layer"], g["k"], g["mode"]): g for g in rows if g["metric"] == key}
            if cells:  # a GPT has no class-token NC1: no section
                sections.append({"experiment": exp, "recipe": recs[0]["recipe"], "metric": key, "label": labels[key],
                                 "layers": layer_order(recs), "cells": cells,
                                 "arms": [(k, mode, arm_label(kl, mode)) for k, mode, kl in arms]})
    return {"name": name, "title": spec.get("title", name), "fmt": spec.get("fmt", ".4g"), "sections": sections}


def cell_text(g, fmt: str) -> str:
    """'mean ± 2se (n)', 'mean (1)' for one seed, '' for no run."""
    if g is None:
        return ""
    spread = f" ± {format(2 * g['se'], fmt)}" if g["se"] is not None else ""
    return f"{format(g['mean'], fmt)}{spread} ({g['n']})"


def _grid(section: dict, fmt: str) -> tuple[list[str], list[list[str]]]:
    head = ["layer"] + [label for *_, label in section["arms"]]
    rows = [[layer] + [cell_text(section["cells"].get((layer, k, mode)), fmt) for k, mode, _ in section["arms"]]
            for layer in section["layers"]]
    return head, rows


_FOOTER = ("Cells: mean ± 2 standard errors (2 x sample std / sqrt(n)) over the n seeds of an arm; "
           "blocks.<i> is the residual stream after block i, norm the final norm (what the head reads).")


def to_markdown(table: dict) -> str:
    out = [f"### {table['name']}: {table['title']}", ""]
    if not table["sections"]:
        out += ["No analysed runs found (run python -m analysis checkpoint=<run>/ckpt/last.pt layers=all).", ""]
    for s in table["sections"]:
        head, rows = _grid(s, table["fmt"])
        out += [f"#### {s['experiment']}: {s['label']} ({s['recipe']})", "", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows), ""]
    return "\n".join(out + [_FOOTER]) + "\n"


def to_latex(table: dict, escape) -> str:
    """One LaTeX `table` (booktabs) per section; `escape` makes text LaTeX (analysis.tables passes its own)."""
    lines = [f"% {table['name']}: written by python -m analysis.tables; regenerate, do not edit"]
    for s in table["sections"]:
        head, rows = _grid(s, table["fmt"])
        lines += [r"\begin{table}[t]", r"\centering\small",
                  rf"\caption{{{escape(s['experiment'] + ': ' + s['label'] + ' at every layer')}}}",
                  r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}", r"\toprule", " & ".join(map(escape, head)) + r" \\",
                  r"\midrule", *(" & ".join(map(escape, r)) + r" \\" for r in rows), r"\bottomrule", r"\end{tabular}",
                  r"\par\footnotesize " + escape(_FOOTER), r"\end{table}"]
    return "\n".join(lines) + "\n"


def to_csv(table: dict) -> str:
    """One line per cell, full precision (repr), so the CSV equals the pooled values."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["experiment", "metric", "layer", "k", "mode", "mean", "std", "se", "n", "seeds", "recipe"])
    for s in table["sections"]:
        for layer in s["layers"]:
            for k, mode, _ in s["arms"]:
                g = s["cells"].get((layer, k, mode))
                if g is not None:
                    w.writerow([s["experiment"], s["metric"], layer, g["k_label"], mode, repr(g["mean"]),
                                *("" if g[x] is None else repr(g[x]) for x in ("std", "se")), g["n"],
                                " ".join(map(str, g["seeds"])), g["recipe"]])
    return buf.getvalue()
