"""`trainer=gpt`: the language model, nanochat's pipeline on the shared engine.

One trainer for the three stages; what it reads is built by `data.kind` (laplace/data/kinds.py):
byte windows of the built-in text, pre-training token shards, or conversations for
mid-training and SFT (which start from a pre-training checkpoint through trainer.init_from).

    python train.py experiment=gpt_d20 model=gpt_d20_5L data.root=/data/fineweb_edu   # the paper's run
    python train.py experiment=gpt_tiny model=gpt_d4_2L                               # built-in text, CPU

nanochat's recipe lives in the configs (configs/experiment/gpt_*.yaml beside
configs/reference/gpt_*.yaml; `python -m train.recipe` renders them, docs/recipes/): Muon + AdamW
(optim=muon, train/optim.py), the batch in tokens (global_batch_size x data.seq_len), a token
budget of `trainer.tokens_per_param` x parameters unless trainer.max_steps or data.train_tokens
is set. Logged: loss, validation bits per byte (see `evaluate`), tokens/s, model FLOPs
utilisation, and greedy samples of fixed prompts at each evaluation (<run_dir>/samples.jsonl).
"""
from __future__ import annotations

import json
import math

import torch

from laplace import model_label
from .dist import all_reduce_sum
from laplace.io import append_line

from .engine import Trainer

class GPTTrainer(Trainer):
    archs, modality = ("gpt",), "text"
    example = "python train.py experiment=gpt_tiny model=gpt_d4_2L"

    def build_data(self):
        from laplace.data.kinds import build_text_data

        return build_text_data(self.cfg.data, seed=self.cfg.seed, micro_batch_size=self.micro_bs,
                               rank=self.dist.rank, world_size=self.dist.world_size,
                               init_from=self.cfg.trainer.init_from, step_windows=self.cfg.trainer.global_batch_size)

    def build_model(self):
        model = super().build_model()
        d = self.cfg.data
        if d.get("kind") != "chat" or d.get("packed"):  # throughput in tokens (SFT: conversations): the MFU
            self.flops_per_unit = model.flops_per_token(d.seq_len)
        if self.dist.is_main:
            print(f"[laplace] {model_label(self.cfg.model)}: {sum(p.numel() for p in model.parameters()):,} parameters",
                  flush=True)
        return model

    # ---- steps and evaluation ------------------------------------------------------------
    def train_step(self, batch):
        x, y = batch
        # Mean over the counted targets; a row of SFT padding alone counts none (loss 0, not NaN).
        return self.net(x, targets=y, reduction="sum") / (y >= 0).sum().clamp(min=1)

    def evaluate(self) -> dict:
        """Validation loss, and bits per byte: the targets' summed nats over their UTF-8 bytes,
        special tokens excluded, as nanochat's evaluate_bpb but with another byte table."""
        batches = self.data.val_batches(self.eval_loader)
        if batches is None:
            return {}
        # Each token's real bytes. nanochat's token_bytes decodes each token to text, so part of
        # a multi-byte character becomes U+FFFD and counts 3 bytes (one byte of "é": 3); ours sum
        # to the text's UTF-8 length whatever the splits (nanochat's bpb is lower on non-ASCII).
        token_bytes = self.data.tokenizer.token_bytes().to(self.device)
        if token_bytes.numel() < self.model.vocab_size:  # a tokenizer smaller than the embedding
            token_bytes = torch.cat([token_bytes, token_bytes.new_zeros(self.model.vocab_size - token_bytes.numel())])
        # Summed nats and counted tokens, and nats and UTF-8 bytes over tokens that have bytes.
        sums = torch.zeros(4, device=self.device, dtype=torch.float64)
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            nats = self.net(x, targets=y, reduction="none").double()  # [B, T], 0 where y == -1
            counted = y >= 0
            nbytes = torch.where(counted, token_bytes[y.clamp(min=0)], 0)
            sums += torch.stack([nats.sum(), counted.sum().double(),
                                 (nats * (nbytes > 0)).sum(), nbytes.sum().double()])
        nats, n, byte_nats, nbytes = all_reduce_sum(sums).tolist()
        if n == 0:
            return {}
        metrics = {"val_loss": nats / n}
        if nbytes > 0:  # targets that are all special tokens have no bytes: no bits per byte (0/0)
            metrics["val_bpb"] = byte_nats / nbytes / math.log(2)
        self._write_samples()
        return metrics

    def _write_samples(self):
        """Greedy completions of trainer.sample_prompts (rank 0), printed and appended to
        <run_dir>/samples.jsonl: what the model says at this step."""
        prompts = list(self.cfg.trainer.sample_prompts or [])
        if not prompts or not self.dist.is_main:
            return
        from laplace.sampling import sample_texts

        texts = sample_texts(self.model, self.data.tokenizer, prompts,
                             max_new_tokens=self.cfg.trainer.sample_tokens)
        append_line(self.run_dir / "samples.jsonl",
                    json.dumps({"step": self.step, "samples": dict(zip(prompts, texts))}))
        if not self.cfg.trainer.progress:
            for p, t in zip(prompts, texts):
                print(f"[sample] {p!r} -> {t!r}", flush=True)

    def results(self, metrics: dict) -> dict:
        return {"tokenizer": self.data.tokenizer.spec}
