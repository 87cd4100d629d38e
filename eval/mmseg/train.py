"""Train an mmseg model with our ViT, like mmseg's tools/train.py (mmengine's Runner).

    python -m eval.mmseg.train configs/mmseg/ade20k_upernet.py \
        --cfg-options model.backbone.checkpoint=runs/dino/.../ckpt/last.pt data_root=/data/ade
    python -m eval.mmseg.train configs/mmseg/ade20k_upernet.py --work-dir /tmp/seg \
        --cfg-options model.backbone.checkpoint=PATH data_root=DIR train_cfg.max_iters=50
    torchrun --nproc-per-node 8 -m eval.mmseg.train CONFIG --launcher pytorch --cfg-options ...
    python -m eval.mmseg.train CONFIG --work-dir DIR --resume      # continue DIR's last checkpoint
    python -m eval.mmseg.train CONFIG --cfg-options optim_wrapper.type=AmpOptimWrapper \
        optim_wrapper.loss_scale=dynamic ...                       # mixed precision (mmseg's --amp)

Work dir, data_root and head widths: eval/mmseg/cli.py. Checkpoints: DIR/iter_N.pth (mmengine's
format; DIR/last_checkpoint names the newest); `python -m eval.mmseg.test CONFIG DIR/iter_N.pth`
evaluates one.
"""
from __future__ import annotations

from mmengine.runner import Runner

from eval.mmseg import cli  # applies the mmcv shim and registers LaplaceViT
from laplace.errors import cli_errors


def main(argv=None):
    p = cli.parser("Train an mmseg segmentor with a laplace ViT backbone")
    p.add_argument("--resume", action="store_true", help="continue from the work dir's last checkpoint")
    args = p.parse_args(argv)
    cfg = cli.load_config(args)
    cfg.resume = args.resume
    Runner.from_cfg(cfg).train()


if __name__ == "__main__":
    cli_errors(main)()  # a bad path or option: one line, not a traceback
