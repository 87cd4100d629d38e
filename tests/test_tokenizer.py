"""laplace.tokenizer: nanochat's BPE trained on the built-in help text, the byte tokenizer, and
the one-line errors of load_tokenizer. No network: gpt2 is only tested for its clear error."""
from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import tiktoken
import torch

from laplace.data import DatasetNotFoundError
from laplace.data.text import BOS as TEXT_BOS
from laplace.data.text import pydoc_documents
from laplace.errors import ConfigError, UserError
from laplace.tokenizer import (
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)

# Unseen by training: non-ASCII, emoji (4-byte UTF-8), code, digits, CRLF, a lone surrogate-free mix.
UNSEEN = [
    "Grüße aus Zürich – naïve café, 東京で寿司を食べた。",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷 then tabs\tand\r\nCRLF",
    "def f(x: int) -> int:\n    return x ** 2 + 1234567  # squares\n",
    "   leading spaces, trailing   \n\n\n",
    "",
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(pydoc_documents(train=True), vocab_size=768, path=path)


def test_split_pattern_is_gpt4_with_two_digit_numbers():
    assert r"\p{N}{1,2}" in SPLIT_PATTERN and r"\p{N}{1,3}" not in SPLIT_PATTERN
    enc = tiktoken.Encoding("t", pat_str=SPLIT_PATTERN, mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={})
    assert enc.encode_ordinary("12345") == list(b"12345")  # the pattern compiles and runs


def test_bpe_vocab_and_specials(bpe):
    assert bpe.kind == "bpe" and bpe.vocab_size == 768
    assert bpe.bos_id == 768 - len(SPECIAL_TOKENS)
    assert [bpe.special_id(s) for s in SPECIAL_TOKENS] == list(range(759, 768))
    with pytest.raises(ConfigError):
        bpe.special_id("<|nope|>")


@pytest.mark.parametrize("text", UNSEEN)
def test_round_trip_unseen_text(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert all(0 <= i < bpe.bos_id for i in ids)
    # token_bytes: the bytes of the tokens add up to the text's UTF-8 length (bits per byte)
    assert int(bpe.token_bytes()[torch.tensor(ids, dtype=torch.long)].sum()) == len(text.encode())


def test_bpe_compresses(bpe):
    text = pydoc_documents(train=False)[0]
    assert len(bpe.encode(text)) < 0.5 * len(text.encode())


def test_special_tokens_whole_and_not_from_plain_text(bpe):
    start, end = bpe.special_id("<|assistant_start|>"), bpe.special_id("<|assistant_end|>")
    ids = [bpe.bos_id, start, *bpe.encode("hi there"), end]
    assert bpe.decode(ids) == "<|bos|><|assistant_start|>hi there<|assistant_end|>"
    assert bpe.decode([start]) == "<|assistant_start|>"
    # ordinary text that spells a special is plain text, never the special id
    plain = bpe.encode("x <|bos|> <|assistant_start|> y")
    assert bpe.bos_id not in plain and start not in plain
    assert bpe.decode(plain) == "x <|bos|> <|assistant_start|> y"
    assert bpe.encode("abc", prepend_bos=True) == [bpe.bos_id, *bpe.encode("abc")]


def test_token_bytes_table(bpe):
    tb = bpe.token_bytes()
    assert tb.dtype == torch.int64 and tb.shape == (bpe.vocab_size,)
    assert (tb[bpe.bos_id:] == 0).all() and (tb[:256] == 1).all() and (tb[256:bpe.bos_id] >= 2).all()
    # bits per byte as nanochat computes it: nats / (ln 2 * bytes)
    ids = torch.tensor(bpe.encode(UNSEEN[0]))
    nats = torch.full((len(ids),), 2.0)
    bpb = nats.sum() / (math.log(2) * tb[ids].sum())
    assert bpb == pytest.approx(2 * len(ids) / (math.log(2) * len(UNSEEN[0].encode())))


def test_decode_accepts_tensors_and_arrays(bpe):
    ids = bpe.encode(UNSEEN[2], prepend_bos=True)
    expected = "<|bos|>" + UNSEEN[2]
    assert bpe.decode(torch.tensor(ids)) == expected
    assert bpe.decode(np.array(ids, dtype=np.uint16)) == expected
    assert bpe.decode(torch.tensor([ids])) == expected  # [1, T] batches flatten


def test_encode_batch_matches_encode(bpe):
    texts = UNSEEN + pydoc_documents(train=False)[:5]
    for threads in (None, 1, 2):
        assert bpe.encode_batch(texts, num_threads=threads) == [bpe.encode(t) for t in texts]
    assert bpe.encode_batch(texts, prepend_bos=True) == [bpe.encode(t, prepend_bos=True) for t in texts]


def test_save_load_and_plain_tiktoken_agree(bpe, tmp_path):
    path = bpe.save(tmp_path / "sub" / "tok.json")
    assert path.is_absolute() and not list(path.parent.glob(".*"))  # no temp leftovers
    loaded = load_tokenizer(path)
    assert loaded is load_tokenizer(str(path))  # cached by spec
    assert loaded.spec == str(path) and loaded.vocab_size == bpe.vocab_size
    assert loaded.fingerprint() == bpe.fingerprint()
    # a tiktoken.Encoding built directly from the saved file gives the same ids
    obj = json.loads(path.read_text())
    assert obj["format"] == "laplace.tokenizer" and obj["version"] == 1
    enc = tiktoken.Encoding("direct", pat_str=obj["pattern"],
                            mergeable_ranks={base64.b64decode(t): r for r, t in enumerate(obj["ranks"])},
                            special_tokens=obj["special_tokens"])
    text = " ".join(UNSEEN)
    assert loaded.encode(text) == bpe.encode(text) == enc.encode_ordinary(text)
    assert enc.encode("<|user_start|>", allowed_special="all") == [loaded.special_id("<|user_start|>")]


def test_load_sees_a_retrained_file(tmp_path):
    path = tmp_path / "tok.json"
    a = train_bpe(pydoc_documents(train=True)[:20], vocab_size=300, path=path)
    assert load_tokenizer(path).fingerprint() == a.fingerprint()
    b = train_bpe(pydoc_documents(train=True)[20:40], vocab_size=320, path=path)
    assert load_tokenizer(path).fingerprint() == b.fingerprint() != a.fingerprint()


def test_training_is_deterministic():
    docs = pydoc_documents(train=True)[:30]
    assert train_bpe(docs, 500).fingerprint() == train_bpe(iter(docs), 500).fingerprint()


def test_bytes_tokenizer():
    tok = load_tokenizer("bytes")
    assert tok.kind == "bytes" and tok.spec == "bytes"
    assert tok.bos_id == 256 == TEXT_BOS and tok.vocab_size == 265
    assert [tok.special_id(s) for s in SPECIAL_TOKENS] == list(range(256, 265))
    text = UNSEEN[1]
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.encode(text, prepend_bos=True)[0] == 256
    assert tok.decode(tok.encode(text, prepend_bos=True)) == "<|bos|>" + text
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # invalid UTF-8 is replaced
    assert tok.encode("<|bos|>") == list(b"<|bos|>")
    assert tok.encode_batch(UNSEEN, prepend_bos=True) == [tok.encode(t, True) for t in UNSEEN]
    tb = tok.token_bytes()
    assert tb[:256].eq(1).all() and tb[256:].eq(0).all()
    with pytest.raises(ConfigError, match="nothing to save"):
        tok.save("/tmp/never.json")


def test_vocab_too_small():
    with pytest.raises(ConfigError, match="vocab_size=265 must exceed 265"):
        train_bpe(["hello"], 265)


def test_too_little_text_is_a_clear_error():
    with pytest.raises(ConfigError, match="needs more training text"):
        train_bpe(["ab ab ab"], 2000)


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert isinstance(e.value, UserError)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_load_missing_file(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        load_tokenizer(tmp_path / "none.json")
    msg = _one_line(e)
    assert str(tmp_path / "none.json") in msg and "python prepare.py" in msg


@pytest.mark.parametrize("content", [b"not json {", b"\xff\xfe\x00", json.dumps({"model": {"type": "BPE"}}).encode(),
                                     json.dumps([1, 2]).encode()])
def test_load_foreign_file(tmp_path, content):
    path = tmp_path / "foreign.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(path)
    assert "not a laplace tokenizer file" in _one_line(e)


def test_load_damaged_file(bpe, tmp_path):
    obj = json.loads(bpe.save(tmp_path / "t.json").read_text())
    obj["special_tokens"]["<|bos|>"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(ConfigError) as e:
        load_tokenizer(tmp_path / "bad.json")
    assert "damaged" in _one_line(e)


def test_gpt2_without_cache_is_a_clear_error(tmp_path, monkeypatch):
    import tiktoken.load
    import tiktoken.registry

    def offline(blobpath, *a, **k):
        raise ConnectionError(f"no network for {blobpath}")  # what requests raises offline

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", offline)  # never touch the network
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # no encoding loaded earlier
    from laplace.tokenizer import _load_cached

    _load_cached.cache_clear()
    with pytest.raises(ConfigError) as e:
        load_tokenizer("gpt2")
    msg = _one_line(e)
    assert "TIKTOKEN_CACHE_DIR" in msg and str(tmp_path) in msg and "get_encoding" in msg
    _load_cached.cache_clear()
