"""laplace: Transformers with Laplacian heads (arXiv:2602.09297).

    import laplace
    model = laplace.create_model("vitb_12L", num_classes=100)       # timm's VisionTransformer
    vit = timm.create_model("vit_small_patch16_224", attn_layer=laplace.attn_layer(3))  # timm's VisionTransformer
    feats = laplace.features(model, images)                          # {"blocks.0": ..., "norm": ...}
    laplace.list_models("vits_*")
    model = laplace.load_model("runs/.../ckpt/last.pt")      # a checkpoint, or an exported folder
    model = laplace.from_pretrained("org/name")               # an export on the Hugging Face Hub
"""
from .attention import attn_layer, set_laplacian_heads
from .checkpoint import load_model
from .zoo import create_model, features, list_models, model_defaults, model_label

__all__ = ["attn_layer", "create_model", "features", "from_pretrained", "list_models", "load_model", "model_defaults",
           "model_label", "set_laplacian_heads"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # laplace.from_pretrained imported on first use: importing laplace.export here would make
    # `python -m laplace.export` run a module that is already imported (runpy warns of it).
    if name == "from_pretrained":
        from .export import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'laplace' has no attribute {name!r}")
