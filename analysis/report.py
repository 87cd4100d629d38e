"""A study's report from its runs, by a plan declared before them: each claim decided by a
paired t over seeds on its primary object and layer, with its 95% interval and Holm's correction
within the declared families; the other readings, the learning curves, the geometry at every
block and checkpoint, the mechanism and the learned gates beside, as descriptions.

    python -m analysis.report runs=runs/miniature_study plan=study out=docs/miniature/study
    python -m analysis.report runs=runs/gpt/study_lm plan=study_lm out=docs/study_lm

    python -m analysis.report per_seed=docs/study_lm/per_seed.csv plan=study_lm out=docs/study_lm

A plan is configs/plan/<name>.yaml: its paradigms (which runs: the experiment folder, the arm k
compared with k = 0), its claims (metric, layer, direction, role: primary or secondary) and its
Holm families. Written to `out`: README.md (the report), per_seed.csv and per_seed.md (the per-seed
values the claims and curves are computed from, and their tables), tables/ (`python -m
analysis.tables`'s tables, claims.csv) and figures/ (`python -m analysis.figures`'s, curves.png).
Every number is a view of the runs' tidy table (analysis.runs.frame); the claims are decided in
analysis/claims.py; every mean, interval and test comes from analysis.stats. With per_seed= alone,
per_seed.md is written from that file (the runs gone).
"""
import datetime
import math
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from analysis.claims import (arm_text, by_seed, check_plan, claim_rows, claims_table, d_text, md_table, mean_text,
                             paired_test, paradigm_runs, per_seed, per_seed_tables, read_per_seed, select)
from analysis.curves import draw_curves, points
from analysis.runs import arms, collect, frame, layer_order, runs_roots
from analysis.stats import describe, interval_text
from train.cli import config_dir, hydra_entry
from laplace.errors import ConfigError
from laplace.io import atomic_write, write_json
from train.rundir import check_writable

# The mechanism's per-head numbers the report pools (analysis/mechanism.py), their labels and formats.
MECHANISM = (("cos_smooth", "cos(head's part, Px - x)", "+.3f"), ("dvar", "d within-seq. variance", "+.3g"),
             ("dvar_exact", "d variance, exact", "+.3g"), ("dshare", "d within-seq. share", "+.3g"),
             ("dshare_exact", "d share, exact", "+.3g"), ("out_norm", "|D| / |x|", ".3g"),
             ("neg_mass", "neg. eigen-mass (null 0.5)", ".3f"))


# ----------------------------------------------------------------------------- descriptions

def paired_grid(f: pd.DataFrame, plan, claims, columns: list, at) -> pd.DataFrame:
    """Rows = claims, columns = `columns`; a cell is the paired d [95% interval] (n) of the claim's
    metric at `at(claim, column)` = (layer, step): where an effect appears, no verdict."""
    rows = []
    for c in claims:  # the same paired d and interval as a claim's, no verdict
        k = c.get("arm", plan.paradigms[c.paradigm].arm)
        g = paradigm_runs(f, plan, c.paradigm)
        rows.append({"paradigm": c.paradigm, "definition": f"{c.definition} ({arm_text(k)})",
                     **{str(col): d_text(paired_test(select(g, c.metric, *at(c, col)), k)) for col in columns}})
    return pd.DataFrame(rows)


def arms_table(f: pd.DataFrame, plan, name: str) -> pd.DataFrame:
    """Every arm of a paradigm with the final value of each claim's metric: mean ± sd (n)."""
    # every claim's metric once, as it is declared: the arms' raw values beside the paired tests
    cols = list(dict.fromkeys((c.metric, c.get("layer"), c.definition) for c in plan.claims if c.paradigm == name
                              and c.get("step", "final") == "final"))
    rows, g = [], paradigm_runs(f, plan, name)
    for _, arm in arms(g):
        row = {"k": arm["k_label"].iloc[0], "mode": arm["mode"].iloc[0]}
        if (g["attention"] != "softmax").any():  # (a column only where a plan has other arms)
            row["attention"] = arm["attention"].iloc[0]
        for metric, layer, label in cols:
            v = select(arm, metric, layer)["value"]
            row[label + (f" @ {layer}" if layer and layer != "norm" else "")] = mean_text(describe(v)) if len(v) else ""
        rows.append(row)
    return pd.DataFrame(rows)


def curves_table(by_arm: dict) -> tuple[pd.DataFrame, list[str]]:
    """Rows = steps, columns = arms, mean [95% interval] (n); and per arm the change over the last
    quarter of training and the quarter before it (has the metric flattened?)."""
    table, lines = {}, []
    for label, by_step in by_arm.items():
        at = {s: describe(v) for s, v in by_step.items()}
        table[label] = {s: interval_text(d.mean, d.lo, d.hi, d.n, ".4g") for s, d in at.items()}
        st = sorted(at)
        if len(st) > 1:
            # the last quarter (from the first step at or after 75%) and the quarter before it: is it
            # still learning? a verdict on an undertrained model says little
            late = next(s for s in st if s >= 0.75 * st[-1])
            late = st[-2] if late == st[-1] else late  # never an empty quarter
            mid = min(next(s for s in st if s >= 0.5 * st[-1]), late)
            lines.append(f"- {label}: {at[st[-1]].mean - at[late].mean:+.4g} from step {late} to {st[-1]}"
                         + (f" (before: {at[late].mean - at[mid].mean:+.4g} from step {mid} to {late})"
                            if mid < late else ""))
    return pd.DataFrame(table).sort_index().fillna("").rename_axis("step").reset_index(), lines


def mechanism_table(f: pd.DataFrame, plan, name: str) -> pd.DataFrame:
    """Per analysed step (every kept checkpoint and the final model), arm and head type: each run's
    mean over the heads of all layers (one number per run, so seeds are the unit), then the mean
    [95% interval] (n, df) over seeds; the eigen-mass beside its 0.5 null."""
    g = paradigm_runs(f, plan, name)
    g = g[(g["layer"] == "all") & g["metric"].str.startswith("mechanism.")]
    rows = []
    for step, label, arm in ((s, *a) for s, at in g.groupby("step") for a in arms(at)):
        for t in ("softmax", "laplacian", "learned", "xsa", "gated", "diff"):  # the head types of mechanism.py
            row = {"step": int(step), "arm": label, "heads": t}
            for key, col, fmt in MECHANISM:
                v = arm[arm["metric"] == f"mechanism.{key}.{t}"]["value"]
                if len(v):
                    s = describe(v)
                    row[col] = interval_text(s.mean, s.lo, s.hi, s.n, fmt)
                    if key == "neg_mass" and s.n > 1:  # against the null: does the interval exclude 0.5?
                        row[col] += " > 0.5" if s.lo > 0.5 else " < 0.5" if s.hi < 0.5 else ""
            if len(row) > 3:
                rows.append(row)
    return pd.DataFrame(rows)


def equal_loss(f: pd.DataFrame, plan, name: str, claims, at="final") -> tuple[pd.DataFrame, str]:
    """The geometry compared at equal validation loss: a common value L (the larger of the two
    arms' mean val_loss at step `at`, by default the final one, which both reach), each run's
    analysed checkpoint whose logged val_loss is nearest L, and the paired d [95% interval] of
    each claim's metric there."""
    p = plan.paradigms[name]
    g = paradigm_runs(f, plan, name)
    # the validation loss logged at each analysed checkpoint's step (a plan may keep one per evaluation)
    loss = g[(g["metric"] == "log.val_loss") & g["step"].isin(g.loc[g["metric"].str.startswith("geometry."), "step"])]
    finals = select(g, "log.val_loss", step=at)
    means = [pd.Series(by_seed(finals, k), dtype=float).mean() for k in (0, p.arm)]
    if any(math.isnan(m) for m in means) or loss.empty:
        return pd.DataFrame(), "not measured: both arms need a final val_loss and val_loss at the kept checkpoints"
    target = max(means)  # the level both arms reach
    # each run's kept checkpoint nearest L: coarse with 3 checkpoints, so their val_loss is printed
    near = loss.assign(gap=(loss["value"] - target).abs()).sort_values("gap").drop_duplicates("run_dir")
    chosen = dict(zip(near["run_dir"], near["step"]))
    # the geometry of the chosen checkpoint of each run; the arms may sit at different steps
    rows = [{"definition": c.definition, "d [95% CI] (n, df)": d_text(paired_test(
        g[(g["metric"] == c.metric) & (g["layer"] == c.layer) & (g["step"] == g["run_dir"].map(chosen))], p.arm))}
        for c in claims]
    how = f"L = {target:.4f} (val_loss); the nearest kept checkpoints: " + "; ".join(
        f"k={k}: steps {sorted(s['step'].tolist())}, val_loss {s['value'].mean():.4f}"
        for k in (0, p.arm) for s in [near[near["k"] == k]])
    return pd.DataFrame(rows), how


def stream_change(checkpoints: list[str], n: int = 64) -> list[float]:
    """Per block, the mean over tokens of |h_i - h_(i-1)| / |h_(i-1)| on n validation sequences
    (h_(-1): the embedding that enters block 0), averaged over the runs: how much each block moves
    the residual stream (a LayerScale of 1e-6 would leave them near identities at this length)."""
    import torch

    from analysis.geometry import eval_split, load_for_analysis
    from laplace.zoo import embed, features

    per_run = []
    for path in checkpoints:  # one model in memory at a time, on the CPU (64 sequences are quick)
        model, _, data = load_for_analysis(path, device="cpu")
        ds, _ = eval_split(model, data, seed=0, max_tokens=None)
        # the first n sequences of the fixed order: the same for every run
        x = torch.utils.data.default_collate([ds[i] for i in range(min(n, len(ds)))])[0]
        with torch.no_grad():
            feats = features(model, x, norm=False)
            # the embedding as block 0 reads it: the ViT's patches + position + class token, the GPT's normed tokens
            hs = [embed(model, x)] + [feats[f"blocks.{i}"] for i in range(len(model.blocks))]
        # |h_i - h_(i-1)| / |h_(i-1)| per token, averaged: how far block i moved the stream
        per_run.append([float(((b - a).norm(dim=-1) / a.norm(dim=-1)).mean()) for a, b in zip(hs, hs[1:])])
    return [sum(col) / len(col) for col in zip(*per_run)]


def draw_claims(rows: pd.DataFrame, stem: Path) -> list[Path]:
    """A panel per paradigm and metric (its primary endpoints, then the within-sequence share at
    the final norm): each claim's paired d with its 95% interval, a row per arm, 0 marked; a claim
    without a test says "not run" or "not measured" where its point would be."""
    from analysis.figures import panels, save

    share = (rows["metric"] == "geometry.within_seq_share") & (rows["layer"] == "norm")
    rows = rows[(rows["role"] == "primary") | share]
    groups = list(rows.groupby(["paradigm", "metric"], sort=False))
    if not groups:
        return []
    fig, axes = panels(len(groups), 2, 4.6, 0.5 + 0.45 * max(len(g) for _, g in groups))
    for ax, ((paradigm, _), g) in zip(axes, groups):
        for y, r in enumerate(g.itertuples()):
            if r.test is None:
                # mid-panel (x in the axes' units): a panel of a paradigm not run has no d to sit beside
                ax.text(0.5, y, r.verdict, transform=ax.get_yaxis_transform(), ha="center", va="center",
                        fontsize=7, color="0.4")
            else:
                ax.errorbar(r.test.d, y, xerr=[[r.test.d - r.test.lo], [r.test.hi - r.test.d]], fmt="o", ms=4,
                            capsize=3, color="C0")
        ax.axvline(0, color="0.5", lw=0.8, ls="--")
        ax.set_yticks(range(len(g)), [k if isinstance(k, str) else f"k={k}" for k in g["k"]])
        ax.set_ylim(len(g) - 0.5, -0.5)  # the plan's order, top to bottom
        ax.set(title=f"{paradigm}: {g['definition'].iloc[0]}", xlabel="d = arm - baseline (95% interval)")
        ax.title.set_fontsize(8)
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return save(fig, stem)


# ----------------------------------------------------------------------------- the report

def write_report(records: list[dict], plan, out: Path, pca_maps: int = 4) -> Path:
    """README.md, tables/ and figures/ of `plan` over `records` (finished runs) in `out`."""
    from analysis.figures import by_arm, draw_figures
    from analysis.gates import gate_groups, to_markdown as gates_markdown
    from analysis.tables import render_tables

    check_plan(plan)
    # every number below is a view of this one table (analysis.runs.frame)
    f = frame(records, logs=True)
    # the per-seed values, committed beside the report and read back: the claims, the per-seed tables
    # and the curves come from the file, so that it regenerates them when the runs are gone
    atomic_write(out / "per_seed.csv", per_seed(f, plan).to_csv(index=False, lineterminator="\n").encode())
    ps = read_per_seed(out / "per_seed.csv")
    write_per_seed_report(ps, plan, out)
    # the claims first: the report's point; everything after describes
    rows = claim_rows(ps, plan)
    primary, secondary = (rows[rows["role"] == r] if len(rows) else rows for r in ("primary", "secondary"))
    unfinished = [r["run_dir"] for r in records if not r["finished"]]
    # the date: a report regenerated later (more runs, a fix) says when it was made
    lines = [f"# {plan.title} ({datetime.date.today().isoformat()})", "", plan.scope.strip(), ""]
    if unfinished:  # a look while the runs train (partial=true): said first, so no one reads it as the result
        lines += [f"**Partial: {len(unfinished)} of {len(records)} runs have not finished**; their latest analysed "
                  "checkpoint stands for their final model and their final results are absent. Not the study's "
                  "result.", ""]
    lines += [f"Command: `{plan.command}`. Plan: configs/plan/{plan.name}.yaml ({plan.declared}). Runs: "
              + ", ".join(f"{n}: {paradigm_runs(f, plan, n)['run_dir'].nunique() or 'not run'} ({p.experiment})"
                          for n, p in plan.paradigms.items()) + ". The paper's tables: tables/; figures: figures/.",
              "", "## Claims", "",
              "Each claim is decided once, on its primary object and layer: the baseline (k = 0) against the arm "
              "k, over the seeds both have, by a paired t on the per-seed differences (the arms of a seed share "
              "the data order and the initial weights); d is the mean difference with its 95% t interval and "
              f"degrees of freedom; Holm's p is adjusted within the declared family ({plan.family}: "
              + {"paradigm": "per paradigm and role", "role": "per role, all paradigms together",
                 "all": "every row one family"}[plan.family]
              + "). Verdict: agrees / disagrees with the paper when Holm's p < 0.05, else inconclusive; beside it "
                "the interval of d at the level that decides it, 1 - 0.05 p / Holm's p: Bonferroni's at Holm's "
                "step (95% for a family of one, 97.5% for the first of two), so it excludes 0 exactly when the "
                "verdict is not inconclusive. Arms: mean ± sd (n). figures/claims.png: d and its 95% interval of "
                "the primary and within-sequence share claims.", "",
              "### Primary", "", md_table(claims_table(primary)), "",
              "### Secondary (other readings and layers, reported apart; Holm within their own family)", "",
              md_table(claims_table(secondary)), "",
              f"### Sensitivity: the other family choice ({plan.sensitivity})", "",
              md_table(claims_table(rows, sensitivity=True)), "",
              "### Per seed (per_seed.csv; also per_seed.md)", "", *per_seed_tables(ps, plan)]
    if len(rows):
        # the claims as numbers (full precision) beside the Markdown: d, its interval and n per row
        sheet = rows.drop(columns=["test", "base", "arm", "ran"]).assign(
            **{key: [getattr(t, key, None) for t in rows["test"]] for key in ("d", "lo", "hi", "n", "df")})
        atomic_write(out / "tables" / "claims.csv", sheet.to_csv(index=False, lineterminator="\n").encode())
    lines += ["## Learning curves", "", "Each arm's validation metric against the step: mean [95% interval] "
              "(n seeds); figures/curves.png. Then the change over the last quarter of the steps, and the quarter "
              "before it.", ""]
    # a paradigm's learning curve: its plan's `curve` metric, logged ("log.val_bpb") or an evaluation of
    # every kept checkpoint ("knn.top1")
    panels = {}
    for name, p in plan.paradigms.items():
        g = paradigm_runs(ps, plan, name)
        panels[name] = (p.curve, points(g[g["metric"] == p.curve]))
        table, change = curves_table(panels[name][1])
        lines += [f"**{name}**: {p.curve}", "", md_table(table), "", *change, ""]
    lines += ["## Every arm (final values, mean ± sd over seeds)", ""]
    for name in plan.paradigms:
        lines += [f"**{name}**", "", md_table(arms_table(f, plan, name)), ""]
    lines += ["## Geometry at every block (descriptive)", "",
              "Each geometry claim at every layer of the final model (blocks.<i>: the residual stream after block "
              "i; norm: the final norm): the arm minus the baseline, d [95% interval] (n) of the paired differences. "
              "Where along the depth a difference appears; not further tests. Every arm: tables/per_block.md.", ""]
    # the geometry claims read at the final norm: the rows of the per-block and per-step tables
    geo = [c for c in plan.claims if c.metric.startswith("geometry.") and c.get("layer") == "norm"]
    for name, p in plan.paradigms.items():
        recs, mine = [r for r in records if r["experiment"] == p.experiment], [c for c in geo if c.paradigm == name]
        if recs and mine:
            lines += [md_table(paired_grid(f, plan, mine, layer_order(recs), lambda c, layer: (layer, "final"))), ""]
    if plan.get("steps"):
        lines += ["## At every kept checkpoint (equal step, descriptive)", "",
                  "Each geometry claim at the final norm of the checkpoints of the same step: d [95% interval] (n).",
                  "", md_table(paired_grid(f, plan, geo, list(plan.steps), lambda c, s: (c.layer, s))), ""]
    # equal_loss: true (the final loss's level) or a list of steps (the level of each: study_lm26's three)
    levels = plan.equal_loss if OmegaConf.is_list(plan.get("equal_loss")) else ["final"] * bool(plan.get("equal_loss"))
    for name, at in ((n, at) for n in plan.paradigms for at in levels):
        table, how = equal_loss(f, plan, name, [c for c in geo if c.paradigm == name], at)
        lines += [f"## At equal validation loss (descriptive{'' if at == 'final' else f', the level of step {at}'})",
                  "", how + ".", "", md_table(table), ""]
    lines += ["## Do the heads smooth the residual stream? (the mechanism, analysis/mechanism.py)", "",
              "Per head, in the stream's frame (its part after LayerScale; its matrix Pi diag(g) W_v W_o diag(lambda) "
              "with the norm's centring and gain): the cosine with Px - x (> 0: toward the attention-weighted mean), "
              "the change of the within-sequence variance (relative) and share (< 0: smooths), to first order and "
              "exactly (the exact adds |D - mean_seq(D)|^2, never negative: it matters where the head's part |D| is "
              "not small beside the stream |x|), and the negative share of the eigen-mass of its symmetric part "
              "(null 0.5: W_o -> -W_o turns a mass m into 1 - m, so a head the training pushed neither way has "
              "0.5). Each run's mean over the heads of a type, then mean [95% interval] (n, df) over seeds, at "
              "every analysed checkpoint. Per head: each run's ckpt/<name>_analysis/mechanism.md.", ""]
    for name in plan.paradigms:
        table = mechanism_table(f, plan, name)
        lines += [f"**{name}**", "", md_table(table), ""] if len(table) else []
    lines += ["## How much the blocks change the residual stream", "",
              "Mean over tokens of |h_i - h_(i-1)| / |h_(i-1)| per block (h_(-1): the embedding), 64 validation "
              "sequences, averaged over seeds:", ""]
    for name, p in plan.paradigms.items():
        # the final models' checkpoints per arm
        mine = [r for r in records if r["experiment"] == p.experiment and Path(r["checkpoint"]).is_file()]
        lines += [f"- {name} {label}: " + ", ".join(f"{c:.3f}" for c in stream_change([r["checkpoint"] for r in rs]))
                  for label, rs in by_arm(mine).items()]
    gates = gate_groups(records)
    if gates:  # only when a plan's runs learned their gates (laplacian_mode=learned)
        lines += ["", "## Learned gates (laplacian_mode=learned; a = 1: the head is fully Laplacian)", "",
                  *[gates_markdown(g) for g in gates]]
    # the paper's tables and figures of the same runs, and the learning curves' figure
    render_tables(records, out / "tables", echo=False)
    # (the metric-vs-k figure's metrics as `python -m analysis.figures` has them)
    vs_k = OmegaConf.to_container(OmegaConf.load(config_dir("figures") / "figures.yaml").vs_k)
    draw_figures(records, out / "figures", vs_k, pca_maps)
    if len(rows):
        draw_claims(rows, out / "figures" / "claims")
    if any(points for _, points in panels.values()):
        draw_curves({n: v for n, v in panels.items() if v[1]}, out / "figures" / "curves", "ci")
    write_json(out / "plan.json", OmegaConf.to_container(plan, resolve=True), indent=1)  # what decided it
    return atomic_write(out / "README.md", ("\n".join(lines) + "\n").encode())


def write_per_seed_report(ps: pd.DataFrame, plan, out: Path) -> Path:
    """per_seed.md in `out`: the claims, per-seed tables and learning curves of per-seed values `ps`
    (read_per_seed) alone: what a report's committed data regenerates without its runs."""
    check_plan(plan)
    rows = claim_rows(ps, plan)
    lines = [f"# {plan.title}: the per-seed values ({datetime.date.today().isoformat()})", "",
             "Generated from per_seed.csv alone (`python -m analysis.report per_seed=<that file> plan="
             f"{plan.name} out=<its folder>`): the claims as README.md decides them, each seed's values and "
             "the learning curves. A claim whose values the file lacks is not measured, and Holm counts only "
             "the measured rows of a family.", "",
             "## Claims", "", md_table(claims_table(rows)), "", "## Per seed", "",
             *per_seed_tables(ps, plan)]
    for name, p in plan.paradigms.items():
        g = paradigm_runs(ps, plan, name)
        table, change = curves_table(points(g[g["metric"] == p.curve]))
        lines += [f"## Learning curve, {name}: {p.curve}", "", md_table(table), "", *change, ""] if len(table) else []
    return atomic_write(out / "per_seed.md", ("\n".join(lines) + "\n").encode())


def run(cfg: DictConfig) -> Path:
    """Collect the runs of cfg.runs and write the report of cfg.plan to cfg.out; with cfg.per_seed
    (a per_seed.csv), its per_seed.md from that file alone."""
    # (before the work: a read-only docs/ would fail after every figure was drawn)
    out = check_writable(Path(cfg.out), "out")
    if cfg.get("per_seed"):
        path = Path(cfg.per_seed)
        if not path.is_file():
            raise ConfigError(f"per_seed={path}: no such file; give a report's per_seed.csv "
                              "(e.g. per_seed=docs/study_lm/per_seed.csv)")
        path = write_per_seed_report(read_per_seed(path), cfg.plan, out)
        print(f"[report] wrote {path} from {cfg.per_seed}", flush=True)
        return path
    if cfg.get("runs") is None:  # (optional in report.yaml, beside per_seed=)
        raise ConfigError("runs is required: add runs=DIR (the folder of the plan's runs) or per_seed=FILE "
                          "(a report's per_seed.csv) to the command")
    # a run still training would pass for a finished one: left out unless partial=true asks for a look
    records = [r for r in collect(runs_roots(cfg, "analysis.report")) if r["finished"] or cfg.partial]
    if not records:
        raise ConfigError(f"runs={cfg.runs}: no finished runs there; train them first ({cfg.plan.command}), "
                          f"or look at unfinished ones with partial=true")
    path = write_report(records, cfg.plan, out, int(cfg.pca_maps))
    print(f"[report] {len(records)} runs ({sum(not r['finished'] for r in records)} unfinished); wrote {path}",
          flush=True)
    return path


main = hydra_entry("report")(run)


if __name__ == "__main__":
    main()
