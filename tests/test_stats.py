"""analysis.stats: the paired t and its interval against scipy, the mean's t interval, Holm's
correction, the verdict words and the pandas summary over seeds."""
import math
import statistics

import pandas as pd
import pytest
from scipy import stats

from analysis.stats import decisive_level, describe, holm, interval_text, paired, summarize, verdict


def test_paired_t_is_scipys_ttest_rel_on_the_common_seeds():
    base = {0: 94.1, 1: 95.0, 2: 93.8, 3: 94.9, 9: 50.0}   # seed 9 has no partner: left out
    arm = {0: 95.2, 1: 95.9, 2: 94.0, 3: 96.1, 7: 99.0}
    r = paired(base, arm)
    ref = stats.ttest_rel([arm[s] for s in range(4)], [base[s] for s in range(4)])
    assert r.n == 4 and r.df == 3 == ref.df
    assert r.t == pytest.approx(ref.statistic) and r.p == pytest.approx(ref.pvalue)
    assert r.d == pytest.approx((1.1 + 0.9 + 0.2 + 1.2) / 4)
    assert r.diffs == pytest.approx((1.1, 0.9, 0.2, 1.2))
    ci = ref.confidence_interval(0.95)  # the 95% interval with 3 degrees of freedom: +-3.18 se
    assert (r.lo, r.hi) == pytest.approx((ci.low, ci.high))
    assert r.hi - r.d == pytest.approx(stats.t.ppf(0.975, 3) * r.se) and r.hi - r.d > 3.1 * r.se


def test_the_mean_interval_is_students_t():
    xs = [3.0, 4.5, 2.5, 5.0, 4.0]
    s = describe(xs)
    assert (s.mean, s.n, s.df) == (statistics.fmean(xs), 5, 4)
    assert s.sd == pytest.approx(statistics.stdev(xs)) and s.se == pytest.approx(s.sd / math.sqrt(5))
    lo, hi = stats.t.interval(0.95, 4, loc=s.mean, scale=stats.sem(xs))
    assert (s.lo, s.hi) == pytest.approx((lo, hi))
    one = describe([7.0])
    assert one.mean == 7.0 and one.n == 1 and math.isnan(one.lo) and math.isnan(one.sd)
    same = describe([2.0, 2.0])  # no spread: the interval is the point
    assert (same.lo, same.hi) == (2.0, 2.0)
    assert interval_text(s.mean, s.lo, s.hi, s.n, ".2f") == f"3.80 [{lo:.2f}, {hi:.2f}] (5, df 4)"
    assert interval_text(-0.5, math.nan, math.nan, 1, ".2f", signed=True) == "-0.50 (1)"


def test_summarize_pools_groups_as_describe_does():
    frame = pd.DataFrame({"k": [0, 0, 0, 3, 3], "mode": [None] * 5, "seed": [0, 1, 2, 0, 1],
                          "run_dir": list("abcde"), "value": [1.0, 2.0, 4.0, 5.0, 5.5]})
    out = summarize(frame, ["k", "mode"])
    assert list(out["k"]) == [0, 3] and list(out["n"]) == [3, 2]  # a None field keeps its runs
    for _, row in out.iterrows():
        want = describe(frame[frame.k == row.k]["value"])
        assert (row["mean"], row["lo"], row["hi"]) == pytest.approx((want.mean, want.lo, want.hi))
    assert out.iloc[0]["seeds"] == [0, 1, 2] and out.iloc[1]["values"] == [5.0, 5.5]


def test_holm_adjusts_step_down_in_the_input_order():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    adj = holm([0.2, float("nan"), 0.01])  # nan is neither adjusted nor counted
    assert math.isnan(adj[1]) and adj[0] == pytest.approx(0.2) and adj[2] == pytest.approx(0.02)
    assert holm([0.9, 0.8]) == [1.0, 1.0] and holm([0.3, 0.02]) == pytest.approx([0.3, 0.04])  # capped, monotone
    ps = [0.04, 0.001, 0.03, 0.2, 0.011]
    adj = holm(ps)
    order = sorted(range(5), key=lambda i: ps[i])
    assert [adj[i] for i in order] == sorted(adj) and all(a >= p for a, p in zip(adj, ps))


def test_degenerate_pairs_and_verdicts():
    one = paired({0: 1.0}, {0: 2.0})
    assert one.n == 1 and math.isnan(one.p) and verdict(one, +1) == "one seed: no test"
    same = paired({0: 1.0, 1: 2.0}, {0: 2.0, 1: 3.0})  # every seed moved by exactly +1
    assert same.p == 0.0 and same.t == math.inf and verdict(same, -1) == "disagrees [+1, +1] (95%)"
    assert (same.lo, same.hi) == (1.0, 1.0)
    r = paired({0: 0.0, 1: 0.0, 2: 0.0}, {0: 0.5, 1: -0.1, 2: 0.9})
    assert verdict(r, +1) == f"inconclusive [{r.lo:+.3g}, {r.hi:+.3g}] (95%)" and r.lo < 0 < r.hi
    down = paired({s: 1.0 for s in range(4)}, {0: 0.5, 1: 0.45, 2: 0.52, 3: 0.48})
    assert verdict(down, -1).startswith("agrees [") and verdict(down, +1).startswith("disagrees [")
    assert verdict(down, -1, p=0.2).startswith("inconclusive [")  # Holm's p decides when given
    assert verdict(None, +1) == "not measured"
    with pytest.raises(ValueError, match="no seed is in both arms"):
        paired({0: 1.0}, {1: 1.0})


def test_the_interval_at_the_verdicts_level_excludes_0_exactly_when_holm_decides():
    """decisive_level: Bonferroni's level at Holm's step (a family of one: 95%; the smallest p of
    three: 1 - 0.05 / 3), and over many random families the interval at it excludes 0 exactly when
    Holm's p < 0.05; Paired.at(0.95) is paired()'s own interval, scipy's ttest_rel one."""
    import numpy as np

    assert decisive_level(0.01, 0.01) == pytest.approx(0.95)
    assert decisive_level(0.01, 0.03) == pytest.approx(1 - 0.05 / 3)
    rng = np.random.default_rng(0)
    decided = 0
    for _ in range(200):
        tests = [paired(dict(enumerate(rng.normal(size=5))), dict(enumerate(rng.normal(2.5 * rng.random(), size=5))))
                 for _ in range(4)]
        for t, hp in zip(tests, holm([t.p for t in tests])):
            lo, hi = t.at(decisive_level(t.p, hp))
            assert (lo > 0 or hi < 0) == (hp < 0.05)
            decided += hp < 0.05
    assert 100 < decided < 700  # both kinds of verdict were tried
    r = paired({0: 1.0, 1: 2.0, 2: 4.0}, {0: 1.5, 1: 2.1, 2: 5.0})
    ci = stats.ttest_rel([1.5, 2.1, 5.0], [1.0, 2.0, 4.0]).confidence_interval(0.99)
    assert r.at(0.95) == pytest.approx((r.lo, r.hi)) and r.at(0.99) == pytest.approx((ci.low, ci.high))
