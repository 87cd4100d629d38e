"""laplace: Transformers with Laplacian heads (arXiv:2602.09297).

    import laplace
    model = laplace.create_model("vitb_12L", num_classes=100)       # timm's VisionTransformer
    vit = timm.create_model("vit_small_patch16_224", attn_layer=laplace.attn_layer(3))  # timm's VisionTransformer
    feats = laplace.features(model, images)                          # {"blocks.0": ..., "norm": ...}
    laplace.list_models("vits_*")
    model = laplace.load_model("runs/.../ckpt/last.pt")  # a checkpoint, a run, an export, a nanochat folder
    model = laplace.from_pretrained("org/name")          # the same loader: an export on the Hugging Face Hub
"""
from .attention import attn_layer, set_laplacian_heads
from .checkpoint import load_model
from .zoo import create_model, features, list_models, model_defaults, model_label

__all__ = ["attn_layer", "create_model", "features", "from_pretrained", "list_models", "load_model", "model_defaults",
           "model_label", "set_laplacian_heads"]
__version__ = "0.1.0"
# The Hub's name for the one loader (which downloads Hub ids). Not huggingface_hub's
# PyTorchModelHubMixin: the mixin ties config.json to one class's constructor arguments, while an
# export names a zoo model (ViT or GPT, chosen by name) and a k = 0 ViT's config.json is timm's.
from_pretrained = load_model
