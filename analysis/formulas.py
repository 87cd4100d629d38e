"""The paper's token-geometry quantities finished from sufficient statistics: the ANOVA shares,
Neural Collapse (NC1-NC4) and CDNV from class means, counts, variances and scatter, linguistic
collapse, and the spectrum counts (PCs for a share of the variance, effective rank), in float64.
analysis/metrics.py accumulates the statistics (streamed, or all rows at once) and calls these.
"""
import math
from typing import Callable, Optional, Sequence

import torch

# every metric is computed in float64: NC1 inverts a nearly singular scatter and the ANOVA
# subtracts large sums of squares, which float32 would not survive
_EPS = torch.finfo(torch.float64).eps
# Variance below this share of the rows' mean square is rounding: the rows do not vary.
_NO_VARIANCE = 1e-12
# n_pcs_<t> counts a share within this of t as reached: rounding must not add a component
_TOL = 1e-9


def as_float64(x, device=None) -> torch.Tensor:
    """features (numpy or torch, [..., D]) -> float64 tensor [N, D] on `device` (default: its own)."""
    # (device None: a tensor's own, numpy's the CPU)
    t = torch.as_tensor(x, dtype=torch.float64, device=device).detach()
    return t.reshape(-1, t.shape[-1])


def as_index(x, device) -> torch.Tensor:
    """ids (numpy, torch or list, any shape) -> int64 tensor [N] on `device`."""
    t = torch.as_tensor(x).detach()
    # float labels would be truncated silently by the cast below
    if t.is_floating_point():
        raise ValueError("ids and labels must be integers")
    return t.to(device=device, dtype=torch.int64).reshape(-1)


def sq_norms(x: torch.Tensor) -> torch.Tensor:
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
            keep = torch.ones_like(v, dtype=torch.bool)
            # the pair (c, c) is not a pair of classes: row r of the block is class i0 + r
            keep.diagonal(i0).fill_(False)
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
        out["nc3"] = float(sq_norms((W / W.norm() - M / M.norm()).reshape(-1)))
    return out


def ncc_mismatch(x: torch.Tensor, means: torch.Tensor, weight: torch.Tensor, bias=None,
                 chunk: int = 4096) -> int:
    """Number of rows where argmax_c (W x + b)_c != argmin_c ||x - mu_c|| (the NC4 count)."""
    W = weight.to(x)
    b = bias.to(x) if bias is not None else None
    m_sq = sq_norms(means)
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
    m_sq = sq_norms(m)

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


# ----------------------------------------------------------------------------- spectra
def spectrum_metrics(cov: torch.Tensor, thresholds: Sequence[float] = (0.9, 0.99), mean_square: float = 0.0) -> dict:
    """n_pcs_<t>, effective_rank, total_variance and the normalised spectrum of a covariance.

    n_pcs_<t> is the smallest k whose top-k eigenvalues explain at least t of the variance;
    _TOL absorbs rounding so that data of planted rank r gives exactly r at t = 0.99. Rows
    that do not vary (trace at the rounding level of their `mean_square`) have no normalised
    spectrum: n_pcs, effective_rank and spectrum are NaN, not 0/0 read as one component.
    """
    # eigvalsh: the covariance is symmetric; descending, as explained variance is counted
    lam = torch.linalg.eigvalsh(cov).flip(0).clamp_min(0)  # tiny negative rounding -> 0
    # ("not >" rather than "<=": a NaN trace also has no spectrum)
    if not lam.sum() > _NO_VARIANCE * mean_square:
        nan = float("nan")
        return {**{f"n_pcs_{t:g}": nan for t in thresholds}, "effective_rank": nan,
                "total_variance": float(lam.sum()), "spectrum": [nan] * lam.numel()}
    # the normalised spectrum: each component's share of the variance
    p = lam / lam.sum()
    counts, erank = spectrum_counts(p, thresholds)
    out = {f"n_pcs_{t:g}": float(c) for t, c in zip(thresholds, counts)}
    out["effective_rank"] = float(erank)
    out["total_variance"] = float(lam.sum())
    out["spectrum"] = p.tolist()
    return out


def spectrum_counts(p: torch.Tensor, thresholds: Sequence[float] = (0.9, 0.99)):
    """The counting rule of `spectrum_metrics` on normalised spectra p[..., n] (descending,
    non-negative, each summing to 1), batched over the leading dimensions.

    Returns ([n_pcs per threshold: tensors [...]], effective_rank [...]): n_pcs_<t> = the
    smallest k with sum of the top-k p >= t - _TOL (at most n), effective_rank = exp of the
    entropy of p (0 log 0 = 0).
    """
    cum = torch.cumsum(p, -1)
    n = p.shape[-1]
    # the first k whose cumulative share reaches t: one more than the count of those still below it
    counts = [((cum < t - _TOL).sum(-1) + 1).clamp_max(n) for t in thresholds]
    # the entropy of the normalised spectrum, 0 log 0 = 0: exp of it is the effective rank
    ent = torch.where(p > 0, p * p.clamp_min(torch.finfo(p.dtype).tiny).log(), torch.zeros_like(p)).sum(-1)
    return counts, torch.exp(-ent)


def sequence_spectra(x: torch.Tensor, thresholds: Sequence[float] = (0.9, 0.99)) -> dict:
    """Spectrum of each sequence's own tokens, one sequence per row of x[B, T, D] (float64).

    Each sequence is centred on its own mean; the eigenvalues of its covariance are those of
    the small T x T Gram matrix (or of the D x D covariance when D < T), batched. Counted as
    `spectrum_metrics` counts (same _TOL, same no-variance rule on the sequence's own mean
    square). Returns tensors [B]: n_pcs_<t> (float, NaN for a sequence that does not vary),
    effective_rank (the same) and varies (bool).
    """
    B, T, D = x.shape
    # each sequence centred on its own mean: the spread of its tokens, not of the set
    xc = x - x.mean(1, keepdim=True)
    # the nonzero eigenvalues of X X^T and X^T X agree: the smaller of T x T and D x D is enough
    gram = xc @ xc.transpose(1, 2) if T <= D else xc.transpose(1, 2) @ xc
    # batched over the sequences of a batch: one small eigen-problem each
    lam = torch.linalg.eigvalsh(gram / T).flip(-1).clamp_min(0)
    total = lam.sum(-1)
    # the same no-variance rule as spectrum_metrics, on each sequence's own mean square
    varies = total > _NO_VARIANCE * sq_norms(x).mean(1)
    p = lam / torch.where(varies, total, torch.ones_like(total))[:, None]
    counts, erank = spectrum_counts(p, thresholds)
    nan = torch.full_like(total, float("nan"))
    out = {f"n_pcs_{t:g}": torch.where(varies, c.to(x.dtype), nan) for t, c in zip(thresholds, counts)}
    out["effective_rank"] = torch.where(varies, erank, nan)
    out["varies"] = varies
    return out
