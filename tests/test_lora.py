"""LoRA fine-tuning (train/lora.py, peft): adapters only trained, exact resume, checkpoints without a
second copy of the base, and a merged export whose logits equal the adapted model's."""
from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_gpt

from laplace.checkpoint import load_checkpoint, load_model
from train import run as train_run

pytest.importorskip("peft")

TINY = ["experiment=gpt_pydoc", "model=gpt_d2_1L", "trainer=lora", "optim=adamw", "optim.lr=0.01",
        "optim.weight_decay=0", "optim.schedules.lr.warmup=null", "data.seq_len=32", "trainer.global_batch_size=8",
        "trainer.num_workers=0", "trainer.progress=false", "trainer.max_steps=4", "trainer.eval_every=100",
        "trainer.sample_prompts=[]", "trainer.ckpt_every=1"]


@pytest.mark.parametrize("name", ["gpt_d2_1L", "gpt26_d2_1L"])  # the 2025 GPT and the authors' 2026 one
def test_lora_trains_adapters_resumes_and_merges(make_cfg, tmp_path, name):
    base = save_tiny_gpt(tmp_path / "base.pt", seq_len=32, name=name)
    args = [*TINY, f"model={name}", f"trainer.base={base}"]
    train_run(make_cfg(*args, run_dir=tmp_path / "straight"))
    train_run(make_cfg(*args, "trainer.stop_after=2", run_dir=tmp_path / "resumed"))
    train_run(make_cfg(*args, run_dir=tmp_path / "resumed"))
    straight, resumed = (load_checkpoint(tmp_path / r / "ckpt" / "last.pt") for r in ("straight", "resumed"))
    assert straight["loop"]["step"] == resumed["loop"]["step"] == 4
    for key in ("model", "train_model"):  # exact resume: the merged model and the adapters, bit for bit
        assert straight[key].keys() == resumed[key].keys()
        assert all(torch.equal(straight[key][k], resumed[key][k]) for k in straight[key]), key

    # the checkpoint holds the adapters beside the merged model, not the base a second time
    assert straight["train_model"] and all("lora_" in k for k in straight["train_model"])
    base_sd = load_checkpoint(base)["model"]
    merged = straight["model"]
    assert merged.keys() == base_sd.keys()
    targets = (".attn.qkv.", ".attn.proj.", ".mlp.c_fc.", ".mlp.c_proj.")
    for k in merged:  # only the adapted matrices moved (base frozen; B starts at 0, so they did train)
        assert torch.equal(merged[k], base_sd[k]) != any(t in k for t in targets), k

    # merge_and_unload: the exported GPT's logits equal the adapted model's
    from train.lora import LoRATrainer

    t = LoRATrainer(make_cfg(*args, run_dir=tmp_path / "straight")).setup()  # resumes at its end
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "straight" / "ckpt" / "last.pt")(x), t.model.eval()(x),
                                   rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in t.model.parameters() if p.requires_grad) == sum(
        v.numel() for v in straight["train_model"].values())
