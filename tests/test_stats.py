"""analysis.stats: the paired t, Holm's correction and the smallest detectable effect."""
import math

import pytest
from scipy import stats

from analysis.stats import holm, paired, verdict


def test_paired_t_is_scipys_ttest_rel_on_the_common_seeds():
    base = {0: 94.1, 1: 95.0, 2: 93.8, 3: 94.9, 9: 50.0}   # seed 9 has no partner: left out
    arm = {0: 95.2, 1: 95.9, 2: 94.0, 3: 96.1, 7: 99.0}
    r = paired(base, arm)
    ref = stats.ttest_rel([arm[s] for s in range(4)], [base[s] for s in range(4)])
    assert r.n == 4 and r.df == 3
    assert r.t == pytest.approx(ref.statistic) and r.p == pytest.approx(ref.pvalue)
    assert r.d == pytest.approx((1.1 + 0.9 + 0.2 + 1.2) / 4)
    assert r.diffs == pytest.approx((1.1, 0.9, 0.2, 1.2))


def test_the_smallest_detectable_effect_has_about_the_asked_power():
    r = paired({s: 0.0 for s in range(5)}, {0: 0.3, 1: -0.2, 2: 0.5, 3: 0.1, 4: -0.4})
    # exact power of the two-sided paired t at a true shift of mde with sd = r.sd
    crit = stats.t.ppf(0.975, r.df)
    nc = r.mde / r.se
    power = stats.nct.sf(crit, r.df, nc) + stats.nct.cdf(-crit, r.df, nc)
    assert 0.75 < power < 0.85
    assert r.mde > 2 * r.se  # always above the significance threshold itself


def test_holm_adjusts_step_down_in_the_input_order():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    adj = holm([0.2, float("nan"), 0.01])  # nan is neither adjusted nor counted
    assert math.isnan(adj[1]) and adj[0] == pytest.approx(0.2) and adj[2] == pytest.approx(0.02)
    assert holm([0.9, 0.8]) == [1.0, 1.0] and holm([0.3, 0.02]) == pytest.approx([0.3, 0.04])  # capped, monotone


def test_degenerate_pairs_and_verdicts():
    one = paired({0: 1.0}, {0: 2.0})
    assert one.n == 1 and math.isnan(one.p) and verdict(one.d, one.p, +1) == "one seed: paper's direction"
    same = paired({0: 1.0, 1: 2.0}, {0: 2.0, 1: 3.0})  # every seed moved by exactly +1
    assert same.p == 0.0 and same.t == math.inf and verdict(same.d, same.p, -1) == "disagrees"
    assert verdict(0.5, 0.2, +1) == "within noise" and verdict(-0.5, 0.01, -1) == "agrees"
    with pytest.raises(ValueError, match="no seed is in both arms"):
        paired({0: 1.0}, {1: 1.0})
