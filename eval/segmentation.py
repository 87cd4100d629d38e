"""Frozen-backbone semantic segmentation, DINOv2's linear protocol, on ADE20K (paper experiment 3).

    python -m eval.segmentation checkpoint=runs/dino/.../ckpt/last.pt data.root=/data/ade
    python -m eval.segmentation checkpoint=... eval=seg_ade20k_linear trainer.layers=4   # +ms: last 4 layers
    python -m eval.segmentation checkpoint=runs/deit3/digits/vitt_3L_s0/ckpt/last.pt eval=seg_digits_linear
    python -m eval.segmentation checkpoint=... iters=2000 crop_size=256 batch_size=8       # a small run

The backbone is rebuilt from the checkpoint (`laplace.checkpoint.load_backbone`) at the crop size (position
embeddings resampled) and frozen; its patch tokens after the final norm (of the last block, or
of the last 4 concatenated: `trainer.layers`, as DINOv2's published ViT-S/14 linear heads,
which take patch channels only, 4 x 384 for +ms; the option `trainer.cls_token` also appends
the class token to each patch) feed a batch norm + 1x1 convolution whose logits are bilinearly
upsampled to the image. Training: mmseg's ADE20K pipeline (laplace/data/ade20k.py) on 512
crops, AdamW lr 1e-3, wd 1e-4, linear warm-up over 1,500 iterations then poly decay with power
1 (linear to 0), 40k iterations at batch 16 (reached by accumulation on fewer GPUs).
Evaluation: sliding windows (512, stride 341) over the image resized to a 512 short side, the
logits resized to the full annotation, mIoU over the 150 classes with "other" ignored.

It runs the loop's `trainer=seg_linear` (train/seg_linear.py: head, loss, sliding windows, on
the shared engine: resume, preemption, DDP, bf16, logging); the run directory sits beside the checkpoint's run,
`<run>/eval/seg_<data>_<layers>` (so `python -m analysis.tables` finds it with the run), and its
results.json holds mIoU, aAcc, mAcc and the per-class IoU. The checkpoint it writes exports the
backbone (what `load_model` returns), the head is its `train_model`.
"""
from __future__ import annotations

from omegaconf import DictConfig, open_dict

from laplace.checkpoint import backbone_node, run_dir_of
from laplace.cli import hydra_entry


def prepare(cfg: DictConfig) -> DictConfig:
    """The backbone's model node from the checkpoint (at the crop size) and the run directory
    beside the checkpoint's run."""
    node = backbone_node(cfg.checkpoint, img_size=cfg.trainer.crop_size, head=True)
    with open_dict(cfg):
        cfg.model = node
        if cfg.run_dir is None:
            cfg.run_dir = str(run_dir_of(cfg.checkpoint) / "eval" / f"seg_{cfg.data.name}_l{cfg.trainer.layers}")
    return cfg


def evaluate_segmentation(cfg: DictConfig) -> dict:
    from train import run

    return run(prepare(cfg))


@hydra_entry("segmentation")
def main(cfg: DictConfig) -> None:
    metrics = evaluate_segmentation(cfg)
    print("[segmentation] " + ", ".join(f"{k}={v:.2f}" for k, v in (metrics or {}).items()))


if __name__ == "__main__":
    main()
