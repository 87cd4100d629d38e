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


@pytest.mark.timeout(1200)  # above its subprocess's 900 s
@pytest.mark.slow
def test_miniature_runs_end_to_end(tmp_path):
    out, docs = tmp_path / "runs", tmp_path / "docs"
    proc = subprocess.run([sys.executable, "scripts/miniature.py", "--seeds", "0", "--steps", "2", "--pca-maps", "1",
                           "--out", str(out), "--docs", str(docs)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (docs / "README.md").read_text()
    for claim in miniature.CLAIMS:  # every claim got a verdict
        assert claim[1] in report
    assert report.count("one seed:") == len(miniature.CLAIMS)
    assert "## How much the blocks change the residual stream" in report and "- gpt gpt_d4_1L_learned:" in report
    # the learned gates of every block, in both paradigms, as the tables and figures show them
    assert report.count("### gates_") == 2 and "| 3 | " in report and "moved toward Laplacian" in report
    assert len(list((docs / "tables").glob("gates_*.md"))) == 2 and len(list((docs / "figures").glob("gates_*.png"))) == 2
    assert (docs / "tables/supervised.md").exists() and list((docs / "figures").glob("*.png"))
    assert len(list(out.glob("*/*/results.json"))) == 8  # 2 paradigms x 4 variants
