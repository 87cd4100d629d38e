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

import functools
import json
import math

import torch
from laplace import model_label
from laplace.dist import all_reduce_sum
from laplace.io import append_line

from .engine import Trainer
from .optim import build_muon_adamw

# bf16 dense peak of one GPU, for model FLOPs utilisation (trainer.peak_flops overrides).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
                   "A100": 312e12, "A800": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token, nanochat's estimate: 6 x (parameters outside the embedding)
    + the attention scores and mixing, 12 x layers x heads x head size x context."""
    n = sum(p.numel() for p in model.parameters()) - model.wte.weight.numel()
    return 6 * n + 12 * model.depth * model.num_heads * model.head_dim * seq_len


class GPTTrainer(Trainer):
    model_archs, data_modality = ("gpt",), "text"
    example = "python train.py experiment=gpt_tiny model=gpt_d4_2L"

    # ---- data ----------------------------------------------------------------------------
    def build_datasets(self):
        from laplace.data.kinds import build_text_data

        self.data = build_text_data(self.cfg.data, seed=self.cfg.seed, micro_batch_size=self.micro_bs,
                                    rank=self.dist.rank, world_size=self.dist.world_size,
                                    init_from=self.cfg.trainer.init_from)
        return self.data.train, self.data.val

    # What the engine reads of the data: throughput unit and batching (the run's length: train/plan.py).
    # collate is the data's own function, not a method: a bound method would carry the whole
    # trainer into each spawned loader worker.
    unit = property(lambda self: self.data.unit)
    units_per_sample = property(lambda self: self.data.units_per_sample)
    collate = property(lambda self: self.data.collate)
    tokenizer = property(lambda self: self.data.tokenizer)

    def data_identity(self) -> dict | None:
        """The feed's identity (token shards) and the tokenizer's fingerprint: data.tokenizer may
        move between machines, the tokenizer it names may not change under a resumed run."""
        identity = super().data_identity() or {}
        if self.tokenizer is not None:
            identity["tokenizer"] = self.tokenizer.fingerprint()[:16]
        return identity or None

    # ---- model and optimizers ------------------------------------------------------------
    def build_model(self):
        model = super().build_model()
        if self.dist.is_main:
            n = sum(p.numel() for p in model.parameters())
            per_step = self.cfg.trainer.global_batch_size * self.units_per_sample
            print(f"[laplace] {model_label(self.cfg.model)}: {n:,} parameters; {per_step:,} {self.unit} per step",
                  flush=True)
        return model

    def configure_optimizers(self):
        if self.cfg.optim.name == "muon":
            return build_muon_adamw(self.model, self.cfg.optim)
        return super().configure_optimizers()

    @functools.cached_property
    def flops(self) -> tuple[float, float | None]:
        """(training FLOPs per token of the model, one device's bf16 peak or None), for the MFU."""
        peak = self.cfg.trainer.peak_flops or peak_flops(self.device)
        return flops_per_token(self.model, self.cfg.data.seq_len), peak

    def throughput_metrics(self, units_per_s: float) -> dict:
        if self.unit != "tok":
            return {}
        per_token, peak = self.flops
        if not peak:
            return {}
        return {"mfu": units_per_s * per_token / (peak * self.dist.world_size)}

    # ---- steps and evaluation ------------------------------------------------------------
    def train_step(self, batch):
        x, y = batch
        # Mean over the counted targets; a row of SFT padding alone counts none (loss 0, not NaN).
        return self.net(x, targets=y, reduction="sum") / (y >= 0).sum().clamp(min=1), {}

    def _val_batches(self):
        return self.data.val_batches(self.eval_loader)

    def evaluate(self) -> dict:
        """Validation loss, and bits per byte: the targets' summed nats over their UTF-8 bytes,
        special tokens excluded, as nanochat's evaluate_bpb but with another byte table."""
        batches = self._val_batches()
        if batches is None:
            return {}
        # Each token's real bytes. nanochat's token_bytes decodes each token to text, so part of
        # a multi-byte character becomes U+FFFD and counts 3 bytes (one byte of "é": 3); ours sum
        # to the text's UTF-8 length whatever the splits (nanochat's bpb is lower on non-ASCII).
        token_bytes = self.tokenizer.token_bytes().to(self.device)
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

        texts = sample_texts(self.model, self.tokenizer, prompts,
                             max_new_tokens=self.cfg.trainer.sample_tokens)
        append_line(self.run_dir / "samples.jsonl",
                    json.dumps({"step": self.step, "samples": dict(zip(prompts, texts))}))
        if not self.cfg.trainer.progress:
            for p, t in zip(prompts, texts):
                print(f"[sample] {p!r} -> {t!r}", flush=True)

    def on_fit_end(self, final_metrics: dict):
        self.write_results({"final": final_metrics, "tokenizer": self.tokenizer.spec})
