"""Issue 53: data that would train to silently wrong numbers, or die in a traceback, is one line
naming the file or key at set-up: shards of another tokenizer, broken shards, ids out of the
vocabulary, an empty validation column, image folders whose classes disagree, a changed image
root on resume, 16-bit PNGs and a feature cache of images changed in place."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from PIL import Image

import fakedata
import laplace.data.prepare as prep
from eval.features import cache_key
from laplace.checkpoint import CheckpointError
from laplace.data.images import load
from laplace.data.imagenet import build_imagenet
from laplace.data.kinds import build_text_data
from laplace.data.shards import TokenStream, write_shard
from laplace.data.transforms import eval_transform
from laplace.data.vision import build_vision_dataset
from laplace.errors import ConfigError, UserError
from train import run

from test_deit3 import TINY
from test_prepare import make_docs, parquet_cfg


def _parquet(folder: Path, files: list[list[str]]) -> Path:
    folder.mkdir(parents=True)
    for k, docs in enumerate(files):  # the last file is the validation split
        pq.write_table(pa.table({"text": pa.array(docs, pa.string())}), folder / f"shard_{k:05d}.parquet")
    return folder


def _shard_node(root: Path, tokenizer: str) -> OmegaConf:
    return OmegaConf.create({"name": "t", "kind": "shards", "root": str(root), "tokenizer": tokenizer,
                             "vocab_size": None, "seq_len": 8, "val_tokens": None})


def test_shards_of_another_tokenizer_are_refused_on_a_fresh_run(tmp_path):
    """Two BPEs with as many ids: the other one trained with rc 0 on ids meaning other tokens."""
    a = prep.prepare(parquet_cfg(_parquet(tmp_path / "a", [make_docs(60, 0), make_docs(20, 1)]), tmp_path / "A"))
    prep.prepare(parquet_cfg(_parquet(tmp_path / "b", [make_docs(60, 5), make_docs(20, 6)]), tmp_path / "B"))
    assert a["vocab_size"] == 320
    build_text_data(_shard_node(tmp_path / "A", str(tmp_path / "A" / "tokenizer.json")), seed=0, micro_batch_size=2)
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*B/tokenizer.json is not the tokenizer that wrote "
                                          r"the shards of data.root=.*A .*set data.tokenizer=.*A/tokenizer.json"):
        build_text_data(_shard_node(tmp_path / "A", str(tmp_path / "B" / "tokenizer.json")), seed=0, micro_batch_size=2)


@pytest.mark.parametrize("how", ["empty", "truncated", "float", "object", "2-d"])
def test_a_broken_shard_is_one_line_naming_it(tmp_path, how):
    bad = tmp_path / "shard_00001.npy"
    write_shard(tmp_path / "shard_00000.npy", np.arange(100) % 50, 50)
    if how == "empty":
        bad.write_bytes(b"")
    elif how == "truncated":
        write_shard(bad, np.arange(1000) % 50, 50)
        bad.write_bytes(bad.read_bytes()[:600])
    else:
        np.save(bad, {"float": np.ones(100), "object": np.array([1, "a"], dtype=object),
                      "2-d": np.ones((10, 10), dtype=np.uint16)}[how], allow_pickle=True)
    with pytest.raises(ConfigError) as e:
        TokenStream([tmp_path / "shard_00000.npy", bad], seq_len=8, micro_batch_size=2)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_ids_out_of_the_vocabulary_are_one_line_naming_the_shard(tmp_path):
    write_shard(tmp_path / "shard_00000.npy", np.arange(100) % 50, 50)
    write_shard(tmp_path / "shard_00001.npy", np.full(100, 70), 100)
    stream = iter(TokenStream(sorted(tmp_path.glob("*.npy")), seq_len=8, micro_batch_size=2, vocab_size=50))
    for _ in range(6):  # the first 6 batches read tokens 0 .. 97 of the first shard
        next(stream)
    with pytest.raises(ConfigError, match=r"shard_00001.npy holds token id 70 .*data.vocab_size=50"):
        next(stream)


@pytest.mark.parametrize("empty", ["", None])
def test_an_empty_validation_column_is_refused_in_prepare(tmp_path, empty):
    src = _parquet(tmp_path / "src", [make_docs(60, 0), [empty] * 20])
    with pytest.raises(ConfigError, match=r"the 20 validation documents are empty .*text_column"):
        prep.prepare(parquet_cfg(src, tmp_path / "out"))
    assert not (tmp_path / "out" / "val" / "shard_00000.npy").exists()  # no empty shard a re-run would keep


def test_validation_shards_shorter_than_a_window_are_refused_at_set_up(tmp_path):
    write_shard(tmp_path / "train" / "shard_00000.npy", np.arange(100) % 50, 257)
    write_shard(tmp_path / "val" / "shard_00000.npy", np.arange(5) % 50, 257)
    with pytest.raises(ConfigError, match=r"validation shards .*val hold 5 tokens.*data.seq_len=8"):
        build_text_data(_shard_node(tmp_path, "bytes"), seed=0, micro_batch_size=2)


# ---------------------------------------------------------------- image folders


def _imagenet_node(root, num_classes: int = 4):
    return OmegaConf.create({"name": "imagenet", "root": str(root), "format": "auto", "cache_dir": None,
                             "num_classes": num_classes, "img_size": 16, "augment": "none", "eval_crop_pct": 1.0,
                             "mean": [0.5] * 3, "std": [0.5] * 3})


def test_a_validation_folder_lacking_a_class_is_refused(tmp_path):
    """val/ without the second class read labels 0, 1, 2 for classes 0, 2, 3: val_acc1 0.0, rc 0."""
    wnids = fakedata.write_imagenet_folder(tmp_path, n_classes=4)
    build_imagenet(str(tmp_path), train=False)
    shutil.rmtree(tmp_path / "val" / wnids[1])
    with pytest.raises(ConfigError, match=rf"val/ lacks \['{wnids[1]}'\].*the same"):
        build_imagenet(str(tmp_path), train=False)


def test_an_empty_class_folder_is_one_line(tmp_path):
    fakedata.write_imagenet_folder(tmp_path, n_classes=2)
    (tmp_path / "train" / "n99999999").mkdir()
    with pytest.raises(UserError) as e:
        build_imagenet(str(tmp_path), train=True)
    assert "n99999999" in str(e.value) and str(tmp_path / "train") in str(e.value) and "\n" not in str(e.value)


def test_more_class_folders_than_num_classes_is_said_at_set_up(tmp_path):
    fakedata.write_imagenet_folder(tmp_path, n_classes=4)
    assert len(build_vision_dataset(_imagenet_node(tmp_path, 4), train=True).classes) == 4
    with pytest.raises(ConfigError, match=r"holds 4 class folders, more than data.num_classes=3: set data.num_classes=4"):
        build_vision_dataset(_imagenet_node(tmp_path, 3), train=True)


def test_a_16_bit_png_is_scaled_not_saturated(tmp_path):
    """convert("RGB") clipped 16-bit grey at 255: 99.6% of this ramp's pixels read as white."""
    ramp = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    img = np.asarray(load(tmp_path / "g16.png", "g16.png"))
    assert img.shape == (64, 64, 3) and np.array_equal(img[..., 0], ramp >> 8)
    x = eval_transform(64, 1.0, (0.0,) * 3, (1.0,) * 3)(Image.open(tmp_path / "g16.png"))
    assert abs(x.mean().item() - ramp.mean() / 65535) < 0.01  # through a transform too


def test_resume_on_another_image_root_is_refused(tmp_path, make_cfg):
    """Token shards were refused on resume; another image data.root (3 -> 7 steps an epoch) was not."""
    fakedata.write_imagenet_folder(tmp_path / "a", n_classes=4, per_class=4)
    fakedata.write_imagenet_folder(tmp_path / "b", n_classes=4, per_class=8)
    tiny = ["experiment=deit3_in1k", *TINY, "trainer.max_steps=4", "trainer.eval_every=100"]
    run(make_cfg(*tiny, f"data.root={tmp_path / 'a'}", "trainer.stop_after=1"))
    shutil.copytree(tmp_path / "a", tmp_path / "moved")  # the same images elsewhere: resumes
    run(make_cfg(*tiny, f"data.root={tmp_path / 'moved'}", "trainer.stop_after=2"))
    with pytest.raises(CheckpointError, match=r"other data than data.root=.*b \(images \[16, 16\] -> \[32, 32\]"):
        run(make_cfg(*tiny, f"data.root={tmp_path / 'b'}"))


def test_the_feature_cache_follows_images_changed_in_place(tmp_path):
    """The k-NN cache was keyed on the sample count: images rewritten in place read 33.33 cached vs 100.00."""
    fakedata.write_imagenet_folder(tmp_path, n_classes=2)
    ds = build_imagenet(str(tmp_path), train=True)
    key = lambda: cache_key({"checkpoint": tmp_path / "x.pt"}, _imagenet_node(tmp_path), "train", "cls", ds, 1.0)  # noqa: E731
    before = key()
    assert key() == before
    path = Path(ds.samples[0][0])
    path.write_bytes(path.read_bytes() + b"\0")  # the same name and count, other bytes
    assert key() != before
