"""`trainer=deit3`: supervised image classification on the shared engine.

The core form: cross-entropy (optional label smoothing), the optimizer from `optim`, top-1 /
top-5 on the validation split after every epoch and `results.json` at the end. The DeiT-III
recipe (3-Augment, Mixup/CutMix with BCE, LAMB, repeated augmentation, 192 -> 224 px) grows
here rather than in a second trainer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from laplace import create_model
from laplace.data.vision import build_vision_dataset
from laplace.dist import all_reduce_mean

from .engine import Trainer


class SupervisedTrainer(Trainer):
    unit = "img"

    def build_datasets(self):
        return build_vision_dataset(self.cfg.data, True), build_vision_dataset(self.cfg.data, False)

    def build_model(self):
        return create_model(**self.cfg.model)

    def train_step(self, batch):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.cfg.trainer.label_smoothing)
        return loss, {}

    def evaluate(self) -> dict:
        if self.val_set is None:
            return {}
        # Sums over this rank's shard, then over ranks: exact, whatever the world size.
        sums = torch.zeros(4, device=self.device, dtype=torch.float64)  # loss, top1, top5, n
        for x, y in self.eval_loader(self.val_set):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            logits = self.net(x).float()
            top5 = logits.topk(min(5, logits.size(1)), dim=1).indices
            hit = top5 == y[:, None]
            sums += torch.stack([F.cross_entropy(logits, y, reduction="sum"),
                                 hit[:, 0].sum(), hit.any(1).sum(), torch.tensor(len(y))]).double()
        sums = all_reduce_mean(sums) * self.dist.world_size
        loss, top1, top5, n = sums.tolist()
        return {"val_loss": loss / n, "val_acc1": 100 * top1 / n, "val_acc5": 100 * top5 / n}

    def on_fit_end(self, final_metrics: dict):
        best = final_metrics
        for rec in self._val_history():
            if rec.get("val_acc1", -1) > best.get("val_acc1", -1):
                best = rec
        m = self.cfg.model
        self.write_results({
            "model": m.name, "num_laplacian_heads": m.num_laplacian_heads,
            "laplacian_mode": m.laplacian_mode, "dataset": self.cfg.data.name,
            "seed": self.cfg.seed, "steps": self.state["step"], "epochs": self.state["epoch"],
            "final": {k: final_metrics[k] for k in ("val_acc1", "val_acc5", "val_loss")},
            "best": {k: best[k] for k in ("val_acc1", "val_acc5", "val_loss")},
            "checkpoint": str(self.ckpt_path),
        })

    def _val_history(self) -> list[dict]:
        from laplace.logger import read_metrics

        if not self.dist.is_main or not (self.run_dir / "metrics.jsonl").exists():
            return []
        return [r for r in read_metrics(self.run_dir) if r.get("split") == "val"]
