"""The paper's tables from a folder of runs: one command, Markdown + LaTeX + CSV.

    python -m analysis.tables runs=runs/deit3/digits
    python -m analysis.tables runs=[runs/deit3,runs/gpt] out=reports/tables only=[supervised,lm]

Runs are found and pooled over seeds by analysis/runs.py (`collect`, `aggregate`: the mean and
spread come from analysis.stats). Each table of configs/tables.yaml is a pandas DataFrame written
to `out/<name>.{md,tex,csv}` (`to_markdown`, `to_latex`, `to_csv`): rows = model family x number
of Laplacian heads k (x mode when learned), cells "mean ± sd (n)", the paper's number and our
delta beside the cells of the paper's own model (analysis/paper.yaml; a run of another model is
not compared with it), a dagger on runs whose recipe is not the paper's. A `kind: per_block`
table has a section per experiment and metric: rows = layers, columns = k, cells "mean [95%
interval] (n)". Without `only`, also out/gates_<exp>.{md,csv} for runs with learned gates
(analysis/gates.py). stdout: the Markdown tables, then one `[tables] wrote <path>` line per file.

    from analysis.runs import collect
    from analysis.tables import render_tables
    render_tables(collect(["runs/deit3/digits"]), "reports/tables")
"""
import re
import statistics
from pathlib import Path
from typing import Callable, Optional

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from analysis.gates import write_gate_tables
from analysis.runs import (BLOCK_METRICS, GROUP_KEYS, aggregate, arm_key, collect, experiments,
                           layer_order, metric_value, per_block, runs_roots, sort_key)
from analysis.stats import interval_text
from train.cli import config_dir, hydra_entry
from laplace.errors import ConfigError
from laplace.io import atomic_write, write_json
from train.rundir import check_writable

PAPER = Path(__file__).with_name("paper.yaml")


# ----------------------------------------------------------------------------- recipes

def recipe_differences(facts: dict, recipe: dict) -> list[str]:
    """How a run's recipe differs from the paper's (`recipe`: family, dataset, epochs,
    global_batch_size, finetune; a key it leaves out is not compared)."""
    diffs = []
    if "family" in recipe and facts.get("family") != recipe["family"]:
        diffs.append(f"model {facts.get('family')}")
    allowed = recipe.get("dataset")
    if allowed is not None and facts.get("dataset") not in (allowed if isinstance(allowed, list) else [allowed]):
        diffs.append(f"dataset {facts.get('dataset')}")
    ft = f"ft{facts['img_size']}" if facts.get("init_from") else None  # DeiT-III's stage 2: "ft224"
    # a fine-tuned run is judged by the run it started from (the paper's 800 epochs)
    src, what = (facts.get("pretrain"), "pre-training ") if ft else (facts, "")
    if ("epochs" in recipe or "global_batch_size" in recipe) and src is None:
        diffs.append("pre-training run not found")
    elif src is not None:
        # a run cut by max_steps is named by its steps: its epoch counter would read as a full schedule
        step_limited = src.get("epochs") is None or (src is facts and facts.get("max_steps") is not None)
        if "epochs" in recipe and (step_limited or src.get("epochs") != recipe["epochs"]):
            diffs.append(f"{what}{src.get('steps')} steps" if step_limited else f"{what}{src['epochs']} epochs")
        if "global_batch_size" in recipe and src.get("global_batch_size") != recipe["global_batch_size"]:
            diffs.append(f"{what}batch {src.get('global_batch_size')}")
    if "finetune" in recipe and ft != recipe["finetune"]:
        diffs.append(f"fine-tuned at {facts.get('img_size')} px" if ft else f"no {recipe['finetune']} stage")
    return diffs


def load_paper(path=None) -> dict:
    """analysis/paper.yaml (or `path`) as plain data: source, recipes, tables, entries."""
    p = Path(path) if path else PAPER
    if not p.is_file():
        raise ConfigError(f"paper={p}: no such file; leave paper=null for analysis/paper.yaml")
    # plain data: the anchors of paper.yaml resolved, every entry a dict
    paper = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    for e in paper.get("entries", []):
        # the paper reports fixed Laplacian heads only
        e.setdefault("mode", "fixed")
    return paper


def load_specs(only=None, specs=None) -> dict:
    """The table specs of configs/tables.yaml (or `specs`), restricted to `only`."""
    if specs is None:
        specs = OmegaConf.to_container(OmegaConf.load(config_dir("tables") / "tables.yaml"))["tables"]
    if only:
        bad = [n for n in only if n not in specs]
        if bad:
            raise ConfigError(f"only={list(only)}: no table {bad[0]!r}; tables: {', '.join(specs)}")
        specs = {n: specs[n] for n in only}
    # (a bad spec stops the command before it writes half of the tables)
    for n, spec in specs.items():  # before any table is written
        if spec.get("kind", "runs") not in ("runs", "per_block"):
            raise ConfigError(f"tables.{n}.kind={spec['kind']}: unknown; use runs (the default) or per_block")
    return specs


# ----------------------------------------------------------------------------- building a table

def _matches(record: dict, where: dict) -> bool:
    # every field must match: a spec's `where: {trainer: deit3, dataset: [cifar10, cifar100]}`;
    # as text: a YAML value and a record's value may differ in type only (7 vs "7")
    return all(str(record.get(field)) in map(str, want if isinstance(want, list) else [want])
               for field, want in (where or {}).items())


def _columns(spec: dict, recs: list[dict], entries: list[dict]) -> list[dict]:
    """The column specs: as listed, or one per value of a record field (`from:`), the
    `order` ones first, then the paper's, then the rest sorted."""
    cols = spec["columns"]
    if isinstance(cols, list):  # listed: the table's own columns (the LM's benchmarks, the geometry's objects)
        return [dict(c) for c in cols]
    field, labels = cols["from"], cols.get("labels") or {}
    values = list(cols.get("order") or [])
    # the paper's columns always appear (empty cells tell the reader what is missing)
    values += [e["column"] for e in entries if e["column"] not in values]
    values += sorted({str(r.get(field)) for r in recs} - set(values))
    return [{"name": v, "label": labels.get(v, v), "metric": cols["metric"], "scale": cols.get("scale", 1),
             "fmt": cols.get("fmt"), "where": {field: v}} for v in values]


def _column_value(col: dict, by_name: dict) -> Callable[[dict], Optional[float]]:
    """A record -> the column's number: its metric x scale, else the mean of `mean_of`."""
    parts = col.get("mean_of") or []
    for n in parts:
        if n not in by_name:
            raise ConfigError(f"tables: column {col['name']!r} has mean_of [{n}], not a column of its table")

    def value(r):
        v = metric_value(r, col["metric"]) if col.get("metric") else None
        if v is not None:
            return v * col.get("scale", 1)
        # a derived column (the benchmark average) only where a run has every part
        vals = [_column_value(by_name[n], by_name)(r) for n in parts]
        return statistics.fmean(vals) if vals and None not in vals else None
    return value


def build_table(name: str, spec: dict, records: list[dict], paper: dict) -> dict:
    """One table: {name, title, rows_by, columns, fmt, spec, notes, n_runs, paper_source, sources,
    cells}; cells is a DataFrame with a row per (table row, column): the rows_by fields, model,
    k, k_label, mode, column, mean, sd, n, seeds, paper, delta, marks (footnote numbers), row_marks
    (those every filled cell of its row carries) and recipe. Table rows are keyed by (rows_by
    fields, family, mode, k); the paper's rows are added where no run of its model fills them.

    Args:
        name: the table's name (paper entries refer to it).
        spec: its spec (see configs/tables.yaml).
        records: finished runs from `collect`.
        paper: from `load_paper`.
    """
    recs = [r for r in records if _matches(r, spec.get("where"))]
    entries = [e for e in paper.get("entries", []) if e["table"] == name]
    rows_by = list(spec.get("rows_by") or [])
    columns = _columns(spec, recs, entries)
    by_name = {c["name"]: c for c in columns}
    # a table row is (rows_by fields, family, mode, k); seeds of one recipe pool into a cell, another
    # recipe of the same row is footnoted beside it, never pooled
    groups: dict = {}  # (row key, column) -> aggregate rows
    by = tuple(dict.fromkeys((*GROUP_KEYS, *rows_by)))  # rows_by splits the pool too ([seed]: a row per seed)
    for col in columns:
        col_recs = [r for r in recs if _matches(r, col.get("where"))]
        for g in aggregate(col_recs, _column_value(col, by_name), by).to_dict("records"):
            key = tuple(g[f] for f in (*rows_by, "family", "mode", "k"))
            groups.setdefault((key, col["name"]), []).append(g)
    keys = {key for key, _ in groups}
    for e in entries:  # a row for each paper number no run of the paper's model sits beside
        fixed = {f: e["recipe"].get(f) for f in rows_by if not isinstance(e["recipe"].get(f), (list, type(None)))}
        # (the paper's row joins a row of its own model only: its family, mode and k)
        if not any(k[-3:] == (e["recipe"]["family"], e["mode"], e["k"])
                   and all(k[rows_by.index(f)] == v for f, v in fixed.items()) for k in keys):
            keys.add((*[fixed.get(f) for f in rows_by], e["recipe"]["family"], e["mode"], e["k"]))
    notes: dict = {}

    def mark(text):
        return notes.setdefault(text, len(notes) + 1)

    cells = []
    for key in sorted(keys, key=lambda k: tuple(sort_key(v) for v in k)):
        family, mode, k = key[-3:]
        row = []
        for col in columns:
            # one recipe per cell: a fine-tuning (the later stage of a run here) first, then most seeds
            # (several recipes in one cell: e.g. DeiT-III's stage 1 at 192 px and its fine-tuning at 224)
            found = sorted(groups.get((key, col["name"]), []), key=lambda g: (
                bool(g["runs"][0].get("init_from")), g["n"], g["runs"][0].get("steps") or 0))
            entry = next((e for e in entries if e["column"] == col["name"] and e["k"] == k and e["mode"] == mode), None)
            cell = {**dict(zip(rows_by, key)), "model": family, "k": k,
                    "k_label": "[" + ",".join(map(str, k)) + "]" if isinstance(k, tuple) else str(k), "mode": mode,
                    "column": col["name"], "mean": None, "sd": None, "n": None, "seeds": None, "paper": None,
                    "delta": None, "marks": [], "recipe": None}
            if found:
                g = found.pop()  # the others are footnoted, never pooled
                # (one seed has no sd: an empty field, never 0)
                cell.update(mean=g["mean"], sd=None if g["n"] < 2 else g["sd"], n=g["n"], seeds=g["seeds"],
                            recipe=g["recipe"])
                recipe = (entry or next((e for e in entries if e["column"] == col["name"]), {})).get("recipe") \
                    or paper.get("tables", {}).get(name)
                diffs = recipe_differences(g["runs"][0], recipe) if recipe else []
                if diffs:
                    cell["marks"].append(mark(f"recipe differs: {', '.join(diffs)} (runs: {g['recipe']}); "
                                              f"the paper's: {recipe.get('text', recipe)}"))
                for other in found:
                    cell["marks"].append(mark(f"not pooled with runs of another recipe ({other['recipe']}): "
                                              f"{_stat(other, col.get('fmt') or spec.get('fmt', '.3f'))}"))
            # the paper's number (and our delta) only in its own model's row: a 2-layer toy beside
            # the paper's depth-20 model is not a comparison
            if entry and family == entry["recipe"].get("family"):
                cell["paper"] = entry["value"]
                cell["delta"] = None if cell["mean"] is None else cell["mean"] - entry["value"]
            row.append(cell)
        # a mark every filled cell of a row carries is shown once, on the model name
        filled = [c["marks"] for c in row if c["n"]]
        # (a miniature row differs from the paper's recipe in every column: one dagger, not six)
        common = [m for m in filled[0] if all(m in f for f in filled)] if len(filled) > 1 else []
        cells += [{**c, "row_marks": common} for c in row]
    # optional columns (benchmarks) appear once a run or the paper fills them
    shown = [c for c in columns if not c.get("optional")
             or any(x["column"] == c["name"] and (x["n"] or x["paper"] is not None) for x in cells)]
    src = paper.get("source", {})
    return {"name": name, "title": spec.get("title", name), "rows_by": rows_by, "columns": shown,
            "fmt": spec.get("fmt", ".3f"), "spec": spec, "notes": list(notes), "n_runs": len(recs),
            "paper_source": f"arXiv:{src.get('arxiv')} {src.get('version', '')}".strip(),
            "sources": list(dict.fromkeys(e.get("source", "") for e in entries if e.get("source"))),
            # object: a missing value stays None, not NaN; the columns even when no row has a cell
            "cells": pd.DataFrame(cells, columns=[*rows_by, "model", "k", "k_label", "mode", "column", "mean", "sd",
                                                  "n", "seeds", "paper", "delta", "marks", "recipe", "row_marks"],
                                  dtype=object)}


# ----------------------------------------------------------------------------- rendering

def _stat(cell: dict, fmt: str) -> str:
    """'mean ± sd (n)'; '' for a missing cell (never 0)."""
    if not cell.get("n"):
        return ""
    sd = f" ± {format(cell['sd'], fmt)}" if cell["n"] > 1 else ""
    return f"{format(cell['mean'], fmt)}{sd} ({cell['n']})"


def cell_text(cell: dict, fmt: str, skip=()) -> str:
    """A cell as text: 'mean ± sd (n)†1 · paper 81.45, Δ −0.12' (marks in `skip` left out)."""
    text = _stat(cell, fmt) + "".join(f"†{m}" for m in cell["marks"] if m not in skip)
    if cell["paper"] is not None:
        p = f"paper {format(cell['paper'], fmt)}"
        if cell["delta"] is not None:
            d = format(abs(cell["delta"]), fmt)  # the sign of what is printed: no "−0.00"
            p += f", Δ {'−' if cell['delta'] < 0 and float(d) != 0 else '+'}{d}"
        text = f"{text} · {p}" if text else p
    return text


def grid(table: dict) -> pd.DataFrame:
    """The table as text cells, one row per table row (what Markdown and LaTeX show)."""
    c = table["cells"]
    if c.empty:
        return pd.DataFrame(columns=[*table["rows_by"], "model", "k"])
    fmts = {col["name"]: col.get("fmt") or table["fmt"] for col in table["columns"]}
    # a row's common marks are shown once, on its model name; a mode column only when some arm is learned
    index = [*table["rows_by"], "model", "k"] + (["mode"] if (c["mode"] != "fixed").any() else [])
    c = c.assign(k=c["k_label"])
    c["text"] = [cell_text(x, fmts.get(x["column"], table["fmt"]), x["row_marks"]) for x in c.to_dict("records")]
    c["model"] = [m + "".join(f"†{i}" for i in marks) for m, marks in zip(c["model"], c["row_marks"])]
    for b in table["rows_by"]:  # as text: a field a row leaves open is an empty cell
        c[b] = ["" if v is None else str(v) for v in c[b]]
    # long -> wide in the rows' order (pivot would sort them), a column per shown column, by its label
    rows = pd.MultiIndex.from_tuples(list(dict.fromkeys(zip(*(c[i] for i in index)))), names=index)
    wide = c.set_index(index).pivot(columns="column", values="text").reindex(rows)
    wide = wide.reindex(columns=[col["name"] for col in table["columns"]])
    wide.columns = [col.get("label", col["name"]) for col in table["columns"]]
    return wide.reset_index()


def _footer(table: dict) -> list[str]:
    lines = [f"†{i} {text}" for i, text in enumerate(table["notes"], 1)]
    if not table["n_runs"]:
        where = ", ".join(f"{k}={v}" for k, v in (table["spec"].get("where") or {}).items())
        lines.append(f"No runs found for this table ({where or 'any run'}): only the paper's numbers are shown.")
    lines.append("Cells: mean ± sample sd (number of seeds) of the runs that differ only in their seed; the "
                 "paper's number and Δ only beside the paper's own model.")
    if table["sources"]:
        lines.append(f"Paper ({table['paper_source']}): " + "; ".join(table["sources"]) + ".")
    return lines


def markdown(title: str, frame: pd.DataFrame, footer: list[str], level: int = 3) -> str:
    """A titled Markdown table (tabulate via pandas; cells are text, never re-parsed as numbers)."""
    # disable_numparse: tabulate would re-read "81.35" as a number and reformat it
    body = frame.to_markdown(index=False, disable_numparse=True) if len(frame.columns) else ""
    return "\n".join(["#" * level + f" {title}", "", body, "", *footer]) + "\n"


_TEX = [("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("#", r"\#"), ("_", r"\_"), ("±", r"$\pm$"),
        ("Δ", r"$\Delta$"), ("−", r"$-$"), ("·", r"\quad"), ("~", r"\textasciitilde{}")]


def _tex(text: str) -> str:
    for a, b in _TEX:
        text = text.replace(a, b)
    return re.sub(r"†(\d+)", r"$^{\\dagger\1}$", text)


def latex(name: str, title: str, frame: pd.DataFrame, footer: list[str], label: bool = True) -> str:
    """A LaTeX `table` (booktabs) by pandas' to_latex; our escapes for ±, Δ and the daggers."""
    # escape=False: our own escapes, which also turn ±, Δ and the daggers into maths
    # booktabs by pandas; every cell and header through _tex first
    text = frame.rename(columns=_tex).map(_tex).to_latex(
        index=False, escape=False, caption=_tex(title), label=f"tab:{name.replace('_', '-')}" if label else None,
        column_format="l" * (len(frame.columns) - 1) + "r")
    notes = "".join(r"\par\footnotesize " + _tex(f) + "\n" for f in footer)
    return f"% {name}: written by python -m analysis.tables; regenerate, do not edit\n" + \
        text.replace("\\end{table}", notes + "\\end{table}")


def to_csv(table: dict) -> str:
    """One line per cell (long format), full precision; a missing value is an empty field."""
    c = table["cells"].copy()
    # the long form: one line per cell, every number at full precision, the footnotes spelt out
    c["seeds"] = c["seeds"].map(lambda s: " ".join(map(str, s or [])))
    c["notes"] = c["marks"].map(lambda ms: " | ".join(table["notes"][m - 1] for m in ms))
    # mean, sd and delta are written as Python floats (repr): the CSV equals the pooled values
    c["n"] = c["n"].astype("Int64")  # an empty cell stays empty, not "nan"; 2 stays "2", not "2.0"
    shown = {col["name"] for col in table["columns"]}
    cols = [*table["rows_by"], "model", "k_label", "mode", "column", "mean", "sd", "n", "seeds", "paper", "delta",
            "notes", "recipe"]
    c = c[c["column"].isin(shown)][cols].rename(columns={"k_label": "k", "sd": "std"})
    return c.to_csv(index=False, lineterminator="\n")


# ----------------------------------------------------------------------------- geometry at every block

_BLOCK_FOOTER = ("Cells: mean [95% t interval] (n seeds) of an arm; blocks.<i> is the residual stream after "
                 "block i, norm the final norm (what the head reads).")


def per_block_table(name: str, spec: dict, records: list[dict]) -> tuple[str, str, str]:
    """(Markdown, LaTeX, CSV) of a `kind: per_block` table: a section per experiment and metric
    (spec.metrics: keys of analysis.runs.BLOCK_METRICS), rows = layers, columns = arms, cells the
    mean [95% interval] (n) of analysis.runs.per_block; `records` already filtered by its `where`."""
    labels = dict(BLOCK_METRICS)
    metrics = list(spec.get("metrics") or labels)
    bad = [m for m in metrics if m not in labels]
    if bad:
        raise ConfigError(f"tables.{name}.metrics: {bad[0]!r} is not a per-block metric; choose from {list(labels)}")
    fmt, md, tex, parts = spec.get("fmt", ".4g"), [f"### {name}: {spec.get('title', name)}", ""], [], []
    for exp, recs in experiments([r for r in records if r.get("layer_geometry")]).items():
        f = per_block(recs, metrics)
        f = f.assign(experiment=exp, recipe=recs[0]["recipe"],
                     text=[interval_text(*v, fmt) for v in zip(f["mean"], f["lo"], f["hi"], f["n"])])
        parts.append(f)
        for metric, s in f.groupby("metric", sort=False):
            arms = [arm for _, arm in sorted(set(zip(map(arm_key, s["k"], s["mode"], s["attention"]), s["arm"])))]
            # long -> wide: rows = layers (the model's order, norm last), columns = arms; a layer no arm
            # measured is dropped
            g = s.pivot(index="layer", columns="arm", values="text").reindex(layer_order(recs)).reindex(columns=arms)
            g = g.dropna(how="all").fillna("").reset_index()
            md.append(markdown(f"{exp}: {labels[metric]} ({recs[0]['recipe']})", g, [], level=4))
            tex.append(latex(name, f"{exp}: {labels[metric]} at every layer", g, [_BLOCK_FOOTER], label=False))
    if not parts:
        md += ["No analysed runs found (run python -m analysis checkpoint=<run>/ckpt/last.pt layers=all).", ""]
    cols = ["experiment", "metric", "layer", "k_label", "mode", "mean", "sd", "se", "lo", "hi", "n", "seeds", "recipe"]
    sheet = pd.concat(parts)[cols] if parts else pd.DataFrame(columns=cols)
    sheet = sheet.assign(seeds=sheet["seeds"].map(lambda s: " ".join(map(str, s)))).rename(columns={"k_label": "k"})
    return "\n".join(md + [_BLOCK_FOOTER]) + "\n", "".join(tex), sheet.to_csv(index=False, lineterminator="\n")


# ----------------------------------------------------------------------------- the command

def render_tables(records: list[dict], out, specs: Optional[dict] = None, paper: Optional[dict] = None,
                  only=None, echo: bool = True) -> list[Path]:
    """Write every table of `specs` (default: configs/tables.yaml) to out/<name>.{md,tex,csv}.

    Args:
        records: from `collect` (unfinished runs are left out).
        out: the output folder.
        specs, paper: table specs and paper numbers (defaults: configs/tables.yaml, paper.yaml).
        only: table names to render (None: all).
        echo: print the Markdown tables to stdout.
    Returns the written paths.
    """
    specs, paper = load_specs(only, specs), paper or load_paper()
    out = Path(out)
    # a run still training has no final results: its numbers would mislead a table
    done = [r for r in records if r["finished"]]
    paths = []
    for name, spec in specs.items():
        # Markdown for reading, LaTeX for a paper, CSV for one's own analysis: the same numbers
        if spec.get("kind") == "per_block":
            md, tex, sheet = per_block_table(name, spec, [r for r in done if _matches(r, spec.get("where"))])
        else:
            table = build_table(name, spec, done, paper)
            g, foot = grid(table), _footer(table)
            md, tex, sheet = markdown(f"{name}: {table['title']}", g, foot), latex(name, table["title"], g, foot), \
                to_csv(table)
        if echo:
            print(md, flush=True)
        for ext, text in (("md", md), ("tex", tex), ("csv", sheet)):
            paths.append(atomic_write(out / f"{name}.{ext}", text.encode()))
    if not only:  # learned gates: a table per experiment, block x head (analysis/gates.py)
        paths += write_gate_tables(done, out, echo)
    return paths


def run(cfg: DictConfig) -> list[Path]:
    """Collect the runs of cfg.runs and write every table; returns the written paths."""
    roots = runs_roots(cfg)
    # checked before the runs are read: a read-only folder fails now, not after every table
    out = check_writable(Path(cfg.out) if cfg.out else roots[0] / "tables", "out")
    skipped: list[str] = []
    records = collect(roots, skipped)
    for line in skipped:
        print(f"[tables] {line}", flush=True)
    if not records:
        raise ConfigError(f"runs={','.join(map(str, roots))}: no run directories in it"
                          + (f" ({len(skipped)} left out, see above)" if skipped else "")
                          + "; pass the folder train.py wrote them to, e.g. runs=runs/deit3/digits")
    unfinished = [r["run_dir"] for r in records if not r["finished"]]
    print(f"[tables] {len(records)} runs under {', '.join(map(str, roots))}"
          + (f" ({len(unfinished)} unfinished, left out)" if unfinished else ""), flush=True)
    for r in records:  # e.g. an analysis of last.pt from before a resume, not used
        for note in r["notes"]:
            print(f"[tables] note: {note}", flush=True)
    specs = OmegaConf.to_container(cfg.tables, resolve=True)
    paths = render_tables(records, out, specs=specs, paper=load_paper(cfg.paper),
                          only=list(cfg.only) if cfg.only else None)
    # (the records are plain data: a table can be rebuilt, or checked, without the run folders)
    # what the tables were made from, for a later look
    rec_path = write_json(out / "records.json", records, indent=1)
    for p in paths + [rec_path]:
        print(f"[tables] wrote {p}", flush=True)
    return paths


main = hydra_entry("tables")(run)


if __name__ == "__main__":
    main()
