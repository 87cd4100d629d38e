"""Evaluate an mmseg checkpoint, like mmseg's tools/test.py (mIoU, aAcc, mAcc on the test split).

    python -m eval.mmseg.test configs/mmseg/ade20k_upernet.py WORK_DIR/iter_160000.pth \
        --cfg-options model.backbone.checkpoint=runs/dino/.../ckpt/last.pt data_root=/data/ade

The config's backbone checkpoint rebuilds the model's shapes; the weights then come from the
mmseg checkpoint. Metrics are printed and written to WORK_DIR/<timestamp>/<timestamp>.json.
"""
from __future__ import annotations

from mmengine.runner import Runner

from eval.mmseg import cli  # applies the mmcv shim and registers LaplaceViT
from laplace.errors import cli_errors


def main(argv=None):
    args = cli.parser("Evaluate an mmseg segmentor with a laplace ViT backbone", checkpoint=True).parse_args(argv)
    cfg = cli.load_config(args)
    cfg.load_from = args.checkpoint
    return Runner.from_cfg(cfg).test()


if __name__ == "__main__":
    cli_errors(main)()  # a bad path or option: one line, not a traceback
