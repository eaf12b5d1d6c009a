"""decode/common/metrics.py on hand-made numbers: every reported metric, its edge cases and the speed-up warnings."""
import math

import pytest

from decode.common import metrics


def test_mat_tokens_per_s_and_speedup():
    assert metrics.mat(10, 4) == 2.5
    assert metrics.mat(7, 7) == 1.0  # autoregressive: one forward per token
    assert metrics.mat(0, 0) == 0.0 and metrics.mat(5, 0) == 0.0  # no forwards: nothing measured
    assert metrics.tokens_per_s(50, 2.0) == 25.0
    assert metrics.tokens_per_s(5, 0.0) == 0.0 and metrics.tokens_per_s(5, -1.0) == 0.0
    assert metrics.speedup(30.0, 20.0) == 1.5
    assert metrics.speedup(30.0, 0.0) == 0.0  # no baseline: no ratio


def test_acceptance_rate_and_hm():
    assert metrics.acceptance_rate(3, 4) == 0.75
    assert metrics.acceptance_rate(0, 0) == 0.0  # nothing drafted (autoregressive)
    # v = 3/4, r = 3/6 → 2·0.75·0.5 / 1.25 = 0.6
    assert metrics.harmonic_mean_metric(3, 4, 6) == pytest.approx(0.6)
    assert metrics.harmonic_mean_metric(0, 0, 0) == 0.0
    assert metrics.harmonic_mean_metric(0, 5, 5) == 0.0  # every draft rejected


def test_regret_best_arm_ratio_and_pull_counts():
    assert metrics.stopping_time_regret(10, [8, 12]) == 2
    assert metrics.stopping_time_regret(8, [8, 12]) == 0
    with pytest.raises(ValueError, match="fixed arm"):
        metrics.stopping_time_regret(10, [])
    assert metrics.best_arm_ratio([1, 1, 0], 1) == pytest.approx(2 / 3)
    assert metrics.best_arm_ratio([], 0) == 0.0
    assert metrics.pull_counts([0, 2, 2], ["a", "b", "c"]) == {"a": 1, "b": 0, "c": 2}
    assert metrics.pull_counts([], ["a"]) == {"a": 0}
    with pytest.raises(ValueError, match="outside"):  # a pull of an unknown arm is not silently dropped
        metrics.pull_counts([0, 5], ["a", "b"])


def test_coefficient_of_variation():
    assert metrics.coefficient_of_variation([10, 10, 10]) == 0.0
    assert metrics.coefficient_of_variation([10]) == 0.0 and metrics.coefficient_of_variation([]) == 0.0
    assert metrics.coefficient_of_variation([0, 0]) == 0.0
    assert metrics.coefficient_of_variation([10, 30]) == pytest.approx(math.sqrt(200) / 20)


STEADY = [20.0, 21.0, 19.5, 20.5]


def test_speedup_warnings_quiet_on_a_clean_run():
    assert metrics.speedup_warnings(STEADY, 1000, [("arm:pld", 2.4, 2.0), ("autoregressive", 1.05, 1.0)]) == []


def test_speedup_warnings_flag_short_noisy_and_implausible_runs():
    few = metrics.speedup_warnings(STEADY, 40, [])
    assert len(few) == 1 and "40 tokens" in few[0]
    one = metrics.speedup_warnings([20.0], 1000, [])
    assert len(one) == 1 and "one prompt" in one[0]
    noisy = metrics.speedup_warnings([10.0, 30.0, 10.0, 30.0], 1000, [])
    assert len(noisy) == 1 and "varies" in noisy[0]
    # the reported case: 17× at MAT 3 cannot come from decoding
    wild = metrics.speedup_warnings(STEADY, 1000, [("arm:pld", 17.0, 3.0), ("arm:suffix", 3.2, 3.0)])
    assert len(wild) == 1 and wild[0].startswith("arm:pld: speed-up 17.00×")


def test_speedup_bound_scales_with_the_step_cost_ratio():
    """A loop whose forward is cheaper than the reference's (ratio 2) may legitimately reach MAT × 2."""
    cells = [("arm:pld", 5.0, 3.0)]
    assert metrics.speedup_warnings(STEADY, 1000, cells, step_cost_ratio=2.0) == []
    assert metrics.speedup_warnings(STEADY, 1000, [("arm:pld", 9.5, 3.0)], step_cost_ratio=2.0)
    # a slower loop never tightens the bound below MAT × slack
    assert metrics.speedup_warnings(STEADY, 1000, [("arm:pld", 4.0, 3.0)], step_cost_ratio=0.5) == []
