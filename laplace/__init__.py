"""laplace: Transformers with Laplacian heads (arXiv:2602.09297).

    import laplace
    model = laplace.create_model("vitb_12L", num_classes=100)
    laplace.list_models("vits_*")
    model = laplace.load_model("runs/.../ckpt/last.pt")      # a checkpoint, or an exported folder
    model = laplace.from_pretrained("org/name")               # an export on the Hugging Face Hub
"""
from .checkpoint import load_model
from .zoo import create_model, list_models, model_defaults, model_label

__all__ = ["create_model", "from_pretrained", "list_models", "load_model", "model_defaults", "model_label"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # laplace.from_pretrained imported on first use: importing laplace.export here would make
    # `python -m laplace.export` run a module that is already imported (runpy warns of it).
    if name == "from_pretrained":
        from .export import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'laplace' has no attribute {name!r}")
