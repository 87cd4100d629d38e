"""Our ViT (laplace/vit.py) as an mmsegmentation backbone: `type='LaplaceViT'` in a config.

    backbone=dict(type='LaplaceViT', checkpoint='runs/dino/.../ckpt/last.pt', img_size=512,
                  model=dict(drop_path_rate=0.1), out_indices=[2, 5, 8, 11])   # fine-tune
    backbone=dict(type='LaplaceViT', model=dict(name='vits_5L'), img_size=512)  # from scratch

forward(images) returns one [B, C, H/p, W/p] map of patch tokens per `out_indices` (the class
token dropped), as mmseg's own VisionTransformer does for UPerHead.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModule
from mmseg.registry import MODELS

from laplace.gpt import block_indices
from laplace.checkpoint import load_model
from laplace.pretrained import backbone_source
from laplace.zoo import create_model, features


@MODELS.register_module()
class LaplaceViT(BaseModule):
    """A trainable laplace VisionTransformer whose blocks' patch tokens feed an mmseg decode head.

    Args:
        checkpoint: a laplace checkpoint of a ViT (or a timm state dict with `model` naming its
            architecture); the model is rebuilt from the checkpoint's own node.
        model: without `checkpoint`, `laplace.create_model`'s arguments (`name` required); with
            it, overrides that keep the weights' shapes (drop_path_rate; a `name` is ignored:
            Laplacian heads add no parameters, so another name would load silently).
        img_size: the training crop; the position embedding is resampled to it.
        out_indices: block indices whose outputs are returned (negative: from the end).
        init_cfg: mmengine's init config (unused: the weights are the checkpoint's or the zoo's).
    """

    def __init__(self, checkpoint: Optional[str] = None, model: Optional[dict] = None, img_size: int = 512,
                 out_indices: Sequence[int] = (2, 5, 8, 11), init_cfg=None):
        super().__init__(init_cfg)
        over = dict(model or {})
        if checkpoint:
            # The backbone's node (one-line errors for a missing file, a GPT), built once by the one
            # loader (strict, the position embedding resampled), trainable, with the overrides added.
            src = backbone_source(checkpoint, over, img_size=img_size)
            over.pop("name", None)
            self.vit = load_model(src, eval_mode=False, **over)
        else:
            self.vit = create_model(**{**over, "img_size": img_size, "num_classes": 0})
        depth = len(self.vit.blocks)
        block_indices(out_indices, depth)  # validates: an IndexError names a bad index
        self.out_indices = [i % depth for i in out_indices]
        # Under DDP a trainable parameter without a gradient is an error: the blocks after the
        # last output and the final norm go.
        del self.vit.blocks[max(self.out_indices) + 1:]
        self.vit.norm = nn.Identity()

    def init_weights(self):
        # mmengine's Runner calls this after building: the weights loaded above must stay.
        pass

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = self.vit.patch_embed.patch_size[0]
        # Whole-image inference passes any size: pad to whole patches (bottom / right); the ViT
        # resamples its position embedding to that grid (bicubic, by the model's own rule).
        x = F.pad(x, (0, -x.shape[-1] % p, 0, -x.shape[-2] % p))
        rows, cols = x.shape[-2] // p, x.shape[-1] // p
        feats = features(self.vit, x, layers=self.out_indices, norm=False)
        # [B, 1 + rows * cols, C] -> [B, C, rows, cols], the class token dropped
        return tuple(feats[f"blocks.{i}"][:, 1:].transpose(1, 2).reshape(x.shape[0], -1, rows, cols)
                     for i in self.out_indices)
