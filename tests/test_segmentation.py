"""Frozen-backbone segmentation (eval/segmentation.py, train/seg_linear.py, laplace/data/ade20k.py):
the metric against a hand computation and a numpy oracle of mmseg's IoUMetric, sliding windows against
whole-image inference, ADE20K's label convention and layout, the training pipeline, and the
protocol end to end on the tiny ADE20K-layout digits set."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import laplace
from PIL import Image

from conftest import ROOT, TINY_VIT
from laplace import create_model
from laplace.data import DatasetNotFoundError
from laplace.data.ade20k import (ADE20K, IGNORE, SegEvalTransform, SegTrainTransform, reduce_zero_label,
                                 write_digits_ade20k)
from train import run
from train.seg_linear import FrozenBackboneSeg, seg_loss, seg_metric, seg_scores, slide_inference


def test_miou_of_a_planted_prediction_by_hand():
    label = torch.tensor([[0, 0, 1, 1], [2, 2, 255, 255]])
    pred = torch.tensor([[0, 1, 1, 1], [2, 0, 0, 3]])
    m = seg_metric(num_classes=4)
    m.update(pred, label)
    out = seg_scores(m)
    # class 0: inter 1, label 2, pred 2 (one of them on an ignored pixel: not counted) -> union 3
    # (labelled pixels only: pred 0 at (0,0), (1,1)); class 1: inter 2, label 2, pred 3 -> 2/3;
    # class 2: inter 1, label 2, pred 1 -> 1/2; class 3: no label, predicted only on ignored -> NaN.
    iou = [1 / 3, 2 / 3, 1 / 2]
    assert out["IoU"][:3] == pytest.approx([100 * v for v in iou]) and math.isnan(out["IoU"][3])
    assert out["mIoU"] == pytest.approx(100 * sum(iou) / 3)
    assert out["aAcc"] == pytest.approx(100 * 4 / 6)
    assert out["mAcc"] == pytest.approx(100 * (1 / 2 + 1 + 1 / 2) / 3)


def _random_predictions(k: int = 6, n: int = 3):
    """n (prediction, label) pairs of 17 x 23 pixels: class 5 never labelled nor predicted (NaN),
    class 4 predicted but never labelled (IoU 0, Acc NaN), some labels ignored (255)."""
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(n):
        label = torch.randint(0, k - 2, (17, 23), generator=g)
        label[torch.rand(label.shape, generator=g) < 0.2] = IGNORE
        pred = torch.randint(0, k - 1, (17, 23), generator=g)
        pred[label == 1] = 1  # class 1 always right: Acc 100
        pairs.append((pred, label))
    return pairs


def _numpy_oracle(pairs, k: int) -> dict:
    """mmseg's definitions written out in numpy: per class intersection / union and
    intersection / labelled area over the labelled pixels, NaN left out of the means."""
    inter, area_pred, area_label = np.zeros(k), np.zeros(k), np.zeros(k)
    for pred, label in pairs:
        keep = label.numpy() != IGNORE
        p, t = pred.numpy()[keep], label.numpy()[keep]
        inter += np.bincount(t[p == t], minlength=k)
        area_pred += np.bincount(p, minlength=k)
        area_label += np.bincount(t, minlength=k)
    with np.errstate(invalid="ignore", divide="ignore"):
        iou, acc = inter / (area_pred + area_label - inter), inter / area_label
    return {"IoU": 100 * iou, "Acc": 100 * acc, "mIoU": 100 * np.nanmean(iou), "mAcc": 100 * np.nanmean(acc),
            "aAcc": 100 * inter.sum() / area_label.sum()}


def test_metrics_equal_a_numpy_oracle():
    k, pairs = 6, _random_predictions()
    m = seg_metric(k)
    for pred, label in pairs:
        m.update(pred, label)
    got, want = seg_scores(m), _numpy_oracle(pairs, k)
    for key in ("mIoU", "aAcc", "mAcc"):
        assert math.isfinite(got[key]) and got[key] == pytest.approx(want[key], rel=1e-6), key
    for key in ("IoU", "Acc"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)  # NaN where the oracle has NaN
    assert math.isnan(got["IoU"][5]) and got["IoU"][4] == 0 and math.isnan(got["Acc"][4]) and got["Acc"][1] == 100


class PixelModel(torch.nn.Module):
    """A per-pixel linear map of a fixed input size (what a sliding window feeds)."""

    def __init__(self, size: int, k: int = 3):
        super().__init__()
        self.size, self.conv = size, torch.nn.Conv2d(3, k, 1)

    def forward(self, x):
        assert x.shape[-2:] == (self.size, self.size)
        return self.conv(x)


@pytest.mark.cuda
def test_sliding_windows_equal_whole_image_inference(device):
    torch.manual_seed(0)
    model = PixelModel(16).to(device)
    img = torch.randn(2, 3, 16, 16, device=device)
    whole = model(img)
    torch.testing.assert_close(slide_inference(model, img, 3, window=16, stride=11), whole)
    # Overlapping windows on a larger image, and an image smaller than the window (padded):
    # a per-pixel model gives the same logits everywhere, whatever the windows.
    big = torch.randn(1, 3, 40, 27, device=device)
    torch.testing.assert_close(slide_inference(model, big, 3, window=16, stride=11), model.conv(big))
    small = torch.randn(1, 3, 10, 12, device=device)
    torch.testing.assert_close(slide_inference(model, small, 3, window=16, stride=11), model.conv(small))


def test_reduce_zero_label():
    mask = np.array([[0, 1, 150], [2, 0, 3]], dtype=np.uint8)
    assert reduce_zero_label(mask).tolist() == [[IGNORE, 0, 149], [1, IGNORE, 2]]


def test_ade20k_layout_and_missing_data(tmp_path):
    base = write_digits_ade20k(tmp_path / "ade", n_train=6, n_val=3)
    assert base.name == "ADEChallengeData2016"
    for root in (tmp_path / "ade", base):  # the parent or the folder itself
        ds = ADE20K(root, "validation")
        assert len(ds) == 3
    img, label = ADE20K(base, "training")[0]
    mask = np.array(Image.open(sorted((base / "annotations/training").glob("*.png"))[0]))
    assert img.size == (64, 64) and label.tolist() == reduce_zero_label(mask).tolist()
    assert set(np.unique(mask)) <= set(range(11)) and (mask > 0).any()  # digits 1..10, background 0
    with pytest.raises(DatasetNotFoundError) as e:
        ADE20K(tmp_path / "nowhere", "training")
    assert "ADEChallengeData2016" in str(e.value) and "data.root" in str(e.value) and "\n" not in str(e.value)
    missing = sorted((base / "annotations/validation").glob("*.png"))[1]
    missing.unlink()
    with pytest.raises(DatasetNotFoundError) as e:  # an image without its annotation: named, in one line
        ADE20K(base, "validation")
    assert str(missing) in str(e.value) and "\n" not in str(e.value)


def test_training_pipeline_crops_pads_and_ignores(tmp_path):
    base = write_digits_ade20k(tmp_path / "ade", n_train=4, n_val=2)
    ds = ADE20K(base, "training", SegTrainTransform(crop=48, scale=64, ratio_range=(0.5, 0.5)))
    torch.manual_seed(0)
    x, y = ds[0]
    # 64 px at ratio 0.5 -> 32 px, padded to the 48 px crop: the padding is ignored.
    assert x.shape == (3, 48, 48) and y.shape == (48, 48)
    assert (y[32:, :] == IGNORE).all()
    assert (y[:, 32:] == IGNORE).all() or (y[:, :16] == IGNORE).all()  # padded right, or flipped
    x2, y2 = ADE20K(base, "validation", SegEvalTransform(scale=32))[0]
    assert x2.shape == (3, 32, 32) and y2.shape == (64, 64)  # the label stays at full size


def test_frozen_backbone_features_and_gradients():
    node = dict(name="vitt_0L", depth=2, embed_dim=48, num_heads=3, num_laplacian_heads=0, img_size=32,
                patch_size=8, num_classes=10)
    vit = create_model(**node)
    seg = FrozenBackboneSeg(vit, num_classes=10, num_layers=2, cls_token=True)
    x = torch.randn(2, 3, 32, 32)
    out = seg.train()(x)
    assert out.shape == (2, 10, 32, 32) and not seg.backbone.training
    out.sum().backward()
    assert all(p.grad is None for p in seg.backbone.parameters())
    assert seg.head.conv.weight.grad is not None and seg.head.bn.num_features == 48 * 2 * 2
    feats = laplace.features(vit, x, layers=[1], norm=True)["norm"][:, 1:]  # the last block, normed
    got = seg.features(x)[:, :48]  # the first layer in the concatenation is block 0
    ref = vit.norm(laplace.features(vit, x, layers=[0], norm=False)["blocks.0"])[:, 1:]
    torch.testing.assert_close(got.flatten(2).transpose(1, 2), ref)
    torch.testing.assert_close(seg.features(x)[:, 96:144].flatten(2).transpose(1, 2), feats)


@pytest.mark.timeout(900)  # above its subprocess's 600 s
@pytest.mark.slow
def test_linear_protocol_end_to_end_on_digits(make_cfg, tmp_path):
    """A backbone trained on digits, then `python -m eval.segmentation` for a few iterations on
    8 canvases (the same ones every step, so the head can fit them): the loss falls, mIoU lands
    in results.json beside the backbone's run."""
    run(make_cfg(*TINY_VIT, "model=vitt_3L", "model.depth=2", "trainer.max_steps=5", run_dir=tmp_path / "bb"))
    proc = subprocess.run(
        [sys.executable, "-m", "eval.segmentation", f"checkpoint={tmp_path / 'bb/ckpt/last.pt'}",
         "eval=seg_digits_linear", "iters=24", "batch_size=8", "data.n_train=8", "data.n_val=4",
         "trainer.eval_every=12", "trainer.log_every=1", "optim.schedules.lr.warmup=0", "optim.lr=1e-2",
         f"paths.data_dir={tmp_path / 'data'}", "trainer.progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "bb/eval/seg_digits_ade20k_l1"
    res = json.loads((out / "results.json").read_text())
    assert res["protocol"] == "linear" and 0 <= res["mIoU"] <= 100 and len(res["per_class_IoU"]) == 10
    assert res["model"] == "vitt_d2_w48_3L" and res["num_laplacian_heads"] == 3 and res["iters"] == 24
    losses = [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()
              if '"split": "train"' in ln]
    # The head learns: 0.533 -> 0.465 seen (mmseg's loss: ignored pixels count in the mean).
    assert sum(losses[-4:]) < 0.93 * sum(losses[:4])
    # The checkpoint exports the frozen backbone (at the crop size), unchanged.
    from laplace.checkpoint import load_checkpoint, load_model

    bb = load_model(out / "ckpt/last.pt")
    src = load_checkpoint(tmp_path / "bb/ckpt/last.pt")["model"]
    assert bb.patch_embed.img_size == (64, 64)
    assert torch.equal(bb.state_dict()["blocks.1.mlp.fc2.weight"], src["blocks.1.mlp.fc2.weight"])


def test_segmentation_cli_errors_are_one_line(tmp_path):
    gpt = tmp_path / "gpt.pt"
    from laplace.checkpoint import save_checkpoint
    from train.config import model_node

    node = dict(model_node("gpt_d2_0L"), vocab_size=32, max_seq_len=16)
    save_checkpoint(gpt, model=create_model(**node), config={"model": node})
    for args, expect in ([f"checkpoint={tmp_path / 'none.pt'}"], "no such file"), ([f"checkpoint={gpt}"], "needs a ViT"):
        proc = subprocess.run([sys.executable, "-m", "eval.segmentation", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(err) == 1 and expect in err[0], proc.stderr[-1000:]


def test_pixel_loss_is_mmsegs_and_zero_on_a_crop_without_labels():
    """mmseg's CrossEntropyLoss (avg_non_ignore=False, DINOv2's protocol) divides the labelled
    pixels' sum by all pixels; a batch with no labelled pixel gives 0 and a zero gradient."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 6, 7, requires_grad=True)
    y = torch.randint(0, 5, (2, 6, 7))
    y[0, :3] = IGNORE
    per_pixel = torch.nn.functional.cross_entropy(logits, y, ignore_index=IGNORE, reduction="none")
    assert seg_loss(logits, y).item() == pytest.approx(per_pixel.sum().item() / y.numel(), rel=1e-6)
    empty = torch.full_like(y, IGNORE)
    loss = seg_loss(logits, empty)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_crop_is_checked_ten_times_then_the_eleventh_taken(monkeypatch):
    """mmseg's RandomCrop with cat_max_ratio: a first box, then up to 10 checks, each failed
    one drawing a new box; a label with no labelled pixel fails every check: 11 boxes."""
    draws = []
    real = torch.randint

    def counting(*a, **k):
        draws.append(a)
        return real(*a, **k)

    monkeypatch.setattr(torch, "randint", counting)
    t = SegTrainTransform(crop=8, scale=16)
    t._crop_box(torch.full((16, 16), IGNORE))
    assert len(draws) == 22  # 11 boxes of (top, left)
    draws.clear()
    t._crop_box(torch.arange(256).reshape(16, 16) % 4)  # 4 classes evenly: the first box passes
    assert len(draws) == 2


def test_training_survives_a_batch_without_labelled_pixels(tmp_path):
    """The issue's run: every training annotation is "other" (0, ignored), so each batch of
    crops holds ignored pixels only; 4 iterations train with loss 0 instead of stopping on NaN."""
    from laplace.checkpoint import save_checkpoint
    from train.config import model_node

    base = tmp_path / "ade" / "ADEChallengeData2016"
    for split in ("training", "validation"):
        (base / "images" / split).mkdir(parents=True)
        (base / "annotations" / split).mkdir(parents=True)
        for i in range(2):
            rng = np.random.default_rng(i)
            Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(
                base / "images" / split / f"ADE_{split}_{i:08d}.jpg")
            mask = np.zeros((40, 48), np.uint8) if split == "training" else rng.integers(0, 4, (40, 48), dtype=np.uint8)
            Image.fromarray(mask).save(base / "annotations" / split / f"ADE_{split}_{i:08d}.png")
    node = dict(model_node("vitt_0L"), depth=1, embed_dim=48, num_heads=3, img_size=32, patch_size=8, num_classes=0)
    save_checkpoint(tmp_path / "bb.pt", model=create_model(**node), config={"model": node})
    out = tmp_path / "seg"
    proc = subprocess.run(
        [sys.executable, "-m", "eval.segmentation", f"checkpoint={tmp_path / 'bb.pt'}", "data=ade20k",
         f"data.root={tmp_path / 'ade'}", "iters=4", "crop_size=64", "batch_size=2", "data.scale=64",
         "trainer.log_every=1", "trainer.num_workers=0", "trainer.progress=false", f"run_dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()
              if '"split": "train"' in ln]
    assert losses == [0.0] * 4
    assert json.loads((out / "results.json").read_text())["iters"] == 4
