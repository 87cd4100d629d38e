"""Spectral decay of token representations: how many principal components explain a fraction of
the variance, of all tokens (one covariance), of tokens less their sequence's mean (pooled), or
of each sequence alone (averaged over sequences). Float64, plain dicts of floats, as
analysis.metrics; `spectral_decay` is the one-batch case of analysis.streaming's accumulator.

    from analysis.spectra import per_sequence_spectra, spectral_decay
    spectral_decay(feats)["n_pcs_0.99"]                                   # global
    spectral_decay(feats, seq_ids=seq, center="sequence")["n_pcs_0.99"]   # pooled within-sequence
    per_sequence_spectra(feats, seq)["n_pcs_0.99"]                        # mean over sequences
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from analysis.metrics import _NO_VARIANCE, _sq, as_float64, as_index, one_pass


def spectrum_metrics(cov: torch.Tensor, thresholds: Sequence[float] = (0.9, 0.99),
                     tol: float = 1e-9, mean_square: float = 0.0) -> dict:
    """n_pcs_<t>, effective_rank, total_variance and the normalised spectrum of a covariance.

    n_pcs_<t> is the smallest k whose top-k eigenvalues explain at least t of the variance;
    `tol` absorbs rounding so that data of planted rank r gives exactly r at t = 0.99. Rows
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
    counts, erank = spectrum_counts(p, thresholds, tol)
    out = {f"n_pcs_{t:g}": float(c) for t, c in zip(thresholds, counts)}
    out["effective_rank"] = float(erank)
    out["total_variance"] = float(lam.sum())
    out["spectrum"] = p.tolist()
    return out


def spectrum_counts(p: torch.Tensor, thresholds: Sequence[float] = (0.9, 0.99), tol: float = 1e-9):
    """The counting rule of `spectrum_metrics` on normalised spectra p[..., n] (descending,
    non-negative, each summing to 1), batched over the leading dimensions.

    Returns ([n_pcs per threshold: tensors [...]], effective_rank [...]): n_pcs_<t> = the
    smallest k with sum of the top-k p >= t - tol (at most n), effective_rank = exp of the
    entropy of p (0 log 0 = 0).
    """
    cum = torch.cumsum(p, -1)
    n = p.shape[-1]
    # the first k whose cumulative share reaches t: one more than the count of those still below it
    counts = [((cum < t - tol).sum(-1) + 1).clamp_max(n) for t in thresholds]
    # the entropy of the normalised spectrum, 0 log 0 = 0: exp of it is the effective rank
    ent = torch.where(p > 0, p * p.clamp_min(torch.finfo(p.dtype).tiny).log(), torch.zeros_like(p)).sum(-1)
    return counts, torch.exp(-ent)


def sequence_spectra(x: torch.Tensor, thresholds: Sequence[float] = (0.9, 0.99), tol: float = 1e-9) -> dict:
    """Spectrum of each sequence's own tokens, one sequence per row of x[B, T, D] (float64).

    Each sequence is centred on its own mean; the eigenvalues of its covariance are those of
    the small T x T Gram matrix (or of the D x D covariance when D < T), batched. Counted as
    `spectrum_metrics` counts (same tol, same no-variance rule on the sequence's own mean
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
    varies = total > _NO_VARIANCE * _sq(x).mean(1)
    p = lam / torch.where(varies, total, torch.ones_like(total))[:, None]
    counts, erank = spectrum_counts(p, thresholds, tol)
    nan = torch.full_like(total, float("nan"))
    out = {f"n_pcs_{t:g}": torch.where(varies, c.to(x.dtype), nan) for t, c in zip(thresholds, counts)}
    out["effective_rank"] = torch.where(varies, erank, nan)
    out["varies"] = varies
    return out


def spectral_decay(features, thresholds: Sequence[float] = (0.9, 0.99), seq_ids=None,
                   center: str = "global") -> dict:
    """Eigen-spectrum of the covariance of centred token representations [N, D]: n_pcs_<t>,
    effective_rank (exp of the entropy of the normalised spectrum), total_variance (trace) and
    spectrum (eigenvalues / sum, descending; a list). center="global" subtracts the mean of all
    rows; "sequence" each sequence's own mean (`seq_ids` [N]): the spectrum of within-sequence
    variation, e.g. of the tokens of one image."""
    if center not in ("global", "sequence"):
        raise ValueError(f"center must be 'global' or 'sequence', not {center!r}")
    acc, _ = one_pass(("spectral",), features, seq_ids if center == "sequence" else None)
    return acc.spectral(thresholds, center)


def per_sequence_spectra(features, seq_ids, thresholds: Sequence[float] = (0.9, 0.99)) -> dict:
    """n_pcs_<t> and effective_rank of each sequence's own centred tokens (`spectral_decay` of one
    sequence at a time; sequences may differ in length), averaged over the sequences that vary;
    n_sequences (averaged) and n_no_variance (left out: their tokens are all equal). The direct
    reference of the streamed, batched `streaming.SequenceSpectra`."""
    x = as_float64(features)
    sid = as_index(seq_ids, x.device)
    if sid.numel() != x.shape[0]:
        raise ValueError(f"{x.shape[0]} feature rows but {sid.numel()} seq_ids")
    keys = [f"n_pcs_{t:g}" for t in thresholds] + ["effective_rank"]
    # one spectrum per sequence; a sequence of identical tokens has none (NaN) and is counted apart
    each = [spectral_decay(x[sid == s], thresholds) for s in torch.unique(sid)]
    varied = [one for one in each if not math.isnan(one["effective_rank"])]
    out = {k: math.fsum(one[k] for one in varied) / len(varied) if varied else float("nan") for k in keys}
    return {**out, "n_sequences": float(len(varied)), "n_no_variance": float(len(each) - len(varied))}
