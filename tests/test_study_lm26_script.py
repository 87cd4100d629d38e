"""scripts/study_lm26.sh, the decisive LM experiment's one command, without training: a `python` on
PATH that records each command (and runs the real one for the script's own `python -`) shows which
runs each stage starts, and finished pilot folders made here feed the declared learning-rate rule."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts/study_lm26.sh"


def _pilot(root: Path, k: int, factor: float, seed: int, endpoint: float, steps=(1300, 1400, 1500, 1600)):
    d = root / "gpt/study_lm26_pilot" / f"gpt26_d4_{k}L_s{seed}_optim.lr_factor-{factor:g}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"seed: {seed}\nmodel:\n  num_laplacian_heads: {k}\noptim:\n  lr_factor: {factor:g}\n")
    vals = [{"step": 100, "split": "val", "val_bpb": 9.0}]  # an early evaluation, outside the last four
    vals += [{"step": s, "split": "val", "val_bpb": endpoint} for s in steps]
    vals.append(vals[-1])  # a finished run re-evaluated: its last step twice
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in vals))
    (d / "results.json").write_text("{}")


def _run(tmp_path: Path, endpoints: dict) -> tuple[subprocess.CompletedProcess, list[str]]:
    runs, data, bin_ = tmp_path / "runs", tmp_path / "data", tmp_path / "bin"
    (data / "stdlib_bpe1k").mkdir(parents=True)
    (data / "stdlib_bpe1k/meta.json").write_text("{}")  # the data exists: no prepare.py
    for (k, f, s), e in endpoints.items():
        _pilot(runs, k, f, s, e)
    bin_.mkdir()
    log = tmp_path / "commands.log"
    (bin_ / "python").write_text(f'#!/bin/sh\n[ "$1" = - ] && exec {sys.executable} "$@"\n'
                                 f'echo "$*" >> {log}\n')
    (bin_ / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "VIRTUAL_ENV": sys.prefix, "RUNS": str(runs),
           "LAPLACE_DATA": str(data), "DOCS": str(tmp_path / "docs"), "JOBS": "1"}  # one at a time: in order
    env.pop("STEPS", None)
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    return proc, log.read_text().splitlines() if log.exists() else []


def _grid(endpoint):
    return {(k, f, s): endpoint(k, f) for k in (0, 2) for f in (0.5, 1.0, 2.0) for s in (100, 101)}


def test_every_stage_starts_its_declared_runs_and_each_arm_gets_its_factor(tmp_path):
    # k = 0: factor 2 lowest by 0.010 (chosen); k = 2: factor 0.5 lowest, but 1 within 0.002 (1 kept)
    proc, cmds = _run(tmp_path, _grid(lambda k, f: {(0, 2.0): 1.40, (2, 0.5): 1.409, (2, 1.0): 1.4105}.get((k, f), 1.41)))
    assert proc.returncode == 0, proc.stderr
    assert "learning-rate factors: k=0 x2, k=2 x1" in proc.stdout
    train = [c for c in cmds if c.startswith("train.py")]
    # one command per run (no line joined to the next), the pilots first, then the pairs seed by seed
    assert train[:12] == [f"train.py -m experiment=study_lm26_pilot model=gpt26_d4_{k}L optim.lr_factor={f} seed={s}"
                          for k in (0, 2) for f in ("0.5", "1", "2") for s in (100, 101)]
    assert train[12:] == [f"train.py -m experiment=study_lm26 model=gpt26_d4_{k}L optim.lr_factor={f} seed={s}"
                          for s in range(8) for k, f in ((0, "2"), (2, "1"))]
    assert cmds[-2].startswith("-m analysis checkpoint=") and "study_lm26/*/ckpt/step_*.pt" in cmds[-2]
    assert cmds[-1].startswith("-m analysis.report") and "plan=study_lm26" in cmds[-1]


@pytest.mark.parametrize("case, message", [
    ("missing", "11 of the 12 pilots finished; re-run this script"),
    ("extra", "other than the 12 declared pilots once each [(0, 4.0, 100)]: move the others out"),
])
def test_pilots_missing_or_beside_others_stop_before_the_paired_runs(tmp_path, case, message):
    grid = _grid(lambda k, f: 1.41)
    if case == "missing":
        grid.pop((2, 2.0, 101))
    else:
        grid[(0, 4.0, 100)] = 1.0  # a run outside the grid would otherwise win
    proc, cmds = _run(tmp_path, grid)
    assert proc.returncode != 0 and message in proc.stderr
    assert not [c for c in cmds if "experiment=study_lm26 " in c]  # no paired run started
