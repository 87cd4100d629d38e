"""The DeiT-III trainer: Mixup/CutMix + BCE by hand, repeated augmentation, RandAugment seeding,
every experiment=deit3_* config on tiny real-format data, resume under the full recipe, and
fine-tuning from laplace checkpoints and timm / DeiT state dicts."""
from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys

import fakedata
import numpy as np
import pytest
import timm
import torch

from laplace import model_label
from omegaconf import OmegaConf
from PIL import Image
from timm.layers import resample_abs_pos_embed
from timm.loss import SoftTargetCrossEntropy

from conftest import CONFIGS, ROOT
from laplace import create_model
from laplace.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from laplace.pretrained import load_pretrained
from train.config import model_node
from laplace.data.vision import build_transform
from laplace.errors import ConfigError
from train.logger import read_metrics
from train import run
from train.feeds import SeededDataset
from train.feeds import SeededRepeatAugSampler
from train.deit3 import build_criterion, build_mixup

EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs/experiment").glob("deit3_*.yaml"))
# A 2-layer, 48-wide ViT-B (12 heads of 4 dims) at 32 px with 8 px patches: steps in milliseconds.
TINY = ["model.depth=2", "model.embed_dim=48", "data.img_size=32", "data.patch_size=8",
        "trainer.num_workers=0", "trainer.progress=false", "trainer.log_every=1",
        "trainer.global_batch_size=16", "trainer.micro_batch_size=8"]


def _trainer_cfg(**kw):
    """The real trainer defaults (configs/trainer/deit3.yaml) with `kw` on top."""
    return OmegaConf.merge(OmegaConf.load(f"{CONFIGS}/trainer/deit3.yaml"), kw)


def _train_losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if r.get("split") == "train"]


# ---------------------------------------------------------------- Mixup / CutMix + BCE


def _bce_by_hand(z: torch.Tensor, t: torch.Tensor) -> float:
    """mean over images and classes of -[t log sigmoid(z) + (1 - t) log(1 - sigmoid(z))]."""
    terms = []
    for zi, ti in zip(z.flatten().tolist(), t.flatten().tolist()):
        p = 1 / (1 + math.exp(-zi))
        terms.append(-(ti * math.log(p) + (1 - ti) * math.log(1 - p)))
    return sum(terms) / len(terms)


def test_mixup_and_binarised_bce_by_hand():
    tc = _trainer_cfg(loss="bce", mixup=0.8, cutmix=0.0)
    mixup, bce = build_mixup(tc, num_classes=5), build_criterion(tc, num_classes=5)
    x = torch.arange(4 * 3 * 2 * 2, dtype=torch.float32).reshape(4, 3, 2, 2)
    y = torch.tensor([0, 1, 2, 4])
    np.random.seed(0)
    xm, t = mixup(x.clone(), y)
    np.random.seed(0)
    np.random.rand()  # Mixup's "mix this batch at all?" draw (prob 1)
    lam = np.random.beta(0.8, 0.8)  # then its lambda
    torch.testing.assert_close(xm, lam * x + (1 - lam) * x.flip(0))
    expect = torch.zeros(4, 5)
    for i in range(4):  # image i is mixed with image 3 - i (the flipped batch)
        expect[i, y[i]] += lam
        expect[i, y[3 - i]] += 1 - lam
    torch.testing.assert_close(t, expect)

    # DeiT-III binarises: every class present in the mix is a positive.
    z = torch.tensor([[0.5, -1.0, 2.0, 0.0, -0.3], [1.5, 0.2, -2.0, 0.7, 0.1],
                      [-0.4, 0.9, 0.3, -1.2, 2.2], [0.0, 0.0, 1.0, -1.0, 0.6]])
    binary = (expect > 0).float()
    assert binary.sum(1).tolist() == [2, 2, 2, 2]
    assert bce(z, t).item() == pytest.approx(_bce_by_hand(z, binary), rel=1e-6)
    assert bce(torch.zeros(4, 5), t).item() == pytest.approx(math.log(2), rel=1e-6)
    # Without binarisation the soft targets are used as they are.
    soft = build_criterion(_trainer_cfg(loss="bce", bce_target_thresh=None), 5)
    assert soft(z, t).item() == pytest.approx(_bce_by_hand(z, t), rel=1e-6)


def test_cutmix_pastes_the_flipped_batch_and_corrects_lambda():
    tc = _trainer_cfg(loss="bce", mixup=0.0, cutmix=1.0)
    mixup = build_mixup(tc, num_classes=4)
    x = torch.arange(4, dtype=torch.float32)[:, None, None, None].expand(4, 3, 8, 8).clone()
    y = torch.arange(4)
    for seed in range(5):
        np.random.seed(seed)
        xm, t = mixup(x.clone(), y)
        for i in range(4):
            pasted = (xm[i] == 3 - i).float().mean().item()  # share of pixels from image 3 - i
            assert ((xm[i] == i) | (xm[i] == 3 - i)).all()
            # lambda corrected to the pasted box's area, the same box in every image
            assert t[i, i].item() == pytest.approx(1 - pasted, abs=1e-6)
            assert t[i, 3 - i].item() == pytest.approx(pasted, abs=1e-6)


def test_criteria_and_their_errors():
    assert build_mixup(_trainer_cfg(), 10) is None
    ce = build_criterion(_trainer_cfg(loss="ce", label_smoothing=0.1), 10)
    z, y = torch.randn(6, 10), torch.randint(0, 10, (6,))
    torch.testing.assert_close(ce(z, y), torch.nn.functional.cross_entropy(z, y, label_smoothing=0.1))
    assert isinstance(build_criterion(_trainer_cfg(loss="ce", mixup=0.8), 10), SoftTargetCrossEntropy)
    with pytest.raises(ValueError, match="label_smoothing"):  # every class would become a positive
        build_criterion(_trainer_cfg(loss="bce", label_smoothing=0.1), 10)
    with pytest.raises(ValueError, match="ce or bce"):
        build_criterion(_trainer_cfg(loss="focal"), 10)


# ---------------------------------------------------------------- repeated augmentation


def test_repeat_aug_sampler_order():
    data = list(range(10))
    s = SeededRepeatAugSampler(data, num_replicas=1, rank=0, num_repeats=3, seed=0)
    s.set_epoch(0)
    order = list(s)
    assert len(order) == len(s) == 10  # an epoch keeps the dataset's length ...
    assert order[0::3][:3] == order[1::3] == order[2::3]  # ... in runs of 3 copies
    assert list(s) == order  # deterministic: what ResumableSampler needs to skip into an epoch
    s.set_epoch(1)
    assert list(s) != order
    other = SeededRepeatAugSampler(data, num_replicas=1, rank=0, num_repeats=3, seed=1)
    other.set_epoch(0)
    assert list(other) != order
    # Two ranks deal the copies out: together they see what one process sees.
    ranks = [SeededRepeatAugSampler(data, num_replicas=2, rank=r, num_repeats=3) for r in (0, 1)]
    for r in ranks:
        r.set_epoch(0)
    a, b = (list(r) for r in ranks)
    assert [v for pair in zip(a, b) for v in pair] == order


# ---------------------------------------------------------------- augmentation seeding


@pytest.mark.parametrize("augment", ["randaugment", "three_augment"])
def test_augmentation_is_a_function_of_the_sample_seed(augment):
    """RandAugment draws from Python's `random` and NumPy, 3-Augment's RandomChoice from
    `random`: under the training feed's SeededDataset the augmented image depends on the
    sample's seed alone (not on what the process drew before), and the global streams are
    left where they were (Mixup draws from NumPy's)."""
    cfg = OmegaConf.merge(OmegaConf.load(f"{CONFIGS}/data/cifar10.yaml"), {"augment": augment, "root": "unused"})
    tf = build_transform(cfg, train=True)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    ds = SeededDataset(_OneImage(img, tf))
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(5)
    py, npy, pt = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    outs = []
    for seed in (7, 7, 8):
        outs.append(ds[(0, seed)][0])
        random.random(), np.random.rand(), torch.rand(1)  # other draws between samples change nothing
    random.setstate(py)
    np.random.seed(123)
    torch.set_rng_state(pt)
    again = ds[(0, 7)][0]
    assert outs[0].shape == (3, 32, 32)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], again) and not torch.equal(outs[0], outs[2])
    assert random.getstate() == py and np.array_equal(np.random.get_state()[1], npy)
    assert torch.equal(torch.get_rng_state(), pt)


class _OneImage(torch.utils.data.Dataset):
    def __init__(self, img, tf):
        self.img, self.tf = img, tf

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return self.tf(self.img), 0


# ---------------------------------------------------------------- experiments end to end


@pytest.fixture
def tiny_data(tmp_path):
    """CIFAR-10/100 and an ImageNet folder tree in the real formats, and an 'ImageNet'
    checkpoint (1000 classes, 16 px: a 2x2 patch grid) for the fine-tuning experiments."""
    root = tmp_path / "data"
    for name in ("cifar10", "cifar100"):
        fakedata.write_cifar(root / "cifar", name, n_train=40, n_test=10)
    fakedata.write_imagenet_folder(root / "imagenet", n_classes=4, per_class=8)
    node = dict(model_node("vitb_0L"), depth=2, embed_dim=48, img_size=16, patch_size=8,
                num_classes=1000)
    src = create_model(**node)
    ckpt = save_checkpoint(tmp_path / "in1k.pt", model=src, config={"model": node})
    return root, ckpt


@pytest.mark.cuda  # evaluation, Mixup, BCE and fine-tuning on the device
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_trains_two_steps(experiment, tiny_data, make_cfg, tmp_path):
    root, ckpt = tiny_data
    data = "imagenet" if "in1k" in experiment else "cifar"
    extra = [f"trainer.init_from={ckpt}"] if experiment.endswith(("_ft", "_ft224")) else []
    cfg = make_cfg(f"experiment={experiment}", *TINY, f"data.root={root / data}",
                   "trainer.max_steps=2", *extra)
    assert model_label(cfg.model) == "vitb_d2_w48_0L" and cfg.trainer.name == "deit3"
    metrics = run(cfg)
    assert math.isfinite(metrics["val_loss"]) and 0 <= metrics["val_acc1"] <= 100
    res = json.loads((tmp_path / "run/results.json").read_text())
    assert res["steps"] == 2 and res["dataset"] == cfg.data.name and res["img_size"] == 32
    if extra:  # loaded, pos_embed resampled 2x2 -> 4x4; the 1000-class head kept only for ImageNet
        src, got = load_checkpoint(ckpt)["model"], load_checkpoint(tmp_path / "run/ckpt/last.pt")["model"]
        close = ["blocks.1.mlp.fc2.weight"] + (["head.weight"] if cfg.data.num_classes == 1000 else [])
        for k in close:  # two steps at a fine-tuning lr barely move the weights
            torch.testing.assert_close(got[k], src[k], atol=5e-3, rtol=0)
        assert got["pos_embed"].shape[1] == 16 and got["head.weight"].shape[0] == cfg.data.num_classes


def test_device_augment_trains_two_steps(tiny_data, make_cfg, tmp_path):
    """data.device_augment: the workers send decoded images with their crops' boxes and parameters, the step
    augments them (laplace.data.crop_augment); any other data.augment is refused in one line."""
    root, _ = tiny_data
    cfg = make_cfg("experiment=deit3_in1k", *TINY, f"data.root={root / 'imagenet'}", "data.device_augment=true",
                   "trainer.max_steps=2")
    assert math.isfinite(run(cfg)["val_loss"])
    bad = make_cfg("experiment=deit3_in1k_author", *TINY, f"data.root={root / 'imagenet'}", "data.device_augment=true",
                   run_dir=tmp_path / "bad")
    with pytest.raises(ConfigError, match="data.device_augment=true .* needs data.augment=three_augment"):
        run(bad)


@pytest.mark.parametrize("model", ["vitb_12L", "vits_5L", "vitt_3L"])
def test_experiments_combine_with_any_model(model, make_cfg):
    for experiment in EXPERIMENTS:
        cfg = make_cfg(f"experiment={experiment}", f"model={model}")
        assert model_label(cfg.model) == model and cfg.model.num_laplacian_heads == int(model[5:-1])
        assert cfg.model.drop_path_rate > 0 and cfg.trainer.mixup == 0.8  # the recipe survives


def test_finetune_experiment_without_init_from_is_refused(tiny_data, make_cfg):
    root, _ = tiny_data
    with pytest.raises(ValueError, match="set trainer.init_from=PATH"):
        run(make_cfg("experiment=deit3_cifar10_ft", *TINY, f"data.root={root / 'cifar'}"))


@pytest.mark.slow
def test_resume_mid_epoch_under_the_full_recipe(tiny_data, make_cfg, tmp_path):
    """6 steps straight == 3 steps, stop, the same command again: the same losses, exactly.

    experiment=deit3_cifar10 as it is: Mixup/CutMix + BCE, repeated augmentation (40 images:
    2 steps of 16 an epoch, the last 8 unused, so the stop is mid-epoch and the run crosses
    epochs), 3-Augment, drop-path 0.2, LAMB, gradient accumulation (16 = 8 x 2)."""
    root, _ = tiny_data
    common = ["experiment=deit3_cifar10", *TINY, f"data.root={root / 'cifar'}", "trainer.max_steps=6",
              "trainer.eval_every=100", "trainer.ckpt_every=100"]
    cfg = make_cfg(*common, run_dir=tmp_path / "straight")
    assert cfg.trainer.mixup == 0.8 and cfg.trainer.repeated_aug == 3 and cfg.model.drop_path_rate == 0.2
    run(cfg)
    run(make_cfg(*common, "trainer.stop_after=3", run_dir=tmp_path / "resumed"))
    assert load_checkpoint(tmp_path / "resumed/ckpt/last.pt")["loop"]["feed"] == {"epoch": 1, "position": 16}
    run(make_cfg(*common, run_dir=tmp_path / "resumed"))

    straight, resumed = _train_losses(tmp_path / "straight"), _train_losses(tmp_path / "resumed")
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]
    assert resumed == straight
    a = load_checkpoint(tmp_path / "straight/ckpt/last.pt")["model"]
    b = load_checkpoint(tmp_path / "resumed/ckpt/last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- init_from


def _node(name="vitb_0L", **kw):
    return OmegaConf.create({**model_node(name), "depth": 2, "embed_dim": 48, "patch_size": 8, **kw})


def _save(tmp_path, node, fname="src.pt"):
    model = create_model(**node)
    return model, save_checkpoint(tmp_path / fname, model=model, config={"model": OmegaConf.to_container(node)})


def test_init_from_laplace_checkpoint_resamples_pos_embed(tmp_path):
    src, path = _save(tmp_path, _node(img_size=32, num_classes=10))
    s = src.state_dict()
    for classes, head, kept in ((10, "auto", True), (10, "reset", False), (100, "auto", False)):
        node = _node(img_size=48, num_classes=classes)
        model = create_model(**node)
        msg = load_pretrained(model, path, node, head)
        got = model.state_dict()
        want_pos = resample_abs_pos_embed(s["pos_embed"], new_size=[6, 6], num_prefix_tokens=0, antialias=False)
        torch.testing.assert_close(got["pos_embed"], want_pos)  # 4x4 grid -> 6x6 grid
        assert all(torch.equal(got[k], s[k]) for k in s if not k.startswith(("head.", "pos_embed")))
        assert ("head loaded" in msg) == kept and got["head.weight"].shape[0] == classes
        if kept:
            assert torch.equal(got["head.weight"], s["head.weight"])
        elif classes == 10:
            assert not torch.equal(got["head.weight"], s["head.weight"])


def test_init_from_timm_and_deit_state_dicts(tmp_path):
    ref = timm.create_model("deit3_base_patch16_224", pretrained=False, depth=2, embed_dim=48,
                            num_heads=12, img_size=32, patch_size=8, num_classes=10).eval()
    sd = ref.state_dict()
    torch.save(sd, tmp_path / "timm.pth")
    # DeiT's own release format: {"model": ...} with LayerScale named gamma_1 / gamma_2.
    deit = {k.replace(".ls1.gamma", ".gamma_1").replace(".ls2.gamma", ".gamma_2"): v for k, v in sd.items()}
    torch.save({"model": deit, "epoch": 799}, tmp_path / "deit.pth")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "timm.safetensors"))
    # timm train.py's checkpoint (the first author's last.pth.tar): its argparse Namespace beside the weights.
    opt = torch.optim.AdamW(ref.parameters())
    torch.save({"epoch": 399, "arch": "deit3_base_patch16_224", "state_dict": sd, "optimizer": opt.state_dict(),
                "version": 2, "args": argparse.Namespace(model="deit3_base_patch16_224", lr=2e-3, scale=[0.08, 1.0]),
                "metric": 81.45}, tmp_path / "last.pth.tar")
    x = torch.randn(2, 3, 32, 32)
    for fname in ("timm.pth", "deit.pth", "timm.safetensors", "last.pth.tar"):
        node = _node(img_size=32, num_classes=10)
        model = create_model(**node).eval()
        assert "timm/DeiT state dict" in load_pretrained(model, tmp_path / fname, node)
        torch.testing.assert_close(model(x), ref(x))


def test_init_from_wrong_files_are_one_line_errors(tmp_path):
    node = _node(img_size=32, num_classes=10)
    (tmp_path / "notes.txt").write_text("not weights\n" * 20)
    torch.save({"epoch": 3, "args": "x"}, tmp_path / "nodict.pth")
    torch.save(create_model(**_node(embed_dim=96, img_size=32, num_classes=10)).state_dict(), tmp_path / "wide.pth")
    _save(tmp_path, _node(img_size=32, num_classes=10), "baseline.pt")
    cases = [("missing.pt", node, "no file at"), ("notes.txt", node, "not a readable weights file"),
             ("nodict.pth", node, "holds no state dict"), ("wide.pth", node, "does not fit model"),
             # Laplacian heads add no parameters: a baseline checkpoint would load silently.
             ("baseline.pt", _node("vitb_12L", img_size=32, num_classes=10), "trained as vitb_d2_w48_0L")]
    for fname, n, expect in cases:
        with pytest.raises(CheckpointError) as e:
            load_pretrained(create_model(**n), tmp_path / fname, n)
        assert expect in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_cli_init_from_error_is_one_line(tiny_data, tmp_path):
    root, _ = tiny_data
    proc = subprocess.run([sys.executable, "train.py", "experiment=deit3_cifar100_ft", *TINY,
                           f"data.root={root / 'cifar'}", f"trainer.init_from={tmp_path / 'nope.pt'}",
                           f"paths.runs_dir={tmp_path / 'runs'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: trainer.init_from: no file at"), proc.stderr[-2000:]
