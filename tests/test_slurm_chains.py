"""slurm/chains/dino.sh: DINO pre-training -> k-NN and linear probe (side by side, each after the
pre-training) -> ADE20K-layout segmentation (after both) -> analysis. The dependencies and the
routing of overrides as dry-run sbatch lines; then the whole chain, tiny (dino_digits for 3 steps,
the digits ADE20K-layout set), on the one-node Slurm of tests/slurm_cluster.py (~2 min on 2 cores;
skipped where Slurm cannot run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_slurm_cluster import cluster, log, sbatch_words, site_env  # noqa: F401 (cluster: the fixture)

ROOT = Path(__file__).resolve().parent.parent


def dry_chain(runs: Path, *args: str) -> tuple[list[str], list[str]]:
    """(job ids, sbatch lines) of `bash slurm/chains/dino.sh ARGS` with LAPLACE_DRY_RUN=1."""
    env = {**site_env(os.environ, runs), "LAPLACE_DRY_RUN": "1", "LAPLACE_GPUS_PER_NODE": "8"}
    proc = subprocess.run(["bash", "slurm/chains/dino.sh", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(), proc.stderr


def test_dino_chain_dependencies_and_overrides(tmp_path):
    ids, err = dry_chain(tmp_path, "vits_5L", "--nodes=2", "seed=1", "data.root=/d/in1k", "seg.data.root=/d/ade",
                         "probes.num_workers=2", "knn.k=10", "linear.epochs=5", "analysis.max_tokens=9")
    (pre_f, pre), (knn_f, knn), (lin_f, lin), (seg_f, seg), (ana_f, ana) = sbatch_words(err)
    dep = lambda flags: next(f for f in flags if f.startswith("--dependency="))  # noqa: E731
    assert not any(f.startswith("--dependency") for f in pre_f) and "--nodes=2" in pre_f
    assert dep(knn_f) == dep(lin_f) == f"--dependency=afterok:{ids[0]}"
    assert dep(seg_f) == f"--dependency=afterok:{ids[1]}:{ids[2]}" and dep(ana_f) == f"--dependency=afterok:{ids[3]}"
    assert not any(f.startswith("--after=") for flags, _ in sbatch_words(err) for f in flags)  # chain.sh's
    stage1 = tmp_path / "chains/dino_in1k_vits_5L_s1_data.root--d-in1k/1_dino_in1k"
    assert pre == ["experiment=dino_in1k", "model=vits_5L", "seed=1", "data.root=/d/in1k", f"run_dir={stage1}"]
    ckpt = f"checkpoint={stage1}/ckpt/last.pt"
    assert knn == ["python", "-m", "eval.knn", ckpt, "data=imagenet", "data.root=/d/in1k", "num_workers=2", "k=10"]
    assert lin == ["python", "-m", "eval.linear", ckpt, "data=imagenet", "data.root=/d/in1k", "num_workers=2",
                   "epochs=5"]
    assert seg == ["python", "-m", "eval.segmentation", ckpt, "data.root=/d/ade"] and "--nodes=1" in seg_f
    assert ana == [ckpt, "max_tokens=9"]
    gpus = lambda flags: [f for f in flags if f.startswith("--gpus-per-node=")][-1]  # noqa: E731 (sbatch: the last wins)
    assert [gpus(f) for f in (pre_f, knn_f, lin_f, seg_f, ana_f)] == ["--gpus-per-node=8", *["--gpus-per-node=1"] * 2,
                                                                    "--gpus-per-node=8", "--gpus-per-node=1"]
    # --after may name earlier stages only
    env = {**site_env(os.environ, tmp_path), "LAPLACE_DRY_RUN": "1"}
    proc = subprocess.run(["bash", "slurm/chain.sh", "::", "train.sbatch", "::", "--after=2", "analysis.sbatch"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "stage 2: --after=2 names no earlier stage (1..1)" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dino_chain_runs_its_stages_in_order(cluster, tmp_path):
    if not (Path(sys.prefix) / "bin/activate").exists():
        pytest.skip(f"the jobs activate a venv and {sys.prefix} is none")
    runs = tmp_path / "runs"
    proc = subprocess.run(
        ["bash", "slurm/chains/dino.sh", "vits_3L", "experiment=dino_digits", "trainer.device=cpu",
         "trainer.num_workers=0", "trainer.max_steps=3", "trainer.progress=false", "probes.num_workers=0",
         "probes.device=cpu", "linear.epochs=2", "seg.eval=seg_digits_linear", "seg.iters=4", "seg.batch_size=8",
         "seg.data.n_train=8", "seg.data.n_val=4", "seg.trainer.progress=false", f"seg.paths.data_dir={tmp_path}/data",
         "analysis.max_tokens=2000", "analysis.figures=false"],
        env=site_env(cluster.env, runs), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ids = proc.stdout.split()
    names = ["dino_digits", "knn", "linear", "seg", "analysis"]
    infos = cluster.wait(*ids, timeout=360)
    assert [i["JobState"] for i in infos] == ["COMPLETED"] * 5, [log(runs, n, j)[-2000:] for n, j in zip(names, ids)]
    pre, knn, lin, seg, ana = infos
    # The probes after the pre-training, the segmentation after both probes, the analysis after it
    # (times in whole seconds).
    assert knn["StartTime"] >= pre["EndTime"] and lin["StartTime"] >= pre["EndTime"]
    assert seg["StartTime"] >= max(knn["EndTime"], lin["EndTime"]) and ana["StartTime"] >= seg["EndTime"]
    (chain,) = (runs / "chains").iterdir()
    stage1 = chain / "1_dino_digits"
    assert json.loads((stage1 / "results.json").read_text())["steps"] == 3
    res = {name: json.loads((stage1 / "eval" / sub / "results.json").read_text())
           for name, sub in [("knn", "knn_digits"), ("linear", "linear_digits"), ("seg", "seg_digits_ade20k_l1")]}
    assert all(r["model"] == "vits_d4_w96_3L" and r["num_laplacian_heads"] == 3 for r in res.values())
    assert 0 < res["knn"]["knn"]["top1"] <= 100 and res["seg"]["iters"] == 4 and 0 <= res["seg"]["mIoU"] <= 100
    assert 0 < res["linear"]["linear"]["top1"] <= 100 and res["linear"]["epochs"] == 2
    analysis = json.loads((stage1 / "ckpt/last_analysis/analysis.json").read_text())
    assert analysis["model"] == "vits_d4_w96_3L"
