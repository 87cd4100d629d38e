"""`trainer=deit3`: supervised image classification with the DeiT-III recipe on the shared engine.

"DeiT III: Revenge of the ViT" (Touvron, Cord, Jegou 2022; facebookresearch/deit) pre-trains
ViT-B on ImageNet-1k with:

    3-Augment + colour jitter 0.3            data.augment=three_augment (laplace.data.transforms)
    Mixup 0.8 / CutMix 1.0, switch prob 0.5  trainer.mixup / cutmix / mixup_switch_prob (timm Mixup)
    BCE on the binarised mixed targets       trainer.loss=bce, trainer.bce_target_thresh=0.0
    repeated augmentation, 3 repeats         trainer.repeated_aug=3 (timm RepeatAugSampler)
    LAMB lr 3e-3 (unscaled), wd 0.05,        optim=lamb
      cosine, 5 warm-up epochs from 1e-6
    drop-path 0.2 (uniform), LayerScale      model.drop_path_rate, model.init_values
    800 epochs at 192 px, then 20 at 224     experiment=deit3_in1k, then deit3_in1k_ft224
                                             (trainer.init_from = the 192 px checkpoint)

The `experiment=deit3_*` files set these; the trainer's own defaults are plain cross-entropy,
so the digits quick start stays a quick start. Mixing happens on the micro batch (what one
process sees per forward, as DeiT mixes each GPU's batch), which must therefore be even.

Fine-tuning (`trainer.init_from=PATH`, fresh runs only: a resumed run restores last.pt):
PATH is a laplace checkpoint or a timm / DeiT-III state dict (.pth, .bin, .safetensors; the
original DeiT `{"model": ...}` files with `gamma_1`/`gamma_2` LayerScale names too). All
tensors load strictly except two: the position embedding is resampled (bicubic) when the patch
grid differs, and the classifier head is kept only if its shape fits the model (same number
of classes) and `trainer.init_head=auto`; otherwise it keeps its fresh initialisation.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import Mixup
from timm.data.distributed_sampler import RepeatAugSampler
from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy

from laplace.checkpoint import CheckpointError, load_weights
from laplace.data.vision import build_vision_dataset
from laplace.dist import all_reduce_sum
from laplace.vit import load_timm_state_dict

from .engine import Trainer


# ---- the recipe's pieces, built from the `trainer` node (module level: tests call them) ----
def build_mixup(tc, num_classes: int) -> Mixup | None:
    """timm's Mixup/CutMix from trainer.{mixup, cutmix, ...}; None when both alphas are 0."""
    if not (tc.mixup > 0 or tc.cutmix > 0):
        return None
    return Mixup(mixup_alpha=tc.mixup, cutmix_alpha=tc.cutmix, prob=tc.mixup_prob,
                 switch_prob=tc.mixup_switch_prob, mode=tc.mixup_mode,
                 label_smoothing=tc.label_smoothing, num_classes=num_classes)


def build_criterion(tc, num_classes: int) -> nn.Module:
    """trainer.loss: `bce` (DeiT-III: binary cross-entropy on targets binarised at
    bce_target_thresh) or `ce` (soft-target cross-entropy when targets are mixed)."""
    ls = tc.label_smoothing
    if tc.loss == "bce":
        thresh = tc.bce_target_thresh
        if thresh is not None and ls / num_classes > thresh:
            # Every smoothed off-target would exceed the threshold and become a positive.
            raise ValueError(f"trainer.loss=bce with bce_target_thresh={thresh} makes every class a "
                             f"positive when label_smoothing={ls}; set trainer.label_smoothing=0")
        return BinaryCrossEntropy(smoothing=ls, target_threshold=thresh)
    if tc.loss == "ce":
        if tc.mixup > 0 or tc.cutmix > 0:
            return SoftTargetCrossEntropy()  # the smoothing is already in the mixed targets
        return nn.CrossEntropyLoss(label_smoothing=ls)
    raise ValueError(f"trainer.loss={tc.loss!r}: choose ce or bce")


class SeededRepeatAugSampler(RepeatAugSampler):
    """timm's RepeatAugSampler (DeiT's RASampler) with the run's seed in its shuffle.

    Each image appears `num_repeats` times per epoch, the copies dealt to consecutive ranks
    (on one process: consecutive positions of a batch), and an epoch keeps the dataset's
    length (floored to a multiple of 256 as DeiT). The order depends only on seed + epoch, as
    torch's DistributedSampler, which is what ResumableSampler needs to skip into an epoch.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, num_repeats: int = 3, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True,
                         num_repeats=num_repeats)
        self.seed = seed

    def set_epoch(self, epoch: int):
        super().set_epoch(self.seed + epoch)


# ---- fine-tuning from a checkpoint ----------------------------------------------------------
def init_from_pretrained(model: nn.Module, path, model_cfg, head: str = "auto") -> str:
    """Load pre-trained weights into `model` for fine-tuning; returns a one-line summary.

    Args:
        model: the freshly built VisionTransformer.
        path: a laplace checkpoint or a timm / DeiT-III state dict file.
        model_cfg: the run's `model` node (its Laplacian heads must match a laplace checkpoint's).
        head: "auto" keeps the loaded head when its shape fits the model, "reset" never does.
    """
    if head not in ("auto", "reset"):
        raise ValueError(f"trainer.init_head={head!r}: choose auto or reset")
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"trainer.init_from: no file at {path}")
    try:
        sd, src_cfg = load_weights(path)
    except CheckpointError as e:  # name the config key that pointed at the file
        raise CheckpointError(f"trainer.init_from: {e}") from None
    if src_cfg is not None:
        got = (src_cfg.get("num_laplacian_heads"), src_cfg.get("laplacian_mode", "fixed"))
        k = model_cfg.num_laplacian_heads
        want = (k if isinstance(k, int) else list(k), model_cfg.laplacian_mode)
        if got != want:  # Laplacian heads add no parameters: a mismatch would load silently
            raise CheckpointError(f"{path} was trained as {src_cfg['name']} ({got[0]} {got[1]} "
                                  f"Laplacian heads) but the model is {model_cfg.name} ({want[0]} "
                                  f"{want[1]}); fine-tune each model from its own pre-training")
    own = model.state_dict()
    for k in [k for k in sd if k.startswith("head.") and k not in own]:
        del sd[k]  # the checkpoint has a head, the model (num_classes=0) does not
    head_keys = [k for k in own if k.startswith("head.")]
    fits = all(k in sd and sd[k].shape == own[k].shape for k in head_keys)
    reset = bool(head_keys) and (head == "reset" or not fits)
    if reset:
        sd.update({k: own[k] for k in head_keys})  # keep the fresh initialisation
    try:
        load_timm_state_dict(model, sd)  # strict; resamples pos_embed to the model's grid
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"trainer.init_from: {path} does not fit model {model_cfg.name}: "
                              f"{' '.join(str(e).split())[:300]}") from None
    kind = "laplace checkpoint" if src_cfg is not None else "timm/DeiT state dict"
    return (f"initialised from {kind} {path}" + ("; head re-initialised" if reset else "; head loaded"))


class SupervisedTrainer(Trainer):
    unit = "img"

    def __init__(self, cfg):
        super().__init__(cfg)
        tc, nc = cfg.trainer, cfg.data.num_classes
        self.mixup = build_mixup(tc, nc)
        if self.mixup is not None and self.micro_bs % 2:
            raise ValueError(f"Mixup/CutMix pair each image with the flipped batch: the micro batch "
                             f"({self.micro_bs}) must be even; change trainer.micro_batch_size")
        self.criterion = build_criterion(tc, nc).to(self.device)

    def build_datasets(self):
        return build_vision_dataset(self.cfg.data, True), build_vision_dataset(self.cfg.data, False)

    def build_sampler(self, dataset):
        n = self.cfg.trainer.repeated_aug
        if not n or n <= 1:
            return super().build_sampler(dataset)
        return SeededRepeatAugSampler(dataset, self.dist.world_size, self.dist.rank, n, self.cfg.seed)

    def build_model(self):
        model = super().build_model()
        tc = self.cfg.trainer
        if tc.init_from == "required":  # what the fine-tuning experiments say
            raise ValueError("this experiment fine-tunes a pre-trained model: set trainer.init_from="
                             "PATH (a laplace checkpoint or a timm/DeiT-III state dict)")
        # A resumed run restores its own weights from last.pt; init_from seeds fresh runs only.
        if tc.init_from and not self.ckpt_path.exists():
            msg = init_from_pretrained(model, tc.init_from, self.cfg.model, tc.init_head)
            if self.dist.is_main:
                print(f"[laplace] {msg}")
        return model

    def train_step(self, batch):
        x, y = batch
        if self.mixup is not None:
            x, y = self.mixup(x, y)  # numpy RNG: per rank, saved in checkpoints
        logits = self.net(x)
        return self.criterion(logits.float(), y), {}

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
        sums = all_reduce_sum(sums)
        loss, top1, top5, n = sums.tolist()
        return {"val_loss": loss / n, "val_acc1": 100 * top1 / n, "val_acc5": 100 * top5 / n}

    def on_fit_end(self, final_metrics: dict):
        best = final_metrics
        for rec in self._val_history():
            if rec.get("val_acc1", -1) > best.get("val_acc1", -1):
                best = rec
        d, tc = self.cfg.data, self.cfg.trainer
        keys = ("val_acc1", "val_acc5", "val_loss")
        self.write_results({
            "img_size": d.img_size, "patch_size": d.patch_size,
            "global_batch_size": tc.global_batch_size, "loss": tc.loss, "init_from": tc.init_from,
            "final": {k: final_metrics[k] for k in keys},
            "best": {k: best[k] for k in keys} | {"step": best.get("step", self.state["step"])},
        })

    def _val_history(self) -> list[dict]:
        from laplace.logger import read_metrics

        if not self.dist.is_main or not (self.run_dir / "metrics.jsonl").exists():
            return []
        return [r for r in read_metrics(self.run_dir) if r.get("split") == "val"]
