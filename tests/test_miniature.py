"""The study's report (analysis/report.py) and the miniature's chain (scripts/miniature.sh): paired
claims with 95% intervals and Holm within the declared families (the other choice as the
sensitivity), the values a claim reads (final model, a kept step, a logged line), the learning
curves' table, the comparison at equal validation loss, every plan composes, and the whole chain
end to end at smoke size (one seed, two steps)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from scipy import stats

from analysis import claims, report
from analysis.runs import frame
from analysis.stats import holm
from conftest import CONFIGS, ROOT
from laplace.errors import ConfigError


def _record(experiment: str, k: int, seed: int, metrics: dict, geometry: dict, steps: int = 100,
            step_geometry: dict = None, logs: dict = None) -> dict:
    """A run as analysis.runs.collect makes it; geometry at the final norm."""
    return {"run_dir": f"/runs/{experiment}/m_{k}L_s{seed}", "experiment": experiment, "trainer": "deit3",
            "dataset": "digits", "family": "vitt", "model": f"vitt_{k}L", "arch": "vit", "k": k, "k_label": str(k),
            "mode": "fixed", "seed": seed, "steps": steps, "recipe_id": "r", "recipe": "r", "finished": True,
            "metrics": metrics, "layer_geometry": {"norm": geometry} if geometry else {}, "analysis_step": steps,
            "step_geometry": step_geometry or {}, "step_mechanism": {}, "mechanism": {}, "logs": logs or {}}


def _frame(records):
    """frame() of records whose logged lines are given in the record (no metrics.jsonl to read)."""
    f = frame(records)
    logged = [{**{c: r.get(c) for c in f.columns}, "step": s, "layer": None, "metric": f"log.{m}", "value": v,
               "final": False} for r in records for (m, s), v in r["logs"].items()]
    import pandas as pd

    return pd.concat([f, pd.DataFrame(logged, columns=f.columns)], ignore_index=True) if logged else f


def _plan(**over):
    base = {"name": "t", "title": "t", "scope": "s", "command": "c", "declared": "d", "family": "paradigm",
            "sensitivity": "role",
            "paradigms": {"a": {"experiment": "exp_a", "arm": 3, "heads": 3, "curve": "log.val_acc1"},
                          "b": {"experiment": "exp_b", "arm": 3, "heads": 3, "curve": "log.val_acc1"}},
            "claims": [{"paradigm": "a", "claim": "acc", "metric": "final.val_acc1", "sign": 1, "definition": "top-1"},
                       {"paradigm": "a", "claim": "share", "metric": "geometry.within_seq_share", "layer": "norm",
                        "sign": -1, "definition": "share"}]}
    return OmegaConf.create({**base, **over})


def test_claims_are_paired_with_intervals_and_holm_within_the_declared_families():
    """Paradigm a: accuracy +1 in every seed but one (agrees), the share grows by 0.3 +- a little
    (disagrees); paradigm b: ten claims of noise. Per paradigm, a's rows keep their verdicts; pooled
    with b's ten (the sensitivity), Holm's m grows and the share row may turn inconclusive."""
    recs = []
    for seed in range(4):
        recs.append(_record("exp_a", 0, seed, {"final.val_acc1": 90.0 + seed}, {"within_seq_share": 0.5 + 0.02 * seed}))
        recs.append(_record("exp_a", 3, seed, {"final.val_acc1": 91.0 + seed + 0.1 * (seed == 2)},
                            {"within_seq_share": 0.8 + 0.02 * seed + 0.01 * (seed % 2)}))
        noise = {f"final.m{i}": ((seed * 7 + i * 3) % 5) / 10 for i in range(10)}
        recs += [_record("exp_b", 0, seed, {k: 0.0 for k in noise}, {}), _record("exp_b", 3, seed, noise, {})]
    noise_claims = [{"paradigm": "b", "claim": f"m{i}", "metric": f"final.m{i}", "sign": 1, "definition": f"m{i}"}
                    for i in range(10)]
    plan = _plan()
    plan.claims = list(plan.claims) + noise_claims
    rows = claims.claim_rows(_frame(recs), plan)
    acc, share = rows.iloc[0], rows.iloc[1]
    base, arm = [90.0 + s for s in range(4)], [91.0 + s + 0.1 * (s == 2) for s in range(4)]
    ref = stats.ttest_rel(arm, base)
    assert acc["test"].p == pytest.approx(ref.pvalue) and acc["test"].df == 3
    assert (acc["test"].lo, acc["test"].hi) == pytest.approx(tuple(ref.confidence_interval(0.95)))
    assert acc["family"] == "a / primary" and share["family"] == "a / primary"
    # Holm within paradigm a's two rows: the adjusted p of each is Holm's over exactly those two
    assert [acc["holm_p"], share["holm_p"]] == pytest.approx(holm([acc["p"], share["p"]]))
    assert acc["verdict"].startswith("agrees [") and share["verdict"].startswith("disagrees [")
    # each verdict's interval is at the level that decides it: Bonferroni at Holm's step here
    first = min(acc["p"], share["p"])
    assert sorted([acc["level"], share["level"]]) == pytest.approx([0.95, 0.975])
    assert (acc if acc["p"] == first else share)["level"] == pytest.approx(0.975)
    lo, hi = acc["test"].at(acc["level"])
    assert acc["verdict"] == f"agrees [{lo:+.3g}, {hi:+.3g}] ({100 * acc['level']:.3g}%)" and lo > 0
    # the sensitivity: one family of all twelve rows
    assert set(rows["sens"]) == {"primary"}
    pooled = holm(list(rows["p"]))
    assert list(rows["sens_p"]) == pytest.approx(pooled) and pooled[1] > share["holm_p"]
    noisy = rows.iloc[2]
    lo, hi = noisy["test"].at(noisy["level"])  # a family of ten: wider than its 95% interval
    assert noisy["verdict"].startswith(f"inconclusive [{lo:+.3g}, {hi:+.3g}]") and lo < noisy["test"].lo
    table = claims.claims_table(rows[rows["role"] == "primary"])
    assert list(table.columns) == ["paradigm", "claim", "definition", "layer", "k", "baseline", "arm",
                                   "d [95% CI] (n, df)", "t", "p", "family", "Holm p", "verdict"]
    assert table.iloc[0]["layer"] == "model output" and table.iloc[1]["layer"] == "norm"
    assert table.iloc[0]["k"] == "3 of 3" and table.iloc[0]["verdict"] == f"**{acc['verdict']}**"
    d = acc["test"]
    assert table.iloc[0]["d [95% CI] (n, df)"] == f"{d.d:+.3g} [{d.lo:+.3g}, {d.hi:+.3g}] (4, df 3)"


def test_a_claim_reads_the_final_model_a_kept_step_or_a_logged_line():
    recs = [_record("exp_a", k, s, {"final.val_acc1": 50.0 + k + s}, {"within_seq_share": 0.5 - 0.01 * k},
                    steps=3000, step_geometry={1000: {"norm": {"within_seq_share": 0.9 - 0.1 * k + 0.001 * s}}},
                    logs={("loss", 2975): 9.0, ("loss", 3000): 4.0 - 0.1 * k + 0.01 * s})
            for k in (0, 1) for s in range(3)]
    f = _frame(recs)
    final = claims.select(f, "geometry.within_seq_share", "norm")
    assert sorted(final["value"]) == pytest.approx([0.49] * 3 + [0.5] * 3)
    early = claims.select(f, "geometry.within_seq_share", "norm", 1000)
    assert claims.by_seed(early, 1) == pytest.approx({0: 0.8, 1: 0.801, 2: 0.802})
    loss = claims.select(f, "log.loss")  # a logged metric: its line at the run's last step
    assert claims.by_seed(loss, 0) == pytest.approx({0: 4.0, 1: 4.01, 2: 4.02})
    last2 = claims.select(f, "log.loss", last=2)  # a claim's mean_last: the mean of its last two lines
    assert claims.by_seed(last2, 1) == pytest.approx({s: (9.0 + 3.9 + 0.01 * s) / 2 for s in range(3)})
    plan = _plan(steps=[1000, 3000], paradigms={"a": {"experiment": "exp_a", "arm": 1, "curve": "log.loss"}},
                 claims=[{"paradigm": "a", "claim": "share", "metric": "geometry.within_seq_share", "layer": "norm",
                          "sign": -1, "definition": "share"}])
    grid = report.paired_grid(f, plan, plan.claims, [1000, 3000], lambda c, s: (c.layer, s))
    assert grid.iloc[0]["1000"] == "-0.1 [-0.1, -0.1] (3, df 2)"  # the same -0.1 in every seed: no spread
    assert grid.iloc[0]["3000"] == "-0.01 [-0.01, -0.01] (3, df 2)"


def test_curves_table_and_last_quarter():
    points = {"k=0": {50: [3.0, 3.2], 100: [2.0, 2.2], 150: [1.9, 2.1], 200: [1.85, 2.05]},
              "k=2": {50: [3.1], 200: [2.5]}}
    table, lines = report.curves_table(points)
    assert list(table.columns) == ["step", "k=0", "k=2"] and list(table["step"]) == [50, 100, 150, 200]
    half = stats.t.ppf(0.975, 1) * 0.1  # two seeds 0.2 apart: sd 0.141, se 0.1
    assert table.iloc[0]["k=0"] == f"3.1 [{3.1 - half:.4g}, {3.1 + half:.4g}] (2, df 1)" and table.iloc[0]["k=2"] == "3.1 (1)"
    assert table.iloc[1]["k=2"] == ""
    # 150 = the first step at or after 75% of 200, 100 the first at or after 50%
    assert lines == ["- k=0: -0.05 from step 150 to 200 (before: -0.1 from step 100 to 150)",
                     "- k=2: -0.6 from step 50 to 200"]  # no step in the last quarter but the end


def test_equal_validation_loss_picks_each_runs_nearest_checkpoint():
    """k = 1 learns slower: at the common loss L (the larger arm mean of the final val_loss), the
    baseline's nearest checkpoint is an earlier one."""
    recs = []
    for s in range(3):
        for k, losses in ((0, {1000: 3.0, 2000: 2.5, 3000: 2.2}), (1, {1000: 3.2, 2000: 2.8, 3000: 2.5})):
            geo = {step: {"norm": {"lc_cdnv_mean": step / 1000 + k + 0.01 * s}} for step in losses}
            recs.append(_record("exp_a", k, s, {}, geo[3000]["norm"], steps=3000, step_geometry=geo,
                                logs={("val_loss", st): v + 0.001 * s for st, v in losses.items()}))
    plan = _plan(steps=[1000, 2000, 3000], paradigms={"a": {"experiment": "exp_a", "arm": 1, "curve": "log.val_loss"}},
                 claims=[{"paradigm": "a", "claim": "cdnv", "metric": "geometry.lc_cdnv_mean", "layer": "norm",
                          "sign": -1, "definition": "CDNV"}])
    table, how = report.equal_loss(_frame(recs), plan, "a", plan.claims)
    # L = 2.501 (k = 1's final mean): k = 0 is nearest at step 2000 (2.5), k = 1 at 3000
    assert how.startswith("L = 2.5010") and "k=0: steps [2000, 2000, 2000]" in how and "k=1: steps [3000" in how
    assert table.iloc[0]["d [95% CI] (n, df)"].startswith("+2 ")  # (3 + 1) - 2 at every seed
    # a plan's equal_loss may name steps: the level of each (L = k = 1's mean at step 2,000, 2.801)
    table, how = report.equal_loss(_frame(recs), plan, "a", plan.claims, at=2000)
    assert how.startswith("L = 2.8010") and "k=0: steps [1000, 1000, 1000]" in how and "k=1: steps [2000" in how
    assert table.iloc[0]["d [95% CI] (n, df)"].startswith("+2 ")  # k = 1 at step 2000, k = 0 at 1000: (2 + 1) - 1


@pytest.mark.parametrize("name", ["short", "long", "study", "study_lm", "study_lm26"])
def test_every_plan_composes_and_names_its_paradigms(name):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("report", overrides=[f"plan={name}", "runs=x", "out=y"])
    report.check_plan(cfg.plan)
    for c in cfg.plan.claims:
        assert c.metric.split(".")[0] in ("final", "geometry", "log", "knn", "linear"), c
        assert (c.get("layer") is not None) == c.metric.startswith("geometry."), c
        assert c.sign in (1, -1) and c.get("role", "primary") in ("primary", "secondary")
    experiments = {p.experiment for p in cfg.plan.paradigms.values()}
    assert experiments <= {p.stem for p in (ROOT / "configs/experiment").glob("*.yaml")}
    primary = [c for c in cfg.plan.claims if c.get("role", "primary") == "primary"]
    # one primary object and layer per claim of a paradigm
    keys = [(c.paradigm, c.claim) for c in primary]
    assert len(keys) == len(set(keys)), name


def test_a_bad_plan_is_one_line():
    with pytest.raises(ConfigError, match=r"plan.claims\[0\].paradigm=zz: not in plan.paradigms"):
        report.check_plan(_plan(claims=[{"paradigm": "zz", "claim": "c", "metric": "final.x", "sign": 1,
                                         "definition": "d"}]))
    with pytest.raises(ConfigError, match="plan.family=seed: choose paradigm, role or all"):
        report.check_plan(_plan(family="seed"))


def test_the_chain_refuses_an_unknown_profile_in_one_line():
    proc = subprocess.run(["bash", "scripts/miniature.sh", "huge"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "usage: bash scripts/miniature.sh [short|long|study]"


@pytest.mark.timeout(1800)  # above its subprocess's 1500 s
@pytest.mark.slow
def test_the_short_profile_end_to_end(tmp_path):
    """Every sweep of the short profile at 2 steps and one seed, the analyses and the report: the
    chain's commands, the claims with the plan's families, the curves, every section, the tables."""
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    env = {**os.environ, "STEPS": "2", "SEEDS": "0", "RUNS": str(runs), "DOCS": str(docs),
           "VIRTUAL_ENV": sys.prefix, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "scripts/miniature.sh", "short"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    commands = (docs / "commands.log").read_text().splitlines()
    assert commands[0] == "$ python train.py -m seed=0 experiment=mini_vit model=vitt_0L,vitt_1L,vitt_3L trainer.max_steps=2"
    assert sum(c.startswith("$ python -m analysis ") for c in commands) == 2
    assert commands[-1].startswith("$ python -m analysis.report ")
    assert len(list(runs.glob("*/*/*/results.json"))) == 8  # 2 paradigms x 4 arms
    assert len(list(runs.glob("*/*/*/ckpt/last_analysis/analysis.json"))) == 8
    text = (docs / "README.md").read_text()
    claims = text.split("## Learning curves")[0]
    plan = OmegaConf.load(ROOT / "configs/plan/short.yaml")
    for c in plan.claims:  # every declared claim has a row, none unmeasured (one seed: no test)
        assert f"| {c.definition} " in claims, c.definition
    assert "not measured" not in claims and "one seed: no test" in claims and "deit3 / primary" in claims
    for section in ("### Sensitivity: the other family choice (role)", "## Geometry at every block",
                    "## Do the heads smooth the residual stream?", "## How much the blocks change the residual stream",
                    "## Learned gates", "**deit3**: log.val_acc1", "**gpt**: log.val_bpb"):
        assert section in text, section
    assert text.count("### gates_") == 2 and "- gpt k=1 learned:" in text
    for f in ("tables/supervised.md", "tables/per_block.md", "tables/claims.csv", "figures/curves.png",
              "figures/vs_k.png", "plan.json"):
        assert (docs / f).stat().st_size > 100, f


def test_unfinished_runs_are_left_out_unless_partial_and_then_said_first(tmp_path, capsys):
    """A run still training has no results.json: the report refuses to pass it for a finished one,
    and with partial=true says first that it is a look, not the result."""
    from train.logger import MetricsLogger

    run = tmp_path / "runs" / "gpt" / "study_lm" / "gpt_d3_0L_s0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {name: gpt_d3_0L, num_laplacian_heads: 0}\ntrainer: {name: gpt}\n"
                                     "data: {name: stdlib_bpe}\nseed: 0\n")
    log = MetricsLogger(run)
    for step, bpb in ((250, 2.0), (500, 1.9)):
        log.log(step, {"val_bpb": bpb, "val_loss": 4.0}, split="val", epoch=0)

    def cfg(*extra):
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            return compose("report", overrides=["plan=study_lm", f"runs={tmp_path / 'runs'}",
                                                f"out={tmp_path / 'docs'}", "pca_maps=0", *extra])

    with pytest.raises(ConfigError, match="no finished runs there; .* or look at unfinished ones with partial=true"):
        report.run(cfg())
    text = report.run(cfg("partial=true")).read_text()
    assert "**Partial: 1 of 1 runs have not finished**" in text.split("## Claims")[0]
    assert re.search(r"\|\s*500\s*\|\s*1\.9 \(1\)\s*\|", text) and "**not measured**" in text  # its curve, no claim


def test_per_seed_values_round_trip_a_csv_and_regenerate_the_claims_and_tables(tmp_path):
    """per_seed(): the claims' per-seed values and the curve, written as per_seed.csv and read back,
    give the same claims as the tidy table; per_seed.md (the claims, a row per seed, the curve) is
    generated from the file alone, with each run's resumes."""
    recs = [_record("exp_a", k, s, {"final.val_acc1": 50.0 + k + s + 0.3 * (s == 1) * k}, {"within_seq_share": 0.5},
                    logs={("val_acc1", 50): 40.0 + k + s, ("val_acc1", 100): 50.0 + k + s})
            for k in (0, 3) for s in range(3)]
    f, plan = _frame(recs), _plan(paradigms={"a": {"experiment": "exp_a", "arm": 3, "curve": "log.val_acc1"}})
    ps = claims.per_seed(f, plan)
    assert list(ps.columns) == claims.PER_SEED and set(ps["metric"]) == {"final.val_acc1", "log.val_acc1",
                                                                        "geometry.within_seq_share"}
    ps.loc[(ps["k"] == 3) & (ps["seed"] == 2), "resumes"] = "60@abc1234"  # as a resumed run's results.json gives
    ps.to_csv(tmp_path / "per_seed.csv", index=False)
    back = claims.read_per_seed(tmp_path / "per_seed.csv")
    a, b = claims.claim_rows(f, plan), claims.claim_rows(back, plan)
    assert [t.diffs for t in a["test"]] == [t.diffs for t in b["test"]] and list(a["verdict"]) == list(b["verdict"])
    md = report.write_per_seed_report(back, plan, tmp_path).read_text()
    assert "| 1      | 51.000 | 54.900 | +3.9000 |" in md  # seed 1: 51 and 54.9
    assert "k=3: 60@abc1234" in md and "## Learning curve, a: log.val_acc1" in md


def test_the_mechanism_table_has_every_analysed_step_the_exact_changes_and_the_heads_scale():
    recs = []
    for k in (0, 1):
        for s in range(3):
            r = _record("exp_a", k, s, {}, {"within_seq_share": 0.5}, steps=3000)
            at = {"dvar.softmax": 0.1 + 0.01 * s, "dvar_exact.softmax": 0.2 + 0.01 * s, "out_norm.softmax": 0.5}
            r.update(mechanism=at, step_mechanism={1000: {**at, "dvar_exact.softmax": 0.3}})
            recs.append(r)
    plan = _plan(paradigms={"a": {"experiment": "exp_a", "arm": 1, "curve": "log.val_acc1"}})
    t = report.mechanism_table(frame(recs), plan, "a")
    assert list(t["step"]) == [1000, 1000, 3000, 3000] and list(t["arm"]) == ["k=0", "k=1"] * 2
    assert t.iloc[0]["d variance, exact"] == "+0.3 [+0.3, +0.3] (3, df 2)" and t.iloc[2]["|D| / |x|"].startswith("0.5 ")
    assert t.iloc[2]["d within-seq. variance"].startswith("+0.11 [")


def test_the_report_from_a_committed_per_seed_file_alone(tmp_path):
    """per_seed=docs/study_lm/per_seed.csv (the finished LM experiment's committed values, its runs
    gone): per_seed.md with the primary claim recomputed from the file and a row per seed; without
    runs= or per_seed=, one line naming both."""
    def cfg(*extra):
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            return compose("report", overrides=["plan=study_lm", f"out={tmp_path}", *extra])

    md = report.run(cfg(f"per_seed={ROOT / 'docs/study_lm/per_seed.csv'}")).read_text()
    assert "+0.0523 [+0.00603, +0.0986] (8, df 7)" in md and "disagrees [+0.00603, +0.0986] (95%)" in md
    assert "| 6      | 1.2756 | 1.4345 | +0.1589 | k=0: 1250@unrecorded" in md
    with pytest.raises(ConfigError, match="runs is required: add runs=DIR .* or per_seed=FILE"):
        report.run(cfg())
