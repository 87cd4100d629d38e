"""Let mmsegmentation 1.2.2 import and train on mmcv-lite (mmcv without compiled ops), and let
mmengine 0.10.7 read package-scoped base configs (`mmseg::...`) without pkg_resources.

Imported by `eval.mmseg` before anything imports mmseg. `apply()` is idempotent and leaves mmcv
alone when full mmcv (with its compiled `mmcv._ext`) is installed, or when no mmcv is.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from importlib import metadata

# Why mmcv-lite: mmseg 1.2.2 asserts 2.0.0rc4 <= mmcv < 2.2.0, and no mmcv 2.1.0 wheel exists for
# our torch (2.14). Full mmcv 2.1.0 builds from source only in ~20 min, with setuptools < 81,
# `--no-build-isolation` (else pip silently builds a wheel without ops and caches it) and
# `-std=c++20`. mmcv-lite installs in seconds, but its mmcv/ops/__init__.py loads `mmcv._ext`, and
# four mmseg modules import `mmcv.ops` unconditionally (utils/mask_classification.py,
# models/utils/point_sample.py, decode_heads/san_head.py, losses/focal_loss.py).
_HINT = ("needs mmcv's compiled ops, and mmcv-lite (the [seg] extra) has none; install full "
         "mmcv 2.1.0 (from source, see eval/mmseg/shim.py) instead of mmcv-lite")


def _sigmoid_focal_loss(*args, **kwargs):
    # mmseg calls the compiled focal loss for CUDA tensors only, its own PyTorch one otherwise.
    raise RuntimeError(f"mmcv.ops.sigmoid_focal_loss (CUDA focal loss) {_HINT}")


def _stub_ops() -> types.ModuleType:
    """A stub `mmcv.ops`: mmcv-lite's pure-PyTorch point_sample, and nothing compiled."""
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
    ops.point_sample = point_sample.point_sample  # the one op mmseg's models import unconditionally
    ops.sigmoid_focal_loss = _sigmoid_focal_loss

    def __getattr__(name: str):
        if name.startswith("__"):  # copy / pickle / inspect probe dunders: plain AttributeError
            raise AttributeError(name)
        # ModuleNotFoundError, not ImportError: mmseg guards its optional ops (CrissCrossAttention,
        # PSAMask, ...) with `except ModuleNotFoundError`, so they fall back as without mmcv.
        raise ModuleNotFoundError(f"mmcv.ops.{name} {_HINT}", name="mmcv._ext")

    ops.__getattr__ = __getattr__
    return ops


def _module_dir(package: str) -> str:
    """The folder of a distribution's top-level module (mmsegmentation -> .../site-packages/mmseg)."""
    module = metadata.distribution(package).read_text("top_level.txt").split()[0]
    return os.path.dirname(importlib.util.find_spec(module).origin)


def _package_configs():
    """mmengine finds the package of a `mmseg::` base config with pkg_resources, which setuptools
    >= 81 no longer ships: find it with importlib.metadata instead (the configs are in mmseg's
    wheel, under mmseg/.mim/configs)."""
    if importlib.util.find_spec("pkg_resources") is not None:
        return
    import mmengine.config.config as config

    config.is_installed = lambda package: bool(list(metadata.distributions(name=package)))
    config.get_installed_path = _module_dir


def apply() -> bool:
    """Install the stub `mmcv.ops` if needed; True when the mmcv shim is active."""
    _package_configs()  # mmengine comes with mmseg (the [seg] extra)
    current = sys.modules.get("mmcv.ops")
    if current is not None:
        return bool(getattr(current, "__laplace_shim__", False))
    if importlib.util.find_spec("mmcv") is None or importlib.util.find_spec("mmcv._ext") is not None:
        return False  # no mmcv, or full mmcv with its compiled ops: the shim stays out of the way
    _stub_ops()
    return True


ACTIVE = apply()
