"""Small trainers that exercise the engine's contract as train/dino.py and train/gpt.py use it,
or fail on purpose, named by import path: `trainer.name=toy_trainers:EMAToy` (the tests folder
is on the path).

    EMAToy      a student ViT, its EMA teacher and a loss centre in one module (DINO's
                meta-architecture): two optimizers (AdamW for the blocks, SGD with momentum
                for the rest) whose lr / weight decay / SGD momentum the tests schedule, an
                EMA momentum read from `trainer.schedules`, the head frozen for the first
                FREEZE_STEPS steps, per-rank noise in the loss, the teacher exported as the model
    StreamLM    a GPT fed by laplace.data.shards.TokenStream (shards under data.root)
    Crashing    DeiT3Trainer whose train_step raises a ValueError at step CRASH_AT_STEP
    SignalledDuringSetup  DeiT3Trainer, sent SIGUSR1 while it builds its data
    Diverging   DeiT3Trainer whose loss turns NaN (DIVERGE=loss) or one weight inf (DIVERGE=weights)
                at step DIVERGE_AT (counted from 1, as the logs count)
    PausesAt    DeiT3Trainer that waits in step PAUSE_AT for a test to signal it (a known step)
"""
from __future__ import annotations

import copy
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from laplace import create_model
from laplace.data import Data
from laplace.data.shards import TokenStream, list_shards
from train.engine import Trainer
from train.deit3 import DeiT3Trainer

FREEZE_STEPS = 2  # the head gets no update in the first steps (DINO: the last layer, 1 epoch)


class StudentTeacher(nn.Module):
    def __init__(self, student: nn.Module, num_classes: int):
        super().__init__()
        self.student, self.teacher = student, copy.deepcopy(student).requires_grad_(False)
        self.register_buffer("center", torch.zeros(num_classes))

    def forward(self, x):
        return self.student(x)


class EMAToy(DeiT3Trainer):
    scheduled_values = ("ema_momentum",)
    export = "teacher"

    def build_model(self):
        return StudentTeacher(create_model(**self.cfg.model), self.cfg.data.num_classes)

    def configure_optimizers(self):
        o, student = self.cfg.optim, self.model.student
        decay, no_decay = [], []
        for n, p in student.blocks.named_parameters():
            (no_decay if p.ndim < 2 else decay).append(p)
        rest = [p for n, p in student.named_parameters() if not n.startswith("blocks.")]
        sgd = torch.optim.SGD(rest, lr=o.lr, momentum=0.9, weight_decay=o.weight_decay)
        # the head (in SGD's params) frozen at first; the EMA after the last optimizer's step
        sgd.register_step_pre_hook(lambda *_: self._freeze_head())
        sgd.register_step_post_hook(lambda *_: self._ema())
        return {"adamw": torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                           lr=o.lr, weight_decay=o.weight_decay), "sgd": sgd}

    def train_step(self, batch):
        x, y = batch
        logits = self.net(x)
        # A DINO-like centre (same on every rank) and noise from this rank's random stream.
        center = self.model.center
        center.mul_(0.9).add_(logits.detach().float().mean(0), alpha=0.1)
        noise = torch.rand(()).to(self.device)
        loss = F.cross_entropy(logits.float() - center, y) * (1 + 0.01 * noise)
        return loss, {"noise": noise}

    def _freeze_head(self):
        if self.step < FREEZE_STEPS:
            for p in self.model.student.head.parameters():
                p.grad = None

    @torch.no_grad()
    def _ema(self):
        m = self.hparams["ema_momentum"]
        t, s = list(self.model.teacher.parameters()), list(self.model.student.parameters())
        torch._foreach_lerp_(t, s, 1.0 - m)

    def evaluate(self):
        return {}


class StreamLM(Trainer):
    """Next-token loss on a TokenStream: data.root holds train/*.npy shards."""

    archs, modality = ("gpt",), "text"

    def build_data(self):
        d = self.cfg.data
        stream = TokenStream(list_shards(d.root, "train"), d.seq_len, self.micro_bs, self.dist.rank,
                             self.dist.world_size, step_windows=self.cfg.trainer.global_batch_size)
        return Data(stream, unit="tok", units_per_sample=d.seq_len, identity=stream.identity())

    def train_step(self, batch):
        x, y = batch
        return self.net(x, targets=y), {"first_token": x[0, 0].float()}


class Crashing(DeiT3Trainer):
    """Raises a plain ValueError (a bug, not bad input) in train_step at step CRASH_AT_STEP
    (self.step, default 2), after writing the time of the crash to <run_dir>/crash_time."""

    def train_step(self, batch):
        if self.step == int(os.environ.get("CRASH_AT_STEP", 2)):
            (self.run_dir / "crash_time").write_text(repr(time.time()))
            raise ValueError("injected bug inside train_step")
        return super().train_step(batch)


class SignalledDuringSetup(DeiT3Trainer):
    """Gets SIGUSR1 while it builds its data, as when a preemption warning comes early."""

    def build_data(self):
        import signal

        os.kill(os.getpid(), signal.SIGUSR1)
        return super().build_data()


class Diverging(DeiT3Trainer):
    """At step DIVERGE_AT (self.step + 1): NaN in the loss (so in the gradients and then the
    weights), or inf written into one weight (head.weight[0, 0]) after the optimizer step while the
    loss stays finite (DIVERGE=weights)."""

    def _now(self, what: str) -> bool:
        return os.environ.get("DIVERGE", "loss") == what and self.step + 1 == int(os.environ["DIVERGE_AT"])

    def train_step(self, batch):
        loss = super().train_step(batch)
        return loss * float("nan") if self._now("loss") else loss

    def configure_optimizers(self):
        optimizers = super().configure_optimizers()
        for opt in optimizers.values():
            opt.register_step_post_hook(lambda *_: self._spoil())
        return optimizers

    @torch.no_grad()
    def _spoil(self):
        if self._now("weights"):
            self.model.head.weight[0, 0] = float("inf")


class PausesAt(DeiT3Trainer):
    """In step PAUSE_AT (counted from 1) writes <run_dir>/paused and waits for <run_dir>/go, so
    that a test signals the process at a known step; unset, an ordinary DeiT3Trainer (same losses)."""

    def train_step(self, batch):
        if self.step + 1 == int(os.environ.get("PAUSE_AT", 0)) and not (self.run_dir / "go").exists():
            (self.run_dir / "paused").touch()
            while not (self.run_dir / "go").exists():
                time.sleep(0.02)
        return super().train_step(batch)
