"""DINO as one module (DINOv2's SSLMetaArch, for DINO): student, EMA teacher, loss and centre.

Everything DINO learns or tracks is state of this module: the student and teacher networks
and the loss centre (a buffer of `loss`), so a checkpoint of the model and the optimizer is the
whole of DINO's training state. A training step is

    loss = dino(crops, teacher_temp)          # per micro-batch; backward on it
    ... optimizer step ...
    dino.update_teacher(teacher_momentum)     # once per optimizer step (train/dino.py: its hook)

DDP wraps the whole module without broadcasting buffers before each forward (the engine's
forward_sync_buffers=False): a broadcast would replace each rank's own teacher-output sums.
"""
import copy

import torch
from torch import nn

from .head import MultiCropWrapper
from .loss import DINOLoss


class DINO(nn.Module):
    """Student (backbone + head), teacher (a deep copy: same initial weights, no gradients) and
    the loss with its centre.

    The teacher's backbone stays in eval mode, so a drop-path backbone runs deterministically as
    DINO's teacher that is built without drop-path; its head follows the student's mode, so a
    BatchNorm head (use_bn) normalises with batch statistics in training, as DINO's teacher,
    which is never put in eval mode.

    Args:
        backbone: a network whose forward is one feature vector per image at every crop size
            (a zoo ViT with num_classes=0).
        head: the projection head (DINOHead), its `out_dim` the loss's.
        n_global, student_temp, center_momentum: DINOLoss's.
    """

    def __init__(self, backbone: nn.Module, head: nn.Module, n_global: int = 2,
                 student_temp: float = 0.1, center_momentum: float = 0.9):
        super().__init__()
        self.student = MultiCropWrapper(backbone, head)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.teacher.backbone.eval()
        self.loss = DINOLoss(head.out_dim, n_global, student_temp, center_momentum)

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.backbone.eval()
        return self

    def forward(self, crops, teacher_temp: float) -> torch.Tensor:
        """The DINO loss of a batch of crops (global crops first)."""
        with torch.no_grad():
            teacher_out = self.teacher(crops[:self.loss.n_global])
        return self.loss(self.student(crops), teacher_out, teacher_temp)

    @torch.no_grad()
    def update_teacher(self, momentum: float):
        """After an optimizer step: the centre moves by the step's teacher outputs (every
        micro-batch's loss used the centre from before the step), then the teacher's weights
        by EMA, t <- m t + (1 - m) s."""
        self.loss.update_center()
        torch._foreach_lerp_(list(self.teacher.parameters()), list(self.student.parameters()), 1.0 - momentum)
