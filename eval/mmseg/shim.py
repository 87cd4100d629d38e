"""Let mmsegmentation 1.2.2 import and train on mmcv-lite (mmcv without compiled ops).

Imported by `eval.mmseg` before anything imports mmseg; `apply()` is idempotent and does
nothing when full mmcv (with its compiled `mmcv._ext`) is installed, or when no mmcv is.

Why: mmseg 1.2.2 asserts 2.0.0rc4 <= mmcv < 2.2.0, and no mmcv 2.1.0 wheel exists for our
torch (2.14). Full mmcv 2.1.0 does build from source, but only in ~20 min and only with
`--no-build-isolation` (else pip silently builds a wheel without ops and caches it),
setuptools < 81 (it needs pkg_resources) and `-std=c++20` (torch 2.14's headers). mmcv-lite
installs in seconds, but its `mmcv/ops/__init__.py` loads `mmcv._ext` and fails, and four mmseg
modules import `mmcv.ops` unconditionally (utils/mask_classification.py,
models/utils/point_sample.py, decode_heads/san_head.py, losses/focal_loss.py), so
`import mmseg.models` fails. This module puts a stub `mmcv.ops` in their place:
  - `point_sample` (and the rest of mmcv-lite's pure-PyTorch mmcv/ops/point_sample.py);
  - `sigmoid_focal_loss`, which raises if called: mmseg calls it for CUDA tensors only and
    uses its own PyTorch focal loss otherwise;
  - any other name raises ModuleNotFoundError, not ImportError: mmseg guards its optional
    ops (CrissCrossAttention, PSAMask, ...) with `except ModuleNotFoundError`, so those
    fall back exactly as they do without mmcv; the models that truly need a compiled op fail
    with a message that names it.
Models built from plain PyTorch layers (EncoderDecoder with ViT / ResNet backbones, FCN,
UPerHead, SegFormer, ASPP, our LaplaceViT + BNHead) train and predict with it.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

# What users see when a model asks for an op mmcv-lite lacks.
_HINT = ("needs mmcv's compiled ops, and mmcv-lite (the [seg] extra) has none; install full "
         "mmcv 2.1.0 (from source, see eval/mmseg/shim.py) instead of mmcv-lite")


def full_mmcv() -> bool:
    """True when mmcv with compiled ops is installed (then the shim stays out of the way)."""
    try:
        return importlib.util.find_spec("mmcv._ext") is not None
    except ImportError:  # no mmcv at all
        return False


def _sigmoid_focal_loss(*args, **kwargs):
    raise RuntimeError(f"mmcv.ops.sigmoid_focal_loss (CUDA focal loss) {_HINT}")


def _stub_ops() -> types.ModuleType:
    import mmcv

    ops = types.ModuleType("mmcv.ops")
    ops.__file__ = __file__
    # The real folder as the package path, so `mmcv.ops.point_sample` is imported from
    # mmcv-lite's own file without running mmcv/ops/__init__.py (which loads _ext).
    ops.__path__ = [f"{p}/ops" for p in importlib.util.find_spec("mmcv").submodule_search_locations]
    ops.__laplace_shim__ = True
    sys.modules["mmcv.ops"] = ops
    mmcv.ops = ops
    point_sample = importlib.import_module("mmcv.ops.point_sample")
    ops.point_sample = point_sample.point_sample
    ops.bilinear_grid_sample = point_sample.bilinear_grid_sample
    ops.SimpleRoIAlign = point_sample.SimpleRoIAlign
    ops.sigmoid_focal_loss = _sigmoid_focal_loss

    def __getattr__(name: str):
        if name.startswith("__"):  # copy / pickle / inspect probe dunders: plain AttributeError
            raise AttributeError(name)
        raise ModuleNotFoundError(f"mmcv.ops.{name} {_HINT}", name="mmcv._ext")

    ops.__getattr__ = __getattr__
    return ops


def apply() -> bool:
    """Install the stub `mmcv.ops` if needed; True when the shim is active."""
    current = sys.modules.get("mmcv.ops")
    if current is not None:
        return bool(getattr(current, "__laplace_shim__", False))
    if importlib.util.find_spec("mmcv") is None or full_mmcv():
        return False
    _stub_ops()
    return True


ACTIVE = apply()
