"""Checkpoints, run folders and exports written before the ViT became timm's (commit b601d55,
tests/fixtures/legacy_b601d55) load with the same outputs, and the run resumes."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import laplace

LEGACY = Path(__file__).parent / "fixtures" / "legacy_b601d55"
EXPECTED = torch.load(LEGACY / "expected.pt", weights_only=True)


def _close(got, key):
    torch.testing.assert_close(got, EXPECTED[key], rtol=0, atol=1e-5)


@torch.no_grad()
def test_vit_checkpoint_and_export_give_the_same_logits():
    vit = laplace.load_model(LEGACY / "vit_run" / "ckpt" / "last.pt")
    assert vit.num_laplacian_heads == [1, 3]
    _close(vit(EXPECTED["img"]), "vit_logits")
    _close(vit(EXPECTED["img16"]), "vit_logits16")  # position embeddings resampled to 2 x 2
    feats = laplace.features(vit, EXPECTED["img"])
    _close(feats["blocks.0"], "vit_blocks.0")
    _close(feats["norm"], "vit_norm")
    _close(laplace.load_model(LEGACY / "export_vit")(EXPECTED["img"]), "vit_export_logits")


@torch.no_grad()
def test_gpt_and_dino_checkpoints_and_the_gpt_export_give_the_same_outputs():
    _close(laplace.load_model(LEGACY / "ckpt" / "gpt.pt")(EXPECTED["ids"]), "gpt_logits")
    _close(laplace.load_model(LEGACY / "export_gpt")(EXPECTED["ids"]), "gpt_export_logits")
    dino = laplace.load_model(LEGACY / "ckpt" / "dino.pt")  # the teacher backbone
    _close(dino(EXPECTED["img"]), "dino_feats")
    _close(dino(EXPECTED["img16"]), "dino_feats16")


@pytest.mark.timeout(600)
def test_the_old_run_resumes(make_cfg, tmp_path):
    from train import run

    run_dir = tmp_path / "vit"
    shutil.copytree(LEGACY / "vit_run", run_dir)
    cfg = make_cfg("model=vitt_1L", "model.depth=2", "model.embed_dim=24", "model.num_laplacian_heads=[1,3]",
                   "model.laplacian_mode=learned", "model.init_values=1.0", "model.qk_norm=true",
                   "trainer.num_workers=0", "trainer.progress=false", "trainer.global_batch_size=16",
                   "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=3", run_dir=run_dir)
    metrics = run(cfg)  # resumed at its last step: evaluates the old weights once more
    old = [r for r in laplace_records(run_dir) if r.get("split") == "val"][0]
    assert metrics["val_acc1"] == pytest.approx(old["val_acc1"]) and metrics["val_loss"] == pytest.approx(old["val_loss"])


def laplace_records(run_dir):
    import json

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
