"""Weighted k-NN classification on frozen class tokens, DINO's protocol (facebookresearch/dino eval_knn.py).

    python -m eval.knn checkpoint=runs/dino/imagenet/vits_0L_s0/ckpt/last.pt data=imagenet data.root=/data/imagenet
    python -m eval.knn checkpoint=runs/deit3/digits/vitt_0L_s0/ckpt/last.pt          # data=digits, any trainer's ViT
    python -m eval.knn checkpoint=deit3_small_224.pth model=vits_0L data=imagenet    # a timm / DeiT-III state dict
    torchrun --nproc_per_node=8 -m eval.knn checkpoint=... data=imagenet                # extraction split over ranks

Each validation image's normed class token (eval/features.py) votes with its k nearest training
tokens by cosine similarity. results.json (`<run>/eval/knn_<data>/`) holds the shared fields,
k, T and `knn: {top1, top5, per_k: {k: {top1, top5}}}` in %; analysis.tables reads `knn.top1`.
"""
import torch
from omegaconf import DictConfig

from train.cli import hydra_entry
from laplace.errors import ConfigError

from .features import eval_features, run_and_clean_up, write_results


@torch.no_grad()
def knn_classify(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor,
                 test_labels: torch.Tensor, ks=(10, 20, 100, 200), T: float = 0.07,
                 num_classes: int | None = None, chunk: int = 256) -> dict[int, dict[str, float]]:
    """DINO's weighted k-NN: {k: {"top1", "top5"}} in % for every k in `ks`.

    Args:
        train_feats, test_feats: L2-normalised features [N, D] / [M, D] (one device).
        train_labels, test_labels: int64 [N] / [M].
        ks: the neighbour counts (capped at N); one top-k search for the largest serves all.
        T: the temperature of the weights exp(similarity / T).
        num_classes: C (default: the largest label + 1).
        chunk: test samples per similarity block.
    """
    if num_classes is None:  # the entry point passes the data node's
        num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    ks = sorted({min(int(k), len(train_feats)) for k in ks})
    correct = {k: [0, 0] for k in ks}
    for s in range(0, len(test_feats), chunk):
        q, y = test_feats[s:s + chunk], test_labels[s:s + chunk]
        # memory stays at chunk x N_train similarities; one search for the largest k serves every k
        sim, idx = (q @ train_feats.T).topk(ks[-1], dim=1, largest=True, sorted=True)  # [b, kmax]
        neighbours = train_labels[idx]
        weights = (sim / T).exp()  # each neighbour votes for its class with exp(similarity / T)
        for k in ks:
            votes = torch.zeros(len(q), num_classes, device=q.device, dtype=weights.dtype)
            votes.scatter_add_(1, neighbours[:, :k], weights[:, :k])
            pred = votes.topk(min(5, k, num_classes), dim=1).indices  # DINO: the first min(5, k) predictions
            hit = pred.eq(y[:, None])
            correct[k][0] += int(hit[:, 0].sum())
            correct[k][1] += int(hit.any(dim=1).sum())
    n = max(len(test_feats), 1)  # an empty split scores 0, not a division by zero
    return {k: {"top1": 100.0 * c1 / n, "top5": 100.0 * c5 / n} for k, (c1, c5) in correct.items()}


def evaluate_knn(cfg: DictConfig) -> dict:
    """Extract (or reuse) the features, classify on rank 0, write results.json; returns it."""
    ks = sorted({int(k) for k in cfg.ks} | {int(cfg.k)})  # DINO prints 10, 20, 100, 200 and reports 20
    if min(ks) < 1 or cfg.T <= 0:
        raise ConfigError(f"ks={ks}, T={cfg.T}: need k >= 1 and T > 0")
    (xtr, ytr), (xva, yva), info, dist_info = eval_features(cfg, "cls")
    if not dist_info.is_main:  # every rank holds all features; rank 0 classifies and writes
        return {}
    res = knn_classify(xtr, ytr, xva, yva, ks, float(cfg.T), int(cfg.data.num_classes), int(cfg.chunk))
    k = min(int(cfg.k), len(xtr))
    for kk, r in res.items():
        print(f"[knn] {kk:>4}-NN T={cfg.T}: top1 {r['top1']:.2f}  top5 {r['top5']:.2f}")
    return write_results(cfg, info, "knn", {
        "k": int(cfg.k), "T": float(cfg.T), "feature": "cls_norm_l2", "n_train": len(xtr), "n_val": len(xva),
        "knn": {**res[k], "per_k": {str(kk): r for kk, r in res.items()}}})


@hydra_entry("knn")
def main(cfg: DictConfig) -> None:
    run_and_clean_up(evaluate_knn, cfg)


if __name__ == "__main__":
    main()
