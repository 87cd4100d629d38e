"""trainer=gpt on the built-in pydoc text: trains, resumes exactly, and its checkpoint generates."""
from __future__ import annotations

import torch

from laplace.checkpoint import load_model
from laplace.data.text import BOS, VOCAB_SIZE, build_pydoc_text, pydoc_documents
from laplace.tokenizer import load_tokenizer
from train.logger import read_metrics
from train import run

TINY_GPT = ["experiment=gpt_pydoc", "model=gpt_d2_1L", "data.seq_len=32", "trainer.global_batch_size=8",
            "trainer.num_workers=0", "trainer.progress=false", "trainer.log_every=1",
            "trainer.eval_every=100", "trainer.max_steps=4"]


def test_pydoc_text_windows_are_real_text():
    train, val = build_pydoc_text(True, 64), build_pydoc_text(False, 64)
    assert len(train) > 1000 and len(val) > 10
    x, y = train[5]
    assert x.shape == y.shape == (64,) and torch.equal(x[1:], y[:-1])  # y is x shifted by one
    assert int(x.max()) < VOCAB_SIZE and (train.tokens == BOS).sum() > 50  # one BOS per document
    assert len(load_tokenizer("bytes").decode(x).split()) > 3  # English words, not noise
    assert not set(pydoc_documents(True)) & set(pydoc_documents(False))  # no topic in both splits


def test_gpt_trainer_resumes_exactly_and_generates(make_cfg, tmp_path):
    run(make_cfg(*TINY_GPT, run_dir=tmp_path / "a"))
    run(make_cfg(*TINY_GPT, "trainer.stop_after=2", run_dir=tmp_path / "b"))
    run(make_cfg(*TINY_GPT, run_dir=tmp_path / "b"))
    losses = lambda d: [(r["step"], r["loss"]) for r in read_metrics(d) if r.get("split") == "train"]
    assert [s for s, _ in losses(tmp_path / "a")] == [1, 2, 3, 4]
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert losses(tmp_path / "a")[-1][1] < losses(tmp_path / "a")[0][1]  # it learns
    val = [r for r in read_metrics(tmp_path / "a") if r.get("split") == "val"]
    assert val and val[-1]["val_bpb"] > 0

    model = load_model(tmp_path / "a/ckpt/last.pt")
    assert model.num_laplacian_heads == [1, 1]
    prompt = torch.tensor([[BOS] + list(b"The ")])
    out = model.generate(prompt, 8, temperature=0)
    assert out.shape == (1, 13) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, model.generate(prompt, 8, temperature=0, use_cache=False))


def test_init_from_works_for_the_gpt_trainer(make_cfg, tmp_path):
    """trainer.init_from is the engine's: a GPT run starts from another GPT's checkpoint (lm_head
    kept, same vocabulary); Laplacian heads must match."""
    import pytest
    from laplace.checkpoint import CheckpointError, load_checkpoint

    run(make_cfg(*TINY_GPT, "trainer.max_steps=2", run_dir=tmp_path / "pre"))
    src = tmp_path / "pre/ckpt/last.pt"
    run(make_cfg(*TINY_GPT, "trainer.max_steps=1", f"trainer.init_from={src}", run_dir=tmp_path / "ft"))
    a, b = load_checkpoint(src)["model"], load_checkpoint(tmp_path / "ft/ckpt/last.pt")["model"]
    for k in ("wte.weight", "lm_head.weight", "blocks.1.attn.qkv.weight"):  # one step at lr 1e-6
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=0)
    with pytest.raises(CheckpointError, match="trained as gpt_d2_1L"):
        baseline = [a for a in TINY_GPT if not a.startswith("model=")] + ["model=gpt_d2_0L"]
        run(make_cfg(*baseline, f"trainer.init_from={src}", run_dir=tmp_path / "bad"))


def test_batches_without_counted_targets_give_no_zero_by_zero(make_cfg, tmp_path):
    """A micro-batch with no counted target (SFT rows of user turns and padding only) trains with
    loss 0 and no gradient; a validation whose targets are special tokens only (0 bytes) reports
    its loss but no bits per byte (it used to report 0.0: 0 nats / max(0 bytes, 1))."""
    import math

    from train.gpt import GPTTrainer

    (tmp_path / "run").mkdir()
    t = GPTTrainer(make_cfg(*TINY_GPT, "trainer.sample_prompts=[]")).setup()
    x = torch.randint(0, 256, (2, 32))
    loss = t.train_step((x, torch.full_like(x, -1)))
    loss.backward()
    assert loss.item() == 0.0
    assert all(not p.grad.any() for p in t.model.parameters() if p.grad is not None)
    t.data.val_batches = lambda loader: [(x, torch.full_like(x, BOS))]
    metrics = t.evaluate()
    assert math.isfinite(metrics["val_loss"]) and metrics["val_loss"] > 0 and "val_bpb" not in metrics
    t.data.val_batches = lambda loader: [(x, x)]
    assert t.evaluate()["val_bpb"] > 0
