"""Linear probe on frozen features, DINO's protocol (facebookresearch/dino eval_linear.py) on cached features.

    python -m eval.linear checkpoint=runs/dino/imagenet/vits_0L_s0/ckpt/last.pt data=imagenet data.root=/data/imagenet
    python -m eval.linear checkpoint=runs/deit3/digits/vitt_0L_s0/ckpt/last.pt         # data=digits, any trainer's ViT
    python -m eval.linear checkpoint=... n_last_blocks=1 avgpool=true                  # DINO's ViT-B features
    torchrun --nproc_per_node=8 -m eval.linear checkpoint=... data=imagenet            # extraction split over ranks

A grid of learning rates is trained at once on the cached features (eval/features.py); the lr is
chosen on a held-out part of the TRAINING set, then retrained on all of it and scored on the
validation split. Deviations from DINO (no augmentation, selection on held-out training data):
configs/linear.yaml. results.json (`<run>/eval/linear_<data>/`) holds the grid and `linear: {top1,
top5, lr, base_lr, heldout_top1}`; analysis.tables reads `linear.top1`.
"""
import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from train.cli import hydra_entry
from laplace.errors import ConfigError

from .features import eval_features, run_and_clean_up, write_results


def train_grid(feats: torch.Tensor, labels: torch.Tensor, lrs, num_classes: int, epochs: int, batch_size: int,
               momentum: float, weight_decay: float, seed: int) -> nn.ModuleList:
    """One linear head per lr in `lrs` (absolute), all trained on the same shuffled batches."""
    # a CPU generator orders the batches, so the order is the same on every device
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the heads' initialisation
    heads = nn.ModuleList(nn.Linear(feats.shape[1], num_classes) for _ in lrs).to(feats.device)
    for h in heads:  # DINO's LinearClassifier: no batch norm, weights N(0, 0.01), bias 0
        nn.init.normal_(h.weight, mean=0.0, std=0.01)
        nn.init.zeros_(h.bias)
    # one parameter group per head: each its own lr, one optimizer step for the grid
    opt = torch.optim.SGD([{"params": h.parameters(), "lr": float(lr)} for h, lr in zip(heads, lrs)],
                          lr=float(lrs[0]), momentum=momentum, weight_decay=weight_decay)
    for e in range(epochs):
        scale = 0.5 * (1 + math.cos(math.pi * e / epochs))  # DINO's per-epoch CosineAnnealingLR to 0
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = float(lr) * scale
        order = torch.randperm(len(feats), generator=g).to(feats.device)
        for s in range(0, len(feats), batch_size):
            idx = order[s:s + batch_size]
            x = feats[idx]
            logits = torch.stack([h(x) for h in heads])  # [L, b, C]
            # one pass over the features for the whole grid (as DINOv2): the heads share no
            # parameter, so the gradient of the sum is each head's own loss gradient
            loss = F.cross_entropy(logits.flatten(0, 1), labels[idx].repeat(len(lrs)), reduction="sum") / len(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return heads


@torch.no_grad()
def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(top-1, top-5) in % of logits [B, C]; a diverged (non-finite) head scores 0, so it is never chosen."""
    if len(labels) == 0 or not torch.isfinite(logits).all():
        return 0.0, 0.0
    hit = logits.topk(min(5, logits.shape[1]), dim=1).indices.eq(labels[:, None])
    return 100.0 * hit[:, 0].float().mean().item(), 100.0 * hit.any(dim=1).float().mean().item()


def linear_probe(train_feats, train_labels, val_feats, val_labels, base_lrs, num_classes: int, *, epochs: int = 100,
                 batch_size: int = 1024, momentum: float = 0.9, weight_decay: float = 0.0, val_fraction: float = 0.1,
                 retrain: bool = True, seed: int = 0) -> dict:
    """The whole protocol on features; the validation split is touched only by the final head.

    Returns {"grid": [{base_lr, lr, heldout_top1, heldout_top5}], "chosen": index, "base_lr", "lr",
    "heldout_top1", "top1", "top5", "retrained", "n_fit", "n_heldout"}.
    """
    if not base_lrs:
        raise ConfigError("lr_grid is empty: give at least one base lr")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction}: use a share of the training set in (0, 1)")
    lrs = [float(b) * batch_size / 256 for b in base_lrs]  # DINO: lr = base x batch / 256
    # the lr is chosen on a seeded held-out part of the TRAINING set, never on the validation split
    perm = torch.randperm(len(train_feats), generator=torch.Generator().manual_seed(seed)).to(train_feats.device)
    n_hold = max(1, int(round(len(train_feats) * val_fraction)))
    fit, hold = perm[n_hold:], perm[:n_hold]
    train = dict(num_classes=num_classes, epochs=epochs, batch_size=batch_size, momentum=momentum,
                 weight_decay=weight_decay, seed=seed)
    heads = train_grid(train_feats[fit], train_labels[fit], lrs, **train)
    with torch.no_grad():
        scores = [accuracy(h(train_feats[hold]), train_labels[hold]) for h in heads]
    # top-1 first, then top-5; ties go to the smaller lr (the first in the grid)
    chosen = max(range(len(lrs)), key=lambda i: (scores[i][0], scores[i][1], -i))
    # retrain: the chosen lr on the whole training set, as a grid of one
    head = train_grid(train_feats, train_labels, [lrs[chosen]], **train)[0] if retrain else heads[chosen]
    with torch.no_grad():
        top1, top5 = accuracy(head(val_feats), val_labels)
    return {"grid": [{"base_lr": float(b), "lr": lr, "heldout_top1": s[0], "heldout_top5": s[1]}
                     for b, lr, s in zip(base_lrs, lrs, scores)],
            "chosen": chosen, "base_lr": float(base_lrs[chosen]), "lr": lrs[chosen], "heldout_top1": scores[chosen][0],
            "top1": top1, "top5": top5, "retrained": bool(retrain), "n_fit": len(fit), "n_heldout": len(hold)}


def evaluate_linear(cfg: DictConfig) -> dict:
    """Extract (or reuse) the features, run the probe on rank 0, write results.json; returns it."""
    if int(cfg.epochs) < 1 or int(cfg.train_batch_size) < 1:
        raise ConfigError(f"epochs={cfg.epochs}, train_batch_size={cfg.train_batch_size}: both must be >= 1")
    (xtr, ytr), (xva, yva), info, dist_info = eval_features(cfg, "linear", int(cfg.n_last_blocks), bool(cfg.avgpool))
    if not dist_info.is_main:  # the probe is small: one process trains it
        return {}
    r = linear_probe(xtr, ytr, xva, yva, list(cfg.lr_grid), int(cfg.data.num_classes), epochs=int(cfg.epochs),
                     batch_size=int(cfg.train_batch_size), momentum=float(cfg.momentum),
                     weight_decay=float(cfg.weight_decay), val_fraction=float(cfg.val_fraction),
                     retrain=bool(cfg.retrain), seed=int(cfg.seed))
    for row in r["grid"]:
        mark = "  <- chosen" if row["base_lr"] == r["base_lr"] else ""
        print(f"[linear] base lr {row['base_lr']:g} (lr {row['lr']:g}): held-out top1 {row['heldout_top1']:.2f}{mark}")
    print(f"[linear] val top1 {r['top1']:.2f}  top5 {r['top5']:.2f} (lr {r['lr']:g}, "
          f"{'retrained on the full train set' if r['retrained'] else 'the chosen head'})")
    return write_results(cfg, info, "linear", {
        "n_last_blocks": int(cfg.n_last_blocks), "avgpool": bool(cfg.avgpool), "feature_dim": xtr.shape[1],
        "epochs": int(cfg.epochs), "train_batch_size": int(cfg.train_batch_size), "seed": int(cfg.seed),
        "val_fraction": float(cfg.val_fraction), "retrained": r["retrained"], "augmentation": "none (cached)",
        "n_train": len(xtr), "n_val": len(xva), "n_fit": r["n_fit"], "n_heldout": r["n_heldout"], "grid": r["grid"],
        "linear": {k: r[k] for k in ("top1", "top5", "lr", "base_lr", "heldout_top1")}})


@hydra_entry("linear")
def main(cfg: DictConfig) -> None:
    run_and_clean_up(evaluate_linear, cfg)


if __name__ == "__main__":
    main()
