"""Frozen-backbone features of an image split, shared by `python -m eval.knn` and `python -m eval.linear`.

Two kinds, DINO's (facebookresearch/dino eval_knn.py / eval_linear.py):
    cls       what the head reads after the final norm (the class token; with global_pool=avg the
              mean patch token), L2-normalised: the k-NN feature
    last<n>   the class tokens of the last n blocks after the final norm, concatenated; `avgpool`
              appends the last block's mean normed patch token: the linear probe's feature

The backbone is `laplace.pretrained.load_backbone`'s (any laplace ViT checkpoint, or timm weights
with `model=`), frozen at the data's size. Features are cached beside the run
(`<run>/eval/features_<data>_<split>_<kind>.pt`); under torchrun every rank gets all of them.
"""
import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler

from laplace.checkpoint import run_dir_of
from laplace.pretrained import load_backbone
from train.dist import DistInfo, all_gather_object, barrier, cleanup, setup
from laplace.errors import ConfigError
from laplace.io import atomic_write, write_json
from train.rundir import check_writable, results_header
from laplace.zoo import features
from train.logger import log_to_training_run, progress_bar, progress_interval


def batch_features(model, x: torch.Tensor, kind: str = "cls", n_last_blocks: int = 4,
                   avgpool: bool = False) -> torch.Tensor:
    """Features [B, F] of images [B, 3, H, W] (see the module docstring)."""
    if kind == "cls":
        out = model.pool(model.forward_features(x)).float()  # timm: final-norm tokens, pooled as the head reads them
        return F.normalize(out, dim=-1, p=2)
    depth = len(model.blocks)
    if not 1 <= n_last_blocks <= depth:
        raise ConfigError(f"n_last_blocks={n_last_blocks}: use 1..{depth} (the model's blocks)")
    layers = list(range(depth - n_last_blocks, depth))
    # DINO's get_intermediate_layers + norm: every block's output through the final norm
    normed = [model.norm(t) for t in features(model, x, layers=layers, norm=False).values()]
    # DINO interleaves class and mean token for n=1, a permutation of the same numbers; DINOv2 appends
    out = [t[:, 0] for t in normed] + ([normed[-1][:, 1:].mean(dim=1)] if avgpool else [])
    return torch.cat(out, dim=-1).float()


def _gather_rows(local: torch.Tensor, n_total: int, info: DistInfo) -> torch.Tensor:
    """Rows of every rank back in dataset order: DistributedSampler gives rank r the samples
    r, r + W, r + 2W, ... (wrapping round to give every rank as many)."""
    if not info.distributed:
        return local
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.stack(parts, dim=1).flatten(0, 1)[:n_total]


def content_stamp(dataset, root) -> str:
    """A digest of the names, sizes and mtimes of a split's files (ImageFolder's images, the parquet
    files, else every file under data.root): images replaced in place make new features."""
    files = [p for p, _ in getattr(dataset, "samples", [])] or list(getattr(dataset, "files", [])) or \
        (sorted(str(p) for p in Path(root).rglob("*") if p.is_file()) if root else [])  # digits: no root
    h = hashlib.sha256()
    for f in files:  # a stat per file: seconds for ImageNet's 1.28 M, against minutes of features
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def cache_key(info: dict, data_cfg, split: str, kind: str, dataset, crop_pct: float) -> dict:
    """What a cached feature file must match: the weights (path, size, mtime, step), the data (its
    files' names, sizes and mtimes: content_stamp) and its evaluation transform, the feature kind
    and the number of samples."""
    # the file's size and mtime with its step: a checkpoint rewritten at the same path (a resumed
    # run's last.pt) makes new features
    path = Path(info["checkpoint"])
    st = path.stat() if path.is_file() else None
    d = OmegaConf.to_container(data_cfg, resolve=True)
    return {"version": 1, "checkpoint": str(path.resolve()), "size": st.st_size if st else None,
            "mtime_ns": st.st_mtime_ns if st else None, "step": info.get("step"), "model": info.get("model"),
            "data": d.get("name"), "root": str(d.get("root")), "split": split, "img_size": d.get("img_size"),
            "crop_pct": float(crop_pct), "mean": list(d.get("mean", [])), "std": list(d.get("std", [])),
            "kind": kind, "n": len(dataset), "content": content_stamp(dataset, d.get("root"))}


@torch.no_grad()
def extract_features(model, dataset, *, kind: str = "cls", n_last_blocks: int = 4, avgpool: bool = False,
                     device="cpu", batch_size: int = 256, num_workers: int = 0, dist_info: DistInfo | None = None,
                     cache: Path | None = None, key: dict | None = None, progress: float | None = None,
                     desc: str = "features") -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, F] float32, labels [N] int64) of `dataset`, both on `device`.

    Args:
        model: the frozen backbone (on `device`).
        dataset: yields (image tensor, int label).
        kind, n_last_blocks, avgpool: the feature (see `batch_features`).
        dist_info: the launch (train.dist.setup); None = one process.
        cache, key: a file holding this key is read instead of running the model; otherwise the
            features are computed and written there (rank 0).
        progress: None, no bar; else rank 0's bar (train.logger.progress_bar) at this interval.
    """
    info, device = dist_info or DistInfo(device=torch.device(device)), torch.device(device)
    if cache is not None and key is not None:
        try:
            hit = torch.load(cache, map_location="cpu", weights_only=True)
        except Exception:  # missing, truncated or foreign: recompute
            hit = None
        # every rank must agree: one that recomputes alone would wait forever in the all_gather below
        if all(all_gather_object(isinstance(hit, dict) and hit.get("key") == key)):
            return hit["features"].to(device), hit["labels"].to(device)
    # rank r takes the samples r, r + W, ...; one process takes them all, in order
    sampler = DistributedSampler(dataset, info.world_size, info.rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        pin_memory=device.type == "cuda")
    feats, labels = [], []
    for x, y in progress_bar(len(loader), progress is not None and info.is_main, interval=progress or 0, desc=desc,
                             unit="batch", iterable=loader):
        # bf16 on CUDA as DINO's evaluations; the features are kept in float32
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            feats.append(batch_features(model, x.to(device, non_blocking=True), kind, n_last_blocks, avgpool).float())
        labels.append(torch.as_tensor(y).to(device=device, dtype=torch.long))
    out_f = _gather_rows(torch.cat(feats), len(dataset), info)
    out_y = _gather_rows(torch.cat(labels), len(dataset), info)
    if cache is not None and key is not None:
        if info.is_main:
            obj = {"key": key, "features": out_f.cpu(), "labels": out_y.cpu()}
            atomic_write(Path(cache), lambda f: torch.save(obj, f))
        barrier()  # the other ranks return once the file is whole
    return out_f, out_y


def probe_data_node(data_cfg, crop_pct: float | None = None) -> DictConfig:
    """The data node with the probes' evaluation transform for both splits: bicubic resize of the
    short side to img_size / crop_pct, centre crop img_size."""
    d = OmegaConf.create(OmegaConf.to_container(data_cfg, resolve=True))  # a copy, interpolations resolved
    d.augment = "none"
    # crop_pct None: the node's probe_crop_pct (data=imagenet: DINO's 0.875, Resize(256) +
    # CenterCrop(224), the same ratio at other sizes), else the supervised evaluation's crop
    d.eval_crop_pct = float(d.get("probe_crop_pct", d.get("eval_crop_pct", 1.0)) if crop_pct is None else crop_pct)
    return d


def eval_features(cfg, kind: str, n_last_blocks: int = 4, avgpool: bool = False):
    """(train (features, labels), val (features, labels), info, dist_info) for the entry config
    `cfg`; info as `load_backbone`'s."""
    from laplace.data.vision import build_vision_dataset

    dist_info = setup(cfg.device)  # under torchrun: the process group, each rank its GPU
    model, info = load_backbone(cfg.checkpoint, cfg.get("model"), cfg.data.img_size, device=dist_info.device)
    d = probe_data_node(cfg.data, cfg.crop_pct)
    # the cache files' name of the kind: "cls" (k-NN) or "last<n>[_avgpool]" (the linear probe)
    name = "cls" if kind == "cls" else f"last{n_last_blocks}" + ("_avgpool" if avgpool else "")
    splits = []
    for split in ("train", "val"):
        dataset = build_vision_dataset(d, train=split == "train")
        # beside the run, so k-NN, the linear probe and a re-run share one extraction
        cache = run_dir_of(cfg.checkpoint) / "eval" / f"features_{d.name}_{split}_{name}.pt" if cfg.cache else None
        splits.append(extract_features(
            model, dataset, kind=kind, n_last_blocks=n_last_blocks, avgpool=avgpool, device=dist_info.device,
            batch_size=cfg.batch_size, num_workers=cfg.num_workers, dist_info=dist_info, cache=cache,
            key=cache_key(info, d, split, name, dataset, d.eval_crop_pct), progress=progress_interval(cfg),
            desc=f"{name} features, {d.name} {split}"))
    return splits[0], splits[1], info, dist_info


def write_results(cfg, info: dict, protocol: str, fields: dict) -> dict:
    """The results header and `fields` as results.json in run_dir, by default
    <the checkpoint's run>/eval/<protocol>_<data>/ (where analysis.tables finds it), and the
    `fields[protocol]` block in the W&B run of the checkpoint's training, if it used W&B; returns it."""
    record = {**results_header(info["node"], cfg.data.name, info["checkpoint"], protocol=protocol,
                               step=info["step"], weights=info["source"]), **fields}
    out = Path(cfg.run_dir) if cfg.run_dir else run_dir_of(info["checkpoint"]) / "eval" / f"{protocol}_{cfg.data.name}"
    write_json(out / "results.json", record)
    log_to_training_run(info["checkpoint"], record[protocol], protocol)
    return record


def run_and_clean_up(evaluate, cfg):
    """evaluate(cfg), then the process group of a torchrun launch is destroyed, whatever happened."""
    try:
        # where the results (and the feature cache) go is checked writable first, not after the work
        if cfg.run_dir:
            check_writable(cfg.run_dir, "run_dir")
        elif cfg.get("checkpoint") and Path(str(cfg.checkpoint)).is_file():
            check_writable(run_dir_of(cfg.checkpoint) / "eval", "run_dir")
        return evaluate(cfg)
    finally:
        cleanup()
