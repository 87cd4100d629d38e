"""Frozen-backbone features of an image split, shared by `python -m eval.knn` and `python -m eval.linear`.

Two kinds of feature, DINO's (facebookresearch/dino eval_knn.py / eval_linear.py):
    cls       what the head reads after the final norm (the class token; with model.global_pool=avg
              the mean of the patch tokens), L2-normalised (k-NN)
    last<n>   the class tokens of the last n blocks, each after the final norm (DINO's
              `get_intermediate_layers` + norm), concatenated [B, n*D]; with `avgpool` the
              average of the last block's normed patch tokens is appended [B, (n+1)*D]
              (DINO interleaves the two for n=1, a permutation of the same numbers; DINOv2
              appends). DINO's ViT-S recipe is n=4 without avgpool, its ViT-B n=1 with it.

The backbone comes from any laplace checkpoint (`laplace.checkpoint.load_backbone`: a DINO
teacher backbone, a DeiT-III model with a head, ...) or from a timm / DeiT-III state dict file
with the architecture named by the `model=` config group. It is rebuilt at the data's image
size (position embeddings resampled), without head, frozen, in eval mode.

`extract_features` runs the model over a split once: each rank of a distributed launch takes
the samples rank, rank + world, ... and the rows are all-gathered back into dataset order, so
every rank ends with all features (one process works the same way). The result is cached at
`<cache_dir>/features_<data>_<split>_<kind>.pt` with a key (checkpoint path, size, mtime and
step, data and transform settings, feature kind, number of samples); a cache whose key differs
is recomputed. On CUDA the forward runs under bf16 autocast; features and labels are returned
as float32 / int64 tensors on the one device given.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader, Subset

from laplace.checkpoint import load_backbone, results_header, run_dir_of
from laplace.dist import DistInfo, all_gather_object, barrier, cleanup
from laplace.errors import ConfigError
from laplace.io import atomic_write, write_json
from laplace.rundir import check_writable
from laplace.vit import VisionTransformer
from laplace.zoo import features
from train.logger import progress_bar, progress_interval

CACHE_VERSION = 1


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


# ----------------------------------------------------------------------------- features of a batch


def feature_kind(kind: str, n_last_blocks: int = 4, avgpool: bool = False) -> str:
    """The cache-file name of a feature kind: "cls" or "last<n>[_avgpool]"."""
    if kind == "cls":
        return "cls"
    if kind != "linear":
        raise ConfigError(f"feature kind {kind!r}: use cls (k-NN) or linear")
    return f"last{n_last_blocks}" + ("_avgpool" if avgpool else "")


def batch_features(model: VisionTransformer, x: torch.Tensor, kind: str = "cls", n_last_blocks: int = 4,
                   avgpool: bool = False) -> torch.Tensor:
    """Features [B, F] of images [B, 3, H, W] (see the module docstring)."""
    if kind == "cls":
        out = model.pool(model.forward_features(x)).float()  # timm: the final-norm tokens, pooled as the head reads them
        return F.normalize(out, dim=-1, p=2)
    depth = len(model.blocks)
    if not 1 <= n_last_blocks <= depth:
        raise ConfigError(f"n_last_blocks={n_last_blocks}: use 1..{depth} (the model's blocks)")
    layers = list(range(depth - n_last_blocks, depth))
    feats = features(model, x, layers=layers, norm=False)
    normed = [model.norm(feats[f"blocks.{i}"]) for i in layers]
    out = [t[:, 0] for t in normed]
    if avgpool:
        out.append(normed[-1][:, 1:].mean(dim=1))
    return torch.cat(out, dim=-1).float()


# ----------------------------------------------------------------------------- a whole split


def _gather_rows(local: torch.Tensor, n_total: int, info: DistInfo) -> torch.Tensor:
    """Rows of every rank in dataset order; rank r holds samples r, r + W, r + 2W, ..."""
    if not info.distributed:
        return local
    world = info.world_size
    m = math.ceil(n_total / world)
    pad = local.new_zeros((m - local.shape[0], *local.shape[1:]))
    padded = torch.cat((local, pad)).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.stack(parts, dim=1).reshape(m * world, *local.shape[1:])[:n_total]


def cache_key(info: dict, data_cfg, split: str, kind: str, n: int, crop_pct: float) -> dict:
    """What a cached feature file must match: the weights (path, size, mtime, step), the data and
    its evaluation transform, the feature kind and the number of samples."""
    path = Path(info["checkpoint"])
    st = path.stat() if path.is_file() else None
    d = _plain(data_cfg)
    return {"version": CACHE_VERSION, "checkpoint": str(path.resolve()), "size": st.st_size if st else None,
            "mtime_ns": st.st_mtime_ns if st else None, "step": info.get("step"), "model": info.get("model"),
            "data": d.get("name"), "root": str(d.get("root")), "split": split, "img_size": d.get("img_size"),
            "crop_pct": float(crop_pct), "mean": list(d.get("mean", [])), "std": list(d.get("std", [])),
            "kind": kind, "n": int(n)}


def _load_cache(path: Path, key: dict, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not path.is_file():
        return None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a truncated or foreign file: recompute
        return None
    if not isinstance(obj, dict) or obj.get("key") != key:
        return None
    return obj["features"].to(device), obj["labels"].to(device)


def _save_cache(path: Path, key: dict, feats: torch.Tensor, labels: torch.Tensor) -> None:
    obj = {"key": key, "features": feats.cpu(), "labels": labels.cpu()}
    atomic_write(path, lambda f: torch.save(obj, f))


@torch.no_grad()
def extract_features(model: nn.Module, dataset, *, kind: str = "cls", n_last_blocks: int = 4,
                     avgpool: bool = False, device: Any = "cpu", batch_size: int = 256, num_workers: int = 0,
                     dist_info: DistInfo | None = None, cache: Path | None = None,
                     key: dict | None = None, progress: float | None = None,
                     desc: str = "features") -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, F] float32, labels [N] int64) of `dataset`, both on `device`.

    Args:
        model: the frozen backbone (on `device`).
        dataset: yields (image tensor, int label).
        kind, n_last_blocks, avgpool: the feature (see `batch_features`).
        dist_info: the launch (laplace.dist.setup); None = one process.
        cache: the cache file; with `key`, a file holding the same key is returned without
            running the model, otherwise the features are computed and written (rank 0).
        progress: None, no bar; else rank 0 shows one over the batches (train.logger.progress_bar,
            a plain line every `progress` seconds where stderr is no terminal).
    """
    info = dist_info or DistInfo(device=torch.device(device))
    device = torch.device(device)
    use_cache = cache is not None and key is not None
    if use_cache:
        hit = _load_cache(Path(cache), key, device)
        if all(all_gather_object(hit is not None)):  # every rank found it valid
            return hit
    shard = Subset(dataset, range(info.rank, len(dataset), info.world_size))
    loader = DataLoader(shard, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                        pin_memory=device.type == "cuda", drop_last=False)
    feats, labels = [], []
    bar = progress_bar(len(loader), progress is not None and info.is_main, interval=progress or 0, desc=desc,
                       unit="batch", iterable=loader)
    for x, y in bar:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            f = batch_features(model, x, kind, n_last_blocks, avgpool)
        feats.append(f.float())
        labels.append(torch.as_tensor(y).to(device=device, dtype=torch.long))
    dim = feats[0].shape[1] if feats else batch_features(model, dataset[0][0][None].to(device), kind,
                                                         n_last_blocks, avgpool).shape[1]
    local_f = torch.cat(feats) if feats else torch.zeros(0, dim, device=device)
    local_y = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=device)
    out_f, out_y = _gather_rows(local_f, len(dataset), info), _gather_rows(local_y, len(dataset), info)
    if use_cache:
        if info.is_main:
            _save_cache(Path(cache), key, out_f, out_y)
        barrier()
    return out_f, out_y


def probe_data_node(data_cfg, crop_pct: float | None = None) -> DictConfig:
    """The data node with the k-NN / linear evaluation transform for both splits: bicubic
    resize of the short side to img_size / crop_pct, centre crop img_size. `crop_pct` None:
    the node's `probe_crop_pct` (data=imagenet: DINO's 0.875, Resize(256) + CenterCrop(224),
    the same ratio at other sizes), else its `eval_crop_pct` (the supervised evaluation's)."""
    d = OmegaConf.create(_plain(data_cfg))
    d.augment = "none"
    if crop_pct is None:
        crop_pct = d.get("probe_crop_pct", d.get("eval_crop_pct", 1.0))
    d.eval_crop_pct = float(crop_pct)
    return d


def split_features(model, info: dict, data_cfg, split: str, *, kind: str, n_last_blocks: int, avgpool: bool,
                   crop_pct: float | None, device, batch_size: int, num_workers: int,
                   dist_info: DistInfo | None, cache_dir: Path | None,
                   progress: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of the `split` ("train" / "val") of the data node, with the probes' evaluation
    transform (`probe_data_node`), cached under `cache_dir`."""
    from laplace.data.vision import build_vision_dataset

    d = probe_data_node(data_cfg, crop_pct)
    dataset = build_vision_dataset(d, train=split == "train")
    name = feature_kind(kind, n_last_blocks, avgpool)
    cache = key = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"features_{d.name}_{split}_{name}.pt"
        key = cache_key(info, d, split, name, len(dataset), d.get("eval_crop_pct", 1.0))
    return extract_features(model, dataset, kind=kind, n_last_blocks=n_last_blocks, avgpool=avgpool, device=device,
                            batch_size=batch_size, num_workers=num_workers, dist_info=dist_info, cache=cache, key=key,
                            progress=progress, desc=f"{name} features, {d.name} {split}")


def eval_features(cfg, kind: str, n_last_blocks: int = 4, avgpool: bool = False):
    """Everything an entry point needs: (train (features, labels), val (features, labels), info,
    dist_info) for the entry config `cfg` (checkpoint, model, data, device, batch_size,
    num_workers, crop_pct, cache, run_dir); info as `load_backbone`'s."""
    from laplace.dist import setup

    dist_info = setup(cfg.device)
    model, info = load_backbone(cfg.checkpoint, cfg.get("model"), cfg.data.img_size, device=dist_info.device)
    cache_dir = (run_dir_of(cfg.checkpoint) / "eval") if cfg.cache else None
    common = dict(kind=kind, n_last_blocks=n_last_blocks, avgpool=avgpool, crop_pct=cfg.crop_pct,
                  device=dist_info.device, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                  dist_info=dist_info, cache_dir=cache_dir, progress=progress_interval(cfg))
    train = split_features(model, info, cfg.data, "train", **common)
    val = split_features(model, info, cfg.data, "val", **common)
    return train, val, info, dist_info


def write_results(cfg, info: dict, protocol: str, fields: dict) -> dict:
    """The results header and `fields` as results.json (atomic) in run_dir, by default
    <the checkpoint's run>/eval/<protocol>_<data>/; returns the record."""
    record = {**results_header(info["node"], cfg.data.name, info["checkpoint"], protocol=protocol,
                               step=info["step"], weights=info["source"]), **fields}
    out = Path(cfg.run_dir) if cfg.run_dir else run_dir_of(info["checkpoint"]) / "eval" / f"{protocol}_{cfg.data.name}"
    write_json(out / "results.json", record)
    return record


def run_and_clean_up(evaluate, cfg):
    """evaluate(cfg), then the process group of a torchrun launch is destroyed, whatever happened.
    Where the results (and the feature cache) go is checked writable first, not after the work."""
    try:
        if cfg.run_dir:
            check_writable(cfg.run_dir, "run_dir")
        elif cfg.get("checkpoint") and Path(str(cfg.checkpoint)).is_file():
            check_writable(run_dir_of(cfg.checkpoint) / "eval", "run_dir")
        return evaluate(cfg)
    finally:
        cleanup()
