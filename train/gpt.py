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
import json
import math

import torch

from laplace import model_label
from .dist import all_reduce_sum

from .engine import Trainer
from .logger import logged
from .rundir import append_line
from .optim import build_muon26, muon26_groups
from .plan import nanochat_scaling

class GPTTrainer(Trainer):
    archs, modality = ("gpt",), "text"
    example = "python train.py experiment=gpt_tiny model=gpt_d4_2L"

    def build_data(self):
        from laplace.data.kinds import build_text_data

        return build_text_data(self.cfg.data, seed=self.cfg.seed, micro_batch_size=self.micro_bs,
                               rank=self.dist.rank, world_size=self.dist.world_size,
                               # a LoRA run's tokenizer is its base's (train/lora.py)
                               init_from=self.cfg.trainer.init_from or self.cfg.trainer.get("base"),
                               step_windows=self.cfg.trainer.global_batch_size)

    def build_model(self):
        model = super().build_model()
        d = self.cfg.data
        if d.get("kind") != "chat" or d.get("packed"):  # throughput in tokens (SFT: conversations): the MFU
            self.flops_per_unit = model.flops_per_token(d.seq_len)
        if self.dist.is_main:
            print(f"[laplace] {model_label(self.cfg.model)}: {sum(p.numel() for p in model.parameters()):,} parameters",
                  flush=True)
        return model

    def configure_optimizers(self):
        if self.cfg.optim.name != "muon26":
            return super().configure_optimizers()
        s = nanochat_scaling(self.cfg)  # the rates and Muon's decay for this batch and horizon
        return build_muon26(self.model, self.cfg.optim, s.lr_scale, s.muon_weight_decay)

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
        # one entry per row of the embedding: a smaller tokenizer's extra rows have no bytes
        token_bytes = torch.nn.functional.pad(token_bytes, (0, self.model.vocab_size - token_bytes.numel()))
        # Summed nats and counted tokens, and nats and UTF-8 bytes over tokens that have bytes.
        sums = torch.zeros(4, device=self.device, dtype=torch.float64)
        for x, y in map(self.to_device, batches):
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
        return metrics | self._core()

    def _core(self) -> dict:
        """{"core_metric": CORE} at the steps trainer.core_metric_every asks for (eval/core.py)."""
        every = self.cfg.trainer.get("core_metric_every")
        if not every or (self.step % every and self.step != self.total_steps):
            return {}
        from laplace.core_eval import ensure_bundle, evaluate

        res = evaluate(self.model, self.data.tokenizer, ensure_bundle(self.cfg.trainer.core_bundle),
                       int(self.cfg.trainer.core_max_per_task))
        return {"core_metric": res["core_metric"]}

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
        own = {"tokenizer": self.data.tokenizer.spec}
        if self.cfg.optim.name == "muon26":  # the fork's sweep columns (runs/laplacian_sweep.sh results.csv)
            n = {g: sum(p.numel() for _, p in ps) for g, ps in muon26_groups(self.model).items()}
            own["params"] = dict(  # nanochat's num_scaling_params: the blocks' parameters are its transformer_matrices
                wte=n["embedding"], value_embeds=n["value_embeds"], lm_head=n["unembedding"],
                transformer_matrices=n["qkv"] + n["matrices"] + n["laplacian_gates"],
                scalars=n["resid_lambdas"] + n["x0_lambdas"] + n["smear"], total=sum(n.values()))
            own["tokens"] = self.step * self.cfg.trainer.global_batch_size * self.cfg.data.seq_len
            # the training steps' time (each record's mean step time over the steps since the last)
            recs = logged(self.run_dir, "train")
            steps = [r["step"] - q["step"] for q, r in zip([{"step": 0}, *recs], recs)]
            own["train_time_s"] = sum(r["step_ms"] * n for r, n in zip(recs, steps)) / 1e3
        return own
