"""Issue 53: data that would train to silently wrong numbers, or die in a traceback, is one line
naming the file or key at set-up: shards of another tokenizer, broken shards, ids out of the
vocabulary, an empty validation column, image folders whose classes disagree, a changed image
root on resume, 16-bit PNGs and a feature cache of images changed in place."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from PIL import Image

import laplace.data.prepare as prep
from laplace.data.kinds import build_text_data
from laplace.data.shards import TokenStream, write_shard
from laplace.errors import ConfigError, UserError

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


def test_validation_shards_shorter_than_a_window_are_refused_at_set_up(tmp_path):
    write_shard(tmp_path / "train" / "shard_00000.npy", np.arange(100) % 50, 257)
    write_shard(tmp_path / "val" / "shard_00000.npy", np.arange(5) % 50, 257)
    with pytest.raises(ConfigError, match=r"validation shards .*val hold 5 tokens.*data.seq_len=8"):
        build_text_data(_shard_node(tmp_path, "bytes"), seed=0, micro_batch_size=2)
