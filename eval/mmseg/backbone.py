"""Our ViT (laplace/vit.py) as an mmsegmentation backbone, `type='LaplaceViT'` in a config.

    backbone=dict(type='LaplaceViT', checkpoint='runs/dino/.../ckpt/last.pt', img_size=512,
                  out_indices=[-1], frozen=True, final_norm=True)          # the linear protocol
    backbone=dict(type='LaplaceViT', model=dict(name='vits_5L', drop_path_rate=0.1),
                  img_size=512, out_indices=[2, 5, 8, 11])                 # UperNet from scratch

The model is rebuilt from the checkpoint's own `model` node (laplace.checkpoint) at `img_size`,
its position embedding resampled by `load_timm_state_dict`, which loads strictly: a checkpoint
that does not fit its node is an error, never a silent partial load. forward(images) returns
one [B, C, H/p, W/p] map of patch tokens per `out_indices` (the class token is dropped).

Inputs of another size than `img_size` (mmseg's slide inference passes images smaller than
the window as they are; `whole` mode passes whole images): an input that fits in `img_size`
is zero-padded to it (bottom / right) and the padding's tokens are cropped from the maps,
as train/seg_linear.py's sliding windows do; a larger one gets the position embedding
resampled (bicubic) to its grid, as mmseg's own ViT does.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModule
from mmseg.registry import MODELS

from laplace.gpt import block_indices
from laplace.checkpoint import CheckpointError, load_checkpoint
from laplace.vit import VisionTransformer, load_timm_state_dict
from laplace.zoo import create_model


@MODELS.register_module()
class LaplaceViT(BaseModule):
    """A laplace VisionTransformer whose blocks' patch tokens feed an mmseg decode head.

    Args:
        checkpoint: a laplace checkpoint of a ViT; the model is rebuilt from its config node.
        model: constructor arguments for `laplace.zoo.create_model`: with `checkpoint`,
            overrides of the checkpoint's node that keep the weights' shapes (drop_path_rate,
            fused_attn; `name` is ignored); without, the model to build from scratch (`name`
            required, e.g. dict(name="vits_5L", drop_path_rate=0.1)).
        img_size: input side the model is built for (the training crop).
        out_indices: block indices whose outputs are returned (negative: from the end).
        frozen: no gradients and eval mode always (the linear protocol's frozen backbone).
        final_norm: apply the final LayerNorm to every output (DINOv2's linear heads do).
        init_cfg: mmengine's init config (unused by the weights loaded here).
    """

    def __init__(self, checkpoint: Optional[str] = None, model: Optional[dict] = None,
                 img_size: int = 512, out_indices: Sequence[int] = (-1,), frozen: bool = False,
                 final_norm: bool = False, init_cfg=None):
        super().__init__(init_cfg)
        kwargs = dict(model or {})
        if checkpoint:
            ckpt = load_checkpoint(checkpoint)
            node = ckpt["config"]["model"]
            if "embed_dim" not in node:
                raise CheckpointError(f"{checkpoint} holds a {node.get('name')} model: LaplaceViT needs a ViT")
            # The checkpoint's node decides the architecture (a `name` in `model` is ignored:
            # Laplacian heads add no parameters, so a different name would load silently).
            # No classifier: its weights are dropped, so no parameter goes unused under DDP.
            kwargs.pop("name", None)
            kwargs = {**node, "drop_path_rate": 0.0, **kwargs, "img_size": img_size, "num_classes": 0}
            state = {k: v for k, v in ckpt["model"].items() if not k.startswith("head.")}
        elif "name" not in kwargs:
            raise ValueError("LaplaceViT: pass checkpoint= (a laplace checkpoint) or model=dict(name=...)")
        else:
            kwargs.update(img_size=img_size, num_classes=0)
            state = None
        self.vit: VisionTransformer = create_model(**kwargs)
        if state is not None:
            try:
                load_timm_state_dict(self.vit, state)
            except (RuntimeError, ValueError) as e:
                raise CheckpointError(f"{checkpoint} does not fit its own model node: "
                                      f"{' '.join(str(e).split())[:200]}") from None
        depth = len(self.vit.blocks)
        block_indices(out_indices, depth)  # validates: IndexError names a bad index
        self.out_indices = [i % depth for i in out_indices]
        self.frozen, self.final_norm = frozen, final_norm
        # Modules no output uses are removed: under DDP a trainable parameter that gets no
        # gradient is an error (the blocks after the last output; the final norm if unused).
        del self.vit.blocks[max(self.out_indices) + 1:]
        if not final_norm:
            self.vit.norm = nn.Identity()
        self.embed_dim = self.vit.embed_dim
        if frozen:
            self.vit.requires_grad_(False).eval()

    def init_weights(self):
        # The weights come from the checkpoint (or the zoo's own init); mmengine's Runner
        # calls this after building, and must not re-initialise them.
        pass

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:  # no drop-path or dropout in a frozen backbone, whatever the head does
            self.vit.eval()
        return self

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, int]]:
        """Images [B, 3, H, W] -> (tokens [B, 1 + rows * cols, C] after the embedding, cols of
        the token grid, (h, w) the grid of the input's own patches); see the module docstring."""
        vit, p = self.vit, self.vit.patch_embed.patch_size[0]
        H, W = x.shape[-2:]
        h, w = math.ceil(H / p), math.ceil(W / p)
        gh, gw = vit.patch_embed.grid_size
        if h <= gh and w <= gw:
            x = F.pad(x, (0, gw * p - W, 0, gh * p - H))
            return vit._pos_embed(vit.patch_embed(x)), gw, (h, w)  # at the model's size
        # Larger: the ViT resamples its position embedding to the grid (plain bicubic).
        return vit._pos_embed(vit.patch_embed(F.pad(x, (0, w * p - W, 0, h * p - H)))), w, (h, w)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            t, cols, (h, w) = self._tokens(x)
            feats = {}
            for i, blk in enumerate(self.vit.blocks):  # as forward_features(x, out_indices, norm=False)
                t = blk(t)
                if i in self.out_indices:
                    feats[i] = t
            outs = []
            for i in self.out_indices:
                f = self.vit.norm(feats[i]) if self.final_norm else feats[i]
                B, _, C = f.shape
                grid = f[:, 1:].transpose(1, 2).reshape(B, C, -1, cols)  # [B, C, rows, cols]
                outs.append(grid[:, :, :h, :w].contiguous())  # the padding's tokens dropped
        return tuple(outs)
