"""The language-model pipeline (issue: BPE tokenizer -> token shards -> Muon pre-training ->
SFT -> sampling) on the built-in help text, and the paper's d20 configuration."""
from __future__ import annotations

import pytest

from train.plan import token_budget_steps


@pytest.mark.parametrize("model, params, steps", [("gpt_d20_5L", 560_988_160, 21_400),
                                                  ("gpt_d12_3L", 185_597_952, 7_080)])
def test_paper_configuration(make_cfg, model, params, steps):
    """experiment=gpt_d20: 560,988,160 parameters, 524,288 tokens per step, 20 tokens per
    parameter; gpt_d12 shares the recipe."""
    import torch

    from laplace import create_model

    exp = "gpt_d20" if "d20" in model else "gpt_d12"
    cfg = make_cfg(f"experiment={exp}", f"model={model}")
    with torch.device("meta"):
        n = sum(p.numel() for p in create_model(**cfg.model).parameters())
    assert n == params
    assert cfg.trainer.global_batch_size * cfg.data.seq_len == 524_288
    assert cfg.optim.name == "muon" and cfg.data.vocab_size == 65_536
    assert token_budget_steps(cfg) == steps == 20 * n // 524_288


# ---- the built-in pipeline at tiny size -------------------------------------------------------
TINY = ["model=gpt_d2_1L", "data.seq_len=64", "trainer.global_batch_size=4", "trainer.num_workers=0",
        "trainer.progress=false", "trainer.log_every=1"]


# pydoc_shards: tests/conftest.py (one per session, shared with tests/test_precision_compile.py)


def _pre(pydoc_shards, *more):
    return ["experiment=gpt_tiny", *TINY, f"data.root={pydoc_shards}", "data.vocab_size=512", *more]


def test_pipeline_tokenizer_shards_pretrain_sft_sample(make_cfg, tmp_path, pydoc_shards, capsys):
    """BPE -> shards -> 3 Muon steps -> 3 SFT steps -> chat sampling, and the checkpoints name
    their tokenizer so that eval finds it from the checkpoint alone."""
    import json
    import subprocess
    import sys

    from laplace.chat_format import render_for_completion
    from laplace.checkpoint import load_checkpoint, load_model
    from laplace.sampling import stream_tokens
    from laplace.tokenizer import tokenizer_from_config
    from train import run
    from train.logger import read_metrics

    pre, sft = tmp_path / "pre", tmp_path / "sft"
    run(make_cfg(*_pre(pydoc_shards, "trainer.max_steps=3", "trainer.eval_every=3",
                       "trainer.peak_flops=1e12"), run_dir=pre))
    recs = read_metrics(pre)
    train_recs = [r for r in recs if r.get("split") == "train"]
    assert [r["step"] for r in train_recs] == [1, 2, 3]
    assert all(r["mfu"] > 0 and r["tok_per_s"] > 0 and 0.85 <= r["momentum"] < 0.95 for r in train_recs)
    val = [r for r in recs if r.get("split") == "val"][-1]
    assert 0 < val["val_bpb"] < val["val_loss"]  # a BPE token holds several bytes
    samples = [json.loads(ln) for ln in (pre / "samples.jsonl").read_text().splitlines()]
    assert samples[-1]["step"] == 3 and set(samples[-1]["samples"]) == {"The for statement", "A class is"}
    ck = load_checkpoint(pre / "ckpt/last.pt")
    assert set(ck["optimizer"]) == {"muon", "adamw"}
    assert ck["config"]["data"]["tokenizer"] == str(pydoc_shards / "tokenizer.json")

    run(make_cfg("experiment=gpt_tiny_sft", *TINY, "trainer.max_steps=3", "trainer.eval_every=3",
                 f"trainer.init_from={pre / 'ckpt/last.pt'}", run_dir=sft))
    cfg = load_checkpoint(sft / "ckpt/last.pt")["config"]
    assert cfg["data"]["tokenizer"] == str(pydoc_shards / "tokenizer.json") and cfg["data"]["vocab_size"] == 512
    assert [r["step"] for r in read_metrics(sft) if r.get("split") == "train"] == [1, 2, 3]
    tok, model = tokenizer_from_config(cfg), load_model(sft / "ckpt/last.pt")
    prompt = render_for_completion(tok, {"messages": [{"role": "user", "content": "What is a class?"}]})
    ids = list(stream_tokens(model, prompt, 12, stop_ids=(tok.special_id("<|assistant_end|>"),)))
    assert 0 < len(ids) <= 12 and all(0 <= i < 512 for i in ids)
    out = subprocess.run([sys.executable, "-m", "eval.generate", f"checkpoint={sft / 'ckpt/last.pt'}",
                          "chat=true", "prompt=What is a class", "max_new_tokens=8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_shard_training_resumes_at_the_same_token(make_cfg, tmp_path, pydoc_shards):
    """4 steps straight == 2 steps, stop, 2 more: the stream, Muon's momentum buffers and the
    schedules all come back."""
    from train import run
    from train.logger import read_metrics

    args = _pre(pydoc_shards, "trainer.max_steps=4", "trainer.eval_every=100", "trainer.sample_prompts=[]")
    run(make_cfg(*args, run_dir=tmp_path / "a"))
    run(make_cfg(*args, "trainer.stop_after=2", run_dir=tmp_path / "b"))
    run(make_cfg(*args, run_dir=tmp_path / "b"))
    losses = lambda d: [(r["step"], r["loss"]) for r in read_metrics(d) if r.get("split") == "train"]  # noqa: E731
    assert losses(tmp_path / "a") == losses(tmp_path / "b") and len(losses(tmp_path / "a")) == 4


def test_mid_training_packs_and_masks(make_cfg, tmp_path, pydoc_shards):
    """Mid-training form (packed rows, assistant-only loss) from a pre-trained checkpoint."""
    from train import run
    from train.logger import read_metrics

    run(make_cfg(*_pre(pydoc_shards, "trainer.max_steps=1", "trainer.sample_prompts=[]"), run_dir=tmp_path / "pre"))
    run(make_cfg("experiment=gpt_tiny_sft", *TINY, "data.packed=true", "trainer.max_steps=2",
                 "trainer.eval_every=2", f"trainer.init_from={tmp_path / 'pre/ckpt/last.pt'}",
                 run_dir=tmp_path / "mid"))
    recs = read_metrics(tmp_path / "mid")
    assert [r["step"] for r in recs if r.get("split") == "train"] == [1, 2]
    assert [r for r in recs if r.get("split") == "val"][-1]["val_loss"] > 0


def test_tokenizer_and_vocab_mismatch_are_one_line_errors(make_cfg, tmp_path, pydoc_shards):
    from laplace.errors import ConfigError
    from train import run

    with pytest.raises(ConfigError, match="data.vocab_size=4096 but the tokenizer"):
        run(make_cfg(*_pre(pydoc_shards, "data.vocab_size=4096"), run_dir=tmp_path / "x"))
    with pytest.raises(ConfigError, match="trainer.init_from"):
        run(make_cfg("experiment=gpt_tiny_sft", *TINY, "trainer.init_from=null", run_dir=tmp_path / "y"))


@pytest.mark.parametrize("setting, compiled", [("auto", False), ("false", False), ("true", True)])
def test_compile_auto_is_off_on_cpu(make_cfg, tmp_path, setting, compiled):
    """trainer.compile=auto compiles on CUDA only; true always wraps the model."""
    import torch

    from train import get_trainer

    cfg = make_cfg("experiment=gpt_pydoc", *TINY, f"trainer.compile={setting}", run_dir=tmp_path)
    trainer = get_trainer("gpt")(cfg).setup()
    on_cuda = trainer.device.type == "cuda"
    expect = compiled or (setting == "auto" and on_cuda)
    assert trainer.compile is expect
    assert isinstance(trainer.net, torch._dynamo.eval_frame.OptimizedModule) is expect


def test_resume_refuses_other_shards_and_records_the_tokenizer(make_cfg, tmp_path, pydoc_shards):
    """The checkpoint records what the data is (the feed's identity, the GPT's tokenizer
    fingerprint: Trainer.data_identity); the same run resumed on other token shards is refused."""
    import shutil

    import numpy as np

    from laplace.checkpoint import CheckpointError, load_checkpoint
    from train import run

    data = tmp_path / "data"
    shutil.copytree(pydoc_shards, data)
    args = [*_pre(data, "trainer.max_steps=2", "trainer.eval_every=100", "trainer.sample_prompts=[]"),
            "trainer.stop_after=1"]
    run(make_cfg(*args, run_dir=tmp_path / "r"))
    saved = load_checkpoint(tmp_path / "r" / "ckpt" / "last.pt")["data_identity"]
    assert set(saved) == {"shards", "tokens", "digest", "tokenizer"} and saved["shards"] == 1
    shard = data / "train" / "shard_00000.npy"
    np.save(shard, np.roll(np.load(shard), 1))  # same length and counts, other tokens
    with pytest.raises(CheckpointError, match="was trained on other data than data.root"):
        run(make_cfg(*args, run_dir=tmp_path / "r"))
