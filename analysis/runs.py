"""Runs found under folders, as records and as one tidy table: what every table, figure and
report of analysis/ reads.

    from analysis.runs import aggregate, collect, frame, per_block
    records = collect(["runs/deit3/digits"])      # one flat record per run directory
    frame(records)                                # a DataFrame row per (run, metric, layer, step)
    aggregate(records, "final.val_acc1")          # a row per group of seeds: mean, sd, n, [lo, hi]
    per_block(records)                            # the same per layer and headline geometry key

Every folder that holds a run's config.yaml (or a results.json) is one run; its results.json (and
its evaluations'), metrics.jsonl and every ckpt/<name>_analysis/analysis.json that `python -m
analysis` wrote become one record. Runs that differ only in their seed are pooled by
analysis.stats; runs of another recipe never are (recipe_id). The geometry is read at the final
norm ("geometry.<key>") or at any measured layer ("geometry@blocks.<i>.<key>").
"""
import glob
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import pandas as pd
from omegaconf import OmegaConf

from analysis.geometry import geometry, layer_geometry, mechanism_summary  # noqa: F401 (analysis.runs.geometry)
from analysis.stats import summarize
from train.config import flatten, required_list
from laplace.errors import ConfigError
from train.rundir import EXECUTION_KEYS

# Runs sharing all of these are seeds of one experiment (recipe_id: the config without seeds).
GROUP_KEYS = ("trainer", "dataset", "family", "k", "mode", "attention", "recipe_id")
_SKIP_DIRS = {"__pycache__", "wandb"}
Metric = Union[str, Iterable[str], Callable[[dict], Optional[float]]]
_AT_LAYER = re.compile(r"geometry@(norm|blocks\.\d+)\.(.+)")
_MECH_AT_LAYER = re.compile(r"mechanism@(blocks\.\d+)\.(.+)")


# ----------------------------------------------------------------------------- collecting

def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or being written by a live run (read on the next call)
        return None


def _read_yaml(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the YAML file as a dict, None), or (None, why it could not be read)."""
    try:
        obj = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # noqa: BLE001 (truncated, not YAML, unreadable)
        return None, (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    return (obj, None) if isinstance(obj, dict) else (None, "not a mapping")


def find_runs(roots: Iterable) -> list[tuple[Path, Optional[str]]]:
    """(folder, None or why its config.yaml cannot be read) of the run directories under `roots`:
    folders with a run's config.yaml (one with a `model` node), or a results.json outside any
    such folder, and folders whose config.yaml cannot be read; sorted."""
    runs: dict = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            # sorted: the same records in the same order on every machine (os.walk's order is the file system's)
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
            d = Path(dirpath).resolve()  # overlapping roots (runs=[runs,runs/deit3]) count a run once
            cfg, why = _read_yaml(d / "config.yaml") if "config.yaml" in filenames else ({}, None)
            # a results.json inside a run (e.g. an evaluation's) belongs to that run
            inside = any(p in runs for p in d.parents)
            if "model" in (cfg or {}) or ("results.json" in filenames and not inside) or why is not None:
                runs.setdefault(d, why)
    return sorted(runs.items())


def flat_metrics(obj: dict) -> dict:
    """Numeric leaves of a results.json: nested blocks dotted ("final.val_acc1") by pandas'
    json_normalize (top-level fields first), a list of {"task", "metric", "value"} records as "task/metric"."""
    out = {}
    for key, v in pd.json_normalize(obj).to_dict("records")[0].items():
        # a bool is an int to Python, not a metric; NaN and inf are "not measured"
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
        elif isinstance(v, list):  # task records (lm-eval's, nanochat's CORE)
            out.update({f"{i['task']}/{i['metric']}" if i.get("metric") else str(i["task"]): float(i["value"])
                        for i in v if isinstance(i, dict) and "task" in i and isinstance(i.get("value"), (int, float))})
    return out


def model_family(name: str, model_cfg: dict) -> str:
    """The zoo name without its _{k}L suffix, tagged where the config changed the shape
    (vitt_3L with model.depth=2 embed_dim=48 -> "vitt_d2_w48"), so shapes never pool."""
    from laplace.zoo import model_defaults

    try:
        zoo = model_defaults(name)
    except ConfigError:  # not a zoo name (an outside trainer's model): the name less a _{k}L suffix
        return re.sub(r"_\d+L$", "", name)
    if zoo["arch"] == "gpt":  # the depth sets the width: it is the family
        return f"{zoo['name']}_d{model_cfg.get('depth', zoo.get('depth'))}"  # gpt_d20, gpt26_d12
    tags = [f"_{t}{model_cfg[key]}" for key, t in (("depth", "d"), ("embed_dim", "w"), ("num_heads", "h"))
            if key in model_cfg and model_cfg[key] != zoo[key]]
    return zoo["name"] + "".join(tags)


def _recipe_id(cfg: dict) -> str:
    """A hash of the config without what may vary between pooled runs: seed, where things are
    written or read from, how they execute, and the row's model name, k, mode and attention (the
    arms of one recipe: their runs are told apart by GROUP_KEYS, not by the recipe)."""
    skip = EXECUTION_KEYS + ("seed", "model.name", "model.num_laplacian_heads", "model.laplacian_mode",
                             "model.attention", "trainer.init_from")  # stage-1 paths carry the seed
    kept = {k: v for k, v in flatten(cfg).items() if not k.startswith(skip)}
    # whether a run fine-tunes still matters: stage 1 and stage 2 of one recipe never pool
    kept["finetuned"] = bool(cfg.get("trainer", {}).get("init_from"))
    return hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _pretrain(init_from) -> Optional[dict]:
    """Epochs / batch of the run a fine-tuning started from, when its folder is still there."""
    if not init_from:
        return None
    p = Path(str(init_from))
    for d in (p.parent.parent, p.parent):  # <run>/ckpt/last.pt, or a weights file in the run
        res = _read_json(d / "results.json")
        if res is not None:
            step_limited = ((_read_yaml(d / "config.yaml")[0] or {}).get("trainer") or {}).get("max_steps") is not None
            return {"epochs": None if step_limited else res.get("epochs"), "steps": res.get("steps"),
                    "global_batch_size": res.get("global_batch_size")}
    return None


def _analyses(d: Path) -> dict[int, dict]:
    """{step: analysis.json} of every analysed checkpoint of a run (ckpt/<name>_analysis/)."""
    out = {}
    for path in sorted((d / "ckpt").glob("*_analysis/analysis.json")):
        a = _read_json(path)
        # by step, not by file name: the report compares checkpoints of the same step across runs (a
        # later file of the same step, e.g. last.pt beside step_3000.pt, replaces nothing)
        if a is not None and a.get("step") is not None:
            out.setdefault(int(a["step"]), {**a, "path": str(path)})
    return out


def read_run(run_dir) -> Optional[dict]:
    """One run's flat record (see `collect`), or None when it names no model."""
    d = Path(run_dir)
    cfg = _read_yaml(d / "config.yaml")[0] or {}
    res = _read_json(d / "results.json")
    mcfg, tcfg, dcfg, r = cfg.get("model") or {}, cfg.get("trainer") or {}, cfg.get("data") or {}, res or {}
    name = r.get("model") or mcfg.get("name")  # results.json's word first: it is what the run did
    if not name:
        return None
    metrics = {}
    for sub in sorted(d.rglob("results.json"), key=lambda p: (len(p.parts), p)):  # its own first, then evaluations
        nested_run = sub.parent != d and (sub.parent / "config.yaml").exists()
        # evaluations of the final model (eval/*/results.json) join the run's metrics; those of kept
        # checkpoints (under ckpt/) are per step, below
        if "ckpt" not in sub.relative_to(d).parts[:-1] and not nested_run:
            metrics.update({k: v for k, v in flat_metrics(_read_json(sub) or {}).items() if k not in metrics})
    k = r.get("num_laplacian_heads", mcfg.get("num_laplacian_heads"))
    k = tuple(k) if isinstance(k, list) else k  # hashable: per-layer counts group like ints
    analyses = _analyses(d)
    # evaluations of kept checkpoints (e.g. the 20-NN of ckpt/step_110.pt in ckpt/step_110_knn/)
    step_metrics = {int(m[1]): flat_metrics(_read_json(p) or {})
                    for p in sorted((d / "ckpt").glob("step_*_*/results.json"))
                    for m in [re.fullmatch(r"step_(\d+)_.+", p.parent.name)] if m}
    # the final model's geometry: the analysis of the step the run ended at (last.pt's, or a kept
    # step_N.pt of the same step; an analysis of an earlier last.pt would mislabel it); a run still
    # training: its latest analysed checkpoint
    final = analyses.get(r.get("steps")) if res else analyses.get(max(analyses, default=None))
    # an analysis of last.pt from before a resume measured an earlier model: said, not used
    notes = [f"{a['path']}: of step {s}, the run ended at step {r.get('steps')}; not its final model "
             f"(re-run python -m analysis)" for s, a in analyses.items()
             if res and s != r.get("steps") and a["path"].endswith("/last_analysis/analysis.json")]
    layers = layer_geometry(final) if final else {}
    init_from = tcfg.get("init_from") or r.get("init_from")
    return {
        # experiment: the folder train.py names from experiment= (or the data's name)
        "run_dir": str(d), "experiment": d.parent.name, "trainer": tcfg.get("name") or r.get("trainer"),
        "dataset": r.get("dataset") or dcfg.get("name"),
        "model": name, "arch": "gpt" if name.startswith("gpt") else (final or {}).get("arch", "vit"),
        "family": model_family(name, mcfg), "k": k,
        "k_label": "[" + ",".join(map(str, k)) + "]" if isinstance(k, tuple) else str(k),
        "mode": r.get("laplacian_mode") or mcfg.get("laplacian_mode") or "fixed",
        # the attention arm (laplace.attention.ARMS); runs from before the arms: softmax
        "attention": r.get("attention") or mcfg.get("attention") or "softmax",
        "seed": r.get("seed", cfg.get("seed")), "steps": r.get("steps"), "epochs": r.get("epochs"),
        "max_steps": tcfg.get("max_steps"),
        "global_batch_size": r.get("global_batch_size", tcfg.get("global_batch_size")),
        "img_size": r.get("img_size", dcfg.get("img_size")), "init_from": init_from, "pretrain": _pretrain(init_from),
        "global_pool": mcfg.get("global_pool", "token"),
        "finished": res is not None, "recipe_id": _recipe_id(cfg) if cfg else "",
        "metrics": metrics, "geometry": layers.get("norm", {}), "layer_geometry": layers,
        "mechanism": mechanism_summary(final),
        # every analysed checkpoint: {step: {layer: geometry}} and {step: mechanism summary}
        "step_geometry": {s: layer_geometry(a) for s, a in analyses.items()},
        "step_mechanism": {s: mechanism_summary(a) for s, a in analyses.items()}, "step_metrics": step_metrics,
        # here, not where it was written (runs move)
        "checkpoint": str(d / "ckpt" / Path(str(r.get("checkpoint") or "last.pt")).name),
        "analysis": final["path"] if final else None, "analysis_step": final["step"] if final else None,
        "notes": notes,
    }


def recipe_tag(r: dict) -> str:
    """Short human tag of a record's recipe, e.g. 'deit3, 3 steps, batch 32, 32 px #1a2b3c4d'."""
    length = f"{r['steps']} steps" if r.get("max_steps") is not None or r.get("epochs") is None \
        else f"{r['epochs']} epochs"
    parts = [r.get("trainer") or "?", length]
    if r.get("global_batch_size"):
        parts.append(f"batch {r['global_batch_size']}")
    if r.get("arch") == "vit" and r.get("img_size"):
        parts.append(f"{r['img_size']} px" + (" fine-tuned" if r.get("init_from") else ""))
    return ", ".join(parts) + (f" #{r['recipe_id']}" if r.get("recipe_id") else "")


def collect(roots, skipped: Optional[list] = None) -> list[dict]:
    """Every run under `roots` (a folder or a list, searched recursively) as one flat record.

    A record: run_dir, experiment, trainer, dataset, model, arch, family, k (int, or a tuple for
    per-layer counts) and k_label, mode, attention (the arm: softmax, xsa, gated, diff), seed, steps,
    epochs, max_steps, global_batch_size, img_size, init_from, pretrain (facts of the run it
    fine-tuned from), finished (results.json exists), recipe_id, recipe (a readable tag), metrics
    ({key: float}, `flat_metrics`), geometry (at the final norm, `geometry`; {} when not analysed),
    layer_geometry (at every measured layer), mechanism (`mechanism_summary`), analysis and
    analysis_step (the final model's analysis.json and its step), step_geometry / step_mechanism /
    step_metrics (every analysed or evaluated checkpoint: {step: ...}) and notes. `skipped` (if
    given) gets a line for each run directory left out, saying why.
    """
    roots = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
    records = []  # finished or not: the tables leave the unfinished out, the curves draw them
    for d, why in find_runs(roots):  # why: None, or why its config.yaml cannot be read
        r = read_run(d)
        if r is not None:
            if why is not None:  # kept through its results.json
                r["notes"].append(f"{d / 'config.yaml'}: not readable ({why}); the run's recipe is unknown")
            records.append({**r, "recipe": recipe_tag(r)})
        elif skipped is not None:
            why = f"config.yaml not readable ({why})" if why else "its results.json names no model"
            skipped.append(f"{d}: {why}; left out")
    return records


# ----------------------------------------------------------------------------- the tidy table

def metric_value(record: dict, metric: Metric) -> Optional[float]:
    """A record's value of `metric`: a metrics key, "geometry.<key>" (at the final norm),
    "geometry@<layer>.<key>" (at a measured layer: "geometry@blocks.2.nc1"), "mechanism.<key>"
    (over all layers: "mechanism.cos_smooth.laplacian"), "mechanism@blocks.<i>.<key>", a list of
    keys (the first a run has: a results key spelt differently by two versions), or a function of
    the record. None when absent or not finite."""
    if callable(metric):  # a table's derived column (scaled, or the mean of others)
        v = metric(record)
        return v if v is None or math.isfinite(v) else None
    for key in ([metric] if isinstance(metric, str) else metric):
        if key.startswith(("geometry@", "mechanism@")):
            geo = key.startswith("geometry@")
            at = (_AT_LAYER if geo else _MECH_AT_LAYER).fullmatch(key)
            if at is None:
                raise ConfigError(f"metric {key!r}: write geometry@<layer>.<key> with layer norm or blocks.<i>, "
                                  f"e.g. geometry@blocks.2.nc1" if geo else
                                  f"metric {key!r}: write mechanism@blocks.<i>.<key>, "
                                  f"e.g. mechanism@blocks.0.cos_smooth.laplacian")
            v = (record.get("layer_geometry" if geo else "mechanism") or {}).get(at[1], {}).get(at[2])
        elif key.startswith(("mechanism.", "geometry.")):
            group, _, name = key.partition(".")
            v = (record.get(group) or {}).get(name)
        else:
            v = record["metrics"].get(key)
        # ("mechanism.blocks.1" is a layer, not a number)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None


def sort_key(v):
    """Sort key that puts None, numbers, strings and tuples apart (they do not compare): a column
    of mixed k (7 and [0,0,6,6]) still sorts."""
    if v is None:
        return (0, 0)
    if isinstance(v, (int, float)):
        return (1, v)
    return (3, v) if isinstance(v, tuple) else (2, str(v))


def arm_key(k, mode, attention: str = "softmax") -> tuple:
    """Sort key of an arm (k, mode, attention): the softmax arms (fixed by k, then learned), then
    the other attentions by name."""
    return attention != "softmax", attention, mode != "fixed", sort_key(k)


def arm_label(k_label: str, mode: str, attention: str = "softmax") -> str:
    """How a legend or a column names an arm: "k=3", "k=1 learned", "k=0 xsa"."""
    return f"k={k_label}" + "".join(f" {w}" for w, plain in ((mode, "fixed"), (attention, "softmax")) if w != plain)


def attention(rows: pd.DataFrame) -> pd.Series:
    """The attention arm of each row; softmax where a table from before the arms has none (an older
    per_seed.csv, a row made without it)."""
    return rows["attention"].fillna("softmax") if "attention" in rows else pd.Series("softmax", index=rows.index)


def arms(rows: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(arm label, its rows) per arm (k, mode, attention) of a slice of the tidy table, in `arm_key` order."""
    groups = sorted(rows.assign(attention=attention(rows)).groupby(["k", "mode", "attention"]),
                    key=lambda kv: arm_key(*kv[0]))
    return [(arm_label(part["k_label"].iloc[0], mode, att), part) for (_, mode, att), part in groups]



# The facts of a run that every row of the tidy table carries (what a group or a label needs).
FACTS = ("run_dir", "experiment", "trainer", "dataset", "family", "model", "arch", "k", "k_label", "mode", "attention",
         "seed", "steps", "recipe_id", "recipe", "finished")


def frame(records: list[dict], logs: bool = False) -> pd.DataFrame:
    """The runs as one tidy table, a row per (run, metric, layer, step): FACTS, step, epoch, layer,
    metric, value, final (the row is of the run's final model). metric is a results key (layer
    None, step the run's last; an evaluation of a kept checkpoint at its step), "geometry.<key>"
    (every analysed layer and checkpoint), "mechanism.<key>.<type>" (layer "all" or "blocks.<i>"),
    and with logs=True "log.<key>" of metrics.jsonl (every logged step, with its epoch)."""
    rows = []
    for r in records:
        facts = {f: r.get(f) for f in FACTS}
        last = r.get("analysis_step")
        # one row per number: pandas groups, pivots and writes it; nothing below knows a file layout
        rows += [{**facts, "step": r.get("steps"), "metric": m, "value": v, "final": True}
                 for m, v in r["metrics"].items()]
        rows += [{**facts, "step": step, "metric": m, "value": v, "final": False}  # evaluations of kept checkpoints
                 for step, ms in r.get("step_metrics", {}).items() for m, v in ms.items()]
        # the final analysis from layer_geometry, the record's own (a caller may have edited it)
        for step, layers in {**r.get("step_geometry", {}), last: r["layer_geometry"]}.items():
            rows += [{**facts, "step": step, "layer": layer, "metric": f"geometry.{key}", "value": v,
                      "final": step == last} for layer, g in layers.items() for key, v in g.items()]
        for step, s in {**r.get("step_mechanism", {}), last: r.get("mechanism") or {}}.items():
            # {"<key>.<type>": over all layers, "blocks.<i>": {"<key>.<type>": ...}}
            flat = [("all", k, v) for k, v in s.items() if not isinstance(v, dict)]
            flat += [(layer, k, v) for layer, d in s.items() if isinstance(d, dict) for k, v in d.items()]
            rows += [{**facts, "step": step, "layer": layer, "metric": f"mechanism.{k}", "value": v,
                      "final": step == last} for layer, k, v in flat]
        if logs and (Path(r["run_dir"]) / "metrics.jsonl").exists():
            from train.logger import read_metrics

            # metrics.jsonl: the learning curves (every logged value at its step and epoch)
            rows += [{**facts, "step": rec.get("step"), "epoch": rec.get("epoch"), "metric": f"log.{key}",
                      "value": float(v), "final": False} for rec in read_metrics(r["run_dir"])
                     for key, v in rec.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and key not in ("step", "epoch")]
    out = pd.DataFrame(rows, columns=[*FACTS, "step", "epoch", "layer", "metric", "value", "final"])
    out["attention"] = out["attention"].fillna("softmax")  # a record from before the arms
    # NaN and inf are "not measured" (a sequence without variance, a diverged run): no row
    out = out[out["value"].map(lambda v: v is not None and math.isfinite(v))]
    # a step logged twice (the run resumed before its last checkpoint) keeps the value of the run that went on
    return out.drop_duplicates(["run_dir", "metric", "layer", "step"], keep="last", ignore_index=True)


def aggregate(records: list[dict], metric: Metric, by: tuple = GROUP_KEYS) -> pd.DataFrame:
    """Pool the runs that share `by` (by default all but the seed) over their seeds: a row per
    group, sorted, with the `by` fields, analysis.stats.summarize's (mean, sd, se, n, df, lo, hi,
    values, seeds, run_dirs), runs (the records), and the recipe of its first run.
    Runs without `metric` (as in `metric_value`) are left out."""
    rows = [{**{f: r.get(f) for f in by}, "seed": r.get("seed"), "run_dir": r["run_dir"], "value": v, "run": r}
            for r in records for v in [metric_value(r, metric)] if v is not None]
    if not rows:
        return pd.DataFrame(columns=[*by, "mean", "sd", "n"])
    # groups in a stable order: the tables' rows do not depend on the order the runs were found
    rows.sort(key=lambda row: tuple(sort_key(row[f]) for f in by))
    flat = pd.DataFrame(rows)
    out = summarize(flat, by)
    out["runs"] = [list(g["run"]) for _, g in flat.groupby(list(by), dropna=False, sort=False)]
    out["recipe"] = [runs[0].get("recipe") for runs in out["runs"]]  # each group's, for a table's marks
    return out


def experiments(records: list[dict]) -> dict[str, list[dict]]:
    """Records by experiment (trainer, dataset, family, recipe): {"<dataset>_<family>": [...]}; a
    second recipe of one dataset and family gets its recipe id in the name, never pooled."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["trainer"], r["dataset"], r["family"], r["recipe_id"]), []).append(r)
    out = {}
    for key in sorted(groups, key=lambda k: tuple(map(str, k))):
        name = f"{key[1]}_{key[2]}"
        out[name if name not in out else f"{name}_{key[3]}"] = groups[key]
    return out


# The headline geometry of the per-block table and figure: (key of `geometry`, label). A key an
# architecture does not measure (a GPT has no class token and no classes of windows) is absent.
BLOCK_METRICS = (("within_seq_share", "within-sequence share"), ("between_class_share", "between-class share"),
                 ("nc1", "NC1 (class token)"), ("patch_nc1", "NC1 (image means of patch tokens)"),
                 ("lc_cdnv_mean", "CDNV (next-token classes)"), ("n_pcs_0.99", "PCs for 99% of the variance"),
                 ("per_seq_n_pcs_0.99", "PCs for 99% of one sequence's variance (mean over sequences)"))


def layer_order(records: list[dict]) -> list[str]:
    """Every layer some record measured: blocks by index, then "norm"."""
    names = {n for r in records for n in r.get("layer_geometry", {})}
    return sorted(names, key=lambda n: (n == "norm", int(n.split(".")[1]) if n != "norm" else 0))


def per_block(records: list[dict], metrics=None) -> pd.DataFrame:
    """The headline geometry of the final checkpoint at every measured layer, pooled over seeds as
    `aggregate` pools: a row per (group, layer, metric: a key of `geometry`) with the GROUP_KEYS
    fields, k_label, layer, metric, the summarize fields and arm (`arm_label`); layers in `layer_order`."""
    keys = [f"geometry.{k}" for k in (metrics or [k for k, _ in BLOCK_METRICS])]
    f = frame(records)  # one tidy table: the same numbers as the tables and the report
    # the final model's layers only (a run's kept checkpoints are the report's business)
    f = f[f["metric"].isin(keys) & f["layer"].notna() & f["final"]]
    order = {n: i for i, n in enumerate(layer_order(records))}
    f = f.assign(metric=f["metric"].str[len("geometry."):],
                 _o=f["layer"].map(order), _m=f["metric"].map(keys.index)).sort_values(["_m", "_o", "seed"])
    # (k_label: a function of k, a label only)
    out = summarize(f, [*GROUP_KEYS, "k_label", "layer", "metric"])
    return out.assign(arm=list(map(arm_label, out["k_label"], out["mode"], out["attention"])))


def expand(cfg, key: str, usage: str, what: str, hint: str, example: str) -> list[Path]:
    """The paths of `key=`: one, a list, or quoted glob patterns (sorted: the same order every
    time), each checked to exist; `what`: "folder", or "file" (an exported folder counts too)."""
    exists = Path.is_dir if what == "folder" else Path.exists
    paths = []
    for item in required_list(cfg, key, usage):
        # a quoted glob picks runs or checkpoints by name: a sweep's in one call
        found = [Path(p) for p in sorted(glob.glob(item)) if exists(Path(p))] if glob.has_magic(item) else [Path(item)]
        if not found:
            raise ConfigError(f"{key}={item}: the pattern matches no {what}; check it (quoted, e.g. {key}='{example}')")
        if not exists(found[0]):  # (a glob finds existing paths only: this is a plain one)
            raise ConfigError(f"{key}={item}: no such {what}; {hint}")
        paths += found
    if not paths:
        raise ConfigError(f"{key}=[]: give at least one; {usage}")
    return paths


def runs_roots(cfg, command: str = "analysis.tables") -> list[Path]:
    """The folders of `runs=`: a path, a list, or quoted glob patterns, each checked to exist."""
    return expand(cfg, "runs", what="folder", example="runs/deit3/digits/vitt_*",
                  usage=f"python -m {command} runs=DIR (or runs=[DIR1,DIR2], or a quoted glob "
                        f"runs='runs/deit3/digits/vitt_*'), folders holding run directories",
                  hint="pass runs=DIR holding run directories (each with config.yaml / results.json), e.g. "
                       "runs=runs/deit3/digits")
