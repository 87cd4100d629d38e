"""`trainer=dino`: self-supervised DINO pre-training of a zoo ViT on the shared engine.

"Emerging Properties in Self-Supervised Vision Transformers" (Caron et al. 2021;
facebookresearch/dino main_dino.py). The pieces and the keys that set them: student = zoo ViT
(no classifier) + DINOHead, teacher = its EMA copy, the loss with its centre (laplace.dino;
trainer.head, student_temp, center_momentum); multi-crop, the teacher seeing the global crops
only (trainer.multicrop, laplace.data.multicrop); the teacher's temperature and EMA momentum
(trainer.schedules.teacher_temp / teacher_momentum); AdamW with DINO's parameter groups
(`dino_param_groups`) and its lr / weight-decay schedules (optim.*); per-tensor gradient clipping
(optim.grad_clip, grad_clip_mode=param); the last layer frozen at first
(trainer.freeze_last_layer). The values are set once, by configs/trainer/dino.yaml and the
experiment files (configs/experiment/dino_*.yaml), beside the reference they claim
(configs/reference/dino_*.yaml); `python -m train.recipe` renders the two side by side, with our
deliberate differences (docs/recipes/dino_in1k.md: the zoo ViT's class token, bf16).

The network is laplace.dino.DINO (student, teacher, head, loss with its centre: all of DINO's
state is the model's); this file wires data, schedules and optimizer to it. The checkpoint's
"model" is the teacher backbone, a plain zoo ViT (`export_model`).

    python train.py experiment=dino_digits                        # CPU minutes
    python train.py experiment=dino_in1k model=vits_5L data.root=/data/imagenet
"""
from __future__ import annotations

import functools

import torch
from omegaconf import OmegaConf

from laplace import create_model
from laplace.data.multicrop import MultiCrop, multicrop_collate
from laplace.data.vision import build_vision_dataset
from laplace.dino import DINO, DINOHead
from laplace.errors import ConfigError

from .engine import Trainer


def dino_param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """DINO's utils.get_params_groups: trainable biases and 1-D tensors (norms, LayerScale,
    gates) get no weight decay; every other trainable tensor (also the class token and the
    position embedding) does."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


class DINOTrainer(Trainer):
    unit = "img"
    model_archs, data_modality = ("vit",), "image"
    example = "python train.py experiment=dino_digits model=vitt_3L"
    scheduled_values = ("teacher_temp", "teacher_momentum")

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.model.num_classes != 0:
            # The exported backbone has no classifier: the saved config (load_model) must say so.
            cfg.model.num_classes = 0

    @property
    def freeze_steps(self) -> int:
        """Steps without an update of the head's last layer (trainer.freeze_last_layer epochs)."""
        return round(float(self.cfg.trainer.freeze_last_layer) * self.steps_per_epoch)

    # ---- data ----------------------------------------------------------------------------
    def build_datasets(self):
        d = self.cfg.data
        mc = self.cfg.trainer.multicrop
        p = d.patch_size
        for key in ("global_size", "local_size"):
            if mc[key] % p:
                raise ConfigError(f"trainer.multicrop.{key}={mc[key]} is not a multiple of the patch "
                                  f"size data.patch_size={p}")
        if "root" in d and (OmegaConf.is_missing(d, "root") or d.root is None):  # experiment=dino_in1k
            raise ConfigError(f"data={d.name} needs its location: set data.root=PATH")
        self.multicrop = MultiCrop.from_config(mc, d.mean, d.std)
        # The real on-disk loader of data=<name> (laplace.data.vision), its transform swapped for
        # the multi-crop one (every loader there applies `.transform` to a PIL image). A plain,
        # resolved copy of the node: its interpolations (paths.data_dir) need the whole config.
        plain = OmegaConf.to_container(d, resolve=True)
        train_set = build_vision_dataset(OmegaConf.create({**plain, "augment": "none"}), True)
        if not hasattr(train_set, "transform"):
            raise ConfigError(f"data={d.name}: its training set takes no transform; trainer=dino "
                              f"needs one of digits, cifar10, cifar100, imagenet")
        train_set.transform = self.multicrop
        self.multicrop.reduce = bool(d.get("reduced_decode", False))
        return train_set, None

    def collate(self, items):
        return multicrop_collate(items)

    # ---- model and optimizer -------------------------------------------------------------
    def build_model(self):
        tc = self.cfg.trainer
        h = tc.head
        # The crops' position embeddings follow DINO's resampling rule (laplace.vit).
        backbone = create_model(**self.cfg.model, pos_embed_resample="dino")
        head = DINOHead(backbone.embed_dim, h.out_dim, h.hidden_dim, h.bottleneck_dim, h.nlayers,
                        h.norm_last_layer, h.use_bn)
        return DINO(backbone, head, len(tc.multicrop.global_blur), tc.student_temp, tc.center_momentum)

    def wrap_model(self, model):
        if self.cfg.trainer.head.use_bn and self.dist.distributed and self.device.type == "cuda":
            # DINO: batch statistics over the global batch (SyncBatchNorm runs on CUDA only; over
            # gloo on CPU each rank normalises its own batch). The teacher is converted too.
            model.student = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model.student)
            model.teacher = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model.teacher)
        return super().wrap_model(model.student)  # DDP / compile around the student only

    @functools.cached_property
    def teacher_net(self):
        """The teacher as the step calls it: it takes no gradient, so outside DDP, compiled on its
        own when compile is on (read after wrap_model, which may have converted its batch norms)."""
        return torch.compile(self.model.teacher) if self.compile else self.model.teacher

    def export_model(self):
        # The checkpoint's "model" is the teacher backbone, a plain zoo ViT with num_classes=0 (as
        # the `model` node says): load_model and every evaluation take it as any other ViT. The
        # whole DINO module is its "train_model" (resume).
        return self.model.teacher.backbone

    def configure_optimizers(self):
        o = self.cfg.optim
        if o.name != "adamw":
            raise ConfigError(f"trainer=dino trains with AdamW (DINO's default): set optim=adamw, "
                              f"not optim={o.name}")
        kwargs = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps}
        return {"adamw": torch.optim.AdamW(dino_param_groups(self.model.student, o.weight_decay), **kwargs)}

    # ---- the step ------------------------------------------------------------------------
    def train_step(self, crops):
        if isinstance(crops, dict):  # multicrop.device_augment: uint8 crops and their parameters
            crops = self.multicrop.augment_batch(crops)
        return self.model(crops, self.hparams["teacher_temp"], student=self.net, teacher=self.teacher_net), {}

    def before_optimizer_step(self):
        logs = super().before_optimizer_step()  # per-tensor clipping (optim.grad_clip_mode=param)
        # DINO's cancel_gradients_last_layer: no update of the last layer in the first epoch(s).
        # Counted in steps: the feed's epoch moves on with the last batch of an epoch already.
        if self.step < self.freeze_steps:
            for p in self.model.student.head.last_layer.parameters():
                p.grad = None
        return logs

    def after_optimizer_step(self):
        self.model.update_teacher(self.hparams["teacher_momentum"])  # the centre, then the EMA

    def on_fit_end(self, final_metrics: dict):
        from .logger import logged

        if not self.dist.is_main:
            return
        train = logged(self.run_dir, "train")
        d, tc = self.cfg.data, self.cfg.trainer
        self.write_results({
            "img_size": d.img_size, "patch_size": d.patch_size, "global_batch_size": tc.global_batch_size,
            "out_dim": tc.head.out_dim, "final": {"train_loss": train[-1]["loss"] if train else None},
        })
