"""laplace.data.kinds: every data.kind the GPT trainer reads is one builder that returns the
sets, the tokenizer, the throughput unit and the collate together."""
from __future__ import annotations

import pytest
import torch

from laplace.data.kinds import KINDS, build_text_data, val_windows
from laplace.errors import ConfigError


def _data(make_cfg, *overrides):
    return make_cfg("trainer=gpt", "model=gpt_d2_1L", *overrides).data


def test_windows_kind(make_cfg):
    d = _data(make_cfg, "data=pydoc_text", "data.seq_len=32")
    data = build_text_data(d, seed=0, micro_batch_size=4)
    assert (data.unit, data.units_per_sample, data.token_budget) == ("tok", 32, False)
    assert data.tokenizer.kind == "bytes" and d.tokenizer == data.tokenizer.spec and d.vocab_size == 257
    assert len(data.val) > 0 and data.val_batches(lambda s: ["loader of", s])[1] is data.val


def test_shards_kind_streams_and_budgets_tokens(make_cfg, pydoc_shards):
    d = _data(make_cfg, "data=pydoc_bpe", f"data.root={pydoc_shards}", "data.vocab_size=512",
              "data.seq_len=64", "data.val_tokens=640")
    data = build_text_data(d, seed=0, micro_batch_size=4, rank=0, world_size=2)
    assert (data.unit, data.units_per_sample, data.token_budget, data.val) == ("tok", 64, True, None)
    assert hasattr(data.train, "state_dict") and data.train.world_size == 2
    assert d.tokenizer == str(pydoc_shards / "tokenizer.json")
    # val_tokens=640: 10 windows, 2 ranks x 4 rows: one batch each (the last 2 windows skipped)
    assert [tuple(x.shape) for x, _ in data.val_batches(None)] == [(4, 64)]
    # The analyses index the same validation windows (without the val_tokens cap).
    windows = val_windows({**d, "seq_len": 64})
    one = build_text_data(d, seed=0, micro_batch_size=1).val_batches(None)
    assert [(x[0].tolist(), y[0].tolist()) for x, y in one] == \
        [(x.tolist(), y.tolist()) for x, y in (windows[g] for g in range(10))]
    assert len(windows) > 10 and val_windows({"name": "pydoc_text", "seq_len": 32})[0][0].shape == (32,)
    with pytest.raises(ConfigError, match="prepare more val_docs"):
        val_windows({**d, "seq_len": 10**9})


@pytest.mark.parametrize("packed", [False, True])
def test_chat_kinds(make_cfg, packed):
    d = _data(make_cfg, "data=pydoc_chat", "data.tokenizer=bytes", "data.seq_len=128",
              f"data.packed={packed}", f"data.masked={not packed}")
    data = build_text_data(d, seed=0, micro_batch_size=4)
    assert d.vocab_size == data.tokenizer.vocab_size
    if packed:  # rows of seq_len tokens, every target counted (masked=false)
        assert (data.unit, data.units_per_sample) == ("tok", 128)
        x, y = data.collate([data.train[0], data.train[1]])
        assert x.shape == (2, 128) and (y >= 0).all()
    else:  # one conversation per row, padded to the batch's longest
        assert (data.unit, data.units_per_sample) == ("conv", 1)
        items = [data.train[0], data.train[1]]
        x, y = data.collate(items)
        assert x.shape[1] == max(len(ids) for ids, _ in items) - 1 and (y == -1).any()
        pad = data.tokenizer.special_id("<|assistant_end|>")
        short = min(range(2), key=lambda b: len(items[b][0]))
        assert x.shape[1] == len(items[short][0]) - 1 or torch.all(x[short, len(items[short][0]) - 1:] == pad)


def test_unknown_kind_and_unmasked_sft_are_one_line_errors(make_cfg):
    d = _data(make_cfg, "data=pydoc_text", "data.kind=stream")
    with pytest.raises(ConfigError) as e:
        build_text_data(d, seed=0, micro_batch_size=4)
    assert str(e.value) == f"data.kind='stream' (data=pydoc_text): choose {', '.join(KINDS)}"
    d = _data(make_cfg, "data=pydoc_chat", "data.tokenizer=bytes", "data.masked=false")
    with pytest.raises(ConfigError, match="data.masked=false: SFT rows"):
        build_text_data(d, seed=0, micro_batch_size=4)
