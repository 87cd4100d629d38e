"""Statistics over seeds, in one place: a mean with its t-based 95% interval, the paired
difference of two arms, Holm's correction, the interval at a Holm verdict's level and the verdict
words. Every table, figure band and report of analysis/ takes its mean, spread and interval from
here.

    from analysis.stats import describe, holm, paired, summarize, verdict
    describe([94.1, 95.0, 93.8])                       # Summary(mean, sd, se, n, df, lo, hi)
    t = paired({0: 94.1, 1: 95.0, 2: 93.8}, {0: 95.2, 1: 95.9, 2: 94.0})   # {seed: value} per arm
    t.d, t.lo, t.hi, t.df, t.t, t.p                    # arm - base, its 95% interval, ...
    holm([0.01, 0.04, 0.03])                           # adjusted p-values
    level = decisive_level(t.p, holm_p)                # the confidence whose interval decides as Holm does
    t.at(level)                                        # (lo, hi) of the difference at that level
    verdict(t, sign=+1, p=holm_p, level=level)         # "agrees [lo, hi] (97.5%)", disagrees, inconclusive
    summarize(frame, by=["k", "layer"])                # pandas: the same numbers per group
"""
import math
from dataclasses import asdict, dataclass, replace
from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd
from scipy import stats as _stats

LEVEL = 0.95  # the confidence of every interval
ALPHA = 0.05  # the level that decides a verdict (after Holm, where a family is declared)


@dataclass(frozen=True)
class Summary:
    """A sample of values (seeds): mean, sample sd (ddof=1), se = sd / sqrt(n), df = n - 1 and
    the t-based LEVEL interval [lo, hi] of the mean; sd, se, lo and hi are NaN for one value."""
    mean: float
    sd: float
    se: float
    n: int
    df: int
    lo: float
    hi: float


def describe(values: Sequence[float], level: float = LEVEL) -> Summary:
    """The mean of `values` and its t interval (Student's t with n - 1 degrees of freedom:
    seeds are few, so the normal's 1.96 would be too narrow; at n = 4 the factor is 3.18)."""
    x = np.asarray(list(values), dtype=float)
    n, nan = len(x), float("nan")
    if n == 0:
        raise ValueError("describe: no values")
    mean = float(x.mean())
    if n < 2:
        return Summary(mean, nan, nan, 1, 0, nan, nan)
    sd = float(x.std(ddof=1))
    se = sd / math.sqrt(n)
    # scipy refuses a zero scale: every seed gave the same value, the interval is that point
    # scipy's t quantiles: the interval of the mean with n - 1 degrees of freedom
    lo, hi = _stats.t.interval(level, n - 1, loc=mean, scale=se) if se > 0 else (mean, mean)
    return Summary(mean, sd, se, n, n - 1, float(lo), float(hi))


def summarize(frame: pd.DataFrame, by: Sequence[str], value: str = "value", level: float = LEVEL) -> pd.DataFrame:
    """One row per group of `frame` (the tidy table of analysis.runs): the `by` columns, the
    Summary fields of its `value`s, and the pooled values, seeds and run folders as lists."""
    # dropna=False: a field that is None for every run (e.g. no mode) must not drop its runs
    # sort=False: groups in the frame's order (the caller sorts); describe() is the one place the
    # numbers come from, so a table's cell equals a report's
    rows = [{**dict(zip(by, key)), **asdict(describe(g[value], level)), "values": g[value].tolist(),
             "seeds": g["seed"].tolist() if "seed" in g else None,
             "run_dirs": g["run_dir"].tolist() if "run_dir" in g else None}
            for key, g in frame.groupby(list(by), dropna=False, sort=False)]
    return pd.DataFrame(rows, columns=[*by, *Summary.__dataclass_fields__, "values", "seeds", "run_dirs"])


@dataclass(frozen=True)
class Paired(Summary):
    """arm - base over the seeds both arms have: the Summary of the per-seed differences (its
    mean is d), their t (+-inf when every seed moved by the same nonzero amount), its two-sided
    p (NaN for one seed) and the differences in seed order."""
    t: float
    p: float
    diffs: tuple

    @property
    def d(self) -> float:
        return self.mean

    def at(self, level: float) -> tuple[float, float]:
        """(lo, hi): the interval of d at confidence `level`, scipy's, as `paired`'s at LEVEL (the
        point when every seed moved by the same amount)."""
        if self.n < 2:  # one seed: no interval (scipy would warn of df 0)
            return self.lo, self.hi
        # the one-sample t of the differences is ttest_rel by definition: the same interval
        return tuple(float(v) for v in _stats.ttest_1samp(self.diffs, 0.0).confidence_interval(level))


def paired(base: Mapping, arm: Mapping, level: float = LEVEL) -> Paired:
    """The paired t of arm - base over the seeds (keys) both have: scipy.stats.ttest_rel, its
    statistic, p and confidence_interval(level)."""
    # paired: the arms of a seed share the data order and the initial weights (a Laplacian head adds
    # no parameter, so k changes no draw): the per-seed differences remove the spread both share.
    # Only the seeds both arms have: a pair is the unit, a seed without its partner says nothing.
    seeds = sorted(set(base) & set(arm), key=str)
    a, b = [float(arm[s]) for s in seeds], [float(base[s]) for s in seeds]
    diffs = tuple(x - y for x, y in zip(a, b))
    if not diffs:
        raise ValueError("paired: no seed is in both arms")
    s = describe(diffs, level)  # mean, sd, se, n and df of the differences
    if s.n < 2:
        t, p = float("nan"), float("nan")
    elif s.se == 0:  # every seed moved by exactly the same amount: the point (all 0: scipy's t is NaN)
        t, p = (0.0, 1.0) if s.mean == 0 else (math.copysign(math.inf, s.mean), 0.0)
    else:
        r = _stats.ttest_rel(a, b)
        t, p, ci = float(r.statistic), float(r.pvalue), r.confidence_interval(level)
        s = replace(s, lo=float(ci.low), hi=float(ci.high))
    return Paired(**asdict(s), t=t, p=p, diffs=diffs)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the input order (NaN stays NaN and is not counted). By hand:
    scipy has no Holm, and the rule is one line of numpy: the i-th smallest of m is multiplied by
    m - i (i from 0), then made non-decreasing and capped at 1."""
    p = np.asarray(pvalues, dtype=float)
    idx = np.flatnonzero(~np.isnan(p))
    idx = idx[np.argsort(p[idx], kind="stable")]  # ascending p, ties in the input order
    out = np.full(len(p), np.nan)
    out[idx] = np.maximum.accumulate(np.minimum(1.0, (len(idx) - np.arange(len(idx))) * p[idx]))
    return out.tolist()


def decisive_level(p: float, adjusted: float, alpha: float = ALPHA) -> float:
    """The confidence whose interval of d excludes 0 exactly when the Holm-adjusted p is below
    alpha: 1 - alpha p / adjusted. Where Holm multiplied p by the m - i hypotheses left at its step,
    this is the Bonferroni interval at that step's level, 1 - alpha / (m - i) (a family of one:
    95%); where Holm's monotone step raised p further, the interval widens with it."""
    # an interval excludes 0 at level 1 - g exactly when p < g, so g = alpha p / adjusted decides
    # as adjusted < alpha does (simultaneous Bonferroni intervals at m would be wider than Holm
    # needs, and could show an interval covering 0 beside a significant verdict)
    if math.isnan(p) or math.isnan(adjusted) or adjusted <= 0:
        return 1 - alpha
    return 1 - alpha * p / adjusted


def verdict(test: Optional[Paired], sign: int, p: Optional[float] = None, alpha: float = ALPHA,
            level: float = LEVEL) -> str:
    """"agrees" / "disagrees" when p < alpha (the claim's direction `sign`: +1, the paper says it
    grows; -1, it falls), else "inconclusive", each followed by the interval of the difference at
    `level` ("[lo, hi] (97.5%)"). `p` is the deciding p (Holm's, in a family; default the test's
    own) and `level` its `decisive_level`, so the interval excludes 0 exactly when the verdict is
    not inconclusive. A non-significant test rules nothing out by itself: the interval says which
    effects remain possible."""
    if test is None:
        return "not measured"
    p = test.p if p is None else p
    if math.isnan(p):
        return "one seed: no test"
    lo, hi = test.at(level)
    # the direction of d, not its size, says agrees or disagrees: the interval gives the size
    word = "inconclusive" if p >= alpha else "agrees" if test.d * sign > 0 else "disagrees"
    return f"{word} [{lo:+.3g}, {hi:+.3g}] ({100 * level:.3g}%)"  # 95%, 97.5%, 98.3%


def interval_text(mean: float, lo: float, hi: float, n: Optional[int], fmt: str = ".3g", signed: bool = False) -> str:
    """'mean [lo, hi] (n, df n - 1)', or 'mean (n)' without an interval (one seed): the df says
    how wide a t interval of n values is (at n = 4, +-3.18 se)."""
    f = ("+" if signed else "") + fmt
    if not n or n < 2 or math.isnan(lo):
        return f"{mean:{f}} ({n})"
    return f"{mean:{f}} [{lo:{f}}, {hi:{f}}] ({n}, df {n - 1})"
