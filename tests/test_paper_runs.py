"""scripts/paper_runs.py (bash slurm/paper.sh): the paper's runs (a DataFrame), their H200-hours and
a dry-run submission of a subset. Costs are composed from the real experiment configs and counted on
fake tensors (no memory)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from test_slurm_cluster import sbatch_words, site_env

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import paper_runs  # noqa: E402


@pytest.mark.slow
def test_every_run_listed_with_positive_hours_proportional_to_steps():
    runs = paper_runs.runs()
    # the author's ViT-B (7 k x 3 seeds) and ViT-L (5 x 3) sweeps; GPT k = 0..10 x pre / mid / SFT;
    # DINO k = 0..6 x pre-training, k-NN, linear, ADE20K
    assert Counter(runs.sweep) == {"deit3_vitb": 21, "deit3_vitl": 15, "gpt_d20": 33, "dino": 28}
    assert Counter(zip(runs.sweep, runs.stage))[("dino", "seg")] == 7
    assert sorted(set(runs.k[runs.sweep == "deit3_vitb"])) == [0, 1, 3, 6, 9, 11, 12]
    # every training stage costed; the evaluations not (minutes, bound by their data loader)
    evals = runs.stage.isin(paper_runs.EVALS)
    trained = runs[~evals]
    assert (trained.gpu_hours > 0).all() and (trained.steps > 0).all() and (trained.flops_per_step > 0).all()
    assert evals.sum() == 21 and runs[evals][["steps", "flops_per_step", "gpu_hours"]].isna().all().all()
    vitb = runs[runs.sweep == "deit3_vitb"].iloc[0]
    assert vitb.steps == 400 * 625  # 400 epochs of 1,281,167 images at 2,048 a step
    # ~77 GFLOPs per image at 192 px (3 x 25.6 forward), x 2,048 a step
    assert vitb.flops_per_step / 2048 == pytest.approx(76.6e9, rel=0.01)
    vitl = runs[runs.sweep == "deit3_vitl"].iloc[0]
    assert 3 < vitl.gpu_hours / vitb.gpu_hours < 4  # ViT-L: ~3.5x ViT-B's compute
    rates = paper_runs.rates()
    assert 0.1 < rates["vit"] / rates["peak"] < 0.5 and 0.1 < rates["gpt"] / rates["peak"] < 0.5
    # twice the steps, twice the hours (and the FLOPs per step unchanged)
    for only, double in [("sweep=deit3_vitb,k=0,seed=0", "trainer.epochs=800"),
                         ("sweep=gpt_d20,k=5,stage=train", "trainer.max_steps=42800"),
                         ("sweep=dino,k=5,stage=train", "trainer.epochs=200")]:
        [one], [two] = paper_runs.runs([only]).itertuples(), paper_runs.runs([only], [double]).itertuples()
        assert two.steps == 2 * one.steps and two.flops_per_step == one.flops_per_step
        assert two.gpu_hours == pytest.approx(2 * one.gpu_hours, rel=1e-12)
    # the cost is counted once per sweep and stage: the Laplacian heads add no counted FLOPs
    assert paper_runs.train_cost("deit3_in1k_author", ("model=vitb_0L",)) == \
        paper_runs.train_cost("deit3_in1k_author", ("model=vitb_12L",))


def test_filters_select_unions_and_refuse_unknown_keys():
    from laplace.errors import ConfigError

    assert paper_runs.SWEEPS.seed["deit3_vitb"] == [0, 1, 2]
    df = pd.DataFrame([dict(sweep="dino", experiment="eval.knn", model=f"vits_{k}L", k=k, seed=0, stage="knn")
                       for k in (4, 5)] + [dict(sweep="gpt_d20", experiment="gpt_d20", model="gpt_d20_5L", k=5,
                                                seed=0, stage="train")])
    assert paper_runs.select(df, "sweep=dino,k=0,k=5").tolist() == [False, True, False]
    assert paper_runs.select(df, "k=5").tolist() == [False, True, True]
    with pytest.raises(ConfigError, match="'foo=1' is no KEY=VALUE"):
        paper_runs.select(df, "foo=1")


@pytest.mark.slow
def test_dry_run_submits_a_subset_through_sweep_and_chain_scripts(tmp_path):
    env = {**site_env(os.environ, tmp_path), "LAPLACE_GPUS_PER_NODE": "8", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "slurm/paper.sh", "--only", "sweep=deit3_vitb,k=0,seed=0,seed=2",
                           "--only", "sweep=dino,k=5", "--submit", "--", "data.root=/d"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The Markdown table: sweep, stage, experiment, k, seeds, runs, steps per run, ... (an evaluation's: empty)
    rows = {tuple(c[:2]): c for c in ([c.strip() for c in ln.split("|")[1:-1]] for ln in proc.stdout.splitlines()
                                      if ln.startswith("| ") and not ln.startswith("| sweep"))}
    assert rows["deit3_vitb", "train"][5:7] == ["2", "250,000"]
    assert rows["dino", "train"][5:7] == ["1", "250,200"] and rows["dino", "knn"][5:] == ["1", "", "", "", ""]
    assert set(rows) == {("deit3_vitb", "train")} | {("dino", s) for s in ("train", "knn", "linear", "seg")}
    total = re.search(r"^Total: 6 runs, ([\d,]+) H200-hours", proc.stdout, re.M)
    assert total and int(total.group(1).replace(",", "")) > 0
    assert re.findall(r"^\$ (.*)$", proc.stderr, re.M) == [
        "bash slurm/sweep.sh --models vitb_0L --seeds 0,2 --ntasks-per-node=4 --gpus-per-node=4 --time=03:00:00 "
        "-- experiment=deit3_in1k_author data.root=/d",
        "bash slurm/chains/dino.sh vits_5L experiment=dino_in1k seed=0 data.root=/d"]
    stages = sbatch_words(proc.stderr)
    assert len(stages) == 2 + 5  # two seeds of one model; the DINO chain's five stages
    (f0, a0), (f1, a1) = stages[:2]
    assert a0 == ["experiment=deit3_in1k_author", "data.root=/d", "model=vitb_0L", "seed=0"]
    assert a1[-1] == "seed=2" and "--gpus-per-node=4" in f0 and "--time=03:00:00" in f0
    assert stages[2][1][:3] == ["experiment=dino_in1k", "model=vits_5L", "seed=0"]
    assert stages[3][1][2:] == ["eval.knn", f"checkpoint={tmp_path}/chains/dino_in1k_vits_5L_s0_data.root--d/"
                                "1_dino_in1k/ckpt/last.pt", "data=imagenet", "data.root=/d"]
    assert not (tmp_path / "slurm").exists()  # a dry run: nothing submitted, no log folder made


def test_submit_without_sbatch_is_one_line(tmp_path):
    """--submit --no-dry-run off a cluster: submit.sh's line, then a 14-line traceback; now one line, nothing run."""
    # the venv's bin only: no sbatch, also where the machine has Slurm (CI installs it for other tests)
    env = {**site_env(os.environ, tmp_path), "PATH": os.path.dirname(sys.executable)}
    proc = subprocess.run([sys.executable, "scripts/paper_runs.py", "--only", "sweep=deit3_vitb,k=0,seed=0",
                           "--submit", "--no-dry-run"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: --no-dry-run: Slurm's sbatch is not on the PATH; submit from the cluster's login node (or load its "
        "Slurm module), or leave out --no-dry-run to print the sbatch lines"], proc.stderr[-2000:]
