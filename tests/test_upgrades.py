"""Resume after an upgrade added config keys (train/resume.py ADDED_KEYS): a checkpoint written
before a key existed resumes when the run's value does what the old code did; another value is a
recipe change, refused in one line unless trainer.resume=force."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_VIT
from laplace.checkpoint import CheckpointError, load_checkpoint
from train import run
from train.resume import config_differences

# Keys of today's configs that an older laplace did not write.
ADDED = ("model.laplacian_mode", "optim.grad_clip_mode", "optim.schedules.lr.warmdown", "data.modality",
         "model.qk_norm", "model.drop_path_schedule")


def _written_before(path, keys):
    """The checkpoint at `path` as a laplace before `keys` existed would have written it."""
    ckpt = torch.load(path, weights_only=True)
    for key in keys:
        *parents, leaf = key.split(".")
        node = ckpt["config"]
        for p in parents:
            node = node[p]
        del node[leaf]
    torch.save(ckpt, path)


def test_a_checkpoint_from_before_added_keys_resumes(make_cfg, tmp_path):
    base = [*TINY_VIT, "model=vitt_1L", "model.depth=1", "trainer.max_steps=3", "trainer.stop_after=1"]
    run(make_cfg(*base))
    _written_before(tmp_path / "run/ckpt/last.pt", ADDED)
    with pytest.raises(CheckpointError) as e:  # the gates are a real change of the recipe
        run(make_cfg(*base, "model.laplacian_mode=learned"))
    msg = str(e.value)
    assert "another configuration (model.laplacian_mode: <unset: fixed before the key> -> learned)" in msg, msg
    run(make_cfg(*base))  # today's defaults are the old behaviour: it resumes
    assert load_checkpoint(tmp_path / "run/ckpt/last.pt")["loop"]["step"] == 2


def test_only_declared_keys_are_forgiven():
    saved = {"model": {"name": "vitt_1L"}, "optim": {"schedules": {"lr": {"value": 1.0}}}}
    now = {"model": {"name": "vitt_1L", "laplacian_mode": "fixed"}, "data": {"probe_crop_pct": 0.875},
           "optim": {"lr": 1e-3, "schedules": {"lr": {"value": 1.0, "warmdown": "20%"}}}}
    assert config_differences(saved, now) == [
        "optim.lr: <unset> -> 0.001",  # not a key added over time: refused as before
        "optim.schedules.lr.warmdown: <unset: None before the key> -> 20%"]
