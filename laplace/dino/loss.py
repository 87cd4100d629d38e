"""DINO's loss (facebookresearch/dino main_dino.py `DINOLoss`).

For teacher global crop i and student crop v != i:

    q_i = softmax((t_i - center) / teacher_temp)     (no gradient)
    l_iv = mean over the batch of  -sum_k q_i[k] log softmax(s_v / student_temp)[k]

and the loss is the mean of l_iv over the pairs. Every sample of an optimizer step sees the
centre from before the step; once per step (`update_center`) it moves towards the mean of the
teacher outputs of the whole global batch, all ranks and micro-batches (DINO: all-reduced sum
/ rows): center <- m * center + (1 - m) * mean(t). The forward only accumulates the teacher
outputs' sum and row count, so gradient accumulation changes neither the loss nor the centre.
Computed in float32 whatever the autocast.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class DINOLoss(nn.Module):
    """Args:
        out_dim: head outputs.
        n_global: global crops (the teacher's views; DINO: 2).
        student_temp: student softmax temperature (DINO: 0.1).
        center_momentum: momentum of the centre (DINO: 0.9).
    """

    def __init__(self, out_dim: int, n_global: int = 2, student_temp: float = 0.1,
                 center_momentum: float = 0.9):
        super().__init__()
        self.n_global, self.student_temp, self.center_momentum = n_global, student_temp, center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))
        # The step's teacher-output sum and row count, one row: [sum_1..sum_K, rows]. Not
        # checkpointed: the engine saves between steps, when it is zero.
        self.register_buffer("_pending", torch.zeros(1, out_dim + 1), persistent=False)
        self._fed = False  # a forward since the last update: known on the host, without reading _pending

    def forward(self, student_out: torch.Tensor, teacher_out: torch.Tensor,
                teacher_temp: float) -> torch.Tensor:
        """student_out: [n_crops * B, K] crop after crop (global crops first);
        teacher_out: [n_global * B, K] for the global crops. Adds the teacher outputs to the
        step's centre statistics; `update_center` applies them."""
        student_out, teacher_out = student_out.float(), teacher_out.detach().float()
        n_crops = student_out.shape[0] // (teacher_out.shape[0] // self.n_global)
        s = F.log_softmax(student_out / self.student_temp, dim=-1).chunk(n_crops)
        q = F.softmax((teacher_out - self.center) / teacher_temp, dim=-1).chunk(self.n_global)
        total, pairs = student_out.new_zeros(()), 0
        for i, qi in enumerate(q):
            for v, sv in enumerate(s):
                if v == i:
                    continue
                total = total + torch.sum(-qi * sv, dim=-1).mean()
                pairs += 1
        with torch.no_grad():
            self._pending[:, :-1] += teacher_out.sum(dim=0, keepdim=True)
            self._pending[:, -1] += teacher_out.shape[0]
        self._fed = True
        return total / pairs

    @torch.no_grad()
    def update_center(self):
        """Once per optimizer step, on every rank: one all-reduce of the step's sum and rows."""
        if not self._fed:
            raise RuntimeError("DINOLoss.update_center: no teacher output since the last update")
        stats = self._pending.clone()
        if dist.is_initialized():  # the centre is every rank's: one sum over all of them
            dist.all_reduce(stats)
        batch_center = stats[:, :-1] / stats[:, -1:]
        self.center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)
        self._pending.zero_()
        self._fed = False
