"""mmsegmentation integration (the optional `[seg]` extra): our ViT as an mmseg backbone, for
UperNet fine-tuning (configs/mmseg/ade20k_upernet.py).

    pip install -e ".[seg]"
    python -m eval.mmseg.train configs/mmseg/ade20k_upernet.py \\
        --cfg-options model.backbone.checkpoint=runs/dino/.../ckpt/last.pt data_root=/data/ade
    python -m eval.mmseg.test configs/mmseg/ade20k_upernet.py WORK_DIR/iter_160000.pth --cfg-options ...

Importing this package lets mmseg run on mmcv-lite (shim.py) and registers `LaplaceViT`
(backbone.py) and `PlainCheckpointHook` (hooks.py), so your own mmseg scripts can
`import eval.mmseg` and use them in any config.
"""
import warnings

from . import shim  # noqa: F401  (before anything imports mmseg)

# mmcv-lite: mmcv's transformer bricks try the compiled deformable attention and warn; no
# model here uses it.
warnings.filterwarnings("ignore", message=".*MultiScaleDeformableAttention.*")

from .backbone import LaplaceViT  # noqa: E402,F401
from .hooks import PlainCheckpointHook  # noqa: E402,F401
