"""mmsegmentation integration (eval/mmseg, the `[seg]` extra): our ViT as an mmseg backbone under
UperNet through `python -m eval.mmseg.train configs/mmseg/ade20k_upernet.py` on the digits set,
its features equal to laplace's own, `--resume` under torch's weights_only default, and a
missing data folder as one line. (Our metrics against mmseg's IoUMetric: tests/test_segmentation.py.)"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import laplace

pytest.importorskip("mmseg", reason="the [seg] extra is not installed (pip install -e '.[seg]')")

from conftest import ROOT, randomize_  # noqa: E402
from eval.mmseg import LaplaceViT  # noqa: E402  (first: the mmcv-lite shim, before mmseg's models)
from laplace.checkpoint import load_model, save_checkpoint  # noqa: E402
from train.config import model_node  # noqa: E402
from laplace.data.ade20k import write_digits_ade20k  # noqa: E402
from laplace.zoo import create_model  # noqa: E402

CONFIG = "configs/mmseg/ade20k_upernet.py"
# The ADE20K recipe shrunk to the 64 px digits canvases: crops of 64, a short side of 64, small heads.
TINY = ["model.backbone.img_size=64", "model.data_preprocessor.size=(64,64)",
        "train_dataloader.dataset.pipeline.2.scale=(256,64)", "train_dataloader.dataset.pipeline.3.crop_size=(64,64)",
        "val_dataloader.dataset.pipeline.1.scale=(256,64)", "model.decode_head.channels=16",
        "model.auxiliary_head.channels=8", "train_dataloader.batch_size=4", "train_dataloader.num_workers=0",
        "train_dataloader.persistent_workers=False", "val_dataloader.num_workers=0",
        "val_dataloader.persistent_workers=False", "val_dataloader.dataset.indices=4",
        "default_hooks.checkpoint.interval=1", "default_hooks.logger.interval=1", "env_cfg.cudnn_benchmark=False"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny ViT-T-3L checkpoint (64 px, patch 8, 4 blocks: UperNet's four maps) and the digits set."""
    tmp = tmp_path_factory.mktemp("mmseg")
    node = model_node("vitt_3L")
    node.update(depth=4, embed_dim=48, img_size=64, patch_size=8, num_classes=10)
    model = randomize_(create_model(**node))  # non-trivial blocks (LayerScale starts at 1e-6)
    ckpt = save_checkpoint(tmp / "vit.pt", model=model, config={"model": node})
    write_digits_ade20k(tmp / "digits")
    return tmp, str(ckpt)


def _train(tmp, ckpt, *options, resume=False, check=True):
    cmd = [sys.executable, "-m", "eval.mmseg.train", CONFIG, "--work-dir", str(tmp / "work"),
           *(["--resume"] if resume else []), "--cfg-options", f"model.backbone.checkpoint={ckpt}",
           f"data_root={tmp / 'digits'}", "model.backbone.out_indices=[0,1,2,3]", *TINY, *options]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def trained(tiny):
    """LaplaceViT + UPerHead + FCNHead, 2 iterations and a validation through the CLI."""
    tmp, ckpt = tiny
    proc = _train(tmp, ckpt, "train_cfg.max_iters=2", "train_cfg.val_interval=2")
    return tmp, ckpt, proc.stdout + proc.stderr


def test_train_cli_writes_checkpoint_with_finite_loss(trained):
    tmp, _, log = trained
    work = tmp / "work"
    assert (work / "iter_2.pth").is_file() and (work / "last_checkpoint").read_text().endswith("iter_2.pth")
    scalars = [json.loads(line) for line in next(work.glob("*/vis_data/scalars.json")).read_text().splitlines()]
    losses = [s["loss"] for s in scalars if "loss" in s]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert any("mIoU" in s for s in scalars), "no validation ran"
    assert "LaplaceViT" in log and "UPerHead" in log


def test_backbone_keys_and_features_equal_laplace(trained):
    tmp, ckpt, _ = trained
    # Also the weights_only fix: mmengine's checkpoint is plain data (eval/mmseg/hooks.py).
    state = torch.load(tmp / "work" / "iter_2.pth", map_location="cpu", weights_only=True)["state_dict"]
    ref = load_model(ckpt)
    vit_keys = {k[len("backbone.vit."):] for k in state if k.startswith("backbone.vit.")}
    # every weight but the classifier and the final norm (no output uses them: removed for DDP)
    assert vit_keys == {k for k in ref.state_dict() if not k.startswith(("head.", "norm."))}
    assert "decode_head.conv_seg.weight" in state and "auxiliary_head.conv_seg.weight" in state

    bb = LaplaceViT(checkpoint=ckpt, img_size=64, out_indices=[1, -1]).train()
    assert bb.vit.training and all(p.requires_grad for p in bb.parameters())  # fine-tuned, not frozen
    ref.eval()
    bb.eval()
    x = torch.randn(2, 3, 64, 64)
    feats = laplace.features(ref, x, layers=[1, 3], norm=False)
    with torch.no_grad():
        outs = bb(x)
    for out, i in zip(outs, (1, 3)):
        torch.testing.assert_close(out, feats[f"blocks.{i}"][:, 1:].transpose(1, 2).reshape(2, 48, 8, 8))
    # Whole-image inference: another size is padded to whole patches (bottom / right) and the
    # position embedding resampled to its grid, as laplace's ViT does for that padded input.
    odd = torch.randn(1, 3, 90, 75)
    want = laplace.features(ref, torch.nn.functional.pad(odd, (0, 5, 0, 6)), layers=[3], norm=False)["blocks.3"]
    with torch.no_grad():
        got = bb(odd)[1]
    assert got.shape == (1, 48, 12, 10)
    torch.testing.assert_close(got, want[:, 1:].transpose(1, 2).reshape(1, 48, 12, 10))


def test_resume_under_weights_only_default(trained):
    tmp, ckpt, _ = trained
    proc = _train(tmp, ckpt, "train_cfg.max_iters=3", "train_cfg.val_interval=100", resume=True)
    assert "resumed epoch: 0, iter: 2" in proc.stdout + proc.stderr
    assert (tmp / "work" / "iter_3.pth").is_file()


def test_missing_data_folder_is_one_line(tiny, tmp_path):
    tmp, ckpt = tiny
    proc = _train(tmp, ckpt, f"data_root={tmp_path / 'nowhere'}", check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1 and "no folder" in err[0] and "data_root" in err[0], proc.stderr[-2000:]
