"""scripts/gpu_check.sh on the CPU: a check's line (what torch logged, the CUDA peak its train.py
runs printed), the record of a CUDA run (docs/gpu_runs.jsonl + .md), the rank comparison, and the
script's dry run, which records nothing unless asked."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


def check(tmp_path, device: str = "cpu") -> gpu_check.Check:
    return gpu_check.Check(argparse.Namespace(out=str(tmp_path), device=device, compile=True, tiny=True))


GRAPH_BREAK_AND_RECOMPILE = """
import torch
def f(x):
    y = x.sin()
    print("a graph break")
    return y.cos()
g = torch.compile(f, backend="eager")
g(torch.randn(4)); g(torch.randn(4, 2))  # another rank: a recompile
"""


@pytest.mark.slow  # ~10 s: a Python that imports torch and compiles twice
def test_a_checks_line_counts_what_torch_logged(tmp_path, capsys):
    """The check's commands run with TORCH_LOGS=graph_breaks,recompiles: its line counts the graph
    breaks and recompiles in torch's own log format (the log keeps the reasons)."""
    c = check(tmp_path)
    c.run("compiles", lambda c: c.sh(sys.executable, "-c", GRAPH_BREAK_AND_RECOMPILE, timeout=120) and "compiled f")
    line = capsys.readouterr().out.strip()
    breaks, recompiles = map(int, re.search(r"compiled f \[(\d+) graph breaks, (\d+) recompiles\]$", line).groups())
    assert line.startswith("PASS compiles") and breaks >= 1 and recompiles >= 1, line
    log = (tmp_path / "compiles.log").read_text()
    assert "Recompiling function f" in log and "Graph break in user code" in log  # the log says where and why
    assert log.count("Recompiling function") == recompiles


def test_a_check_passes_skips_or_fails_with_the_peak_its_runs_printed(tmp_path, capsys):
    c = check(tmp_path)
    peaks = "echo 'CUDA peak 2.50 GiB'; echo 'CUDA peak 11.25 GiB'"  # what RUN prints at exit, per train.py
    c.run("echo", lambda c: c.sh("sh", "-c", peaks) and "said hi")
    c.run("skipped", lambda c: "SKIP: one GPU")
    c.run("broken", lambda c: c.sh("sh", "-c", "echo the last words; exit 2"))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS echo") and out[0].endswith("said hi [peak 11.2 GiB, 0 graph breaks, 0 recompiles]")
    assert out[1].startswith("SKIP skipped") and out[1].endswith("one GPU")
    assert out[2].startswith("FAIL broken") and "exit status 2, expected 0: the last words" in out[2]
    assert list(c.results) == ["echo", "broken"] and c.results["broken"]["result"] == "FAIL"  # a SKIP: no record
    assert (tmp_path / "echo.log").read_text().splitlines()[-1] == "CUDA peak 11.25 GiB"


def test_the_run_wrapper_keeps_the_exit_status_and_argv(tmp_path):
    """RUN runs train.py in its own process (sys.argv as train.py sees it) and keeps its status."""
    script = tmp_path / "s.py"
    script.write_text("import sys; print(sys.argv); sys.exit(3)")
    proc = subprocess.run([sys.executable, "-c", gpu_check.RUN, str(script), "a=1", "b=2"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3 and proc.stdout.strip() == repr([str(script), "a=1", "b=2"])
    assert "CUDA peak" not in proc.stdout  # CUDA never initialised: no peak


def test_rank_fingerprints_that_differ_are_named():
    same = {"w": "a", "b": "c"}
    result = {"dino": {"phases": {"set-up": [same, same], "end": [same, {"w": "a", "b": "x", "extra": "y"}]}}}
    assert gpu_check.differing(result) == ["dino end: b, extra"]
    assert gpu_check.differing({"gpt": {"phases": {"set-up": [same, dict(same)]}}}) == []


def test_the_record_keeps_the_last_run_of_each_check(tmp_path, monkeypatch):
    path = tmp_path / "gpu_runs.jsonl"
    c = check(tmp_path)
    c.results = {"deit3": {"result": "PASS", "measured": "6 steps | a pipe", "used": "peak 3.0 GiB"},
                 "analysis": {"result": "FAIL", "measured": "RuntimeError: x | y", "used": ""}}
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--only", "deit3", "analysis"])
    gpu_check.record(c, path)
    c.results = {"analysis": {"result": "PASS", "measured": "two checkpoints", "used": ""}}
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--only", "analysis"])
    gpu_check.record(c, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["check"], r["result"]) for r in rows] == [("deit3", "PASS"), ("analysis", "FAIL"), ("analysis", "PASS")]
    assert rows[0]["gpu"] == "cpu (dry run)" and rows[-1]["command"] == "bash scripts/gpu_check.sh --only analysis"
    assert rows[0]["commit"] and rows[0]["torch"]
    table = (tmp_path / "gpu_runs.md").read_text().splitlines()
    body = [ln for ln in table if ln.startswith("| ") and not ln.startswith("| check")]
    assert [ln.split("|")[1].strip() for ln in body] == ["deit3", "analysis"]  # one row each, first-run order
    assert "two checkpoints" in body[1] and "| PASS " in body[1]
    assert "6 steps \\| a pipe" in body[0] and body[0].count(" | ") == body[1].count(" | ")  # escaped: one cell


def test_a_cpu_run_records_nothing_unless_asked(tmp_path):
    """Without --record only a CUDA run writes docs/gpu_runs.*: a dry run leaves them as they were."""
    docs = {p: p.read_bytes() for p in (ROOT / "docs").glob("gpu_runs.*")}
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--out", str(tmp_path), "--only"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "[gpu_check] 0/0 passed" in proc.stdout, proc.stdout + proc.stderr
    assert {p: p.read_bytes() for p in (ROOT / "docs").glob("gpu_runs.*")} == docs


@pytest.mark.slow  # ~2 min (~4 on 2 busy cores): the script itself on CPU, three of its checks
def test_cpu_dry_run_records_only_where_asked(tmp_path):
    """deit3 trains, stops and resumes; analysis fails (a fresh --out holds no gpt_tiny checkpoint);
    compile is skipped (--no-compile). Both results land in --record's file; docs/ stays as it was."""
    docs = {p: p.read_bytes() for p in (ROOT / "docs").glob("gpu_runs.*")}
    record = tmp_path / "runs.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--no-compile", "--tiny", "--out",
                           str(tmp_path / "out"), "--only", "deit3", "analysis", "compile", "--record", str(record)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS deit3" in proc.stdout and "FAIL analysis" in proc.stdout and "SKIP compile" in proc.stdout
    assert "stop@3 + resume -> 6; val_loss=" in proc.stdout and "[gpu_check] 1/2 passed" in proc.stdout
    assert [json.loads(line)["check"] for line in record.read_text().splitlines()] == ["deit3", "analysis"]
    assert (tmp_path / "runs.md").exists()
    assert {p: p.read_bytes() for p in (ROOT / "docs").glob("gpu_runs.*")} == docs
