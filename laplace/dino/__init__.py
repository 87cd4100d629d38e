"""DINO self-supervised pre-training pieces (facebookresearch/dino), trained by `trainer=dino`
(train/dino.py); the multi-crop augmentation is laplace.data.multicrop."""
from .head import (
           DINOHead,
           DINOModel,
           MultiCropWrapper,
           interpolate_pos_embed,
           vit_class_token,
)
from .loss import DINOLoss

__all__ = ["DINOHead", "DINOLoss", "DINOModel", "MultiCropWrapper", "interpolate_pos_embed",
           "vit_class_token"]
