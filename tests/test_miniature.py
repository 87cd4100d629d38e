"""The miniature reproduction (scripts/miniature.py): its verdict rule, and the whole script
end to end at smoke size (every paradigm and variant, one seed, two steps)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import miniature  # noqa: E402
import miniature_claims as mc  # noqa: E402


def _record(k: int, seed: int, by_layer: dict, model: str = "vitt_0L", arch: str = "vit") -> dict:
    """A flat record as analysis.runs.collect makes it, with geometry at the given layers."""
    return {"k": k, "mode": "fixed", "seed": seed, "model": model, "arch": arch, "run_dir": "/nonexistent",
            "metrics": {"final.val_acc1": 50.0 + k + seed + 0.1 * seed * seed},
            "layer_geometry": by_layer, "geometry": by_layer["norm"]}


def test_claims_use_the_papers_objects_arms_and_layers():
    names = {(c.paradigm, c.metric): c for c in mc.CLAIMS}
    # the claim rows on the paper's objects; the class token's NC1 and the global spectrum kept beside
    assert names["deit3", "geometry.patch_nc1"].family == "paper" and names["deit3", "geometry.nc1"].family == "other"
    assert names["deit3", "geometry.per_seq_n_pcs_0.99"].family == "paper"
    assert names["deit3", "geometry.n_pcs_0.99"].family == "other"
    # the arm nearest the paper's: all 3 heads (ViT-B-12L), 5 of 6 for DINO, 1 of 2 for the LM's 5 of 10
    deit = [_record(k, 0, {"norm": {}}) for k in (0, 1, 3)]
    assert mc.claim_arm(deit, mc.ALL) == 3
    assert mc.claim_arm([_record(k, 0, {"norm": {}}, "vits_0L") for k in (0, 3, 5, 6)], mc.DINO_BEST) == 5
    assert mc.claim_arm([_record(k, 0, {"norm": {}}, "vits_0L") for k in (0, 3, 6)], mc.DINO_BEST) == 6
    assert mc.claim_arm([_record(k, 0, {"norm": {}}, "gpt_d3_0L", "gpt") for k in (0, 1, 2)], mc.LM_BEST) == 1
    # a class-token ViT: patch claims also at the last block's input; the class token's at the norm only
    layers = {"blocks.0": {}, "blocks.1": {}, "blocks.2": {}, "norm": {}}
    vit = [_record(0, 0, layers)]
    assert mc.claim_layers(vit, names["deit3", "geometry.patch_nc1"]) == [
        ("norm", "final norm"), ("blocks.1", "blocks.1 (deepest the loss reaches)")]
    assert mc.claim_layers(vit, names["deit3", "geometry.nc1"]) == [("norm", "final norm")]
    assert mc.claim_layers(vit, names["deit3", "final.val_acc1"]) == [(None, "model output")]
    gpt = [_record(0, 0, layers, "gpt_d3_0L", "gpt")]
    assert mc.claim_layers(gpt, names["gpt", "geometry.per_seq_n_pcs_0.99"]) == [("norm", "final norm")]


def test_claim_rows_are_paired_and_holm_corrected():
    # patch NC1 falls by exactly 0.5 + 0.01 seed at the final norm: the pairing sees it; the
    # seeds' spread (0.3 a seed) hides it from the earlier unpaired rule
    def geo(k, s):
        return {"blocks.0": {"patch_nc1": 2.0}, "blocks.1": {"patch_nc1": 2.0 + 0.1 * s},
                "norm": {"patch_nc1": 2.0 + 0.3 * s - (0.5 + 0.01 * s) * (k > 0), "nc1": 1.0 + 0.3 * s}}
    recs = {"deit3": [_record(k, s, geo(k, s)) for k in (0, 1, 3) for s in range(5)]}
    rows = mc.claim_rows(recs, "paper")
    nc1 = next(r for r in rows if r["claim"].metric == "geometry.patch_nc1" and r["layer"] == "norm")
    assert nc1["k"] == 3 and nc1["test"].n == 5 and nc1["test"].df == 4
    assert nc1["test"].d == pytest.approx(-0.52) and nc1["verdict"] == "agrees"
    assert mc.old_rule(nc1["base"], nc1["arm"], -1) == "within noise"
    acc = next(r for r in rows if r["claim"].metric == "final.val_acc1")
    assert acc["test"].d == pytest.approx(3.0) and acc["verdict"] == "agrees"  # +3 in every seed
    # Holm: the adjusted p is never below the raw one; metrics never measured are "not measured"
    tested = [r for r in rows if r["test"] is not None]
    assert all(r["holm_p"] >= r["test"].p for r in tested)
    assert any(r["verdict"] == "not measured" for r in rows)  # e.g. the per-image spectrum
    table = mc.claims_table(rows)
    assert table[0].startswith("| paradigm | claim | definition | layer | k | baseline | arm | d | t (df) | p | Holm p |")
    row = next(ln for ln in table if "sequence means" in ln and "| final norm |" in ln)
    assert "| 3 of 3 |" in row and "| -0.52 |" in row and "**agrees**" in row
    blocks = mc.block_table(recs)
    assert blocks[0] == "| deit3: definition (arm k) | blocks.0 | blocks.1 | norm |"
    row = next(ln for ln in blocks if ln.startswith("| NC1 of the image means"))
    assert row.split(" | ")[1:] == ["+0 ± 0", "+0 ± 0", "-0.52 ± 0.014 |"]  # descriptive: no verdicts
    assert not any(ln.startswith("| val top-1") for ln in blocks)  # no layer: not in the per-block table
    changes = mc.changes_table(rows, mc.claim_rows(recs, "other"))
    line = next(ln for ln in changes if "neural collapse" in ln)
    # the earlier reading (class-token NC1, unpaired) saw nothing; the paired test on the image means does
    assert line.split(" | ")[2:] == ["within noise (NC1 of the class token)", "within noise", "agrees",
                                     line.split(" | ")[-1]]


def test_paradigms_not_trained_get_no_rows():
    recs = {"deit3": [_record(k, s, {"norm": {"nc1": 2.0 - 0.5 * k + 0.01 * s}}) for k in (0, 3) for s in (0, 1, 2)]}
    assert {r["paradigm"] for r in mc.claim_rows(recs, "paper")} == {"deit3"}
    assert mc.base_paradigm("deit3_avg") == "deit3" and mc.claims_of("deit3_avg") == mc.claims_of("deit3")


def test_curves_table_and_last_quarter():
    from miniature_curves import curves_markdown

    data = {"gpt": {"gpt_d3_0L": {50: [3.0, 3.2], 100: [2.0, 2.2], 150: [1.9, 2.1], 200: [1.85, 2.05]},
                    "gpt_d3_2L": {50: [3.1], 200: [2.5]}}}
    md = curves_markdown(data, {"gpt": "val_bpb"})
    assert md[2] == "| step | gpt_d3_0L | gpt_d3_2L |"
    assert "| 50 | 3.1 ± 0.2 (2) | 3.1 (1) |" in md and "| 100 | 2.1 ± 0.2 (2) |  |" in md
    # 150 = the first step at or after 75% of 200, 100 the first at or after 50%
    assert "- gpt_d3_0L: -0.05 from step 150 to 200 (before: -0.1 from step 100 to 150)" in md
    assert "- gpt_d3_2L: -0.6 from step 50 to 200" in md    # no step in the last quarter but the end


@pytest.mark.timeout(1200)  # above its subprocess's 900 s
@pytest.mark.slow
def test_miniature_runs_end_to_end(tmp_path):
    out, docs = tmp_path / "runs", tmp_path / "docs"
    proc = subprocess.run([sys.executable, "scripts/miniature.py", "--seeds", "0", "--steps", "2", "--pca-maps", "1",
                           "--out", str(out), "--docs", str(docs)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (docs / "README.md").read_text()
    trained = [c for c in mc.CLAIMS if c.paradigm in ("deit3", "gpt")]  # the short profile's paradigms
    claims = report.split("## Learning curves")[0]
    for c in trained:  # every claim's every definition got a row with a verdict, none unmeasured
        assert f"| {c.definition} |" in claims
    assert "not measured" not in claims and "| **one seed: " in claims
    assert "| final norm |" in claims and "| blocks.2 (deepest the loss reaches) |" in claims
    assert "### What the definitions and the test change, on these runs" in claims
    assert "| dino |" not in report
    assert "## Do the heads smooth?" in claims and "**deit3, k = 3 fixed** (n = 1)" in claims
    assert "## How much the blocks change the residual stream" in report and "- gpt gpt_d4_1L_learned:" in report
    assert "| deit3: definition (arm k) | blocks.0 | blocks.1 | blocks.2 | blocks.3 | norm |" in report
    assert "blocks.3" in (docs / "tables/per_block.md").read_text() and list((docs / "figures").glob("blocks_*.png"))
    # the learned gates of every block, in both paradigms, as the tables and figures show them
    assert report.count("### gates_") == 2 and "| 3 | " in report and "moved toward Laplacian" in report
    assert len(list((docs / "tables").glob("gates_*.md"))) == 2 and len(list((docs / "figures").glob("gates_*.png"))) == 2
    assert (docs / "tables/supervised.md").exists() and list((docs / "figures").glob("*.png"))
    assert len(list(out.glob("*/*/results.json"))) == 8  # 2 paradigms x 4 variants
    # learning curves: one line per arm, one row per evaluated step
    assert "## Learning curves" in report and (docs / "figures/curves.png").exists()
    assert "| step | vitt_0L | vitt_1L | vitt_3L | vitt_1L_learned |" in (docs / "tables/curves.md").read_text()


def test_run_jobs_skips_what_is_done_and_goes_seed_by_seed(tmp_path, monkeypatch):
    import io
    import json

    import miniature_runs as mr

    calls = []
    monkeypatch.setattr(mr, "sh", lambda cmd, *a, **k: calls.append(cmd))
    recipes = {"deit3": dict(variants=[("vitt_0L", [])], args=[]),
               "dino": dict(variants=[("vits_0L", [])], args=[], evals=mr.LONG["dino"]["evals"])}
    done = tmp_path / "dino" / "vits_0L_s0"
    (done / "eval" / "knn_digits").mkdir(parents=True)
    (done / "results.json").write_text("{}")
    (done / "eval" / "knn_digits" / "results.json").write_text("{}")
    runs = mr.run_jobs(recipes, tmp_path, [0, 1], io.StringIO())
    assert runs == {"deit3": [tmp_path / "deit3" / f"vitt_0L_s{s}" for s in (0, 1)],
                    "dino": [tmp_path / "dino" / f"vits_0L_s{s}" for s in (0, 1)]}
    # seed 0 whole before seed 1; the finished run and its k-NN are skipped, its linear probe is not
    what = [(c[1], next(a for a in c if a.startswith(("run_dir=", "seed=")))) for c in calls]
    assert what == [("train.py", "seed=0"), ("-m", f"run_dir={done / 'eval' / 'linear_digits'}"),
                    ("train.py", "seed=1"), ("train.py", "seed=1"),
                    ("-m", f"run_dir={tmp_path / 'dino' / 'vits_0L_s1' / 'eval' / 'knn_digits'}"),
                    ("-m", f"run_dir={tmp_path / 'dino' / 'vits_0L_s1' / 'eval' / 'linear_digits'}")]
    timings = [json.loads(x) for x in (tmp_path / "timings.jsonl").read_text().splitlines()]
    assert len(timings) == len(calls) and all(t["end"] >= t["start"] for t in timings)


def test_wall_time_counts_only_while_a_command_ran(tmp_path):
    """Two overlapping runs, then a paradigm re-run a day later: 10 + 5 minutes of wall time,
    not the day between."""
    import json

    rows = [{"run": "deit3/a_s0", "start": 0, "end": 480}, {"run": "gpt/b_s0", "start": 120, "end": 600},
            {"run": "gpt/b_s0", "start": 86400, "end": 86700}]
    (tmp_path / "timings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = miniature.wall_time(tmp_path)
    assert "15 min of wall time" in text and "21 min summed over 3 commands (deit3 8, gpt 13;" in text
    assert miniature.wall_time(tmp_path / "none") == ""


def test_only_and_train_only_train_one_paradigm_then_stop(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run_jobs(recipes, out, seeds, log, jobs=1, steps=None, dry=False):
        calls.append((sorted(recipes), dry))
        return {pd: [out / pd / f"x_s{s}" for s in seeds] for pd in recipes}

    monkeypatch.setattr(miniature, "run_jobs", fake_run_jobs)
    docs = tmp_path / "docs"
    monkeypatch.setattr(sys, "argv", ["miniature.py", "--only", "gpt", "--train-only", "--out", str(tmp_path / "runs"),
                                      "--docs", str(docs)])
    miniature.main()
    # the asked paradigm trained; the whole profile's run dirs named (dry); no analysis, no report
    assert calls == [(["gpt"], False), (["deit3", "gpt"], True)] and not (docs / "README.md").exists()
    monkeypatch.setattr(sys, "argv", ["miniature.py", "--only", "dino", "--out", str(tmp_path / "runs")])
    with pytest.raises(SystemExit):
        miniature.main()
    assert "--only dino: the short profile trains deit3, gpt" in capsys.readouterr().err and len(calls) == 2


def test_run_jobs_dry_names_the_runs_and_runs_nothing(tmp_path, monkeypatch):
    import io

    import miniature_runs as mr

    monkeypatch.setattr(mr, "sh", lambda *a, **k: pytest.fail("a dry run_jobs ran a command"))
    runs = mr.run_jobs({"gpt": dict(variants=[("gpt_d3_0L", []), ("gpt_d3_1L", mr.LEARNED)], args=[])},
                       tmp_path, [0, 1], io.StringIO(), dry=True)
    assert runs == {"gpt": [tmp_path / "gpt" / n for n in ("gpt_d3_0L_s0", "gpt_d3_1L_learned_s0", "gpt_d3_0L_s1",
                                                           "gpt_d3_1L_learned_s1")]}
    assert not (tmp_path / "timings.jsonl").exists()
