"""DINOv2's linear segmentation head for mmsegmentation, `type='BNHead'` in a config.

    decode_head=dict(type='BNHead', in_channels=[384], in_index=[0], num_classes=150,
                     input_transform='resize_concat', norm_cfg=dict(type='SyncBN'))

Batch norm + 1x1 convolution over the backbone's maps, resized to the first one's size and
concatenated (several layers: DINOv2's "+ms" head). The same head as train/seg_linear.py's
`LinearSegHead`; mmseg's BaseDecodeHead adds the loss, the bilinear upsampling of the logits
and the 0.01-std normal init of the 1x1 convolution (`conv_seg`).
"""
from __future__ import annotations

import torch
from mmcv.cnn import build_norm_layer
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from mmseg.registry import MODELS


@MODELS.register_module()
class BNHead(BaseDecodeHead):
    """BN + 1x1 conv over the (resize-)concatenated inputs.

    Args:
        **kwargs: BaseDecodeHead's (in_channels, in_index, num_classes, input_transform,
            norm_cfg, dropout_ratio, loss_decode, align_corners, ...). `channels` defaults to
            the concatenated width (it must equal it: the head has no projection). norm_cfg
            defaults to SyncBN, which mmengine turns into BatchNorm when not distributed.
    """

    def __init__(self, **kwargs):
        in_channels = kwargs["in_channels"]
        width = sum(in_channels) if isinstance(in_channels, (list, tuple)) else in_channels
        kwargs.setdefault("channels", width)
        kwargs.setdefault("dropout_ratio", 0.0)
        kwargs.setdefault("norm_cfg", dict(type="SyncBN", requires_grad=True))
        super().__init__(**kwargs)
        if self.in_channels != self.channels:
            raise ValueError(f"BNHead: channels={self.channels} must equal the input width "
                             f"{self.in_channels} (a linear head has no projection)")
        self.bn = build_norm_layer(self.norm_cfg, self.in_channels)[1]

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.cls_seg(self.bn(self._transform_inputs(inputs)))
