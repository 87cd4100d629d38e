"""mmengine checkpoints that load under torch's `weights_only=True` default, resume included.

`python -m eval.mmseg.train` adds `PlainCheckpointHook` to every config; a checkpoint written
without it needs TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 to load, and only if you trust it.
"""
from __future__ import annotations

import numpy as np
from mmengine.hooks import Hook
from mmengine.logging import HistoryBuffer
from mmengine.utils import apply_to
from mmseg.registry import HOOKS

# torch >= 2.6 loads with weights_only=True by default and mmengine 0.10.7 calls torch.load without
# the argument. Its checkpoints hold the message hub's log history as HistoryBuffer objects (numpy
# arrays inside) and numpy scalars (the ETA), so `Runner(resume=True)`, `load_from` and mmseg's
# `init_model` fail: "Unsupported global: HistoryBuffer" (mmengine issue 1655). Allow-listing them
# would also allow numpy's `_reconstruct` and `builtins.getattr`, what weights_only exists to
# refuse. So the hook writes the hub as plain data (a HistoryBuffer as a tagged dict of lists,
# numpy values as Python numbers) and rebuilds the HistoryBuffers after loading.
_TAG = "__history_buffer__"


def _plain(obj):
    """A copy of obj with HistoryBuffers as tagged dicts and numpy values as Python data."""

    def plain(v):
        if isinstance(v, HistoryBuffer):
            log, count = v.data
            return {_TAG: True, "log": log.tolist(), "count": count.tolist(), "max_length": v.max_length}
        return v.tolist()  # a numpy array or scalar

    # mmengine's apply_to walks the dicts, lists and tuples (a new object: the live hub is untouched)
    return apply_to(obj, lambda v: isinstance(v, (HistoryBuffer, np.ndarray, np.generic)), plain)


def _rebuild(obj):
    if isinstance(obj, dict):
        if obj.get(_TAG):
            return HistoryBuffer(obj["log"], obj["count"], obj["max_length"])
        return type(obj)((k, _rebuild(v)) for k, v in obj.items())
    return obj


@HOOKS.register_module()
class PlainCheckpointHook(Hook):
    """Writes the message hub as plain data and restores it on load (module docstring)."""

    priority = "VERY_LOW"  # last before a save: after every hook that adds to the checkpoint

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        for key in ("message_hub", "meta"):
            if key in checkpoint:
                checkpoint[key] = _plain(checkpoint[key])

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        if "message_hub" in checkpoint:
            checkpoint["message_hub"] = _rebuild(checkpoint["message_hub"])
