"""laplace: Transformers with Laplacian heads (arXiv:2602.09297).

    import laplace
    model = laplace.create_model("vitb_12L", num_classes=100)
    laplace.list_models("vits_*")
"""
from .zoo import create_model, list_models, model_defaults

__all__ = ["create_model", "list_models", "model_defaults"]
__version__ = "0.1.0"
