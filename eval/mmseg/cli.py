"""What `python -m eval.mmseg.train` and `.test` share: their arguments and the config they run.

On top of mmseg's tools/train.py, the config gets:
  - `--cfg-options data_root=DIR` in every dataloader's dataset (DIR: ADEChallengeData2016 or the
    folder holding it); a missing data folder is a one-line error;
  - the heads' input widths from the LaplaceViT's width (a ViT-S config runs a ViT-B checkpoint);
  - `PlainCheckpointHook` (hooks.py: without it `--resume` fails under torch's weights_only);
  - a work dir beside the backbone checkpoint's run, `<run>/eval/mmseg_<config name>` (else
    `runs/mmseg/<config name>`), with no timestamp: the same command with --resume continues it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mmengine.config import Config, DictAction

from laplace.checkpoint import run_dir_of
from laplace.pretrained import backbone_source
from laplace.data import DatasetNotFoundError
from laplace.data.ade20k import FOLDER
from laplace.errors import ConfigError
from laplace.zoo import model_defaults


def parser(description: str, checkpoint: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("config", help="an mmseg config, e.g. configs/mmseg/ade20k_upernet.py")
    if checkpoint:
        p.add_argument("checkpoint", help="an mmseg checkpoint written by eval.mmseg.train (iter_N.pth)")
    p.add_argument("--work-dir", help="where logs and checkpoints go (default: see eval/mmseg/cli.py)")
    p.add_argument("--cfg-options", nargs="+", action=DictAction, default={},  # e.g. train_cfg.max_iters=2000
                   help="key=value overrides, e.g. model.backbone.checkpoint=PATH data_root=DIR")
    p.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none", help="pytorch: torchrun")
    return p


def _match_widths(model):
    """in_channels of the neck, or of the heads without one, set to the LaplaceViT's width."""
    # mmseg's configs name the heads' widths; ours follow the checkpoint, so one config serves
    # ViT-S and ViT-B alike (a neck maps the backbone's width to its own for the heads).
    bb = model.backbone
    node = dict(bb.get("model") or {})
    if bb.get("checkpoint"):
        width = backbone_source(bb.checkpoint, node)["node"]["embed_dim"]  # one-line errors for a bad file
    elif "name" in node:
        width = node.get("embed_dim") or model_defaults(node["name"])["embed_dim"]
    else:
        raise ConfigError("the LaplaceViT backbone needs a checkpoint: pass --cfg-options "
                          "model.backbone.checkpoint=PATH (a laplace checkpoint of a ViT)")
    for m in [model.neck] if model.get("neck") else [model.get("decode_head"), model.get("auxiliary_head")]:
        if m is not None:
            m.in_channels = [width] * len(m.in_channels) if isinstance(m.in_channels, (list, tuple)) else width


def load_config(args) -> Config:
    """The config file, the --cfg-options and the additions of the module docstring."""
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    cfg.merge_from_dict(args.cfg_options)
    datasets = [cfg[k].dataset for k in ("train_dataloader", "val_dataloader", "test_dataloader") if cfg.get(k)]
    if "data_root" in args.cfg_options:
        # mmengine substituted the variable when it read the file: set it where it was used.
        root = Path(args.cfg_options["data_root"]).expanduser()
        root = root / FOLDER if (root / FOLDER).is_dir() else root
        for ds in datasets:
            ds.data_root = str(root)
    for ds in datasets:  # a missing folder: one line naming it, before anything is built
        for prefix in (ds.get("data_prefix") or {}).values():
            folder = Path(ds.get("data_root") or ".") / prefix
            if not folder.is_dir():
                raise DatasetNotFoundError(
                    f"no folder {folder}: for ADE20K unzip "
                    f"ADEChallengeData2016.zip (http://sceneparsing.csail.mit.edu) and pass "
                    f"--cfg-options data_root=DIR (ADEChallengeData2016 or the folder holding it)")
    if cfg.model.get("backbone", {}).get("type") == "LaplaceViT":  # other backbones: mmseg's config as it is
        _match_widths(cfg.model)
    # Without it torch's weights_only default refuses mmengine's checkpoints: --resume fails.
    if not any(h.get("type") == "PlainCheckpointHook" for h in cfg.setdefault("custom_hooks", [])):
        cfg.custom_hooks.append(dict(type="PlainCheckpointHook"))
    # No timestamp in the work dir: the same command with --resume continues it.
    name, ckpt = Path(args.config).stem, cfg.model.get("backbone", {}).get("checkpoint")
    if args.work_dir or not cfg.get("work_dir"):
        default = run_dir_of(ckpt) / "eval" / f"mmseg_{name}" if ckpt else Path("runs") / "mmseg" / name
        cfg.work_dir = str(args.work_dir or default)
    return cfg
