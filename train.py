"""Train any paper model with one command (Hydra entry point).

    python train.py                                          # tiny ViT on the built-in digits
    python train.py model=vits_5L data=cifar100 data.root=/data/cifar
    python train.py experiment=deit3_in1k model=vitb_12L     # a paper row
    python -m train.launch --nproc_per_node=8 train.py experiment=deit3_in1k model=vitb_12L

One node's GPUs through train.launch, not torchrun: torchrun exits 1 when the run stops on a
preemption signal, so a Slurm job around it is never requeued (train/launch.py); several nodes:
slurm/train.sbatch.

The run directory is named from the command line (no timestamp): running the same command
again resumes the run from runs/.../ckpt/last.pt. Exit status: 0 done (or stopped by
trainer.stop_after), 1 an error (bad input: one `error:` line; a bug: its traceback), 75 stopped
by SIGUSR1 / SIGTERM after writing last.pt, to be requeued (train/signals.py).
"""
from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from train import run
from train.cli import hydra_entry


@hydra_entry("config")
def main(cfg: DictConfig) -> dict:
    return run(cfg, HydraConfig.get().overrides.task)  # the overrides name the run directory


if __name__ == "__main__":
    main()
