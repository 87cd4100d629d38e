"""Semantic-segmentation metrics from a confusion matrix accumulated on the device.

mIoU, aAcc and mAcc as mmseg's `IoUMetric` computes them: per class IoU = intersection /
union and Acc = intersection / ground-truth area, over the pixels whose label is not the
ignore index; a class with an empty union (absent from labels and predictions) is NaN and left
out of the means (nanmean); aAcc = correct pixels / labelled pixels.

    m = SegMetric(num_classes=150)
    m.update(pred, label)          # int tensors of the same shape, any device
    m.all_reduce()                 # sum over ranks (exact)
    m.compute()                    # {"mIoU", "aAcc", "mAcc", "IoU": [per class], "Acc": [...]} in %
"""
from __future__ import annotations

import math

import torch

from laplace.dist import all_reduce_sum


class SegMetric:
    """Confusion matrix [label, prediction] of `num_classes` classes.

    Args:
        num_classes: K; labels and predictions are 0..K-1.
        ignore_index: label value of pixels left out (ADE20K: 255).
        device: where the matrix lives (the predictions' device).
    """

    def __init__(self, num_classes: int, ignore_index: int = 255, device=None):
        self.k, self.ignore_index = num_classes, ignore_index
        self.conf = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)

    @torch.no_grad()
    def update(self, pred: torch.Tensor, label: torch.Tensor):
        keep = label != self.ignore_index
        idx = label[keep].to(self.conf.device).long() * self.k + pred[keep].to(self.conf.device).long()
        self.conf += torch.bincount(idx, minlength=self.k * self.k).view(self.k, self.k)

    def all_reduce(self):
        self.conf = all_reduce_sum(self.conf)

    def compute(self) -> dict:
        conf = self.conf.double().cpu()
        inter, area_label, area_pred = conf.diag(), conf.sum(1), conf.sum(0)
        union = area_label + area_pred - inter
        iou = torch.where(union > 0, inter / union.clamp_min(1), torch.nan)
        acc = torch.where(area_label > 0, inter / area_label.clamp_min(1), torch.nan)
        total = float(area_label.sum())

        def nanmean(t):
            v = t[~t.isnan()]
            return float(v.mean()) * 100 if v.numel() else math.nan

        return {"mIoU": nanmean(iou), "aAcc": 100 * float(inter.sum()) / total if total else math.nan,
                "mAcc": nanmean(acc), "IoU": [100 * float(v) for v in iou], "Acc": [100 * float(v) for v in acc]}
