"""Frozen-backbone semantic segmentation, DINOv2's linear protocol, on ADE20K (paper experiment 3).

    python -m eval.segmentation checkpoint=runs/dino/.../ckpt/last.pt data.root=/data/ade
    python -m eval.segmentation checkpoint=... eval=seg_ade20k_linear trainer.layers=4   # +ms: last 4 layers
    python -m eval.segmentation checkpoint=runs/deit3/digits/vitt_3L_s0/ckpt/last.pt eval=seg_digits_linear
    python -m eval.segmentation checkpoint=... iters=2000 crop_size=256 batch_size=8       # a small run

The backbone is rebuilt from the checkpoint (`laplace.checkpoint.load_backbone`) at the crop
size (position embeddings resampled) and frozen; its patch tokens after the final norm (of the last block, or
of the last 4 concatenated: `trainer.layers`, as DINOv2's published ViT-S/14 linear heads,
which take patch channels only, 4 x 384 for +ms; the option `trainer.cls_token` also appends
the class token to each patch) feed a batch norm + 1x1 convolution whose logits are bilinearly
upsampled to the image. Training: mmseg's ADE20K pipeline (laplace/data/ade20k.py) on 512
crops, AdamW lr 1e-3, wd 1e-4, linear warm-up over 1,500 iterations then poly decay with power
1 (linear to 0), 40k iterations at batch 16 (reached by accumulation on fewer GPUs).
Evaluation: sliding windows (512, stride 341) over the image resized to a 512 short side, the
logits resized to the full annotation, mIoU over the 150 classes with "other" ignored.

It runs on the shared engine (train/engine.py: resume, preemption, DDP, bf16, logging) as
`trainer=seg_linear`; the run directory sits beside the checkpoint's run,
`<run>/eval/seg_<data>_<layers>` (so `python -m analysis.tables` finds it with the run), and its
results.json holds mIoU, aAcc, mAcc and the per-class IoU. The checkpoint it writes exports the
backbone (what `load_model` returns), the head is its `train_model`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, open_dict

from laplace.checkpoint import backbone_node, load_backbone, run_dir_of
from laplace.data.ade20k import IGNORE
from laplace.cli import hydra_entry
from laplace.errors import ConfigError
from laplace.vit import VisionTransformer
from train.engine import Trainer

from .seg_metrics import SegMetric


class LinearSegHead(nn.Module):
    """Batch norm + 1x1 convolution over patch features [B, C, h, w] (DINOv2's BNHead)."""

    def __init__(self, in_dim: int, num_classes: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(in_dim)
        self.conv = nn.Conv2d(in_dim, num_classes, 1)
        nn.init.normal_(self.conv.weight, std=0.01)  # mmseg's decode-head init
        nn.init.zeros_(self.conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.bn(x))


class FrozenBackboneSeg(nn.Module):
    """A frozen ViT and a trainable linear head; forward(images [B, 3, H, W]) -> logits
    [B, K, H, W] (images of the backbone's size).

    Args:
        backbone: a laplace VisionTransformer (frozen here).
        num_classes: K.
        layers: feature layers, the last `layers` blocks (1: the last), each after the final norm.
        cls_token: also append the class token to every patch token.
    """

    def __init__(self, backbone: VisionTransformer, num_classes: int, layers: int = 1, cls_token: bool = False):
        super().__init__()
        depth = len(backbone.blocks)
        if not 1 <= layers <= depth:
            raise ConfigError(f"trainer.layers={layers}: use 1..{depth} (the last blocks' patch tokens)")
        self.backbone = backbone.requires_grad_(False).eval()
        self.layers, self.cls_token = list(range(depth - layers, depth)), cls_token
        dim = backbone.norm.normalized_shape[0] * layers * (2 if cls_token else 1)
        self.head = LinearSegHead(dim, num_classes)

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: no drop-path, whatever the head does
        return self

    def features(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            feats = self.backbone.forward_features(x, layers=self.layers, norm=False)
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
        logits = self.head(self.features(x).float())
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def seg_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Pixel cross-entropy as mmseg's CrossEntropyLoss (avg_non_ignore=False, DINOv2's
    protocol): the sum over labelled pixels divided by ALL pixels of the batch, ignored ones
    included. A crop without a labelled pixel gives 0 (no gradient), where a mean over the
    labelled pixels only would be 0/0 and end the run with a NaN loss."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")
    return loss / labels.numel()


@torch.no_grad()
def slide_inference(model: nn.Module, img: torch.Tensor, num_classes: int, window: int, stride: int) -> torch.Tensor:
    """Logits [B, K, H, W] of images [B, 3, H, W] from windows of `window` px every `stride` px
    (mmseg's `slide` mode), the overlaps averaged. A window that sticks out is shifted back
    inside; an image smaller than the window is padded (the padding's logits dropped)."""
    B, _, H, W = img.shape
    rows = max(H - window + stride - 1, 0) // stride + 1
    cols = max(W - window + stride - 1, 0) // stride + 1
    logits = img.new_zeros(B, num_classes, H, W)
    count = img.new_zeros(1, 1, H, W)
    for r in range(rows):
        for c in range(cols):
            y2, x2 = min(r * stride + window, H), min(c * stride + window, W)
            y1, x1 = max(y2 - window, 0), max(x2 - window, 0)
            crop = img[:, :, y1:y2, x1:x2]
            h, w = crop.shape[-2:]
            out = model(F.pad(crop, (0, window - w, 0, window - h)))[:, :, :h, :w]
            logits[:, :, y1:y2, x1:x2] += out.float()
            count[:, :, y1:y2, x1:x2] += 1
    return logits / count


class SegLinearTrainer(Trainer):
    """`trainer=seg_linear`: the linear protocol on the engine (see the module docstring)."""

    unit = "img"
    model_archs, data_modality = ("vit",), "segmentation"
    example = "python -m eval.segmentation checkpoint=PATH eval=seg_ade20k_linear"

    def build_datasets(self):
        from laplace.data.ade20k import ADE20K, SegEvalTransform, SegTrainTransform, write_digits_ade20k

        d, tc = self.cfg.data, self.cfg.trainer
        if d.get("builtin"):  # the digits set is written on first use
            write_digits_ade20k(d.root, d.n_train, d.n_val)
        norm = dict(mean=tuple(d.mean), std=tuple(d.std))
        train = ADE20K(d.root, "training", SegTrainTransform(tc.crop_size, d.scale, tuple(tc.ratio_range),
                                                             tc.cat_max_ratio, **norm))
        return train, ADE20K(d.root, "validation", SegEvalTransform(d.scale, **norm))

    def build_model(self):
        tc = self.cfg.trainer
        # The node `prepare` recorded; the head is built (and unused) as it always was, so the
        # linear head's initialisation draws the same random numbers.
        backbone, _ = load_backbone(self.cfg.checkpoint, img_size=tc.crop_size, head=True)
        return FrozenBackboneSeg(backbone, self.cfg.data.num_classes, tc.layers, tc.cls_token)

    def wrap_model(self, model):
        if self.dist.distributed and self.device.type == "cuda":
            # DINOv2 / mmseg: the head's batch norm synchronised over ranks. SyncBatchNorm has CUDA
            # kernels only (on CPU its forward raises): over gloo each rank normalises its own batch.
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return super().wrap_model(model)

    def export_model(self):
        return self.model.backbone

    def train_step(self, batch):
        x, y = batch
        return seg_loss(self.net(x), y), {}

    def evaluate(self) -> dict:
        if self.val_set is None:
            return {}
        tc, k = self.cfg.trainer, self.cfg.data.num_classes
        window = tc.crop_size
        stride = tc.slide_stride or math.ceil(window * 2 / 3)  # 341 for 512, as DINOv2
        metric = SegMetric(k, device=self.device)
        for x, y in self.eval_loader(self.val_set, batch_size=1):  # images differ in size
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            logits = slide_inference(self.net, x, k, window, stride)
            logits = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
            metric.update(logits.argmax(1), y)
        metric.all_reduce()
        out = metric.compute()
        self._per_class = out
        return {"val_mIoU": out["mIoU"], "val_aAcc": out["aAcc"], "val_mAcc": out["mAcc"]}

    def on_fit_end(self, final_metrics: dict):
        tc, pc = self.cfg.trainer, getattr(self, "_per_class", {})
        self.write_results({
            "protocol": f"linear{'_ms' if tc.layers > 1 else ''}", "backbone_checkpoint": str(self.cfg.checkpoint),
            "layers": tc.layers, "cls_token": tc.cls_token, "crop_size": tc.crop_size, "iters": self.total_steps,
            "global_batch_size": tc.global_batch_size, "mIoU": final_metrics.get("val_mIoU"),
            "aAcc": final_metrics.get("val_aAcc"), "mAcc": final_metrics.get("val_mAcc"),
            "per_class_IoU": pc.get("IoU")})


def prepare(cfg: DictConfig) -> DictConfig:
    """The backbone's model node from the checkpoint (at the crop size) and the run directory
    beside the checkpoint's run."""
    node = backbone_node(cfg.checkpoint, img_size=cfg.trainer.crop_size, head=True)
    with open_dict(cfg):
        cfg.model = node
        if cfg.run_dir is None:
            cfg.run_dir = str(run_dir_of(cfg.checkpoint) / "eval" / f"seg_{cfg.data.name}_l{cfg.trainer.layers}")
    return cfg


def evaluate_segmentation(cfg: DictConfig) -> dict:
    from train import run

    return run(prepare(cfg))


@hydra_entry("segmentation")
def main(cfg: DictConfig) -> None:
    metrics = evaluate_segmentation(cfg)
    print("[segmentation] " + ", ".join(f"{k}={v:.2f}" for k, v in (metrics or {}).items()))


if __name__ == "__main__":
    main()
