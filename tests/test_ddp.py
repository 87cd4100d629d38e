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


# ---------------------------------------------------------------- one model on every rank

STEPS = ["trainer.device=cpu", "trainer.num_workers=0", "trainer.progress=false", "trainer.log_every=1",
         "trainer.max_steps=4", "trainer.eval_every=100"]
TINY_DINO = ["experiment=dino_digits", "model.depth=1", "model.embed_dim=48", "trainer.global_batch_size=8",
             "trainer.head.out_dim=64", "trainer.head.hidden_dim=32", "trainer.head.bottleneck_dim=16",
             "trainer.multicrop.local_crops=2", "data.val_fraction=0.99"]


def _rank_runs(tmp, out) -> dict[str, list[str]]:
    """label -> config name and overrides (seg_linear reads DINO's checkpoint): each stops after
    2 of 4 steps and resumes, but dino_straight, DINO uninterrupted."""
    import fakedata

    fakedata.write_cifar(tmp / "cifar", "cifar10", n_train=16, n_test=8)
    runs_dir = f"paths.runs_dir={tmp / 'runs'}"
    stop = [*STEPS, "trainer.stop_after=2", runs_dir]
    return {
        "deit3": ["config", "experiment=deit3_cifar10", "model.depth=1", "model.embed_dim=48", "data.img_size=32",
                  "data.patch_size=8", f"data.root={tmp / 'cifar'}", "trainer.global_batch_size=8", *stop],
        "gpt": ["config", "experiment=gpt_pydoc", "model=gpt_d2_1L", "data.seq_len=32", "optim=muon",
                "trainer.global_batch_size=8", *stop],
        "dino": ["config", *TINY_DINO, *stop],
        "dino_straight": ["config", *TINY_DINO, *STEPS, runs_dir],
        "seg_linear": ["segmentation", f"checkpoint={out}.dino/ckpt/last.pt", "eval=seg_digits_linear", "iters=4",
                       "batch_size=4", "data.n_train=8", "data.n_val=2", f"paths.data_dir={tmp / 'data'}", *stop],
    }


@pytest.fixture(scope="module")
def rank_fingerprints(tmp_path_factory) -> tuple[dict, Path]:
    """Every run of _rank_runs in one torchrun of 2 CPU processes (gloo): label -> phase -> the
    fingerprint of the whole trained module on each rank (tests/ddp_ranks.py)."""
    tmp = tmp_path_factory.mktemp("ranks")
    out = tmp / "out"
    lines = "\n".join(" ".join([name, *args]) for name, args in _rank_runs(tmp, out).items())
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests/ddp_ranks.py"), str(out), lines],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    return json.loads(out.read_text()), out


@pytest.mark.timeout(300)
@pytest.mark.slow  # the fixture: one torchrun of five small runs
@pytest.mark.parametrize("name", ["deit3", "gpt", "dino", "seg_linear"])
def test_every_rank_holds_one_model(name, rank_fingerprints):
    """After set-up, after steps, after a resume and at the end, every parameter and buffer of the
    whole trained module is bitwise the same on both ranks: DINO's teacher and centre (outside
    DDP), and batch-norm statistics that gloo cannot synchronise (seg_linear's head, DINO's)."""
    phases = rank_fingerprints[0][name]["phases"]
    assert list(phases) == ["set-up", "stopped", "resumed", "end"]
    for phase, (rank0, rank1) in phases.items():
        differ = sorted(k for k in rank0 if rank0[k] != rank1.get(k))
        assert not differ and rank0.keys() == rank1.keys(), (phase, differ[:8])
    names = set(phases["end"][0])
    whole = {"dino": {"teacher.backbone.cls_token", "loss.center", "teacher.head.mlp.1.running_mean"},
             "seg_linear": {"head.bn.running_mean", "backbone.cls_token"}}.get(name, set())
    assert whole <= names, whole - names
    # No trainer needs DDP's broadcast of buffers before every forward (the GPT's rotary tables,
    # the heads' masks: equal by construction; centre and batch norms: see above).
    assert rank_fingerprints[0][name]["buffer_broadcasts"] == 0


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_dino_on_two_processes_resumes_with_the_uninterrupted_losses(rank_fingerprints):
    """A 2-process DINO run stopped after 2 steps and resumed logs the losses of the same run
    uninterrupted (with a teacher per rank, the resumed run, whose ranks all load rank 0's
    teacher, jumped at step 3)."""
    out = rank_fingerprints[1]
    losses = [[r["loss"] for r in _records(f"{out}.{d}", "train")] for d in ("dino", "dino_straight")]
    assert len(losses[0]) == len(losses[1]) == 4
    assert losses[0] == losses[1]
