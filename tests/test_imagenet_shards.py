"""prepare source=imagefolder: ImageNet's class folders -> HF-layout parquet shards that the parquet
route reads as the folder route (same bytes, same labels, same order); idempotent re-runs, resume
after a kill, pinned settings; and data.cache_dir, where `datasets` puts its Arrow cache."""
from __future__ import annotations

import json
from pathlib import Path

import fakedata
import numpy as np
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from laplace.data import DatasetNotFoundError
from laplace.data.imagenet import ImageFolder, ParquetImageNet, build_imagenet
from laplace.data.prepare import prepare
from laplace.data.vision import build_vision_dataset
from laplace.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SPLITS = (("train", True), ("validation", False))


def convert(src: Path, out: Path, *more: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("prepare", overrides=["source=imagefolder", f"in={src}",
                                            f"out={out}", "images_per_shard=4", "num_workers=2",
                                            "progress=false", *more])
    return prepare(cfg)


@pytest.fixture
def folder(tmp_path) -> tuple[Path, list[str]]:
    """3 classes x 5 real JPEGs in train/ and in val/: 15 images a split, 4 shards of <= 4."""
    src = tmp_path / "imagenet"
    return src, fakedata.write_imagenet_folder(src, n_classes=3, per_class=5)


def shard_files(out: Path, split: str) -> list[Path]:
    return sorted((out / "data").glob(f"{split}-*.parquet"))


def test_shards_read_as_the_folder_route(folder, tmp_path):
    src, wnids = folder
    out = tmp_path / "shards"
    meta = convert(src, out)
    for split, train in SPLITS:
        files = shard_files(out, split)
        assert [f.name for f in files] == [f"{split}-{i:05d}-of-00004.parquet" for i in range(4)]
        assert [pq.read_metadata(f).num_rows for f in files] == [4, 4, 4, 3]
        assert meta[split]["images"] == 15 and [s["images"] for s in meta[split]["shards"]] == [4, 4, 4, 3]

        shards = build_imagenet(out, train=train, fmt="parquet", cache_dir=tmp_path / "cache")
        files_route = build_imagenet(src, train=train, fmt="folder")
        assert isinstance(shards, ParquetImageNet) and isinstance(files_route, ImageFolder)
        assert len(shards) == len(files_route) == 15
        for i, (path, label) in enumerate(files_route.samples):
            row = shards.ds[i]
            assert row["image"]["bytes"] == Path(path).read_bytes()  # copied, not re-encoded
            assert row["image"]["path"] == Path(path).name and row["label"] == label
        for i in (0, 7, 14):  # decoded through each route's own __getitem__
            (a, ya), (b, yb) = shards[i], files_route[i]
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert ya == yb == i // 5
    # The schema is the hub's: HF features in the metadata, class names the wnids in label order.
    from datasets import ClassLabel, Features, Image

    feats = Features.from_arrow_schema(pq.read_schema(shard_files(out, "train")[0]))
    assert feats["image"] == Image() and isinstance(feats["label"], ClassLabel)
    assert feats["label"].names == wnids == meta["classes"]
    # ... and the same columns and types as files `datasets` writes with the Image / ClassLabel features.
    fakedata.write_imagenet_parquet(tmp_path / "hub", n_classes=3, per_class=2)
    hub = pq.read_schema(next((tmp_path / "hub" / "data").glob("train-*.parquet")))
    assert pq.read_schema(shard_files(out, "train")[0]).remove_metadata() == hub.remove_metadata()
    assert Features.from_arrow_schema(hub)["image"] == feats["image"]


def test_rerun_keeps_shards_and_resume_replaces_a_killed_write(folder, tmp_path):
    src, _ = folder
    out = tmp_path / "shards"
    convert(src, out)
    files = shard_files(out, "train") + shard_files(out, "validation")
    before = {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in files}
    convert(src, out)  # nothing to do: every shard kept as it was
    assert {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in files} == before

    # A run killed while writing shard 1 (its temp file left behind) and before shard 2; shard 3
    # damaged by hand (not a whole parquet file).
    train = shard_files(out, "train")
    temp = out / "data" / f".{train[1].name}.k1ll3d.tmp"
    temp.write_bytes(train[1].read_bytes()[:100])
    train[1].unlink()
    train[2].unlink()
    train[3].write_bytes(before[train[3]][1][:500])
    convert(src, out)
    assert not temp.exists() and not list((out / "data").glob(".*"))
    for f in files:
        assert f.read_bytes() == before[f][1]  # rewritten shards are byte-identical
    assert train[0].stat().st_mtime_ns == before[train[0]][0]  # the whole one was not touched
    ds = build_imagenet(out, train=True, fmt="parquet", cache_dir=tmp_path / "cache")
    assert [ds.ds[i]["label"] for i in range(len(ds))] == [c for c in range(3) for _ in range(5)]


def test_row_groups_are_datasets_own(folder, tmp_path, monkeypatch):
    """datasets' parquet writer decides the row groups (rows per group for image columns: the
    hub's 100, scaled down here); a whole split in one shard still reads as the folder route."""
    import datasets

    src, _ = folder
    monkeypatch.setattr(datasets.config, "PARQUET_ROW_GROUP_SIZE_FOR_IMAGE_DATASETS", 8)
    convert(src, tmp_path / "big", "images_per_shard=15", "num_workers=1")
    meta = pq.ParquetFile(shard_files(tmp_path / "big", "train")[0]).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [8, 7]
    ds = build_imagenet(tmp_path / "big", train=True, fmt="parquet", cache_dir=tmp_path / "cache")
    files_route = build_imagenet(src, train=True, fmt="folder")
    assert [ds.ds[i]["image"]["bytes"] for i in range(15)] == [Path(p).read_bytes() for p, _ in files_route.samples]


def test_settings_are_pinned(folder, tmp_path):
    src, wnids = folder
    out = tmp_path / "shards"
    convert(src, out)
    with pytest.raises(ConfigError, match="out=.* holds shards made with images_per_shard=4, not 5: set it back"):
        convert(src, out, "images_per_shard=5")
    extra = src / "train" / wnids[1] / "zz_new.JPEG"
    extra.write_bytes((src / "train" / wnids[1] / f"{wnids[1]}_0.JPEG").read_bytes())
    changed = 'holds shards made with train images="15 files, sha256 .*", not "16 files'
    with pytest.raises(ConfigError, match=changed) as e:
        convert(src, out)
    assert "rebuild=true" in str(e.value)
    meta = convert(src, out, "rebuild=true", "images_per_shard=8")
    assert [pq.read_metadata(f).num_rows for f in shard_files(out, "train")] == [8, 8]
    assert meta["train"]["images"] == 16 and len(shard_files(out, "validation")) == 2


def test_bad_input_is_one_line(folder, tmp_path):
    src, wnids = folder
    with pytest.raises(ConfigError, match="source=imagefolder needs in="):
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            prepare(compose("prepare", overrides=["source=imagefolder", f"out={tmp_path / 'o'}"]))
    with pytest.raises(DatasetNotFoundError, match="holds neither train/ nor val/"):
        convert(tmp_path / "nowhere", tmp_path / "o")
    (src / "val" / wnids[2]).rename(src / "val" / "n09999999")  # val sorted with other labels
    with pytest.raises(ConfigError, match="train/ and val/ hold different class folders") as e:
        convert(src, tmp_path / "o")
    assert "\n" not in str(e.value)


def test_cache_dir_from_config_is_honoured(folder, tmp_path, make_cfg, monkeypatch):
    import datasets

    src, _ = folder
    out = tmp_path / "shards"
    convert(src, out)
    hf_default = tmp_path / "hf_default"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_default)  # what cache_dir=None would use
    data_dir = tmp_path / "laplace_data"
    cfg = make_cfg("data=imagenet", f"paths.data_dir={data_dir}", f"data.root={out}")
    ds = build_vision_dataset(cfg.data, train=False)
    assert isinstance(ds, ParquetImageNet) and len(ds) == 15
    default = data_dir / "cache" / "datasets"  # configs/data/imagenet.yaml's default
    assert list(default.rglob("*.arrow")) and not hf_default.exists()

    other = tmp_path / "elsewhere"
    cfg = make_cfg("data=imagenet", f"paths.data_dir={data_dir}", f"data.root={out}", f"data.cache_dir={other}")
    build_vision_dataset(cfg.data, train=True)
    assert [p.name for p in other.rglob("*.arrow")] and not hf_default.exists()
    assert json.loads((out / "meta.json").read_text())["validation"]["images"] == 15


def test_shuffle_seed_orders_the_training_rows(folder, tmp_path):
    src, _ = folder
    out = tmp_path / "shards"
    meta = convert(src, out, "shuffle_seed=3")
    shards = build_imagenet(out, train=True, fmt="parquet", cache_dir=tmp_path / "cache")
    files_route = build_imagenet(src, train=True, fmt="folder")
    rows = [(shards.ds[i]["image"]["bytes"], shards.ds[i]["label"]) for i in range(len(shards))]
    samples = [(Path(p).read_bytes(), label) for p, label in files_route.samples]
    assert sorted(rows) == sorted(samples) and rows != samples  # the same images and labels, reordered
    assert [r[1] for r in rows] == [samples[i][1] for i in np.random.default_rng(3).permutation(15)]
    val = build_imagenet(out, train=False, fmt="parquet", cache_dir=tmp_path / "cache")
    assert [val.ds[i]["label"] for i in range(15)] == [c for c in range(3) for _ in range(5)]  # val: folder order
    assert meta["shuffle_seed"] == 3
    with pytest.raises(ConfigError, match="made with shuffle_seed=3, not null"):
        convert(src, out)
