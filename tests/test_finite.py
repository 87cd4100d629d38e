"""No non-finite checkpoint (train/finite.py): a loss that turns NaN between log steps, or a weight
that does while the loss is finite, stops the run with one line naming the step before anything
non-finite is saved; last.pt keeps the last good state."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_VIT
from laplace.checkpoint import load_checkpoint
from laplace.errors import UserError
from train import run

RUN = [*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.name=toy_trainers:Diverging", "trainer.max_steps=20",
       "trainer.log_every=10", "trainer.ckpt_every=2", "trainer.eval_every=1000", "optim.schedules.lr.warmup=2"]


def _all_finite(ckpt) -> bool:
    return all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())


@pytest.mark.parametrize("where,at,message", [
    ("loss", 7, "training diverged: the training loss is nan at step 7 (last.pt keeps step 6, the last finite "
                "state); lower optim.lr or set optim.grad_clip; to continue from step 6 with the new setting, "
                "add run_dir="),
    ("weights", 8, "training diverged: after step 8, 1 tensor(s) of the model hold NaN or inf (head.weight) "
                   "while the loss was finite (last.pt keeps step 6"),
])
def test_a_diverging_run_keeps_its_last_good_checkpoint(where, at, message, make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("DIVERGE", where)
    monkeypatch.setenv("DIVERGE_AT", str(at))
    with pytest.raises(UserError) as e:
        run(make_cfg(*RUN))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert isinstance(e.value, FloatingPointError)  # what callers caught before it was one line
    ckpt = load_checkpoint(tmp_path / "run/ckpt/last.pt")
    assert ckpt["loop"]["step"] == 6 and _all_finite(ckpt)


def test_divergence_before_the_first_checkpoint_says_so(make_cfg, monkeypatch):
    monkeypatch.setenv("DIVERGE_AT", "1")
    with pytest.raises(UserError, match=r"the training loss is nan at step 1 \(no checkpoint was written\); "
                                        r"lower optim.lr or set optim.grad_clip$"):
        run(make_cfg(*RUN))
