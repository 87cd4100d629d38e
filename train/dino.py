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
import torch
from omegaconf import OmegaConf

from laplace import create_model
from laplace.data import Data
from laplace.data.multicrop import MultiCrop, multicrop_collate
from laplace.data.vision import build_vision_dataset, image_identity
from laplace.dino import DINO, DINOHead
from laplace.errors import ConfigError

from .engine import Trainer
from .optim import build_optimizers


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
    archs, modality = ("vit",), "image"
    example = "python train.py experiment=dino_digits model=vitt_3L"
    export = "teacher.backbone"  # a plain zoo ViT with num_classes=0: load_model and every evaluation take it
    scheduled_values = ("teacher_temp", "teacher_momentum")

    def build_data(self) -> Data:
        d = self.cfg.data
        mc = self.cfg.trainer.multicrop
        for key in ("global_size", "local_size"):
            if mc[key] % d.patch_size:
                raise ConfigError(f"trainer.multicrop.{key}={mc[key]} is not a multiple of the patch "
                                  f"size data.patch_size={d.patch_size}")
        if "root" in d and (OmegaConf.is_missing(d, "root") or d.root is None):  # experiment=dino_in1k
            raise ConfigError(f"data={d.name} needs its location: set data.root=PATH")
        self.multicrop = MultiCrop.from_config(mc, d.mean, d.std)
        # The real on-disk loader of data=<name> (laplace.data.vision) with the multi-crop transform.
        # A plain, resolved copy of the node: its interpolations (paths.data_dir) need the whole config.
        train_set = build_vision_dataset(OmegaConf.create(OmegaConf.to_container(d, resolve=True)), True,
                                         self.multicrop)
        self.multicrop.reduce = bool(d.get("reduced_decode", False))
        return Data(train_set, None, multicrop_collate, unit="img", identity=image_identity(train_set))

    def build_model(self):
        tc = self.cfg.trainer
        # The exported backbone has no classifier: the saved config (what load_model reads) says so.
        self.cfg.model.num_classes = 0
        h = tc.head
        # The crops' position embeddings follow DINO's resampling rule (laplace.vit).
        backbone = create_model(**self.cfg.model, pos_embed_resample="dino")
        head = DINOHead(backbone.embed_dim, h.out_dim, h.hidden_dim, h.bottleneck_dim, h.nlayers,
                        h.norm_last_layer, h.use_bn)
        return DINO(backbone, head, len(tc.multicrop.global_blur), tc.student_temp, tc.center_momentum)

    def configure_optimizers(self):
        optimizers = build_optimizers(dino_param_groups(self.model.student, self.cfg.optim.weight_decay), self.cfg.optim)
        for opt in optimizers.values():
            # Around the step, as main_dino: the head's last layer keeps its weights in the first
            # epoch(s) (its gradients dropped after clipping), and after the step the centre and
            # the EMA teacher move.
            opt.register_step_pre_hook(lambda *_: self._freeze_last_layer())
            opt.register_step_post_hook(lambda *_: self.model.update_teacher(self.hparams["teacher_momentum"]))
        return optimizers

    def _freeze_last_layer(self):
        # DINO's cancel_gradients_last_layer, counted in steps (the feed's epoch moves on with an
        # epoch's last batch already).
        if self.step < round(float(self.cfg.trainer.freeze_last_layer) * self.steps_per_epoch):
            for p in self.model.student.head.last_layer.parameters():
                p.grad = None

    def train_step(self, crops):
        if self.cfg.trainer.multicrop.device_augment:  # uint8 crops and their parameters: augmented here
            crops = self.multicrop.augment_batch(crops)
        return self.net(crops, self.hparams["teacher_temp"])

    def results(self, metrics: dict) -> dict:
        return {"out_dim": self.cfg.trainer.head.out_dim}
