"""Frozen-backbone semantic segmentation on ADE20K, DINOv2's linear protocol (paper experiment 3).

    python -m eval.segmentation checkpoint=runs/dino/.../ckpt/last.pt data.root=/data/ade  # the paper's
    python -m eval.segmentation checkpoint=... trainer.layers=4                            # +ms: last 4 layers
    python -m eval.segmentation checkpoint=runs/deit3/digits/vitt_3L_s0/ckpt/last.pt eval=seg_digits_linear
    python -m eval.segmentation checkpoint=... iters=2000 crop_size=256 batch_size=8       # a small run

It runs `trainer=seg_linear` (train/seg_linear.py) on the training engine; the protocol's sizes
and schedule are configs/eval/seg_*.yaml. UperNet fine-tuning is not provided: docs/experiments.md.
"""
from omegaconf import DictConfig, open_dict

from laplace.checkpoint import run_dir_of
from laplace.pretrained import backbone_source
from train.cli import hydra_entry


def prepare(cfg: DictConfig) -> DictConfig:
    """The backbone's model node from the checkpoint and the run directory (both recorded in
    the run's config)."""
    # Rebuilt at the crop size: the position embedding is resampled to the training windows.
    # head=True keeps the classifier in the node (unused): the segmentation head's initialisation
    # then draws the same random numbers as in every run before.
    node = backbone_source(cfg.checkpoint, img_size=cfg.trainer.crop_size, head=True)["node"]
    with open_dict(cfg):
        cfg.model = node
        if cfg.run_dir is None:
            # Beside the backbone's run: `python -m analysis.tables` finds it with that run.
            cfg.run_dir = str(run_dir_of(cfg.checkpoint) / "eval" / f"seg_{cfg.data.name}_l{cfg.trainer.layers}")
    return cfg


@hydra_entry("segmentation")
def main(cfg: DictConfig) -> None:
    from train import run

    metrics = run(prepare(cfg))
    print("[segmentation] " + ", ".join(f"{k}={v:.2f}" for k, v in (metrics or {}).items()))


if __name__ == "__main__":
    main()
