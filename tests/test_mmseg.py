"""mmsegmentation integration (eval/mmseg, the `[seg]` extra): our SegMetric against mmseg's
IoUMetric, our ViT as a frozen mmseg backbone trained with BNHead through
`python -m eval.mmseg.train` on the digits set, the backbone untouched and its features equal
to laplace's own, and `--resume` under torch's weights_only default."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("mmseg", reason="the [seg] extra is not installed (pip install -e '.[seg]')")

from conftest import ROOT, randomize_  # noqa: E402
from eval.mmseg import LaplaceViT  # noqa: E402  (first: the mmcv-lite shim, before mmseg's models)
from train.seg_metrics import SegMetric  # noqa: E402
from laplace.checkpoint import load_model, save_checkpoint  # noqa: E402
from laplace.config import model_node  # noqa: E402
from laplace.data.ade20k import write_digits_ade20k  # noqa: E402
from laplace.zoo import create_model  # noqa: E402

CONFIG = "configs/mmseg/digits_linear.py"


def test_segmetric_equals_mmseg_iou_metric():
    from mmseg.evaluation import IoUMetric

    k, g = 6, torch.Generator().manual_seed(0)
    mm = IoUMetric(iou_metrics=["mIoU"])
    mm.dataset_meta = {"classes": [str(c) for c in range(k)]}
    ours = SegMetric(k)
    samples = []
    for _ in range(3):
        label = torch.randint(0, k - 1, (17, 23), generator=g)  # class 5 never in the labels...
        label[torch.rand(label.shape, generator=g) < 0.2] = 255  # ... some pixels ignored
        pred = torch.randint(0, k - 2, (17, 23), generator=g)  # ... and 4 never predicted:
        pred[label == 1] = 1                                   # 5 absent (NaN), 4 IoU 0
        samples.append({"pred_sem_seg": {"data": pred[None]}, "gt_sem_seg": {"data": label[None]}})
        ours.update(pred, label)
    mm.process({}, samples)
    theirs, got = mm.compute_metrics(mm.results), ours.compute()
    for key in ("mIoU", "aAcc", "mAcc"):  # mmseg rounds to 2 decimals
        assert math.isfinite(got[key]) and got[key] == pytest.approx(float(theirs[key]), abs=0.006), key
    areas = [sum(a) for a in zip(*mm.results)]  # per class, unrounded: NaN where mmseg has NaN
    per_class = IoUMetric.total_area_to_metrics(*areas, metrics=["mIoU"])
    for key in ("IoU", "Acc"):
        torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                   100 * torch.as_tensor(per_class[key], dtype=torch.float64), equal_nan=True)
    assert math.isnan(got["IoU"][5]) and got["IoU"][4] == 0 and got["Acc"][1] == 100


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny ViT-T-3L checkpoint (64 px, patch 8, depth 2) and the digits set."""
    tmp = tmp_path_factory.mktemp("mmseg")
    node = model_node("vitt_3L")
    node.update(depth=2, embed_dim=48, img_size=64, patch_size=8, num_classes=10)
    model = randomize_(create_model(**node))  # non-trivial blocks (LayerScale starts at 1e-6)
    ckpt = save_checkpoint(tmp / "vit.pt", model=model, config={"model": node})
    write_digits_ade20k(tmp / "digits")
    return tmp, str(ckpt)


def _train(tmp, ckpt, *options, resume=False):
    cmd = [sys.executable, "-m", "eval.mmseg.train", CONFIG, "--work-dir", str(tmp / "work"),
           *(["--resume"] if resume else []), "--cfg-options", f"model.backbone.checkpoint={ckpt}",
           f"data_root={tmp / 'digits'}", "train_dataloader.batch_size=4", "val_dataloader.dataset.indices=4",
           "default_hooks.checkpoint.interval=1", "default_hooks.logger.interval=1", *options]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def trained(tiny):
    """LaplaceViT (frozen) + BNHead, 2 iterations and a validation through the CLI."""
    tmp, ckpt = tiny
    log = _train(tmp, ckpt, "train_cfg.max_iters=2", "train_cfg.val_interval=2")
    return tmp, ckpt, log


def test_train_cli_writes_checkpoint_with_finite_loss(trained):
    tmp, _, log = trained
    work = tmp / "work"
    assert (work / "iter_2.pth").is_file() and (work / "last_checkpoint").read_text().endswith("iter_2.pth")
    scalars = [json.loads(line) for line in next(work.glob("*/vis_data/scalars.json")).read_text().splitlines()]
    losses = [s["loss"] for s in scalars if "loss" in s]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert any("mIoU" in s for s in scalars), "no validation ran"
    assert "LaplaceViT" in log and "BNHead" in log


def test_frozen_backbone_unchanged_and_features_equal_laplace(trained):
    tmp, ckpt, _ = trained
    # Also the weights_only fix: mmengine's checkpoint is plain data (eval/mmseg/hooks.py).
    state = torch.load(tmp / "work" / "iter_2.pth", map_location="cpu", weights_only=True)["state_dict"]
    ref = load_model(ckpt)
    trained_vit = {k[len("backbone.vit."):]: v for k, v in state.items() if k.startswith("backbone.vit.")}
    expected = {k: v for k, v in ref.state_dict().items() if not k.startswith("head.")}
    assert trained_vit.keys() == expected.keys()
    assert all(torch.equal(trained_vit[k], expected[k]) for k in expected), "the frozen backbone moved"
    assert "decode_head.conv_seg.weight" in state and "decode_head.bn.running_mean" in state

    bb = LaplaceViT(checkpoint=ckpt, img_size=64, out_indices=[0, -1], frozen=True, final_norm=True).train()
    assert not bb.vit.training and not any(p.requires_grad for p in bb.parameters())
    x = torch.randn(2, 3, 64, 64)
    feats = ref.forward_features(x, layers=[0, 1], norm=False)
    with torch.no_grad():
        outs = bb(x)
    for out, i in zip(outs, (0, 1)):
        want = ref.norm(feats[f"blocks.{i}"])[:, 1:].transpose(1, 2).reshape(2, 48, 8, 8)
        torch.testing.assert_close(out, want)
    # A window smaller than the crop (mmseg's slide inference passes it as it is): padded to
    # the model's size, as train/seg_linear.py's windows are, the padding's tokens dropped.
    small = bb(x[:, :, :40, :56])[1]
    padded = torch.nn.functional.pad(x[:, :, :40, :56], (0, 8, 0, 24))
    want = ref.norm(ref.forward_features(padded, layers=[1], norm=False)["blocks.1"])
    torch.testing.assert_close(small, want[:, 1:].transpose(1, 2).reshape(2, 48, 8, 8)[:, :, :5, :7])
    assert bb(torch.randn(1, 3, 96, 80))[0].shape == (1, 48, 12, 10)  # larger: pos_embed resampled


def test_resume_under_weights_only_default(trained):
    tmp, ckpt, _ = trained
    log = _train(tmp, ckpt, "train_cfg.max_iters=3", "train_cfg.val_interval=100", resume=True)
    assert "resumed epoch: 0, iter: 2" in log
    assert (tmp / "work" / "iter_3.pth").is_file()
