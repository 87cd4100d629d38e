"""mmsegmentation integration (the optional `[seg]` extra): our ViT as an mmseg backbone.

    pip install -e ".[seg]"
    python -m eval.mmseg.train configs/mmseg/ade20k_linear.py \\
        --cfg-options model.backbone.checkpoint=runs/dino/.../ckpt/last.pt data_root=/data/ade
    python -m eval.mmseg.train configs/mmseg/digits_linear.py --cfg-options model.backbone.checkpoint=...
    python -m eval.mmseg.test configs/mmseg/ade20k_linear.py WORK_DIR/iter_40000.pth

Importing this package makes mmseg usable with mmcv-lite (shim.py, applied before mmseg is
imported) and registers `LaplaceViT` (backbone.py) and `BNHead` (heads.py) in mmseg's MODELS
and `PlainCheckpointHook` (hooks.py: checkpoints that load under torch's weights_only default,
resume included) in its HOOKS, so a user's own mmseg scripts can `import eval.mmseg` and use
them in any config.
"""
import warnings

from . import shim  # noqa: F401  (before anything imports mmseg)

# mmcv-lite: mmcv's transformer bricks try the compiled deformable attention and warn; no
# model here uses it.
warnings.filterwarnings("ignore", message=".*MultiScaleDeformableAttention.*")

from .backbone import LaplaceViT  # noqa: E402
from .heads import BNHead  # noqa: E402
from .hooks import PlainCheckpointHook  # noqa: E402

__all__ = ["LaplaceViT", "BNHead", "PlainCheckpointHook"]
