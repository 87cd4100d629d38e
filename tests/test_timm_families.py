"""Which of timm's vision transformers take `attn_layer=laplace.attn_layer(k)` (docs/library.md names
them): "any timm ViT" was untrue, Eva, BEiT, Swin, CaiT, XCiT and LeViT refuse it (issue 53)."""
from __future__ import annotations

import pytest
import timm

import laplace
from laplace.attention import LaplacianAttention
from laplace.errors import ConfigError


TAKE_ATTN_LAYER = ["vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224", "flexivit_small", "vit_base_r26_s32_224",
                   "naflexvit_base_patch16_gap"]
REFUSE_ATTN_LAYER = ["eva02_tiny_patch14_224", "vit_small_patch16_rope_224", "beit_base_patch16_224",
                     "swin_tiny_patch4_window7_224", "cait_xxs24_224", "xcit_nano_12_p16_224", "levit_128s",
                     "vit_relpos_small_patch16_224", "samvit_base_patch16", "mvitv2_tiny", "davit_tiny"]


def test_the_timm_families_docs_library_names_take_attn_layer_or_refuse_it():
    """docs/library.md names which of timm's ViTs take attn_layer: 'any timm ViT' was untrue (issue 53)."""
    for name in TAKE_ATTN_LAYER:
        model = timm.create_model(name, pretrained=False, depth=2, attn_layer=laplace.attn_layer(1))
        assert sum(isinstance(m, LaplacianAttention) for m in model.modules()) == 2, name
    for name in REFUSE_ATTN_LAYER:
        with pytest.raises(TypeError, match="attn_layer"):
            timm.create_model(name, pretrained=False, attn_layer=laplace.attn_layer(1))
    eva = timm.create_model("eva02_tiny_patch14_224", pretrained=False, depth=2)
    with pytest.raises(ConfigError, match=r"^Eva has no Laplacian attention: build it with attn_layer="):
        laplace.set_laplacian_heads(eva, 1)  # it changed nothing, silently
