"""Multi-process training: torchrun with 2 CPU processes (gloo) == 1 process at the same global batch.

What must match, and why it does: with repeated augmentation (as with torch's
DistributedSampler) rank r takes positions r, r + 2, ... of the one epoch order, so the 16
samples of optimizer step s are positions 16s .. 16s + 15 whether one process takes them as one
micro batch or two processes take 4 + 4 twice (accumulation under DDP's no_sync). A ViT has no
batch statistics, so with no randomness in the forward pass (drop-path 0, no Mixup) the averaged
gradients, LAMB's updates, the logged losses (the engine averages them over ranks) and the
validation metrics agree to float rounding. 3-Augment stays on: a sample's augmentation seed
is fixed by its global position in the epoch, not by the rank that loads it. Drop-path and
Mixup draw per rank, so they stay off here.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY_VIT
from laplace.checkpoint import load_checkpoint
from train.logger import read_metrics
from train import run

RECIPE = [*TINY_VIT, "model=vitt_3L", "optim=lamb", "trainer.loss=bce", "trainer.repeated_aug=3",
          "model.drop_path_rate=0.0", "trainer.mixup=0.0", "trainer.cutmix=0.0", "data.augment=three_augment",
          "trainer.device=cpu", "trainer.global_batch_size=16", "trainer.max_steps=4",
          "trainer.eval_every=2", "optim.schedules.lr.warmup=1"]


def _records(run_dir, split):
    return [r for r in read_metrics(run_dir) if r.get("split") == split]


@pytest.mark.timeout(900)  # above its torchrun subprocess's 600 s
@pytest.mark.slow
def test_two_processes_match_one(make_cfg, tmp_path):
    run(make_cfg(*RECIPE, "trainer.micro_batch_size=16", run_dir=tmp_path / "one"))

    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train.py", *RECIPE, "trainer.micro_batch_size=4", f"run_dir={tmp_path / 'two'}",
           f"paths.runs_dir={tmp_path / 'runs'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "global batch 16 = 4 x 2 x 2 accum" in proc.stdout

    one, two = tmp_path / "one", tmp_path / "two"
    losses = [[r["loss"] for r in _records(d, "train")] for d in (one, two)]
    assert len(losses[0]) == len(losses[1]) == 4
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)
    for a, b in zip(_records(one, "val"), _records(two, "val")):
        assert a["val_acc1"] == b["val_acc1"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    ckpt = load_checkpoint(two / "ckpt/last.pt")
    assert ckpt["loop"]["world_size"] == 2
    w1, w2 = load_checkpoint(one / "ckpt/last.pt")["model"], ckpt["model"]
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)
