"""Every trainer trains a step and evaluates on a stand-in CUDA device (tests/fakedevice.py):
a tensor left on the CPU where CUDA needs it on the device fails here as it would on a GPU."""
from __future__ import annotations

import math

import fakedata
import pytest

from fakedevice import fake_cuda
from train import run

VIT = ["model.depth=1", "model.embed_dim=48", "trainer.num_workers=0", "trainer.progress=false",
       "trainer.log_every=1", "trainer.device=cuda", "trainer.compile=false", "trainer.max_steps=1"]


def _run_on_fake_cuda(cfg) -> dict:
    with fake_cuda() as tags:
        metrics = run(cfg)
        assert tags.held, "nothing was placed on the device: the run ignored trainer.device=cuda"
    return metrics


def test_deit3_step_and_evaluation(make_cfg, tmp_path):
    fakedata.write_cifar(tmp_path / "cifar", "cifar10", n_train=16, n_test=8)
    cfg = make_cfg("experiment=deit3_cifar10", *VIT, "data.img_size=32", "data.patch_size=8",
                   f"data.root={tmp_path / 'cifar'}", "trainer.global_batch_size=8", "trainer.micro_batch_size=8")
    metrics = _run_on_fake_cuda(cfg)
    assert math.isfinite(metrics["val_loss"])


def test_gpt_step_and_evaluation(make_cfg):
    cfg = make_cfg("experiment=gpt_pydoc", "model=gpt_d2_1L", "data.seq_len=32", "trainer.global_batch_size=8",
                   *VIT[2:], "trainer.eval_every=1")
    metrics = _run_on_fake_cuda(cfg)
    assert math.isfinite(metrics["val_loss"])


def test_dino_step_and_evaluation(make_cfg):
    cfg = make_cfg("experiment=dino_digits", *VIT, "trainer.global_batch_size=8", "trainer.head.out_dim=64",
                   "trainer.head.hidden_dim=32", "trainer.head.bottleneck_dim=16",
                   "trainer.multicrop.local_crops=2", "data.val_fraction=0.99")
    _run_on_fake_cuda(cfg)
