"""The miniature reproduction (scripts/miniature.py): its verdict rule, and the whole script
end to end at smoke size (every paradigm and variant, one seed, two steps)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import miniature  # noqa: E402


def test_verdict_rule():
    base, lap = [1.0, 1.1, 0.9], [2.0, 2.1, 1.9]
    v, d, se = miniature.verdict(base, lap, +1)
    assert v == "agrees" and d == pytest.approx(1.0) and se == pytest.approx((0.01 / 3 * 2) ** 0.5)
    assert miniature.verdict(base, lap, -1)[0] == "disagrees"
    assert miniature.verdict(base, [1.05, 1.2, 0.95], +1)[0] == "within noise"  # d = 0.067 < 2 se
    assert miniature.verdict([1.0], [2.0], +1)[0] == "one seed: paper's direction"
    assert miniature.verdict([1.0], [1.0], -1)[0] == "one seed: no difference"


def _record(k: int, seed: int, by_layer: dict) -> dict:
    """A flat record as analysis.runs.collect makes it, with geometry at two layers."""
    return {"k": k, "mode": "fixed", "seed": seed, "metrics": {"final.val_acc1": 50.0 + k + seed},
            "layer_geometry": by_layer, "geometry": by_layer["norm"]}


def test_claims_state_and_use_their_layer():
    # nc1 falls with Laplacian heads at blocks.0 only; at the final norm the arms are the same
    recs = {"deit3": [_record(k, s, {"blocks.0": {"nc1": (1.0 if k else 2.0) + 0.01 * s}, "norm": {"nc1": 3.0 + 0.01 * s}})
                      for k in (0, 3) for s in (0, 1, 2)]}
    for _, _, metric, _ in miniature.CLAIMS:  # PAPER.md names no layer for any claim
        want = ("norm", "final norm (paper silent)") if metric.startswith("geometry.") else (None, "model output")
        assert miniature.claim_layer(metric) == want
    rows = {ln.split(" | ")[1]: ln for ln in miniature.claims_table(recs)[2:]}
    nc1 = rows["neural collapse strengthens (NC1 of the class token falls)"]
    assert "| final norm (paper silent) | 3.01 ± 0.01 | 3.01 ± 0.01 | +0 |" in nc1 and "**within noise**" in nc1
    assert "| model output | 51 ± 1 | 54 ± 1 | +3 |" in rows["accuracy improves (val top-1)"]
    block = miniature.block_claims_table(recs)
    assert block[0] == "| deit3: claim | blocks.0 | norm |"
    row = next(ln for ln in block if ln.startswith("| neural collapse strengthens"))
    assert row.split(" | ")[1:] == ["-1 ± 0.016 agrees", "+0 ± 0.016 within noise |"]
    assert not any(ln.startswith("| accuracy") for ln in block)  # no layer: not in the per-block table


def test_middle_arm_and_paradigms_not_trained():
    recs = {"deit3": [_record(k, s, {"norm": {"nc1": 2.0 - 0.5 * k + 0.01 * s}}) for k in (0, 1, 3) for s in (0, 1, 2)]}
    rows = {ln.split(" | ")[1]: ln for ln in miniature.claims_table(recs, "middle")[2:]}
    assert "baseline vs the middle k" in miniature.claims_table(recs, "middle")[0]
    assert "| 2.01 ± 0.01 | 1.51 ± 0.01 | -0.5 |" in rows["neural collapse strengthens (NC1 of the class token falls)"]
    assert "| 2.01 ± 0.01 | 0.51 ± 0.01 | -1.5 |" in miniature.claims_table(recs)[5]  # all: k = 3
    assert all(not ln.startswith(("| gpt", "| dino")) for ln in miniature.claims_table(recs))


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
    trained = [c for c in miniature.CLAIMS if c[0] in ("deit3", "gpt")]  # the short profile's paradigms
    for claim in trained:  # every claim got a verdict
        assert claim[1] in report
    assert "| dino |" not in report
    claims = report.split("## Geometry at every block")[0]  # the per-block verdicts follow
    assert claims.count("one seed:") == 2 * len(trained)  # all heads Laplacian, and the middle arm
    assert "## How much the blocks change the residual stream" in report and "- gpt gpt_d4_1L_learned:" in report
    assert "final norm (paper silent)" in report and "| deit3: claim | blocks.0 | blocks.1 | blocks.2 | blocks.3 | norm |" in report
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
