"""`trainer=deit3`: supervised image classification with the DeiT-III recipe on the shared engine.

"DeiT III: Revenge of the ViT" (Touvron, Cord, Jegou 2022; facebookresearch/deit). The recipe's
pieces and the keys that set them: 3-Augment (data.augment, laplace.data.transforms), Mixup /
CutMix (trainer.mixup, cutmix, ...: timm's Mixup), BCE on binarised targets (trainer.loss,
bce_target_thresh), repeated augmentation (trainer.repeated_aug: timm's RepeatAugSampler), LAMB
(optim=lamb), drop-path and LayerScale (model.drop_path_rate, model.init_values). The values are
set once, by the experiment files (configs/experiment/deit3_*.yaml, e.g. deit3_in1k then
deit3_in1k_ft224 from its checkpoint) beside the reference they claim (configs/reference/);
`python -m train.recipe` renders the two side by side (docs/recipes/). The trainer's own defaults
are plain cross-entropy, so the digits quick start stays a quick start.

    python train.py experiment=deit3_cifar100 model=vitb_12L data.root=/data/cifar

Fine-tuning (`trainer.init_from=PATH`, an engine option, fresh runs only) takes a laplace
checkpoint or a timm / DeiT-III state dict (.pth, .bin, .safetensors; the original DeiT
`{"model": ...}` files with `gamma_1`/`gamma_2` LayerScale names too): see
`laplace.pretrained.load_pretrained` (position embeddings resampled, head kept when it fits).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy

from laplace.data import Data
from laplace.data.vision import build_vision_dataset, image_identity
from .dist import all_reduce_sum
from laplace.errors import ConfigError

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
            raise ConfigError(f"trainer.loss=bce with bce_target_thresh={thresh} makes every class a "
                              f"positive when label_smoothing={ls}; set trainer.label_smoothing=0")
        return BinaryCrossEntropy(smoothing=ls, target_threshold=thresh)
    if tc.loss == "ce":
        if tc.mixup > 0 or tc.cutmix > 0:
            return SoftTargetCrossEntropy()  # the smoothing is already in the mixed targets
        return nn.CrossEntropyLoss(label_smoothing=ls)
    raise ConfigError(f"trainer.loss={tc.loss!r}: choose ce or bce")


class DeiT3Trainer(Trainer):
    archs, modality = ("vit",), "image"
    example = "python train.py experiment=deit3_cifar100 model=vitb_12L"
    best_metric = "val_acc1"

    def build_data(self) -> Data:
        d, tc = self.cfg.data, self.cfg.trainer
        # The recipe's Mixup / CutMix and loss (first: a bad combination is one line before any data).
        # Mixing happens on the micro batch (what one process sees per forward), as DeiT mixes each GPU's.
        self.mixup, self.criterion = build_mixup(tc, d.num_classes), build_criterion(tc, d.num_classes)
        if self.mixup is not None and self.micro_bs % 2:
            raise ConfigError(f"Mixup/CutMix pair each image with the flipped batch: the micro batch "
                              f"({self.micro_bs}) must be even; change trainer.micro_batch_size")
        # data.device_augment: the workers send decoded images of different sizes (padded) with
        # their crops' boxes and parameters; the step cuts and augments them on the device.
        collate = device_collate if d.get("device_augment") else torch.utils.data.default_collate
        train, val = build_vision_dataset(d, True), build_vision_dataset(d, False)
        return Data(train, val, collate, val_collate=torch.utils.data.default_collate, unit="img",
                    identity=image_identity(train, val))

    def train_step(self, batch):
        x, y = batch
        d = self.cfg.data
        if d.get("device_augment"):  # decoded images, their crops' boxes and parameters: cut and augmented here
            from laplace.data.crop_augment import crop_and_augment  # (imported by the runs that use it)

            x = crop_and_augment(x, [d.img_size], tuple(d.mean), tuple(d.std), jitter_last=True)[0]
        if self.mixup is not None:
            x, y = self.mixup(x, y)  # numpy RNG: per rank, saved in checkpoints
        return self.criterion(self.net(x).float(), y)  # timm's losses hold no tensor: any device

    def evaluate(self) -> dict:
        # Sums over this rank's shard, then over ranks: exact, whatever the world size.
        sums = torch.zeros(4, device=self.device, dtype=torch.float64)  # loss, top1, top5, n
        for x, y in map(self.to_device, self.eval_loader(self.data.val)):
            logits = self.net(x).float()
            top5 = logits.topk(min(5, logits.size(1)), dim=1).indices
            hit = top5 == y[:, None]
            sums += torch.stack([F.cross_entropy(logits, y, reduction="sum"),
                                 hit[:, 0].sum(), hit.any(1).sum(), torch.tensor(len(y), device=self.device)]).double()
        loss, top1, top5, n = all_reduce_sum(sums).tolist()
        return {"val_loss": loss / n, "val_acc1": 100 * top1 / n, "val_acc5": 100 * top5 / n}

    def results(self, metrics: dict) -> dict:
        return {"loss": self.cfg.trainer.loss}


def device_collate(items):
    """Batches of (decoded image with its crops' parameters, label), images padded (data.device_augment)."""
    from laplace.data.crop_augment import decoded_collate

    return decoded_collate([x for x, _ in items]), torch.utils.data.default_collate([y for _, y in items])
