"""Engine infrastructure that the training tests do not reach: SLURM ranks, periodic
checkpoints, the metrics log on resume, wandb (offline)."""
from __future__ import annotations

import json
import os

import pytest

from train import dist
from train.logger import MetricsLogger, read_metrics
from conftest import TINY_VIT
from train import run


def test_slurm_environment_gives_ranks(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so the values env_ranks exports are undone after
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")  # srun sets it in step tasks only
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("MASTER_ADDR", "node0")  # set: no scontrol call
    assert dist.env_ranks() == (5, 8, 1)
    assert os.environ["RANK"] == "5" and os.environ["WORLD_SIZE"] == "8"
    assert os.environ["MASTER_PORT"] == str(20000 + 123)


def test_torchrun_environment_wins_and_single_process_default(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.env_ranks() == (1, 2, 1)
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    assert dist.env_ranks() == (0, 1, 0)


def test_keep_every_writes_periodic_checkpoints(make_cfg, tmp_path):
    run(make_cfg(*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.max_steps=4",
                 "trainer.ckpt_every=2", "trainer.keep_every=2", "trainer.eval_every=100"))
    ckpts = sorted(p.name for p in (tmp_path / "run/ckpt").iterdir())
    assert ckpts == ["last.pt", "step_2.pt", "step_4.pt"]


def test_resumed_log_drops_lines_after_the_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path)
    for step in (1, 2, 3, 4):
        log.log(step, {"loss": float(step)}, split="train")
    MetricsLogger(tmp_path, resume_step=2)  # the interrupted run had checkpointed at step 2
    recs = read_metrics(tmp_path)  # (the resume itself is a record of its own, at its step)
    assert [r["step"] for r in recs if r["split"] != "resume"] == [1, 2] and recs[-1]["split"] == "resume"


def test_wandb_logger_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(tmp_path, wandb_cfg={"project": "laplace-test", "mode": "offline"},
                        config={"seed": 0})
    log.log(1, {"loss": 0.5}, split="train")
    log.finish()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 0.5
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run was written"


def test_disabled_logger_writes_nothing(tmp_path):
    MetricsLogger(tmp_path, enabled=False).log(1, {"loss": 1.0})
    assert not (tmp_path / "metrics.jsonl").exists()
