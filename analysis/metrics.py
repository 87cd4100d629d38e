"""The paper's token-geometry metrics: ANOVA, Neural Collapse (NC1-NC4), CDNV and linguistic
collapse, in float64 (spectra: analysis/spectra.py).

    from analysis.metrics import anova, neural_collapse
    anova(feats, seq_ids, labels)["within_seq_share"]
    neural_collapse(seq_means, seq_labels, weight=head.weight, bias=head.bias)["nc1"]

Every function takes features [N, D] (numpy or torch; [B, T, D] is flattened) with integer
seq_ids [N] and/or labels [N] and returns a dict of floats; all means are token-weighted. They
are the one-batch case of `analysis.streaming.GeometryAccumulator`, the one implementation (what
`python -m analysis` streams over millions of tokens); this file holds the formulas that finish
each metric from its sufficient statistics, which the accumulator calls.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import torch

# every metric is computed in float64: NC1 inverts a nearly singular scatter and the ANOVA
# subtracts large sums of squares, which float32 would not survive
_EPS = torch.finfo(torch.float64).eps
# Variance below this share of the rows' mean square is rounding: the rows do not vary.
_NO_VARIANCE = 1e-12


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


def _sq(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum(-1)


def _cov(v: torch.Tensor) -> float:
    """Coefficient of variation std/mean (population std) of a 1-d tensor."""
    return float(v.std(unbiased=False) / v.mean())


def add_shares(out: dict, mean_square: float) -> dict:
    """The ANOVA parts' shares of out["total"], in place; NaN when the rows do not vary."""
    # relative to the rows' mean square: features far from the origin that do not vary still leave
    # rounding in the total, which must not read as a share (0/0 or noise)
    varies = out["total"] > _NO_VARIANCE * mean_square
    for part in ("within_seq", "between_seq", "within_class", "between_class"):
        if part in out:
            out[f"{part}_share"] = out[part] / out["total"] if varies else float("nan")
    return out


# ----------------------------------------------------------------------------- pairs of classes
def offdiag_stats(block_fn: Callable[[int, int], dict], C: int, chunk: Optional[int] = None) -> dict:
    """Mean and population std over ordered pairs c != c' of pairwise quantities; block_fn(i0, i1)
    gives {name: tensor [i1 - i0, C]} for rows i0:i1."""
    if C < 2:
        return {}
    # rows per block: about 16 M pair values at a time, so a vocabulary of 65k classes never
    # forms a C x C matrix
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
    """NC1 = tr(Sigma_W pinv(Sigma_B)) / C with Sigma_B = M^T M / C, M the centred class means."""
    C, D = M.shape
    # with C <= D the eigenvectors come from the SVD of M: eigh of the nearly null D x D Sigma_B
    # is both less accurate and, on CPU, very slow (denormals)
    if C <= D:
        _, s, Vh = torch.linalg.svd(M, full_matrices=False)
        lam, V = s * s / C, Vh.T
    else:
        lam, V = torch.linalg.eigh(M.T @ M / C)
    # numpy's pinv cut-off (D * eps * max): Sigma_B has rank C - 1, its null directions must not
    # be inverted
    keep = lam > lam.max() * D * _EPS
    V, lam = V[:, keep], lam[keep]
    return float(((V.T @ sigma_w) * V.T).sum(1).div(lam).sum() / C)


def class_mean_geometry(means: torch.Tensor, mu: torch.Tensor, weight=None) -> dict:
    """NC2 (and NC3 with the classifier rows `weight` [C, D] of the same classes) from class
    means [C, D] and the global mean mu [D]."""
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


def lc_from_class_stats(means, counts, var, unembedding=None, center: str = "classes") -> dict:
    """Linguistic-collapse measures (keys lc_*, see `linguistic_collapse`) from the kept classes'
    means, counts and variances; `unembedding` holds their rows in the same order."""
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
        cos = (U * _unit_rows(unembedding.to(means))).sum(1)  # the unembedding rows as they are, as the code
        out["lc_self_duality_cos_mean"] = float(cos.mean())
        out["lc_self_duality"] = 1.0 - float(cos.mean())
        out["lc_uniform_duality"] = float(cos.std(unbiased=False))
    return out


# ----------------------------------------------------------------------------- in memory
def one_pass(metrics, features, seq_ids=None, labels=None):
    """(a GeometryAccumulator fed every row at once, the rows as float64 [N, D])."""
    from analysis.streaming import GeometryAccumulator  # it builds on the formulas above

    x = as_float64(features)
    acc = GeometryAccumulator(x.shape[1], metrics, device=x.device)
    acc.update(x, seq_ids, labels)
    return acc, x


def anova(features, seq_ids, labels=None) -> dict:
    """Variance decomposition of token representations into within/between sequence and class.

    With mu the mean of all rows, mu_s the mean of sequence s, mu_c the mean of class c:
        total       = mean_i ||x_i - mu||^2             = within_seq + between_seq
        within_seq  = mean_i ||x_i - mu_s(i)||^2
        between_seq = mean_i ||mu_s(i) - mu||^2         = within_class + between_class
        within_class  = mean_i ||mu_s(i) - mu_c(i)||^2
        between_class = mean_i ||mu_c(i) - mu||^2
    and the shares <part>_share = part / total. `labels`: the class of each token, the same for
    every token of a sequence; None for the sequence parts only.
    """
    return one_pass(("anova_seq",) if labels is None else ("anova",), features, seq_ids, labels)[0].compute()


def neural_collapse(features, labels, weight=None, bias=None) -> dict:
    """Neural Collapse NC1-NC4 (Papyan, Han & Donoho 2020) of rows `features` with class `labels`.

    mu is the mean of all rows, mu_c the class means, M the rows mu_c - mu, C the classes present:
        nc1 = tr(Sigma_W pinv(Sigma_B)) / C, Sigma_W = 1/N sum_i (x_i - mu_c(i))(...)^T,
              Sigma_B = 1/C sum_c (mu_c - mu)(...)^T
        nc2_equinorm = std_c ||mu_c - mu|| / mean_c ||mu_c - mu||
        nc2_equiangular = std over c != c' of cos(mu_c - mu, mu_c' - mu)
        nc2_maxangle = mean over c != c' of |cos(mu_c - mu, mu_c' - mu) + 1/(C-1)|
    and with the classifier `weight` [K, D] (rows indexed by label) and `bias` [K]:
        nc2_equinorm_w = std / mean of the row norms of W
        nc3 = || W/||W||_F - M/||M||_F ||_F^2
        nc4 = fraction of rows where argmax_c (W x + b)_c != argmin_c ||x - mu_c||
    Stds are population stds (ddof=0); num_classes is returned too.
    """
    acc, x = one_pass(("nc",), features, labels=labels)
    out = acc.compute(weight=weight)
    if weight is not None:
        # NC4 compares every row with the final class means: a second look at the rows
        classes, means = acc.class_means()
        b = None if bias is None else as_float64(bias, x.device).reshape(-1)[classes]
        out["nc4"] = ncc_mismatch(x, means, as_float64(weight, x.device)[classes], b) / x.shape[0]
    return out


def cdnv(features, labels) -> dict:
    """Class-distance normalised variance (Galanti et al. 2022; Wu & Papyan 2024's NC1 measure):
    per pair of classes (sigma_c^2 + sigma_c'^2) / (2 ||mu_c - mu_c'||^2), with sigma_c^2 the mean
    over the rows of c of ||x - mu_c||^2; the mean and population std over pairs (cdnv_mean, cdnv_std)."""
    return one_pass(("cdnv",), features, labels=labels)[0].compute()


def linguistic_collapse(features, labels, unembedding=None, min_count: int = 1, center: str = "classes") -> dict:
    """Wu & Papyan's "linguistic collapse" measures, classes = next-token ids.

    As "Linguistic Collapse: Neural Collapse in (Large) Language Models" (NeurIPS 2024,
    arXiv:2405.17767) computes them in its code (rhubarbwu/linguistic-collapse, lib/collapse.py):
    class means of the classes with at least `min_count` rows (its --min_per_class), centred by
    the unweighted mean of those class means (center="tokens": the token-weighted mean), the
    unembedding rows as they are.
    Keys (pairs are ordered pairs c != c', stds are population stds):
        lc_num_classes            number of kept classes
        lc_cdnv_mean, lc_cdnv_std CDNV over pairs of kept classes (within-class variability, NC1)
        lc_equinorm               std / mean of ||mu_c - mu_G|| (NC2 equinormness)
        lc_coherence_mean/_std    mean / std of cos(mu_c - mu_G, mu_c' - mu_G) (the code's
                                  "coherence" / "interference"; unlike the code, without c = c')
        lc_abs_coherence_mean/_std  the same for |cos|
        lc_self_duality_cos_mean  mean_c cos(mu_c - mu_G, w_c)     (with an unembedding)
        lc_self_duality           1 - lc_self_duality_cos_mean      (NC3 self-duality distance)
        lc_uniform_duality        std_c cos(mu_c - mu_G, w_c)       (UNC3 uniform duality)
        lc_ncc_agreement          fraction of kept-class rows whose argmax_c w_c . x (over kept
                                  classes) is the nearest kept class mean (NC4)
    """
    acc, x = one_pass(("lc",), features, labels=labels)
    out = acc.compute(unembedding=unembedding, min_count=min_count, lc_center=center)
    if unembedding is not None:
        # rows of dropped classes are removed first, as the code's --min_per_class does
        classes, means = acc.class_means(min_count)
        rows = x[torch.isin(as_index(labels, x.device), classes)]
        W = as_float64(unembedding, x.device)[classes]
        out["lc_ncc_agreement"] = 1.0 - ncc_mismatch(rows, means, W) / rows.shape[0]
    return out
