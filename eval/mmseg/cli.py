"""What `python -m eval.mmseg.train` and `.test` share: arguments and the config they run.

On top of mmseg's tools/train.py, the config gets:
  - `--cfg-options data_root=DIR` reaches every dataloader's dataset (mmengine substitutes
    `data_root` when the file is read, so overriding the variable alone would change nothing);
    DIR may be the ADEChallengeData2016 folder or its parent, as everywhere in laplace;
  - `builtin_digits = True` (configs/mmseg/digits_linear.py): the digits set is written there;
  - `PlainCheckpointHook` in custom_hooks if the config lacks it (eval/mmseg/hooks.py: without
    it, torch's weights_only default refuses mmengine's checkpoints, so --resume fails);
  - the heads' input widths set from a LaplaceViT backbone's width (a ViT-S config runs a
    ViT-T checkpoint unchanged);
  - the work dir, when not given: beside the backbone checkpoint's run,
    `<run>/eval/mmseg_<config name>` (as eval.segmentation's runs), else
    `runs/mmseg/<config name>`. No timestamp: the same command with --resume continues it.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from mmengine.config import Config, DictAction

from laplace.data import DatasetNotFoundError
from laplace.errors import ConfigError


def parser(description: str, checkpoint: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("config", help="an mmseg config, e.g. configs/mmseg/ade20k_linear.py")
    if checkpoint:
        p.add_argument("checkpoint", help="an mmseg checkpoint written by eval.mmseg.train (iter_N.pth)")
    p.add_argument("--work-dir", help="where logs and checkpoints go (default: see eval/mmseg/cli.py)")
    p.add_argument("--cfg-options", nargs="+", action=DictAction, default={},
                   help="key=value overrides merged into the config, e.g. "
                        "model.backbone.checkpoint=PATH data_root=DIR train_cfg.max_iters=2000")
    p.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none",
                   help="job launcher (pytorch: under torchrun)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0)
    return p


def _dataloaders(cfg: Config):
    return [cfg[k] for k in ("train_dataloader", "val_dataloader", "test_dataloader") if cfg.get(k)]


def _set_data_root(cfg: Config, root: str):
    from laplace.data.ade20k import FOLDER

    path = Path(root).expanduser()
    if (path / FOLDER).is_dir() or (cfg.get("builtin_digits") and path.name != FOLDER):
        path = path / FOLDER  # the parent of ADEChallengeData2016 was given
    cfg.data_root = str(path)
    for loader in _dataloaders(cfg):
        loader.dataset.data_root = str(path)


def _backbone_width(backbone) -> int:
    from laplace.checkpoint import load_checkpoint
    from laplace.zoo import model_defaults

    model = dict(backbone.get("model") or {})
    if backbone.get("checkpoint"):
        return load_checkpoint(backbone.checkpoint)["config"]["model"]["embed_dim"]
    return model.get("embed_dim") or model_defaults(model["name"])["embed_dim"]


def _match_widths(cfg: Config):
    """in_channels of the neck, or of the heads without one, from the LaplaceViT's width."""
    m = cfg.model
    if m.get("backbone", {}).get("type") != "LaplaceViT":
        return
    if not (m.backbone.get("checkpoint") or (m.backbone.get("model") or {}).get("name")):
        raise ConfigError("the LaplaceViT backbone needs a checkpoint: pass "
                          "--cfg-options model.backbone.checkpoint=PATH (a laplace checkpoint of a ViT)")
    width, n = _backbone_width(m.backbone), len(m.backbone.out_indices)
    if m.get("neck"):
        m.neck.in_channels = [width] * n
        return
    for head in (m.get("decode_head"), m.get("auxiliary_head")):
        if head is None:
            continue
        if isinstance(head.in_channels, (list, tuple)):
            head.in_channels = [width] * len(head.in_channels)
        else:
            head.in_channels = width
        if head.type == "BNHead":
            head.pop("channels", None)  # BNHead's width is its input's


def load_config(args) -> Config:
    """The config file, the --cfg-options and the rules of the module docstring."""
    os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    cfg.merge_from_dict(args.cfg_options)
    if "data_root" in args.cfg_options or cfg.get("builtin_digits"):
        _set_data_root(cfg, args.cfg_options.get("data_root", cfg.data_root))
    if cfg.get("builtin_digits"):
        from laplace.data.ade20k import write_digits_ade20k

        write_digits_ade20k(Path(cfg.data_root).parent)  # idempotent: a marker says it is complete
    for loader in _dataloaders(cfg):  # a missing folder: one line naming it, before any build
        ds = loader.dataset
        folders = [Path(ds.get("data_root") or ".") / p for p in (ds.get("data_prefix") or {}).values()]
        missing = [str(f) for f in folders if not f.is_dir()]
        if missing:
            raise DatasetNotFoundError(
                f"no folder {missing[0]}: for ADE20K unzip ADEChallengeData2016.zip "
                f"(http://sceneparsing.csail.mit.edu) and pass --cfg-options data_root=DIR "
                f"(ADEChallengeData2016 or the folder holding it)")
    _match_widths(cfg)
    hooks = cfg.setdefault("custom_hooks", [])
    if not any(h.get("type") == "PlainCheckpointHook" for h in hooks):
        hooks.append(dict(type="PlainCheckpointHook"))
    name = Path(args.config).stem
    if args.work_dir:
        cfg.work_dir = args.work_dir
    elif not cfg.get("work_dir"):
        ckpt = cfg.model.get("backbone", {}).get("checkpoint")
        if ckpt:
            path = Path(ckpt)
            run = path.parent.parent if path.parent.name == "ckpt" else path.parent
            cfg.work_dir = str(run / "eval" / f"mmseg_{name}")
        else:
            cfg.work_dir = str(Path("runs") / "mmseg" / name)
    return cfg
