"""Train any paper model with one command (Hydra entry point).

    python train.py                                          # tiny ViT on the built-in digits
    python train.py model=vits_5L data=cifar100 data.root=/data/cifar
    python train.py experiment=deit3_in1k model=vitb_12L     # a paper row
    torchrun --nproc_per_node=8 train.py experiment=deit3_in1k model=vitb_12L

The run directory is named from the command line (no timestamp): running the same command
again resumes the run from runs/.../ckpt/last.pt.
"""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from laplace.checkpoint import CheckpointError
from laplace.config import register_model_configs
from laplace.data import DatasetNotFoundError
from laplace.zoo import UnknownModelError
from train import run, run_dir_from_overrides

# Errors of bad input (config keys, paths, checkpoints) are shown as one line, not a traceback;
# HYDRA_FULL_ERROR=1 shows the traceback.
USER_ERRORS = (UnknownModelError, DatasetNotFoundError, CheckpointError, ValueError)


def _one_line_errors(fn):
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            sys.exit(f"error: {e}")
    return wrapped


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> dict:
    if cfg.run_dir is None:
        with open_dict(cfg):
            cfg.run_dir = run_dir_from_overrides(cfg, list(HydraConfig.get().overrides.task))
    return _one_line_errors(run)(cfg)


if __name__ == "__main__":
    _one_line_errors(register_model_configs)()
    main()
