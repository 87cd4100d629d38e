"""Token-geometry metrics of the paper, in memory: ANOVA, Neural Collapse, CDNV, linguistic
collapse of a feature matrix (spectral decay: analysis/spectra.py).

Every function takes `features[N, D]` (numpy array or torch tensor; a leading [B, T, D] shape is
flattened) with integer `seq_ids[N]` and/or `labels[N]`, computes in float64 on the input's
device (CPU for numpy) and returns a plain dict of Python floats. All means are token-weighted.

    from analysis.metrics import anova, neural_collapse
    anova(feats, seq_ids, labels)["within_seq_share"]
    neural_collapse(seq_means, seq_labels, weight=head.weight, bias=head.bias)["nc1"]

For millions of tokens use `analysis.streaming.GeometryAccumulator`: one pass over batches,
memory independent of N, the same keys. The helpers that finish a metric from class means or
scatter matrices (`nc1_from_scatter`, `class_mean_geometry`, `cdnv_from_class_stats`,
`lc_from_class_stats`, `ncc_mismatch`) are shared with it.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

# every metric is computed in float64: NC1 inverts a nearly singular scatter and the ANOVA
# subtracts large sums of squares, which float32 would not survive
_EPS = torch.finfo(torch.float64).eps


# ----------------------------------------------------------------------------- inputs
def as_float64(x, device=None) -> torch.Tensor:
    """features (numpy or torch, [..., D]) -> float64 tensor [N, D] on `device` (default: its own)."""
    t = torch.from_numpy(np.asarray(x)) if not torch.is_tensor(x) else x.detach()
    t = t.to(device=device if device is not None else t.device, dtype=torch.float64)
    return t.reshape(-1, t.shape[-1])


def as_index(x, device) -> torch.Tensor:
    """ids (numpy, torch or list, any shape) -> int64 tensor [N] on `device`."""
    t = torch.from_numpy(np.asarray(x)) if not torch.is_tensor(x) else x.detach()
    # float labels would be truncated silently by the cast below
    if t.is_floating_point():
        raise ValueError("ids and labels must be integers")
    return t.to(device=device, dtype=torch.int64).reshape(-1)


def group_sums(x: torch.Tensor, inv: torch.Tensor, G: int):
    """Per-group sums [G, D] and counts [G] of rows x[N, D] with group index inv[N]."""
    # index_add_: one pass over the rows, no Python loop over groups (a vocabulary may have 65k)
    sums = torch.zeros(G, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, inv, x)
    counts = torch.zeros(G, dtype=x.dtype, device=x.device).index_add_(0, inv, torch.ones_like(inv, dtype=x.dtype))
    return sums, counts


def _check_rows(x: torch.Tensor, *ids):
    for i in ids:
        if i is not None and i.numel() != x.shape[0]:
            raise ValueError(f"{x.shape[0]} feature rows but {i.numel()} ids/labels")


def _sq(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum(-1)


def _cov(v: torch.Tensor) -> float:
    """Coefficient of variation std/mean (population std) of a 1-d tensor."""
    return float(v.std(unbiased=False) / v.mean())


# ----------------------------------------------------------------------------- ANOVA
def anova(features, seq_ids, labels=None) -> dict:
    """Variance decomposition of token representations into within/between sequence and class.

    With mu the mean of all rows, mu_s the mean of sequence s, mu_c the mean of class c:
        total       = mean_i ||x_i - mu||^2             = within_seq + between_seq
        within_seq  = mean_i ||x_i - mu_s(i)||^2
        between_seq = mean_i ||mu_s(i) - mu||^2         = within_class + between_class
        within_class  = mean_i ||mu_s(i) - mu_c(i)||^2
        between_class = mean_i ||mu_c(i) - mu||^2
    plus the shares within_seq_share, between_seq_share, within_class_share, between_class_share
    (each part / total).

    Args:
        features: [N, D] token representations.
        seq_ids: [N] sequence (image / document) of each token.
        labels: [N] class of each token, the same for every token of a sequence; None for the
            sequence parts only.
    """
    x = as_float64(features)
    sid = as_index(seq_ids, x.device)
    y = as_index(labels, x.device) if labels is not None else None
    _check_rows(x, sid, y)
    # sequence ids are any integers: their inverse index numbers the groups 0..S-1
    _, s_inv = torch.unique(sid, return_inverse=True)
    S, n_s = group_sums(x, s_inv, int(s_inv.max()) + 1)
    mu, mu_s = x.mean(0), S / n_s[:, None]
    out = {
        "total": float(_sq(x - mu).mean()),
        "within_seq": float(_sq(x - mu_s[s_inv]).mean()),
        "between_seq": float((n_s * _sq(mu_s - mu)).sum() / x.shape[0]),
    }
    if y is not None:
        check_labels_per_sequence(s_inv, y)
        _, c_inv = torch.unique(y, return_inverse=True)
        T, n_c = group_sums(x, c_inv, int(c_inv.max()) + 1)
        mu_c = T / n_c[:, None]
        # one label per sequence (checked above): each sequence's class, to place its mean in the class part
        seq_class = torch.zeros_like(n_s, dtype=torch.int64).scatter_(0, s_inv, c_inv)
        out["within_class"] = float((n_s * _sq(mu_s - mu_c[seq_class])).sum() / x.shape[0])
        out["between_class"] = float((n_c * _sq(mu_c - mu)).sum() / x.shape[0])
    return add_shares(out, float(_sq(x).mean()))


# Variance below this share of the rows' mean square is rounding: the rows do not vary.
_NO_VARIANCE = 1e-12


def add_shares(out: dict, mean_square: float) -> dict:
    """The ANOVA parts' shares of out["total"], in place. Rows that do not vary (total at the
    rounding level of their mean square) have no shares: NaN, not 0/0 or rounding noise."""
    # relative to the rows' mean square: features far from the origin that do not vary still leave
    # rounding in the total
    varies = out["total"] > _NO_VARIANCE * mean_square
    for part in ("within_seq", "between_seq", "within_class", "between_class"):
        if part in out:
            out[f"{part}_share"] = out[part] / out["total"] if varies else float("nan")
    return out


def check_labels_per_sequence(s_inv: torch.Tensor, y: torch.Tensor):
    """Raise ValueError unless every token of a sequence carries its sequence's label."""
    G = int(s_inv.max()) + 1
    # the smallest and largest label of each sequence: one vectorised pass
    lo = torch.full((G,), torch.iinfo(torch.int64).max, device=y.device).scatter_reduce(0, s_inv, y, "amin")
    hi = torch.full((G,), torch.iinfo(torch.int64).min, device=y.device).scatter_reduce(0, s_inv, y, "amax")
    if (lo != hi).any():
        raise ValueError(
            f"{int((lo != hi).sum())} sequences have tokens with different labels; the class parts "
            "of the ANOVA need one label per sequence (next-token labels: use labels=None)")


# ----------------------------------------------------------------------------- pairs of classes
def offdiag_stats(block_fn: Callable[[int, int], dict], C: int, chunk: Optional[int] = None) -> dict:
    """Mean and population std over ordered pairs c != c' of pairwise quantities.

    block_fn(i0, i1) returns {name: tensor [i1 - i0, C]} for rows i0:i1; blocks are merged with
    Chan's parallel update so a vocabulary of 65k classes never forms a C x C matrix.
    """
    if C < 2:
        return {}
    # rows per block: about 16 M pair values at a time, whatever the number of classes
    chunk = chunk or max(1, 2 ** 24 // C)
    acc = {}
    for i0 in range(0, C, chunk):
        i1 = min(C, i0 + chunk)
        for name, v in block_fn(i0, i1).items():
            rows = torch.arange(i1 - i0, device=v.device)
            keep = torch.ones_like(v, dtype=torch.bool)
            # the pair (c, c) is not a pair of classes
            keep[rows, rows + i0] = False
            v = v[keep]
            nb, mb = v.numel(), float(v.mean())
            m2b = float(((v - mb) ** 2).sum())
            na, ma, m2a = acc.get(name, (0, 0.0, 0.0))
            n, d = na + nb, mb - ma
            # Chan's parallel update of (count, mean, sum of squared deviations): blocks merge exactly
            acc[name] = (n, ma + d * nb / n, m2a + m2b + d * d * na * nb / n)
    return {k: (m, math.sqrt(m2 / n)) for k, (n, m, m2) in acc.items()}


def _unit_rows(M: torch.Tensor) -> torch.Tensor:
    return M / M.norm(dim=1, keepdim=True)


def _cosine_block(U: torch.Tensor, extra: Optional[Callable] = None):
    """block_fn giving the cosines of unit rows U (and whatever `extra(cos)` derives)."""
    def fn(i0, i1):
        cos = U[i0:i1] @ U.T
        return {"cos": cos, **(extra(cos) if extra else {})}
    return fn


# ----------------------------------------------------------------------------- Neural Collapse
def nc1_from_scatter(sigma_w: torch.Tensor, M: torch.Tensor) -> float:
    """NC1 = tr(Sigma_W pinv(Sigma_B)) / C with Sigma_B = M^T M / C, M the centred class means.

    pinv keeps the eigenvalues above D * eps * max (numpy's default rtol), so the rank C - 1 of
    Sigma_B is respected. With C <= D the eigenvectors come from the SVD of M: eigh of the
    nearly null D x D Sigma_B is both less accurate and, on CPU, very slow (denormals).
    """
    C, D = M.shape
    if C <= D:
        _, s, Vh = torch.linalg.svd(M, full_matrices=False)
        lam, V = s * s / C, Vh.T
    else:
        lam, V = torch.linalg.eigh(M.T @ M / C)
    # numpy's pinv cut-off: Sigma_B has rank C - 1, its null directions must not be inverted
    keep = lam > lam.max() * D * _EPS
    V, lam = V[:, keep], lam[keep]
    return float(((V.T @ sigma_w) * V.T).sum(1).div(lam).sum() / C)


def class_mean_geometry(means: torch.Tensor, mu: torch.Tensor, weight=None) -> dict:
    """NC2 (and NC3 with a classifier) from class means [C, D] and the global mean mu [D].

    Args:
        means: class means mu_c; rows M = mu_c - mu are the centred means.
        mu: global mean (token-weighted in this package).
        weight: classifier rows [C, D] of the same classes, in the same order; optional.
    """
    C = means.shape[0]
    M = means - mu
    norms = M.norm(dim=1)
    # -1 / (C - 1): the cosine between the vertices of a simplex ETF (NC2's ideal)
    pairs = offdiag_stats(_cosine_block(_unit_rows(M), lambda cos: {"ang": (cos + 1 / (C - 1)).abs()}), C)
    out = {
        "nc2_equinorm": _cov(norms),
        "nc2_equiangular": pairs["cos"][1] if pairs else float("nan"),
        "nc2_maxangle": pairs["ang"][0] if pairs else float("nan"),
    }
    if weight is not None:
        W = weight.to(means)
        out["nc2_equinorm_w"] = _cov(W.norm(dim=1))
        out["nc3"] = float(_sq((W / W.norm() - M / M.norm()).reshape(-1)))
    return out


def ncc_mismatch(x: torch.Tensor, means: torch.Tensor, weight: torch.Tensor, bias=None,
                 chunk: int = 4096) -> int:
    """Number of rows where argmax_c (W x + b)_c != argmin_c ||x - mu_c|| (the NC4 count)."""
    W = weight.to(x)
    b = bias.to(x) if bias is not None else None
    m_sq = _sq(means)
    wrong = 0
    for i in range(0, x.shape[0], chunk):
        xb = x[i:i + chunk]
        logits = xb @ W.T if b is None else torch.addmm(b, xb, W.T)
        # the nearest class mean by expanding ||x - mu_c||^2: no N x C x D difference tensor
        nearest = (m_sq - 2 * xb @ means.T).argmin(1)  # ||x||^2 is the same for every class
        wrong += int((logits.argmax(1) != nearest).sum())
    return wrong


def _class_index(labels, x, weight=None):
    """Present classes (sorted ids), per-row class index, and the classifier rows of those ids."""
    y = as_index(labels, x.device)
    _check_rows(x, y)
    classes, inv = torch.unique(y, return_inverse=True)
    if weight is None:
        return classes, inv, None
    W = as_float64(weight, x.device)
    if classes.min() < 0 or classes.max() >= W.shape[0]:
        raise ValueError(f"labels must index the {W.shape[0]} classifier rows")
    return classes, inv, W[classes]


def neural_collapse(features, labels, weight=None, bias=None) -> dict:
    """Neural Collapse NC1-NC4 (Papyan, Han & Donoho 2020) of rows `features` with class `labels`.

    mu is the global token-weighted mean (mean of all rows), mu_c the class means, M the rows
    mu_c - mu, C the number of classes present:
        nc1 = tr(Sigma_W pinv(Sigma_B)) / C, Sigma_W = 1/N sum_i (x_i - mu_c(i))(...)^T,
              Sigma_B = 1/C sum_c (mu_c - mu)(...)^T
        nc2_equinorm = std_c ||mu_c - mu|| / mean_c ||mu_c - mu||
        nc2_equiangular = std over c != c' of cos(mu_c - mu, mu_c' - mu)
        nc2_maxangle = mean over c != c' of |cos(mu_c - mu, mu_c' - mu) + 1/(C-1)|
    and with the classifier W (rows of the present classes):
        nc2_equinorm_w = std / mean of the row norms of W
        nc3 = || W/||W||_F - M/||M||_F ||_F^2
        nc4 = fraction of rows where argmax_c (W x + b)_c != argmin_c ||x - mu_c||
    Stds are population stds (ddof=0). num_classes is returned too.

    Args:
        features: [N, D] rows (tokens, or one mean per sequence for the paper's ViT analysis).
        labels: [N] integer class of each row; indexes the rows of weight when weight is given.
        weight: [K, D] classifier weight (K >= max label + 1); optional.
        bias: [K] classifier bias; optional.
    """
    x = as_float64(features)
    classes, inv, W = _class_index(labels, x, weight)
    C = classes.numel()
    T, n_c = group_sums(x, inv, C)
    means, mu = T / n_c[:, None], x.mean(0)
    # the within-class residuals, for the within-class scatter Sigma_W
    R = x - means[inv]
    M = means - mu
    out = {"num_classes": float(C),
           "nc1": nc1_from_scatter(R.T @ R / x.shape[0], M)}
    out.update(class_mean_geometry(means, mu, W))
    if W is not None:
        b = as_float64(bias, x.device).reshape(-1)[classes] if bias is not None else None
        out["nc4"] = ncc_mismatch(x, means, W, b) / x.shape[0]
    return out


# ----------------------------------------------------------------------------- CDNV
def cdnv_from_class_stats(means: torch.Tensor, var: torch.Tensor) -> dict:
    """Mean and std over class pairs of (var_c + var_c') / (2 ||mu_c - mu_c'||^2)."""
    # ||mu_c - mu_c'||^2 = |mu_c|^2 + |mu_c'|^2 - 2 <mu_c, mu_c'> per block of rows: no C x C x D tensor
    m = means - means.mean(0)  # centring first keeps the Gram-form distances accurate
    m_sq = _sq(m)

    def fn(i0, i1):
        d2 = (m_sq[i0:i1, None] + m_sq[None] - 2 * m[i0:i1] @ m.T).clamp_min(0)
        return {"cdnv": (var[i0:i1, None] + var[None]) / (2 * d2)}

    s = offdiag_stats(fn, means.shape[0]).get("cdnv", (float("nan"), float("nan")))
    return {"cdnv_mean": s[0], "cdnv_std": s[1]}


def _class_var(x, inv, means, n_c):
    """sigma_c^2 = mean over rows of c of ||x - mu_c||^2."""
    return torch.zeros_like(n_c).index_add_(0, inv, _sq(x - means[inv])) / n_c


def cdnv(features, labels) -> dict:
    """Class-distance normalised variance (Galanti et al. 2022; Wu & Papyan 2024's NC1 measure).

    Per unordered pair of classes (sigma_c^2 + sigma_c'^2) / (2 ||mu_c - mu_c'||^2), with
    sigma_c^2 = mean over the rows of c of ||x - mu_c||^2; returns the mean and population std
    over pairs as cdnv_mean, cdnv_std.
    """
    x = as_float64(features)
    classes, inv, _ = _class_index(labels, x)
    T, n_c = group_sums(x, inv, classes.numel())
    means = T / n_c[:, None]
    return cdnv_from_class_stats(means, _class_var(x, inv, means, n_c))


# ----------------------------------------------------------------------------- linguistic collapse
def lc_from_class_stats(means, counts, var, unembedding=None, center: str = "classes",
                        center_unembedding: bool = False) -> dict:
    """Linguistic-collapse measures (keys lc_*) from kept class means, counts and variances.

    See `linguistic_collapse` for the definitions; `unembedding` holds the rows of the kept
    classes in the same order as `means`.
    """
    if center not in ("classes", "tokens"):
        raise ValueError(f"center must be 'classes' or 'tokens', not {center!r}")
    # the code's default centre is the unweighted mean of the class means: frequent tokens do not
    # dominate it
    mu = means.mean(0) if center == "classes" else counts @ means / counts.sum()
    M = means - mu
    U = _unit_rows(M)
    pairs = offdiag_stats(_cosine_block(U, lambda cos: {"abs": cos.abs()}), means.shape[0])
    nan2 = (float("nan"), float("nan"))
    out = {"lc_num_classes": float(means.shape[0])}
    out.update({f"lc_{k}": v for k, v in cdnv_from_class_stats(means, var).items()})
    out["lc_equinorm"] = _cov(M.norm(dim=1))
    out["lc_coherence_mean"], out["lc_coherence_std"] = pairs.get("cos", nan2)
    out["lc_abs_coherence_mean"], out["lc_abs_coherence_std"] = pairs.get("abs", nan2)
    if unembedding is not None:
        W = unembedding.to(means)
        W = W - W.mean(0) if center_unembedding else W
        cos = (U * _unit_rows(W)).sum(1)
        out["lc_self_duality_cos_mean"] = float(cos.mean())
        out["lc_self_duality"] = 1.0 - float(cos.mean())
        out["lc_uniform_duality"] = float(cos.std(unbiased=False))
    return out


def linguistic_collapse(features, labels, unembedding=None, min_count: int = 1,
                        center: str = "classes", center_unembedding: bool = False) -> dict:
    """Wu & Papyan's "linguistic collapse" measures, classes = next-token ids.

    Follows "Linguistic Collapse: Neural Collapse in (Large) Language Models" (Wu & Papyan,
    NeurIPS 2024, arXiv:2405.17767) as implemented in its code (github.com/rhubarbwu/
    linguistic-collapse, lib/collapse.py): class means of the classes with at least
    `min_count` rows, centred by the unweighted mean of those class means (the code's default;
    center="tokens" uses the token-weighted mean instead), and the unembedding rows used as
    they are (not centred; center_unembedding=True centres them over the kept classes).
    Keys (pairs are ordered pairs c != c', stds are population stds):
        lc_num_classes            number of kept classes
        lc_cdnv_mean, lc_cdnv_std CDNV over pairs of kept classes (within-class variability, NC1)
        lc_equinorm               std / mean of ||mu_c - mu_G|| (NC2 equinormness)
        lc_coherence_mean/_std    mean / std of cos(mu_c - mu_G, mu_c' - mu_G): the code's
                                  "coherence" / "interference"; its std is NC2 equiangularity.
                                  Unlike the code, the diagonal (cos = 1) is left out.
        lc_abs_coherence_mean/_std  the same for |cos|
        lc_self_duality_cos_mean  mean_c cos(mu_c - mu_G, w_c)     (with an unembedding)
        lc_self_duality           1 - lc_self_duality_cos_mean      (NC3 self-duality distance)
        lc_uniform_duality        std_c cos(mu_c - mu_G, w_c)       (UNC3 uniform duality)
        lc_ncc_agreement          fraction of kept-class rows whose argmax_c w_c . x (over kept
                                  classes) is the nearest kept class mean (NC4)

    Args:
        features: [N, D] token representations.
        labels: [N] next-token id of each row (index into the unembedding rows).
        unembedding: [V, D] unembedding (LM head) weight; optional.
        min_count: classes with fewer rows are dropped (the code's --min_per_class).
        center: "classes" (unweighted mean of class means) or "tokens" (token-weighted).
        center_unembedding: subtract the mean of the kept rows of the unembedding first.
    """
    x = as_float64(features)
    classes, inv, W = _class_index(labels, x, unembedding)
    T, n_c = group_sums(x, inv, classes.numel())
    kept = n_c >= min_count
    if int(kept.sum()) < 2:
        raise ValueError(f"fewer than 2 classes have {min_count} or more rows")
    # rows of dropped classes are removed before the NCC agreement, as the code's --min_per_class does
    remap = torch.cumsum(kept, 0) - 1  # old class index -> kept index
    rows = kept[inv]
    x, inv = x[rows], remap[inv[rows]]
    means, n_c = T[kept] / n_c[kept, None], n_c[kept]
    W = W[kept] if W is not None else None
    out = lc_from_class_stats(means, n_c, _class_var(x, inv, means, n_c), W, center, center_unembedding)
    if W is not None:
        out["lc_ncc_agreement"] = 1.0 - ncc_mismatch(x, means, W) / x.shape[0]
    return out

