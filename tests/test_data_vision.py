"""Vision data: CIFAR/ImageNet readers on tiny datasets in the real formats, and 3-Augment."""

import random

import fakedata
import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from laplace.data import DatasetNotFoundError
from laplace.data.cifar import NUM_CLASSES, build_cifar
from laplace.data.imagenet import ParquetImageNet, build_imagenet
from laplace.data.transforms import eval_transform, three_augment

MEAN, STD = torch.tensor(IMAGENET_DEFAULT_MEAN)[:, None, None], torch.tensor(IMAGENET_DEFAULT_STD)[:, None, None]


# ---------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_reads_real_format(tmp_path, name):
    written = fakedata.write_cifar(tmp_path, name, n_train=23, n_test=7)
    for train, split in ((True, "train"), (False, "test")):
        ds = build_cifar(name, tmp_path, train=train, transform=None)
        hwc, labels = written[split]
        assert len(ds) == len(labels)
        assert ds.targets == labels  # order preserved across the 5 CIFAR-10 batch files
        img, label = ds[3]
        assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (32, 32)
        np.testing.assert_array_equal(np.asarray(img), hwc[3])  # channel-major bytes -> HWC
        assert label == labels[3] and 0 <= label < NUM_CLASSES[name]
    assert len(ds.classes) == NUM_CLASSES[name]


@pytest.mark.parametrize("name,folder", [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")])
def test_cifar_missing_is_one_line(tmp_path, name, folder):
    with pytest.raises(DatasetNotFoundError) as e:
        build_cifar(name, tmp_path / "nowhere", train=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(tmp_path / "nowhere" / folder) in msg and "data.download=true" in msg


def test_cifar_with_transform_through_dataloader(tmp_path):
    fakedata.write_cifar(tmp_path, "cifar100", n_train=8, n_test=4)
    ds = build_cifar("cifar100", tmp_path, train=True, transform=three_augment(32, simple_random_crop=True))
    x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (4,)


# ---------------------------------------------------------------- ImageNet


def test_imagenet_folder(tmp_path):
    wnids = fakedata.write_imagenet_folder(tmp_path, n_classes=3, per_class=2)
    for train in (True, False):
        ds = build_imagenet(tmp_path, train=train, transform=eval_transform(16))
        assert len(ds) == 6 and ds.classes == wnids  # sorted wnids = ImageNet label order
        x, y = ds[5]
        assert x.shape == (3, 16, 16) and y == 2


def test_imagenet_parquet_lazy_and_workers(tmp_path):
    written = fakedata.write_imagenet_parquet(tmp_path, n_classes=3, per_class=2)
    for train, split in ((True, "train"), (False, "validation")):
        ds = build_imagenet(tmp_path, train=train, transform=None, fmt="auto", cache_dir=tmp_path / "cache")
        assert isinstance(ds, ParquetImageNet) and len(ds) == len(written[split])
        assert [ds[i][1] for i in range(len(ds))] == written[split]  # both shards, in order
        img, _ = ds[4]
        assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (27, 24)
    # Items decode inside worker processes (the Arrow table must pickle into them).
    ds = build_imagenet(tmp_path, train=True, transform=eval_transform(16), cache_dir=tmp_path / "cache")
    batches = list(torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2))
    assert torch.cat([y for _, y in batches]).tolist() == written["train"]
    assert batches[0][0].shape == (3, 3, 16, 16)


def test_imagenet_parquet_without_hf_metadata(tmp_path):
    # Files written by plain pyarrow (no "huggingface" schema metadata, so `image` is just a
    # struct column) must read the same as the hub's.
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    jpeg = fakedata._jpeg_bytes(np.random.default_rng(0), 24)
    table = pa.table({"image": [{"bytes": jpeg, "path": "a.JPEG"}] * 2, "label": [7, 3]})
    pq.write_table(table, tmp_path / "data" / "validation-00000-of-00001.parquet")
    ds = build_imagenet(tmp_path, train=False, fmt="parquet", cache_dir=tmp_path / "cache")
    assert [ds[i][1] for i in range(2)] == [7, 3] and ds[0][0].size == (27, 24)


def test_imagenet_auto_prefers_folder_and_fmt_is_respected(tmp_path):
    fakedata.write_imagenet_folder(tmp_path, n_classes=2, per_class=1)
    fakedata.write_imagenet_parquet(tmp_path, n_classes=2, per_class=1)
    assert not isinstance(build_imagenet(tmp_path, train=False), ParquetImageNet)
    ds = build_imagenet(tmp_path, train=False, fmt="parquet", cache_dir=tmp_path / "cache")
    assert isinstance(ds, ParquetImageNet)


def test_imagenet_missing_is_one_line(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        build_imagenet(tmp_path, train=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(tmp_path / "val") in msg and str(tmp_path / "data" / "validation-*.parquet") in msg
    assert isinstance(e.value, FileNotFoundError)


# ---------------------------------------------------------------- transforms


def _pixels(x: torch.Tensor) -> torch.Tensor:
    """Undo Normalize and return 0..255 values."""
    return (x * STD + MEAN) * 255


@pytest.mark.parametrize("simple", [False, True])
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_three_augment_shape_and_range(mode, simple):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)).convert(mode)
    tf = three_augment(24, simple_random_crop=simple)
    torch.manual_seed(0), random.seed(0)
    for _ in range(10):
        x = tf(img)
        assert x.shape == (3, 24, 24) and x.dtype == torch.float32
        # ToTensor gives [0, 1]; Normalize maps it to [(0 - mean) / std, (1 - mean) / std].
        assert (x >= -MEAN / STD - 1e-5).all() and (x <= (1 - MEAN) / STD + 1e-5).all()
    assert x.std() > 0.1  # not a constant image


def test_three_augment_takes_each_branch_exactly_one_at_a_time():
    # A flat colour survives crop, flip and blur unchanged, so each branch leaves a unique mark
    # (no jitter): grayscale makes R = G = B; solarize (threshold 128) inverts only R = 200 -> 55;
    # blur leaves (200, 100, 30). Anything else (two branches, none) would show another colour.
    colour = (200, 100, 30)
    gray = round(0.299 * 200 + 0.587 * 100 + 0.114 * 30)  # PIL's L conversion (ITU-R 601-2)
    marks = {(gray,) * 3: "grayscale", (55, 100, 30): "solarize", colour: "blur"}
    tf = three_augment(16, color_jitter=0)
    img = Image.new("RGB", (20, 30), colour)
    torch.manual_seed(0), random.seed(0)
    seen = []
    for _ in range(300):
        px = _pixels(tf(img)).round()
        assert (px == px[:, :1, :1]).all(), "expected a flat image"
        seen.append(marks[tuple(int(v) for v in px[:, 0, 0])])
    counts = {b: seen.count(b) for b in marks.values()}
    assert all(60 <= c <= 140 for c in counts.values()), counts  # 100 +- 8 each if uniform


def test_three_augment_color_jitter_changes_flat_colour():
    tf = three_augment(16, color_jitter=0.3)
    img = Image.new("RGB", (16, 16), (120, 90, 60))  # below 128: solarize is a no-op
    torch.manual_seed(0), random.seed(0)
    colours = {tuple(_pixels(tf(img))[:, 0, 0].round().int().tolist()) for _ in range(20)}
    assert len(colours) > 10  # jitter draws new factors each call


def test_eval_transform_shape_and_centre_crop():
    # 40x60 image whose left/right thirds are black and centre is white; resize short side to
    # 20 (crop_pct 1.0) gives 20x30, and the centre 20x20 crop is mostly white.
    arr = np.zeros((40, 60, 3), np.uint8)
    arr[:, 20:40] = 255
    x = eval_transform(20)(Image.fromarray(arr).convert("L"))
    assert x.shape == (3, 20, 20)
    px = _pixels(x)
    assert px[:, :, 8:12].mean() > 250 and px[:, :, :2].mean() < 10
    assert eval_transform(224, crop_pct=0.875).transforms[0].crop.size == 256  # DecodeCrop(T.Resize)
    assert eval_transform(224).transforms[0].crop.size == 224


def _photos(tmp_path):
    """scikit-learn's two real photographs as ImageNet-like JPEG files (500x375, quality 90)."""
    from sklearn.datasets import load_sample_image

    paths = []
    for name in ("china.jpg", "flower.jpg"):
        paths.append(tmp_path / name)
        Image.fromarray(load_sample_image(name)).resize((500, 375), Image.BICUBIC).save(paths[-1], quality=90)
    return paths


def test_timm_augment_is_timms_train_transform(tmp_path):
    """data.augment=timm (experiment=deit3_in1k_author) is timm's create_transform as timm's
    train.py calls it with the first author's flags (--aa 3a --color-jitter 0.3, random
    interpolation, no erasing): the same pixels from the same seeds. The evaluation transform at
    crop 0.875 is timm's too. tests/test_author_fork.py checks both against the fork's timm."""
    from omegaconf import OmegaConf
    from timm.data import create_transform

    from laplace.data.vision import build_transform

    cfg = OmegaConf.create(dict(name="imagenet", img_size=96, augment="timm", auto_augment="3a",
                                train_interpolation="random", color_jitter=0.3, eval_crop_pct=0.875,
                                mean=list(IMAGENET_DEFAULT_MEAN), std=list(IMAGENET_DEFAULT_STD)))
    pairs = [(build_transform(cfg, True),
              create_transform(96, is_training=True, auto_augment="3a", color_jitter=0.3, interpolation="random",
                               re_prob=0.0)),
             (build_transform(cfg, False),
              create_transform(96, is_training=False, interpolation="bicubic", crop_pct=0.875))]
    for path in _photos(tmp_path):
        with Image.open(path) as img:
            img = img.convert("RGB")
        for split, (ours, theirs) in zip(("train", "eval"), pairs):
            outs = []
            for seed in range(6):
                for tf in (ours, theirs):
                    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
                    outs.append(tf(img))
                assert torch.equal(outs[-2], outs[-1]), (path.name, split, seed)
            if split == "train":  # the seeds do draw different crops and branches
                assert len({round(o.sum().item(), 3) for o in outs}) == 6
    with pytest.raises(Exception, match=r"data.train_interpolation.*\+data.train_interpolation=random"):
        build_transform(OmegaConf.create({**OmegaConf.to_container(cfg), "train_interpolation": None}), True)
