"""The arms study's report (configs/plan/arms.yaml, docs/arms.md): runs read with their attention
arm, the arms at k = 0 never pooled with the softmax baseline, every arm (the Laplacian one too)
compared with softmax k = 0 by a paired t with Holm within (paradigm, role), and the report with
its figure written where one paradigm (the GPT) has no runs. Small fake run folders in the real
formats: config.yaml, results.json, metrics.jsonl and ckpt/last_analysis/analysis.json."""
from __future__ import annotations

import json
import re

import pytest
import yaml
from hydra import compose, initialize_config_dir
from scipy import stats

from analysis import claims, report
from analysis.runs import collect, frame
from analysis.stats import holm
from conftest import CONFIGS

SEEDS = range(3)
# arm -> (model name, k, attention, accuracy offset, within-image share offset) against softmax k = 0
ARMS = {"softmax": ("vitt_0L", 0, "softmax", 0.0, 0.0), "laplacian": ("vitt_3L", 3, "softmax", 1.0, -0.10),
        "xsa": ("vitt_0L", 0, "xsa", 0.5, -0.05), "gated": ("vitt_0L", 0, "gated", -0.3, 0.0),
        "diff": ("vitt_0L", 0, "diff", 2.0, 0.02)}


def _acc(arm: str, seed: int) -> float:
    # a seed's own level plus the arm's offset, and a little noise per (arm, seed) so t is finite
    return 90.0 + seed + ARMS[arm][3] + 0.05 * ((seed * 3 + len(arm)) % 4) * (arm != "softmax")


def _share(arm: str, seed: int) -> float:
    return 0.6 + 0.01 * seed + ARMS[arm][4] + 0.002 * ((seed + len(arm)) % 3) * (arm != "softmax")


def _runs(root, steps: int = 400):
    """The ViT arms' runs as train.py and `python -m analysis` leave them: five arms x three seeds."""
    for arm, (model, k, attention, _, _) in ARMS.items():
        for s in SEEDS:
            d = root / "deit3" / "arms_vit" / f"{model}_{attention}_s{s}"
            (d / "ckpt" / "last_analysis").mkdir(parents=True)
            cfg = {"trainer": {"name": "deit3", "max_steps": steps, "global_batch_size": 64},
                   "model": {"name": model, "depth": 4, "num_laplacian_heads": k, "laplacian_mode": "fixed",
                             "attention": attention},
                   "data": {"name": "digits", "img_size": 32}, "seed": s}
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
            res = {"model": f"vitt_d4_{k}L", "num_laplacian_heads": k, "laplacian_mode": "fixed",
                   "attention": attention, "dataset": "digits", "checkpoint": str(d / "ckpt" / "last.pt"),
                   "seed": s, "steps": steps, "epochs": 18, "global_batch_size": 64, "init_from": None,
                   "final": {"val_loss": 0.2, "val_acc1": _acc(arm, s), "val_acc5": 100.0},
                   "commit": "4a066c2", "resumes": [], "img_size": 32, "patch_size": 4, "loss": "ce"}
            (d / "results.json").write_text(json.dumps(res, indent=2))
            lines = [{"step": st, "split": "val", "epoch": st // 25, "val_loss": 0.2,
                      "val_acc1": _acc(arm, s) - 400 / st} for st in (200, 400)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            patch = {layer: {"anova": {"within_seq_share": _share(arm, s) + 0.1 * (layer != "norm"),
                                       "between_class_share": 0.1}} for layer in ("blocks.0", "norm")}
            analysis = {"arch": "vit", "step": steps, "num_heads": 3, "num_laplacian_heads": k,
                        "layers": ["blocks.0", "norm"], "results": {"patch": patch}}
            (d / "ckpt" / "last_analysis" / "analysis.json").write_text(json.dumps(analysis))


def _plan():
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("report", overrides=["plan=arms", "out=x"]).plan


def test_runs_record_their_attention_and_the_arms_share_one_recipe(tmp_path):
    _runs(tmp_path)
    recs = collect(tmp_path)
    assert sorted({r["attention"] for r in recs}) == ["diff", "gated", "softmax", "xsa"]
    # model.attention is left out of the recipe like k and the mode: one recipe, five arms
    assert len({r["recipe_id"] for r in recs}) == 1
    f = frame(recs)
    assert set(f["attention"]) == {"softmax", "xsa", "gated", "diff"}


def test_every_arm_against_softmax_k0_with_holm_within_paradigm_and_role(tmp_path):
    _runs(tmp_path)
    plan = _plan()
    rows = claims.claim_rows(frame(collect(tmp_path)), plan)
    deit3, gpt = rows[rows["paradigm"] == "deit3"], rows[rows["paradigm"] == "gpt"]
    base = [_acc("softmax", s) for s in SEEDS]
    primary = deit3[deit3["role"] == "primary"]
    assert list(primary["k"]) == [3, "xsa", "gated", "diff"]
    for (_, r), arm in zip(primary.iterrows(), ("laplacian", "xsa", "gated", "diff")):
        # the baseline is softmax at k = 0 only: the arms at k = 0 are not pooled with it
        assert r["base"].n == 3 and r["base"].mean == pytest.approx(sum(base) / 3)
        ref = stats.ttest_rel([_acc(arm, s) for s in SEEDS], base)
        assert r["test"].n == 3 and r["test"].p == pytest.approx(ref.pvalue)
        assert r["test"].d == pytest.approx(ARMS[arm][3] + sum(_acc(arm, s) - _acc("softmax", s) - ARMS[arm][3]
                                                               for s in SEEDS) / 3)
    # Holm within (paradigm, role): the four primary rows are one family, the eight secondary another
    assert set(primary["family"]) == {"deit3 / primary"}
    assert list(primary["holm_p"]) == pytest.approx(holm(list(primary["p"])))
    secondary = deit3[deit3["role"] == "secondary"]
    assert list(secondary["holm_p"]) == pytest.approx(holm(list(secondary["p"])))
    share = secondary[secondary["metric"] == "geometry.within_seq_share"]
    assert share.iloc[0]["test"].d == pytest.approx(-0.10, abs=0.01)  # the Laplacian arm's share drops
    # the GPT's arms did not run: said, not crashed, not "not measured"
    assert set(gpt["verdict"]) == {"not run"} and gpt["test"].isna().all()
    table = claims.claims_table(primary)
    assert list(table["k"]) == ["3 of 3", "xsa", "gated", "diff"]


def test_the_arms_report_with_its_figure_and_the_gpt_not_run(tmp_path):
    _runs(tmp_path / "runs")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("report", overrides=["plan=arms", f"runs={tmp_path / 'runs'}", f"out={tmp_path / 'docs'}",
                                           "pca_maps=0"])
    text = report.run(cfg).read_text()
    docs = tmp_path / "docs"
    assert "deit3: 15 (arms_vit), gpt: not run (arms_lm)" in text
    assert (docs / "figures" / "claims.png").stat().st_size > 1000
    sheet = (docs / "tables" / "claims.csv").read_text()
    assert sheet.count("not run") == 24  # the GPT's twelve rows, declared and other family choice
    ps = claims.read_per_seed(docs / "per_seed.csv")
    assert set(ps["attention"]) == {"softmax", "xsa", "gated", "diff"}
    # every arm its own row of the arms table and its own learning curve, the baseline apart from them
    for label in ("k=0", "k=3", "k=0 xsa", "k=0 gated", "k=0 diff"):
        assert f"| {label} " in text or f"| {label}|" in text, label
    # per_seed.md, from the file alone: a column per arm beside the softmax baseline's
    md = (docs / "per_seed.md").read_text()
    assert re.search(r"\|\s*seed\s*\|\s*k=0\s*\|\s*xsa\s*\|\s*d\s*\|", md)
