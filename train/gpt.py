"""`trainer=gpt`: causal language-model pre-training on the shared engine.

The core form: next-token cross-entropy on fixed windows of a token stream (`data=pydoc_text`,
built in), the optimizer from `optim`, validation loss and bits per byte. nanochat's full
pipeline (FineWeb-Edu shards, Muon, mid-training, SFT, benchmark evaluation) grows here.

    python train.py experiment=gpt_pydoc model=gpt_d2_1L trainer.max_steps=200
"""
from __future__ import annotations

import math

import torch

from laplace.dist import all_reduce_sum
from laplace.errors import ConfigError

from .engine import Trainer


class GPTTrainer(Trainer):
    unit = "tok"
    model_archs, data_modality = ("gpt",), "text"
    example = "python train.py experiment=gpt_pydoc model=gpt_d2_1L"

    def build_datasets(self):
        d = self.cfg.data
        self.units_per_sample = d.seq_len
        if d.name != "pydoc_text":
            raise ConfigError(f"trainer=gpt supports data=pydoc_text for now, got data={d.name!r}")
        from laplace.data.text import build_pydoc_text

        return build_pydoc_text(True, d.seq_len), build_pydoc_text(False, d.seq_len)

    def train_step(self, batch):
        x, y = batch
        return self.net(x, targets=y), {}

    def evaluate(self) -> dict:
        if self.val_set is None:
            return {}
        sums = torch.zeros(2, device=self.device, dtype=torch.float64)  # summed nats, tokens
        for x, y in self.eval_loader(self.val_set):
            x, y = x.to(self.device), y.to(self.device)
            loss = self.net(x, targets=y)
            sums += torch.stack([loss.double() * y.numel(), torch.tensor(y.numel(), device=self.device)])
        nats, n = all_reduce_sum(sums).tolist()
        # Byte tokens: bits per byte = nats per token / ln 2 (BOS tokens are a 1/1000 minority).
        return {"val_loss": nats / n, "val_bpb": nats / n / math.log(2)}

    def on_fit_end(self, final_metrics: dict):
        self.write_results({"final": final_metrics})
