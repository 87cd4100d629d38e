"""Linear probe on frozen features, DINO's protocol (facebookresearch/dino eval_linear.py) on cached features.

    python -m eval.linear checkpoint=runs/dino/imagenet/vits_0L_s0/ckpt/last.pt data=imagenet data.root=/data/imagenet
    python -m eval.linear checkpoint=runs/deit3/digits/vitt_0L_s0/ckpt/last.pt         # data=digits, any trainer's ViT
    python -m eval.linear checkpoint=... n_last_blocks=1 avgpool=true                  # DINO's ViT-B features
    torchrun --nproc_per_node=8 -m eval.linear checkpoint=... data=imagenet            # extraction split over ranks

Features (eval/features.py): DINO's ViT-S recipe, the class tokens of the last 4 blocks after
the final norm, concatenated (`n_last_blocks`, `avgpool` appends the last block's mean patch
token). They are extracted once with the evaluation transform and cached beside the run.

The probe: one linear layer (no batch norm; weights N(0, 0.01), bias 0), cross-entropy, SGD
with momentum 0.9 and no weight decay, the lr annealed to 0 by a cosine over `epochs` (100),
batches of 1024, lr = base x batch / 256 (DINO). A GRID of base lrs is trained at once: one
head per lr in one module, all fed the same batches (one pass over the features per epoch, as
DINOv2's linear evaluation). The lr is chosen by top-1 on a held-out part of the TRAINING set
(`val_fraction` = 0.1, seeded), never on the validation split; with `retrain` (default) a head
with the chosen lr is then trained on the whole training set, and its top-1 / top-5 on the
validation split are reported.

Deviations from DINO: DINO trains on the fly with RandomResizedCrop + flip, and reports the best
validation accuracy over epochs (selection on the validation split). Here the features are
cached (no augmentation: the same centre-crop feature every epoch), which makes the lr grid
cheap; the lr is selected on held-out training data; the probe trains on one process.

results.json lands in `<the checkpoint's run>/eval/linear_<data>/` with protocol "linear", the
grid (`grid`: each lr's held-out top-1 / top-5) and the block
`linear: {top1, top5, lr, base_lr, heldout_top1}`; `python -m analysis.tables` reads `linear.top1`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from laplace.cli import hydra_entry
from laplace.errors import ConfigError
from train.logger import log_to_training_run


from .features import eval_features, run_and_clean_up, write_results


class LinearGrid(nn.Module):
    """One linear classifier per lr of a grid: forward(x [B, D]) -> logits [L, B, C]."""

    def __init__(self, dim: int, num_classes: int, n_heads: int):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(dim, num_classes) for _ in range(n_heads))
        for h in self.heads:  # DINO's LinearClassifier init
            nn.init.normal_(h.weight, mean=0.0, std=0.01)
            nn.init.zeros_(h.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([h(x) for h in self.heads])


def train_grid(feats: torch.Tensor, labels: torch.Tensor, lrs, num_classes: int, epochs: int = 100,
               batch_size: int = 1024, momentum: float = 0.9, weight_decay: float = 0.0,
               seed: int = 0) -> LinearGrid:
    """Train one head per lr in `lrs` (absolute lrs) on the same shuffled batches; SGD with
    momentum, the lr of every head multiplied by (1 + cos(pi e / epochs)) / 2 in epoch e
    (DINO's per-epoch CosineAnnealingLR to 0)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    grid = LinearGrid(feats.shape[1], num_classes, len(lrs)).to(feats.device)
    opt = torch.optim.SGD([{"params": h.parameters(), "lr": float(lr)} for h, lr in zip(grid.heads, lrs)],
                          lr=float(lrs[0]), momentum=momentum, weight_decay=weight_decay)
    n = len(feats)
    for e in range(epochs):
        scale = 0.5 * (1 + math.cos(math.pi * e / epochs))
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = float(lr) * scale
        order = torch.randperm(n, generator=g).to(feats.device)
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            logits = grid(feats[idx])  # [L, b, C]
            y = labels[idx]
            # The heads share no parameter: the sum's gradient is each head's own loss gradient.
            loss = F.cross_entropy(logits.flatten(0, 1), y.repeat(len(lrs)), reduction="sum") / len(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return grid


@torch.no_grad()
def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(top-1, top-5) in % of logits [B, C]; a diverged (non-finite) head scores 0."""
    if len(labels) == 0:
        return 0.0, 0.0
    if not torch.isfinite(logits).all():
        return 0.0, 0.0
    pred = logits.topk(min(5, logits.shape[1]), dim=1).indices
    hit = pred.eq(labels[:, None])
    return 100.0 * hit[:, 0].float().mean().item(), 100.0 * hit.any(dim=1).float().mean().item()


def holdout_split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit indices, held-out indices) of a training set of n, a seeded permutation."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction}: use a share of the training set in (0, 1)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_hold = max(1, int(round(n * val_fraction)))
    return perm[n_hold:], perm[:n_hold]


def linear_probe(train_feats, train_labels, val_feats, val_labels, base_lrs, num_classes: int, *, epochs: int = 100,
                 batch_size: int = 1024, momentum: float = 0.9, weight_decay: float = 0.0, val_fraction: float = 0.1,
                 retrain: bool = True, seed: int = 0) -> dict:
    """The whole protocol on features; the validation split is touched only by the final head.

    Returns {"grid": [{base_lr, lr, heldout_top1, heldout_top5}], "chosen": index,
    "base_lr", "lr", "heldout_top1", "top1", "top5", "retrained"}.
    """
    if not base_lrs:
        raise ConfigError("lr_grid is empty: give at least one base lr")
    lrs = [float(b) * batch_size / 256 for b in base_lrs]
    fit, hold = holdout_split(len(train_feats), val_fraction, seed)
    fit, hold = fit.to(train_feats.device), hold.to(train_feats.device)
    grid = train_grid(train_feats[fit], train_labels[fit], lrs, num_classes, epochs, batch_size, momentum,
                      weight_decay, seed)
    with torch.no_grad():
        held = grid(train_feats[hold])
    scores = [accuracy(held[i], train_labels[hold]) for i in range(len(lrs))]
    chosen = max(range(len(lrs)), key=lambda i: (scores[i][0], scores[i][1], -i))
    if retrain:
        head = train_grid(train_feats, train_labels, [lrs[chosen]], num_classes, epochs, batch_size, momentum,
                          weight_decay, seed).heads[0]
    else:
        head = grid.heads[chosen]
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
    (xtr, ytr), (xva, yva), info, dist_info = eval_features(cfg, "linear", int(cfg.n_last_blocks),
                                                                  bool(cfg.avgpool))
    if not dist_info.is_main:
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
    record = write_results(cfg, info, "linear", {
        "n_last_blocks": int(cfg.n_last_blocks), "avgpool": bool(cfg.avgpool), "feature_dim": xtr.shape[1],
        "epochs": int(cfg.epochs), "train_batch_size": int(cfg.train_batch_size), "seed": int(cfg.seed),
        "val_fraction": float(cfg.val_fraction), "retrained": r["retrained"], "augmentation": "none (cached)",
        "n_train": len(xtr), "n_val": len(xva), "n_fit": r["n_fit"], "n_heldout": r["n_heldout"],
        "grid": r["grid"],
        "linear": {"top1": r["top1"], "top5": r["top5"], "lr": r["lr"], "base_lr": r["base_lr"],
                   "heldout_top1": r["heldout_top1"]}})
    log_to_training_run(info["checkpoint"], record["linear"], "linear")  # when the run used W&B
    return record


@hydra_entry("linear")
def main(cfg: DictConfig) -> None:
    run_and_clean_up(evaluate_linear, cfg)


if __name__ == "__main__":
    main()
