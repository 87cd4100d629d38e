"""Chat rendering (laplace.chat_format), the chat tasks read through HF datasets from files written in
the hub's own layout, the mixture, and the SFT / mid-training datasets (laplace.data.chat)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch
from conftest import ROOT

from laplace.chat_format import (
    ConversationError,
    render_conversation,
    render_conversations,
    render_for_completion,
)
from laplace.data import DatasetNotFoundError
from laplace.data.chat import (
    PackedChatDataset,
    PydocChat,
    SFTDataset,
    build_mixture,
    gsm8k_parts,
    load_split,
    load_task,
    render_mc,
    sft_collate,
)
from laplace.data.text import pydoc_documents
from laplace.errors import ConfigError
from laplace.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_config, train_bpe

TWO_TURNS = {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi, who are you?"},
    {"role": "assistant", "content": "A small model."},
    {"role": "user", "content": "Ça va ? <|assistant_end|>"},  # a special's text is just text
    {"role": "assistant", "content": "Très bien."}]}
GSM = {"messages": [
    {"role": "user", "content": "Tom has 3 apples and buys 4. How many?"},
    {"role": "assistant", "content": gsm8k_parts("He has 3+4 = <<3+4=7>>7 apples.\n#### 7")}]}


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def tok(request):
    if request.param == "bytes":
        return load_tokenizer("bytes")
    return train_bpe(pydoc_documents(True), 512)


def _sp(tok, name):
    return tok.special_id(name)


# ---------------------------------------------------------------------------- rendering

def test_two_turns_render_exactly_with_system_merged(tok):
    ids, mask = render_conversation(tok, TWO_TURNS)
    us, ue, as_, ae = (_sp(tok, n) for n in ("<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                                             "<|assistant_end|>"))
    want = ([tok.bos_id, us] + tok.encode("You are terse.\n\nHi, who are you?") + [ue, as_]
            + tok.encode("A small model.") + [ae, us] + tok.encode("Ça va ? <|assistant_end|>") + [ue, as_]
            + tok.encode("Très bien.") + [ae])
    assert ids == want and len(mask) == len(ids)
    # The mask is exactly the assistant's content and its <|assistant_end|>.
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "A small model.<|assistant_end|>Très bien.<|assistant_end|>"
    assert ids.count(ae) == 2  # the user's "<|assistant_end|>" text is not the special token
    assert mask[:ids.index(as_) + 1] == [0] * (ids.index(as_) + 1)
    # Several conversations at once (one encode_batch call) render the same.
    assert render_conversations(tok, [GSM, TWO_TURNS]) == [render_conversation(tok, GSM), (ids, mask)]


def test_tool_calls_are_trained_and_tool_outputs_are_not(tok):
    ids, mask = render_conversation(tok, GSM)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == ("He has 3+4 = <|python_start|>3+4<|python_end|>7 apples.\n#### 7"
                       "<|assistant_end|>")
    untrained = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert untrained.endswith("<|assistant_start|><|output_start|>7<|output_end|>")
    assert [p["type"] for p in GSM["messages"][1]["content"]] == ["text", "python", "python_output", "text"]


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "message 1 .* should be from 'assistant'"),
    ([{"role": "assistant", "content": "a"}], "message 0 .* should be from 'user'"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "system message must be followed"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "code", "text": "x"}]}],
     "assistant part"),
    ([{"role": "user", "content": ["a"]}], "string content"),
    ([], "no messages"),
])
def test_malformed_conversations_are_one_line_errors(messages, match):
    with pytest.raises(ConversationError, match=match) as e:
        render_conversation(load_tokenizer("bytes"), {"messages": messages})
    assert "\n" not in str(e.value)


def test_truncation_and_completion_prompt(tok):
    ids, mask = render_conversation(tok, TWO_TURNS)
    short, short_mask = render_conversation(tok, TWO_TURNS, max_tokens=12)
    assert short == ids[:12] and short_mask == mask[:12]
    prompt = render_for_completion(tok, TWO_TURNS)  # drops the last assistant reply
    head = {"messages": TWO_TURNS["messages"][:-1]}
    assert prompt[-1] == _sp(tok, "<|assistant_start|>")
    assert prompt == render_conversation(tok, head)[0] + [_sp(tok, "<|assistant_start|>")]
    assert render_for_completion(tok, head) == prompt  # a conversation ending with the user
    assert TWO_TURNS["messages"][-1]["role"] == "assistant"  # the input is not modified
    with pytest.raises(ConversationError, match="ends with a user message"):
        render_for_completion(tok, {"messages": [{"role": "assistant", "content": "no question"}]})


def test_tokenizer_without_chat_tokens_is_its_one_line_config_error():
    # GPT-2's kind (no chat specials) built offline: bytes as ranks, <|endoftext|> as BOS.
    enc = tiktoken.Encoding("gpt2-like", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={"<|endoftext|>": 256})
    gpt2_like = Tokenizer("gpt2", enc, "<|endoftext|>", "gpt2")
    with pytest.raises(ConfigError, match="has no special token <\\|user_start\\|>"):
        render_conversation(gpt2_like, TWO_TURNS)
    with pytest.raises(ConfigError):
        SFTDataset([TWO_TURNS], gpt2_like)


def test_tokenizer_from_config():
    assert tokenizer_from_config({"data": {"name": "pydoc_text", "vocab_size": 257}}).kind == "bytes"
    assert tokenizer_from_config({"data": {"tokenizer": None}}).kind == "bytes"
    with pytest.raises(DatasetNotFoundError, match="tokenizer file not found"):
        tokenizer_from_config({"data": {"tokenizer": "/no/such/tokenizer.json"}})


# ---------------------------------------------------------------------------- datasets

def test_sft_collate_targets(tok):
    ds = SFTDataset([TWO_TURNS, GSM], tok, max_tokens=2048)
    items = [ds[0], ds[1]]
    assert all(i.dtype == torch.long for pair in items for i in pair)
    pad = _sp(tok, "<|assistant_end|>")
    x, y = sft_collate(items, pad_id=pad)
    T = max(len(i) for i, _ in items) - 1
    assert x.shape == y.shape == (2, T)
    for b, (ids, mask) in enumerate(items):
        n = len(ids) - 1
        assert torch.equal(x[b, :n], ids[:-1]) and (x[b, n:] == pad).all()
        want = torch.where(mask[1:] == 1, ids[1:], torch.tensor(-1))
        assert torch.equal(y[b, :n], want) and (y[b, n:] == -1).all()
        # The targets that count are exactly the assistant's tokens.
        assert tok.decode(y[b][y[b] >= 0]) == tok.decode([i for i, m in zip(ids.tolist(), mask.tolist()) if m])
    assert pickle.loads(pickle.dumps(ds))[1][0].tolist() == items[1][0].tolist()  # DataLoader workers


def test_packed_rows(tok):
    convs = [TWO_TURNS, GSM] * 6
    L = 24
    ds = PackedChatDataset(convs, tok, seq_len=L)
    stream = [t for c in convs for t in render_conversation(tok, c, max_tokens=None)[0]]
    masks = [m for c in convs for m in render_conversation(tok, c, max_tokens=None)[1]]
    assert len(ds) == (len(stream) - 1) // L and len(ds) > 3
    for i in range(len(ds)):
        tokens, mask = ds.row(i)
        assert tokens.shape == mask.shape == (L + 1,)
        assert tokens.tolist() == stream[i * L: i * L + L + 1] and mask.tolist() == [bool(m) for m in masks[i * L: i * L + L + 1]]
        x, y = ds[i]
        assert x.shape == y.shape == (L,) and torch.equal(x, tokens[:-1])
        assert torch.equal(y, torch.where(mask[1:], tokens[1:], torch.tensor(-1)))
    x, y = PackedChatDataset(convs, tok, seq_len=L, masked=False)[1]  # nanochat: every token trained
    assert torch.equal(y, ds.row(1)[0][1:])
    with pytest.raises(ConfigError, match="seq_len=100000"):
        PackedChatDataset([GSM], tok, seq_len=100_000)


def test_pydoc_chat_is_built_in_and_deterministic():
    train, val = PydocChat("train"), PydocChat("val")
    assert len(train) > 500 and len(val) > 20
    assert [train[i] for i in range(0, len(train), 97)] == [PydocChat("train")[i] for i in range(0, len(train), 97)]
    qa = train[0]["messages"]
    assert qa[0]["content"].startswith("What does the Python documentation say about")
    assert 20 < len(qa[1]["content"]) <= 600
    mc = [c for c in (train[i] for i in range(40)) if "letters" in c]
    assert mc and all(c["messages"][1]["content"] in "ABCD" for c in mc)
    assert "=A\n" in mc[0]["messages"][0]["content"]  # nanochat's render_mc format
    train_q = {train[i]["messages"][0]["content"] for i in range(len(train))}
    assert not train_q & {val[i]["messages"][0]["content"] for i in range(len(val))}
    tok = load_tokenizer("bytes")
    assert sum(render_conversation(tok, val[0])[1]) > 10
    with pytest.raises(ConfigError, match="split='test'"):
        PydocChat("test")


# ---------------------------------------------------------------------------- hub-format files

def _write(path, table: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(table), path)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Tiny copies of the four hub datasets in their repos' layout and column nesting."""
    root = tmp_path_factory.mktemp("hub")
    msgs = [[{"content": "Hello!", "role": "user"}, {"content": "Hi, how can I help?", "role": "assistant"}],
            [{"content": "Be brief.", "role": "system"}, {"content": "Capital of France?", "role": "user"},
             {"content": "Paris.", "role": "assistant"}, {"content": "And Italy?", "role": "user"},
             {"content": "Rome.", "role": "assistant"}],
            [{"content": "2+2?", "role": "user"}, {"content": "4", "role": "assistant"}]]
    _write(root / "smol-smoltalk/data/train-00000-of-00001.parquet",
           {"messages": msgs, "source": ["a", "b", "c"]})
    _write(root / "smol-smoltalk/data/test-00000-of-00001.parquet", {"messages": msgs[:1], "source": ["a"]})
    aux = [{"question": f"Q{i}?", "subject": "", "choices": [f"c{i}{j}" for j in range(4)], "answer": i % 4}
           for i in range(8)]
    _write(root / "mmlu/auxiliary_train/train-00000-of-00001.parquet", {"train": aux})
    _write(root / "mmlu/all/test-00000-of-00001.parquet",
           {"question": ["What is 1+1?"], "subject": ["elementary_mathematics"],
            "choices": [["1", "2", "3", "4"]], "answer": [1]})
    _write(root / "mmlu/all/dev-00000-of-00001.parquet",
           {"question": ["Dev?"], "subject": ["x"], "choices": [["a", "b", "c", "d"]], "answer": [3]})
    _write(root / "gsm8k/main/train-00000-of-00001.parquet",
           {"question": ["Weng earns $12 an hour. She worked 50 minutes. How much did she earn?"],
            "answer": [("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
                        "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10")]})
    _write(root / "ai2_arc/ARC-Easy/train-00000-of-00001.parquet",
           {"id": ["q1", "q2"], "question": ["Which is a gas?", "Pick two."],
            "choices": [{"text": ["rock", "steam", "wood", "iron"], "label": ["A", "B", "C", "D"]},
                        {"text": ["one", "two", "three"], "label": ["1", "2", "3"]}],
            "answerKey": ["B", "2"]})
    return root


def test_task_loaders_read_the_hub_layout(hub, tmp_path):
    kw = {"cache_dir": str(tmp_path / "cache")}
    smol = load_task("smoltalk", str(hub / "smol-smoltalk"), **kw)
    assert len(smol) == 3 and smol[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert len(load_task("smoltalk", str(hub / "smol-smoltalk"), split="test", **kw)) == 1

    aux = load_task("mmlu", str(hub / "mmlu"), **kw)  # subset auxiliary_train: rows under `train`
    assert len(aux) == 8
    c = aux[2]["messages"]
    assert c[0]["content"] == render_mc("Q2?", "ABCD", ["c20", "c21", "c22", "c23"]) and c[1]["content"] == "C"
    assert c[0]["content"].startswith("Multiple Choice question: Q2?\n- c20=A\n- c21=B\n")
    test = load_task("mmlu", str(hub / "mmlu"), subset="all", split="test", **kw)
    assert test[0]["messages"][1]["content"] == "B" and test[0]["subject"] == "elementary_mathematics"
    dev = load_task("mmlu", str(hub / "mmlu" / "all"), split="dev", **kw)  # the subset folder itself
    assert len(dev) == 1 and dev[0]["messages"][1]["content"] == "D"

    gsm = load_task("gsm8k", str(hub / "gsm8k"), **kw)[0]["messages"]
    assert [p["type"] for p in gsm[1]["content"]] == ["text", "python", "python_output", "text", "python",
                                                      "python_output", "text"]
    assert gsm[1]["content"][1:3] == [{"type": "python", "text": "12/60"}, {"type": "python_output", "text": "0.2"}]
    assert gsm[1]["content"][4]["text"] == "0.2*50" and gsm[1]["content"][5]["text"] == "10"
    assert gsm[1]["content"][-1]["text"].endswith("#### 10")

    arc = load_task("arc", str(hub / "ai2_arc"), subset="ARC-Easy", **kw)
    assert arc[0]["messages"][1]["content"] == "B" and "- steam=B\n" in arc[0]["messages"][0]["content"]
    assert arc[1]["letters"] == ("1", "2", "3") and arc[1]["messages"][1]["content"] == "2"

    tok = load_tokenizer("bytes")  # every task renders
    for task in (smol, aux, load_task("gsm8k", str(hub / "gsm8k"), **kw), arc):
        assert all(sum(render_conversation(tok, task[i])[1]) > 0 for i in range(len(task)))


def test_missing_data_is_a_one_line_error(hub, tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        build_mixture([{"task": "mmlu", "path": str(tmp_path / "nope")}], seed=0)
    msg = str(e.value)
    assert "\n" not in msg and "data.tasks[0].path" in msg and "hf download <hub id> --repo-type dataset" in msg
    with pytest.raises(DatasetNotFoundError, match="no 'validation' split files") as e:
        load_split(str(hub / "gsm8k"), "main", "validation", key="data.tasks[1].path")
    assert "\n" not in str(e.value)


def test_mixture_is_deterministic_and_respects_repeats(hub, tmp_path):
    kw = {"cache_dir": str(tmp_path / "cache")}
    specs = [{"task": "mmlu", "path": str(hub / "mmlu"), "repeats": 2},
             {"task": "smoltalk", "path": str(hub / "smol-smoltalk")},
             {"task": "pydoc_chat", "repeats": 0.5, "max_examples": 100}]
    a, b = build_mixture(specs, seed=3, **kw), build_mixture(specs, seed=3, **kw)
    assert np.bincount(a.task_of).tolist() == [16, 3, 50] and len(a) == 69  # mmlu, smoltalk, pydoc_chat
    assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]
    c = build_mixture(specs, seed=4, **kw)
    assert [a[i] for i in range(len(a))] != [c[i] for i in range(len(c))]
    mmlu = sorted(a[i]["messages"][0]["content"] for i in range(len(a)) if a.task_of[i] == 0)
    assert len(set(mmlu)) == 8 and all(mmlu.count(q) == 2 for q in mmlu)  # every example twice
    assert len(set(a.task_of[:20].tolist())) > 1  # the tasks are interleaved
    assert pickle.loads(pickle.dumps(a))[5] == a[5]
    for bad, match in [([{"task": "mmlu", "weight": 2}], r"data.tasks\[0\].weight: unknown key"),
                       ([{"task": "nope"}], "data.tasks\\[0\\].task='nope'"),
                       ([{"task": "pydoc_chat", "path": "x"}], "pydoc_chat is built in"),
                       ([{"task": "pydoc_chat", "repeats": -1}], "repeats=-1"),
                       ([], "is empty")]:
        with pytest.raises(ConfigError, match=match):
            build_mixture(bad, seed=0, **kw)


def test_unreachable_hub_id_is_a_one_line_error(tmp_path):
    """A hub id without network (offline mode: no retries) names the key and how to download."""
    code = ("from laplace.data.chat import load_split\n"
            f"load_split('cais/mmlu', 'all', 'test', key='data.tasks[0].path', cache_dir={str(tmp_path)!r})")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "DatasetNotFoundError: data.tasks[0].path=cais/mmlu" in last
    assert "hf download cais/mmlu --repo-type dataset --local-dir DIR" in last
