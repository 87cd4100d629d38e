"""DINO self-supervised pre-training (facebookresearch/dino) as a meta-architecture, `DINO`:
student, EMA teacher, head and loss with its centre in one module, trained by `trainer=dino`
(train/dino.py); the multi-crop augmentation is laplace.data.multicrop."""
from .head import DINOHead, MultiCropWrapper
from .loss import DINOLoss
from .meta import DINO

__all__ = ["DINO", "DINOHead", "DINOLoss", "MultiCropWrapper"]
