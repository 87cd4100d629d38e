"""`trainer=seg_linear`: a linear head on a frozen ViT, DINOv2's segmentation protocol, on the
training engine (resume, preemption, DDP, logging). `python -m eval.segmentation` runs it.

The checkpoint it writes exports the frozen backbone (what `load_model` returns); the head is
its `train_model`. results.json: mIoU, aAcc, mAcc and the per-class IoU, as mmseg's IoUMetric.
"""
import math
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassConfusionMatrix, MulticlassJaccardIndex

from laplace.pretrained import load_backbone
from laplace.data import Data
from laplace.data.ade20k import IGNORE
from laplace.errors import ConfigError
from laplace.vit import VisionTransformer
from laplace.zoo import features

from .engine import Trainer
from .logger import progress_bar


class FrozenBackboneSeg(nn.Module):
    """A frozen ViT and a trainable linear head; forward(images [B, 3, H, W]) -> logits
    [B, K, H, W] (images of the backbone's size).

    Args:
        backbone: a laplace VisionTransformer (frozen here).
        num_classes: K.
        num_layers: the last `num_layers` blocks' patch tokens, concatenated (trainer.layers; 4:
            DINOv2's "+ms" head, which takes patch channels only, 4 x 384 for ViT-S).
        cls_token: also append the class token to every patch token.
    """

    def __init__(self, backbone: VisionTransformer, num_classes: int, num_layers: int = 1,
                 cls_token: bool = False):
        super().__init__()
        depth = len(backbone.blocks)
        if not 1 <= num_layers <= depth:
            raise ConfigError(f"trainer.layers={num_layers}: use 1..{depth} (the last blocks' patch tokens)")
        self.backbone = backbone.requires_grad_(False).eval()
        self.layers, self.cls_token = list(range(depth - num_layers, depth)), cls_token  # block indices
        dim = backbone.norm.normalized_shape[0] * num_layers * (2 if cls_token else 1)
        # The head: batch norm + 1x1 convolution over patch features [B, C, h, w] (DINOv2's BNHead);
        # named children, so the state dict keys stay head.bn.* and head.conv.* (checkpoints resume).
        self.head = nn.Sequential(OrderedDict(bn=nn.BatchNorm2d(dim), conv=nn.Conv2d(dim, num_classes, 1)))
        nn.init.normal_(self.head.conv.weight, std=0.01)  # mmseg's decode-head init
        nn.init.zeros_(self.head.conv.bias)

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: no drop-path, whatever the head does
        return self

    def features(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            feats = features(self.backbone, x, layers=self.layers, norm=False)
            gh, gw = self.backbone.patch_embed.grid_size
            out = []
            for i in self.layers:
                t = self.backbone.norm(feats[f"blocks.{i}"])  # DINOv2 normalises every layer used
                patches = t[:, 1:]
                if self.cls_token:
                    patches = torch.cat((patches, t[:, :1].expand_as(patches)), dim=-1)
                out.append(patches.transpose(1, 2).reshape(x.shape[0], -1, gh, gw))
        return torch.cat(out, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.features(x).float())  # the head in float32 under bf16 autocast too
        # DINOv2's linear head: logits at the patch grid, upsampled bilinearly to the pixels
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def seg_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Pixel cross-entropy as mmseg's CrossEntropyLoss (avg_non_ignore=False, DINOv2's protocol)."""
    # The sum over labelled pixels divided by ALL pixels of the batch, ignored ones included: a
    # crop without a labelled pixel gives 0 (no gradient), where a mean over the labelled pixels
    # only would be 0 / 0 and end the run with a NaN loss.
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum") / labels.numel()


@torch.no_grad()
def slide_inference(model: nn.Module, img: torch.Tensor, num_classes: int, window: int, stride: int) -> torch.Tensor:
    """Logits [B, K, H, W] of images [B, 3, H, W] from windows of `window` px every `stride` px
    (mmseg's `slide` mode), the overlaps averaged."""
    # Hand-written: neither torch nor timm has one (mmseg's EncoderDecoder.slide_inference would
    # bring mmcv and mmengine).
    B, _, H, W = img.shape
    rows = max(H - window + stride - 1, 0) // stride + 1
    cols = max(W - window + stride - 1, 0) // stride + 1
    logits = img.new_zeros(B, num_classes, H, W)
    count = img.new_zeros(1, 1, H, W)
    for r in range(rows):
        for c in range(cols):
            # A window that sticks out is shifted back inside the image.
            y2, x2 = min(r * stride + window, H), min(c * stride + window, W)
            y1, x1 = max(y2 - window, 0), max(x2 - window, 0)
            crop = img[:, :, y1:y2, x1:x2]
            h, w = crop.shape[-2:]
            # An image smaller than the window is padded to it; the padding's logits are dropped.
            out = model(F.pad(crop, (0, window - w, 0, window - h)))[:, :, :h, :w]
            logits[:, :, y1:y2, x1:x2] += out.float()
            count[:, :, y1:y2, x1:x2] += 1
    return logits / count


def seg_metric(num_classes: int) -> MetricCollection:
    """The pixel counts of mmseg's IoUMetric, accumulated by torchmetrics (on the predictions'
    device, summed over ranks at `compute`): update(pred, label) with class-index tensors."""
    return MetricCollection({
        # Per-class IoU; a class neither labelled nor predicted is NaN (zero_division), as in mmseg.
        "IoU": MulticlassJaccardIndex(num_classes, average="none", ignore_index=IGNORE, zero_division=math.nan),
        # The same confusion matrix (one state: torchmetrics' compute group), for the accuracies.
        "confmat": MulticlassConfusionMatrix(num_classes, ignore_index=IGNORE)})


def seg_scores(metric: MetricCollection) -> dict:
    """mIoU, aAcc, mAcc and the per-class IoU / Acc, in %, as mmseg's IoUMetric reports them."""
    out = metric.compute()
    iou, conf = out["IoU"].double().cpu(), out["confmat"].double().cpu()
    # Accuracy by hand: torchmetrics' macro recall counts a class that is predicted but never
    # labelled as 0, where mmseg leaves it out (0 / 0 = NaN here, skipped by nanmean).
    acc = conf.diag() / conf.sum(1)
    return {"mIoU": 100 * float(iou.nanmean()), "aAcc": 100 * float(conf.diag().sum() / conf.sum()),
            "mAcc": 100 * float(acc.nanmean()), "IoU": (100 * iou).tolist(), "Acc": (100 * acc).tolist()}


class SegLinearTrainer(Trainer):
    """`trainer=seg_linear`: the linear protocol on the engine (see the module docstring)."""

    archs, modality = ("vit",), "segmentation"
    example = "python -m eval.segmentation checkpoint=PATH eval=seg_ade20k_linear"
    export = "backbone"  # the frozen backbone: what load_model returns; the head is in train_model
    per_class: dict = {}  # the last evaluation's per-class scores, for results.json (replaced, never mutated)

    def build_data(self) -> Data:
        # mmseg's ADE20K pipeline (laplace/data/ade20k.py): random rescale, crop, flip, colours;
        # validation images at `data.scale` short side, labels at full size.
        from laplace.data.ade20k import ADE20K, SegEvalTransform, SegTrainTransform, write_digits_ade20k

        d, tc = self.cfg.data, self.cfg.trainer
        if d.get("builtin"):  # the digits set is written on first use
            write_digits_ade20k(d.root, d.n_train, d.n_val)
        norm = dict(mean=tuple(d.mean), std=tuple(d.std))
        train = ADE20K(d.root, "training", SegTrainTransform(tc.crop_size, d.scale, tuple(tc.ratio_range),
                                                             tc.cat_max_ratio, **norm))
        return Data(train, ADE20K(d.root, "validation", SegEvalTransform(d.scale, **norm)), unit="img")

    def build_model(self):
        tc = self.cfg.trainer
        # The node `prepare` recorded; the head is built (and unused) as it always was, so the
        # linear head's initialisation draws the same random numbers.
        backbone, _ = load_backbone(self.cfg.checkpoint, img_size=tc.crop_size, head=True)
        return FrozenBackboneSeg(backbone, self.cfg.data.num_classes, tc.layers, tc.cls_token)

    def train_step(self, batch):
        x, y = batch
        return seg_loss(self.net(x), y)

    def evaluate(self) -> dict:
        tc, k = self.cfg.trainer, self.cfg.data.num_classes
        window = tc.crop_size
        stride = tc.slide_stride or math.ceil(window * 2 / 3)  # 341 for 512, as DINOv2
        metric = seg_metric(k).to(self.device)
        # Evaluation as DINOv2: sliding windows over the image at a 512 short side, the logits
        # resized to the full annotation, where the pixels are counted.
        loader = self.eval_loader(self.data.val, batch_size=1)  # images differ in size
        bar = progress_bar(len(loader), self.dist.is_main and tc.progress, interval=self.cfg.logger.progress_interval,
                           desc="val (sliding windows)", unit="img", leave=False, iterable=loader)
        for x, y in map(self.to_device, bar):
            logits = slide_inference(self.net, x, k, window, stride)
            logits = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
            metric.update(logits.argmax(1), y)
        self.per_class = out = seg_scores(metric)
        return {"val_mIoU": out["mIoU"], "val_aAcc": out["aAcc"], "val_mAcc": out["mAcc"]}

    def results(self, final_metrics: dict) -> dict:
        # results.json in <backbone run>/eval/seg_<data>_l<layers>/, where analysis.tables reads it
        tc, pc = self.cfg.trainer, self.per_class
        return {
            "protocol": f"linear{'_ms' if tc.layers > 1 else ''}", "backbone_checkpoint": str(self.cfg.checkpoint),
            "layers": tc.layers, "cls_token": tc.cls_token, "crop_size": tc.crop_size, "iters": self.total_steps,
            "global_batch_size": tc.global_batch_size, "mIoU": final_metrics.get("val_mIoU"),
            "aAcc": final_metrics.get("val_aAcc"), "mAcc": final_metrics.get("val_mAcc"),
            "per_class_IoU": pc.get("IoU")}
