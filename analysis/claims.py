"""A plan's claims, decided from per-seed values: one value per run and claim (`select`), the
per-seed values a report writes as per_seed.csv and reads back (`per_seed`, `read_per_seed`), each
claim's paired test with Holm's correction in its family and the verdict at the level that decides
it (`claim_rows`), and their tables (`claims_table`, `per_seed_tables`). analysis/report.py writes
them into a study's report; a plan is configs/plan/<name>.yaml (`check_plan`).
"""
import json
import math
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from analysis.runs import attention as attention_of
from analysis.stats import decisive_level, describe, holm, interval_text, paired, verdict
from laplace.errors import ConfigError

# A plan's keys: a misspelt one (famly: role) would otherwise change nothing and pass unseen
PLAN_KEYS = {"name", "title", "scope", "command", "family", "sensitivity", "paradigms", "claims", "steps",
             "equal_loss", "declared"}


def md_table(df: pd.DataFrame) -> str:
    # (text cells as they are: tabulate would re-read "0.50" as a number and reformat it)
    return df.to_markdown(index=False, disable_numparse=True) if len(df) else "(no runs)"


def check_plan(plan) -> None:
    """Refuse a plan whose claims name an undeclared paradigm or family rule, in one line."""
    # checked before any number is read: a bad plan is one line, not a traceback halfway
    bad = set(plan) - PLAN_KEYS
    if bad:
        raise ConfigError(f"plan.{sorted(bad)[0]}: not a plan key; keys: {', '.join(sorted(PLAN_KEYS))}")
    for key in ("family", "sensitivity"):
        if plan[key] not in ("paradigm", "role", "all"):
            raise ConfigError(f"plan.{key}={plan[key]}: choose paradigm, role or all (the Holm families)")
    for i, c in enumerate(plan.claims):
        if c.paradigm not in plan.paradigms:
            raise ConfigError(f"plan.claims[{i}].paradigm={c.paradigm}: not in plan.paradigms "
                              f"({', '.join(plan.paradigms)})")


# ----------------------------------------------------------------------------- selecting values

def select(f: pd.DataFrame, metric: str, layer=None, step="final", last: int = 0) -> pd.DataFrame:
    """One value per run: `metric` at `layer` (None: not a layer's), of the final model
    (step="final": its results, its last analysis, or a log line at its last step) or of the
    checkpoint at `step`; with `last` > 0 (a claim's mean_last), the mean of its last `last` values."""
    g = f[(f["metric"] == metric) & (f["layer"].isna() if layer is None else f["layer"] == layer)]
    if last:  # e.g. the mean val bpb of the last four evaluations: less of one evaluation's noise
        tail = g.sort_values("step").groupby("run_dir").tail(last)
        tail = tail.assign(value=tail.groupby("run_dir")["value"].transform("mean"))
        return tail.drop_duplicates("run_dir", keep="last")
    # a logged metric (e.g. the training loss) is never "final": its line at the run's last step is
    g = g[g["final"] | (g["step"] == g["steps"])] if step == "final" else g[g["step"] == step]
    # a final row wins over a kept checkpoint's of the same step (e.g. eval/ and ckpt/step_N_knn/)
    return g.sort_values("final", kind="stable").drop_duplicates("run_dir", keep="last")


def claim_values(f: pd.DataFrame, plan, c) -> pd.DataFrame:
    """A claim's one value per run: its metric at its layer, of the final model unless it names a
    step, or the mean of its last values (mean_last)."""
    p = paradigm_runs(f, plan, c.paradigm)
    return select(p, c.metric, c.get("layer"), c.get("step", "final"), c.get("mean_last", 0))


def arm_of(arm) -> tuple:
    """(k, attention) of a plan's `arm`: k Laplacian heads (an int) with softmax attention, or
    {attention: <arm>} at k = 0 (configs/plan/arms.yaml); the baseline is 0, softmax at k = 0."""
    if isinstance(arm, (dict, DictConfig)):
        return arm.get("k", 0), arm["attention"]
    return arm, "softmax"


def arm_text(arm) -> str:
    """How a table names an arm: "k=3", or its attention ("xsa")."""
    k, attention = arm_of(arm)
    return f"k={k}" if attention == "softmax" else attention if k == 0 else f"k={k} {attention}"


def by_seed(g: pd.DataFrame, arm) -> dict:
    """{seed: value} of the fixed-mode runs of `arm` (`arm_of`: learned gates are their own arm,
    and so is each attention at k = 0: a claim compares its arm with softmax at k = 0)."""
    k, attention = arm_of(arm)
    sel = g[(g["k"] == k) & (g["mode"] == "fixed") & (attention_of(g) == attention)]
    return dict(zip(sel["seed"], sel["value"]))


def paired_test(g: pd.DataFrame, arm):
    """The paired test of `arm` against softmax k = 0 over one value per run, None without a common
    seed (a claim not measured is said so, never read as inconclusive)."""
    base, arm = by_seed(g, 0), by_seed(g, arm)
    return paired(base, arm) if set(base) & set(arm) else None


def d_text(t) -> str:
    return "" if t is None else interval_text(t.d, t.lo, t.hi, t.n, signed=True)


def paradigm_runs(f: pd.DataFrame, plan, name: str) -> pd.DataFrame:
    # a paradigm's runs: the folder its experiment config names (runs/<trainer>/<experiment>/...)
    return f[f["experiment"] == plan.paradigms[name].experiment]


# ----------------------------------------------------------------------------- the claims

def claim_rows(f: pd.DataFrame, plan) -> pd.DataFrame:
    """Every claim of the plan tested: its fields, k, the arms' Summaries (base, arm), the Paired
    test, family, Holm's p in it, the level of the interval that decides it, the verdict; and under
    the sensitivity's other family choice its Holm p, level and verdict (sens_p, sens_level,
    sens_verdict)."""
    rows = []
    for c in plan.claims:  # in the plan's order: the tables show them as declared
        p = plan.paradigms[c.paradigm]
        g = claim_values(f, plan, c)
        # a claim may name its own arm (the LM's spectrum: all heads; the arms study: an attention)
        k = c.get("arm", p.arm)
        base, arm, test = by_seed(g, 0), by_seed(g, k), paired_test(g, k)
        rows.append({**OmegaConf.to_container(c), "layer": c.get("layer"), "role": c.get("role", "primary"),
                     "k": k if arm_of(k)[1] == "softmax" else arm_text(k), "heads": p.get("heads"),
                     "base": describe(base.values()) if base else None,
                     "arm": describe(arm.values()) if arm else None, "test": test,
                     "p": test.p if test else math.nan, "ran": not paradigm_runs(f, plan, c.paradigm).empty})
    out = pd.DataFrame(rows)
    if out.empty:  # a plan without claims still gets its descriptions
        return out
    # a family is the rows sharing these fields; Holm adjusts within it only: the declared choice,
    # and the other as the sensitivity (configs/plan/*.yaml)
    family = {"paradigm": ["paradigm", "role"], "role": ["role"], "all": []}
    for col, choice in (("family", plan.family), ("sens", plan.sensitivity)):
        keys = family[choice]
        out[col] = out[keys].astype(str).agg(" / ".join, axis=1) if keys else "all"
        out[f"{col}_p"] = out.groupby(col)["p"].transform(lambda ps: holm(list(ps)))
        # each verdict beside the interval at the level that decides it (stats.decisive_level)
        out[f"{col}_level"] = [decisive_level(p, hp) for p, hp in zip(out["p"], out[f"{col}_p"])]
        # a paradigm with no runs at all (the GPT arms not trained yet): "not run", not "not measured"
        out[f"{col}_verdict"] = [verdict(t, s, hp, level=lv) if ran else "not run" for t, s, hp, lv, ran in
                                 zip(out["test"], out["sign"], out[f"{col}_p"], out[f"{col}_level"], out["ran"])]
    return out.rename(columns={"family_p": "holm_p", "family_verdict": "verdict", "family_level": "level"})


def _p(p: float) -> str:
    return "" if math.isnan(p) else f"{p:.2g}" if p >= 1e-4 else "<1e-4"


def mean_text(s) -> str:
    """An arm's 'mean ± sd (n)'."""
    return "" if s is None else f"{s.mean:.4g}" + ("" if s.n < 2 else f" ± {s.sd:.2g}") + f" ({s.n})"


def claims_table(rows: pd.DataFrame, sensitivity: bool = False) -> pd.DataFrame:
    """The claims as text: paradigm, claim, definition, layer, k, both arms, d [95% interval] (n, df),
    p, Holm's p in its family, the verdict with the interval at its level (or, with `sensitivity`,
    the other family choice's too)."""
    out = []
    for r in rows.to_dict("records"):  # text cells: the numbers at the precision a reader needs
        # "3 of 3": the arm beside the paper's (ViT-B-12L: all heads; its LM: 5 of 10)
        t, k = r["test"], f"{r['k']}" + (f" of {r['heads']}" if r.get("heads") and not isinstance(r["k"], str) else "")
        row = {"paradigm": r["paradigm"], "claim": r["claim"], "definition": r["definition"],
               # pandas' string columns hold a missing layer as NaN, not None
               "layer": r["layer"] if isinstance(r["layer"], str) else "model output", "k": k,
               "baseline": mean_text(r["base"]), "arm": mean_text(r["arm"]),
               "d [95% CI] (n, df)": d_text(t),
               "t": "" if t is None or t.n < 2 else f"{t.t:+.2f}", "p": _p(r["p"])}
        if sensitivity:
            row.update({"family (declared)": r["family"], "Holm p": _p(r["holm_p"]), "verdict": r["verdict"],
                        "family (other choice)": r["sens"], "Holm p, other": _p(r["sens_p"]),
                        "verdict, other": r["sens_verdict"]})
        else:
            row.update({"family": r["family"], "Holm p": _p(r["holm_p"]), "verdict": f"**{r['verdict']}**"})
        out.append(row)
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------- per-seed values

# The columns of <out>/per_seed.csv: the tidy table's (analysis.runs.frame) that the claims, the
# per-seed tables and the curves read, the run's provenance (its commit, its resumes as
# "step@commit") and `source` (empty for values read from runs; committed values say where from).
PER_SEED = ["experiment", "run_dir", "k", "k_label", "mode", "attention", "seed", "steps", "metric", "layer", "step",
            "final", "value", "commit", "resumes", "source"]


def _provenance(run_dir: str) -> tuple:
    """(commit, resumes) of a run's results.json (train/engine.py writes them; older runs: none)."""
    path = Path(run_dir) / "results.json"
    r = json.loads(path.read_text()) if path.is_file() else {}
    return r.get("commit"), " ".join(f"{x['step']}@{x.get('commit')}" for x in r.get("resumes", []))


def per_seed(f: pd.DataFrame, plan) -> pd.DataFrame:
    """The per-seed values the report's claims, per-seed tables and curves are computed from (PER_SEED
    columns): each claim's metric at its layer, of the final model and at the plan's kept steps, and
    each paradigm's curve metric at every step."""
    steps = list(plan.get("steps") or [])
    keep = f["metric"].isin([p.curve for p in plan.paradigms.values()])
    for c in plan.claims:
        at = f["layer"].isna() if c.get("layer") is None else f["layer"] == c.layer
        when = f["final"] | (f["step"] == f["steps"]) | f["step"].isin(steps) | bool(c.get("mean_last"))
        keep |= (f["metric"] == c.metric) & at & when
    out = f[keep & f["experiment"].isin([p.experiment for p in plan.paradigms.values()])].copy()
    prov = {d: _provenance(d) for d in out["run_dir"].unique()}
    out["commit"], out["resumes"] = (out["run_dir"].map(lambda d, i=i: prov[d][i]) for i in (0, 1))
    return out.assign(source="").reindex(columns=PER_SEED).sort_values(["experiment", "metric", "k", "seed", "step"])


def read_per_seed(path: Path) -> pd.DataFrame:
    """A per_seed.csv as the tidy table's columns: an empty cell is NaN (no layer: a result of the
    model output; no commit or resume recorded)."""
    return pd.read_csv(path, dtype={"k_label": str, "layer": object})


def per_seed_tables(ps: pd.DataFrame, plan) -> list[str]:
    """Markdown: per claim with per-seed values, a row per seed (the baseline, the arm, d), and
    the runs' resumes; every row from the per-seed values, nothing typed."""
    lines = []
    for c in plan.claims:
        g = claim_values(ps, plan, c)
        k = c.get("arm", plan.paradigms[c.paradigm].arm)
        base, arm = by_seed(g, 0), by_seed(g, k)
        if not base and not arm:
            continue
        rows = [{"seed": s, "k=0": f"{base[s]:#.5g}" if s in base else "",
                 arm_text(k): f"{arm[s]:#.5g}" if s in arm else "",
                 "d": f"{arm[s] - base[s]:+.4f}" if s in base and s in arm else "",
                 # where a run of this seed stopped and went on: a resume is part of what the value is
                 "resumed (arm: step@commit)": "; ".join(f"k={r.k}: {r.resumes}" for r in g[g["seed"] == s].itertuples()
                                                         if isinstance(r.resumes, str) and r.resumes)}
                for s in sorted(set(base) | set(arm))]
        lines += [f"**{c.claim}** ({c.definition}{', ' + c.layer if c.get('layer') else ''})", "",
                  md_table(pd.DataFrame(rows)), ""]
    sources = sorted(set(ps["source"].dropna()) - {""})
    return lines + [f"Source of the committed values: {s}" for s in sources] + ([""] if sources else [])
