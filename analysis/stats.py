"""Paired comparisons of two arms over seeds, corrected for the number of claims tested.

    from analysis.stats import holm, paired
    t = paired({0: 94.1, 1: 95.0, 2: 93.8}, {0: 95.2, 1: 95.9, 2: 94.0})   # {seed: value} per arm
    t.d, t.t, t.df, t.p, t.mde                                              # mean difference, ...
    holm([0.01, 0.04, 0.03])                                                # adjusted p-values

Why paired: the arms of a seed share the data order and the initial weights (a Laplacian head
adds no parameter, so k changes no draw of the initialisation), so the per-seed differences
remove the seed-to-seed spread that both arms share; the test is Student's t on those
differences (scipy.stats.ttest_rel), with n - 1 degrees of freedom.

The smallest detectable effect (`mde`): the true mean difference that a two-sided paired t at
level alpha would detect with probability `power`, given the observed spread of the
differences: (t_{1 - alpha/2, df} + t_{power, df}) * sd / sqrt(n) (the usual normal-shift
approximation with t quantiles). A "within noise" verdict says nothing about effects smaller
than it.

Holm's step-down correction controls the chance of any false "agrees"/"disagrees" over a
family of claims (family-wise error) without assuming independence between them.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from scipy import stats as _stats

ALPHA = 0.05
POWER = 0.8


@dataclass(frozen=True)
class Paired:
    """A paired comparison (arm minus baseline) over the seeds both arms have."""
    n: int          # seeds in both arms
    d: float        # mean of the per-seed differences
    sd: float       # their sample standard deviation (nan for n < 2)
    se: float       # sd / sqrt(n)
    t: float        # d / se (nan for n < 2; +-inf when every difference is the same nonzero value)
    df: int         # n - 1
    p: float        # two-sided p of the paired t (nan for n < 2)
    mde: float      # smallest detectable |effect| at ALPHA, POWER (nan for n < 2)
    diffs: tuple    # the per-seed differences, in seed order


def paired(base: Mapping, arm: Mapping, alpha: float = ALPHA, power: float = POWER) -> Paired:
    """Paired t of arm - base over the seeds (keys) both have."""
    seeds = sorted(set(base) & set(arm), key=str)
    diffs = tuple(float(arm[s]) - float(base[s]) for s in seeds)
    n = len(diffs)
    if n == 0:
        raise ValueError("paired: no seed is in both arms")
    d = statistics.fmean(diffs)
    if n < 2:
        nan = float("nan")
        return Paired(n, d, nan, nan, nan, 0, nan, nan, diffs)
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    df = n - 1
    if se == 0:  # every seed moved by exactly the same amount
        t, p = (0.0, 1.0) if d == 0 else (math.copysign(math.inf, d), 0.0)
    else:
        t = d / se
        p = float(2 * _stats.t.sf(abs(t), df))
    mde = float((_stats.t.ppf(1 - alpha / 2, df) + _stats.t.ppf(power, df)) * se)
    return Paired(n, d, sd, se, t, df, p, mde, diffs)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the input order (nan stays nan and is not counted): the
    i-th smallest of m is multiplied by m - i (i from 0), made non-decreasing, capped at 1."""
    idx = sorted((i for i, p in enumerate(pvalues) if not math.isnan(p)), key=lambda i: pvalues[i])
    m, out, running = len(idx), [float("nan")] * len(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def verdict(d: float, p: float, sign: int, alpha: float = ALPHA) -> str:
    """"agrees" / "disagrees" (the direction relative to the claim's `sign`, +1: the paper says it
    grows) when p < alpha, else "within noise"; "one seed" without a p."""
    if math.isnan(p):
        return "one seed: " + ("no difference" if d == 0 else "paper's direction" if d * sign > 0
                               else "the other direction")
    if p < alpha:
        return "agrees" if d * sign > 0 else "disagrees"
    return "within noise"
