"""Ranks and device under Slurm, from environments recorded on a real one-node Slurm 22.05
(`sbatch --ntasks=2`): the batch script itself vs. the tasks of an `srun` step in it."""
from __future__ import annotations

import os
import types

import pytest
import torch

from train import dist

# `env | grep ^SLURM` in the batch script of an `sbatch --ntasks=2` job (trimmed): SLURM_NTASKS=2
# and SLURM_PROCID=0 although this is one process, and no SLURM_STEP_* at all.
BATCH = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "vm", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
         "SLURM_GTIDS": "0", "SLURM_LOCALID": "0", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2"}
# The same in task 1 of `srun` (step 0) inside that script.
SRUN_TASK1 = {**BATCH, "SLURM_GTIDS": "0,1", "SLURM_LOCALID": "1", "SLURM_PROCID": "1", "SLURM_STEPID": "0",
              "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "vm",
              "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2"}


@pytest.fixture
def slurm_env(monkeypatch):
    """Replace the launcher variables with `env`; what env_ranks exports is undone after."""
    def apply(env):
        for k in [k for k in os.environ if k.startswith("SLURM_")] + [
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]:
            monkeypatch.setenv(k, "")  # recorded, so a value set later is removed on teardown
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    return apply


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend `n` GPUs are visible; real CUDA is never touched."""
    def apply(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    return apply


def test_batch_script_of_multi_task_job_runs_single_process(slurm_env, monkeypatch, capsys):
    slurm_env(BATCH)
    monkeypatch.setattr(dist.dist, "init_process_group", lambda *a, **k: pytest.fail("process group initialised"))
    info = dist.setup("cpu")
    assert (info.rank, info.world_size, info.local_rank) == (0, 1, 0) and not info.distributed
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "srun" in err[0]


def test_srun_step_task_gets_its_ranks(slurm_env, monkeypatch, capsys):
    slurm_env(SRUN_TASK1)
    monkeypatch.setattr(dist.subprocess, "check_output", lambda cmd: b"vm\n")  # scontrol show hostnames vm
    assert dist.env_ranks() == (1, 2, 1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("vm", str(20000 + 1))
    assert capsys.readouterr().err == ""


def test_single_task_step_and_torchrun_inside_slurm(slurm_env, capsys):
    slurm_env({**SRUN_TASK1, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
               "SLURM_NPROCS": "1", "SLURM_STEP_NUM_TASKS": "1"})  # `srun -n1` in the same job
    assert dist.env_ranks() == (0, 1, 0) and capsys.readouterr().err == ""
    os.environ.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3")  # torchrun launched from the batch script
    os.environ.update(BATCH)
    assert dist.env_ranks() == (3, 4, 3)


@pytest.mark.parametrize("visible, expected", [(1, 0), (2, 1)])  # --gpus-per-task=1 vs --gpus=2
def test_device_index_follows_visible_gpus(slurm_env, fake_cuda, monkeypatch, visible, expected):
    slurm_env(SRUN_TASK1)
    fake_cuda(visible)
    monkeypatch.setenv("MASTER_ADDR", "vm")
    calls = []
    monkeypatch.setattr(dist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    where = {}  # setup() leaves each rank's host and pid in the rendezvous store (for lost_peer)
    monkeypatch.setattr(dist, "_store", lambda: types.SimpleNamespace(set=where.__setitem__))
    info = dist.setup("cuda")
    assert info.device == torch.device("cuda", expected) and info.local_rank == 1
    assert list(where) == ["laplace/where/1"]
    assert calls == [(("nccl",), {"rank": 1, "world_size": 2})]
    assert dist.resolve_device("cuda:1") == torch.device("cuda", 1)  # an explicit index is kept
