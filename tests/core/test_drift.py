"""Drift tests against scipy's (binomial tail, one-sided KS, PSI by hand), and their level on normal windows."""

import numpy as np
import pytest
import torch
from scipy import stats

from padim.core.calibration import Calibration
from padim.core.drift import LEVEL, assess, binomial_tail, histogram, ks_greater, population_stability


@pytest.mark.parametrize(
    "k,n,p",
    [
        (0, 10, 0.1),
        (1, 10, 0.1),
        (3, 10, 0.1),
        (7, 40, 0.019),
        (40, 2000, 0.019),
        (60, 2000, 0.019),
        (10, 10, 0.5),
        (11, 10, 0.5),
        (5, 100, 0.0),
        (5, 100, 1.0),
    ],
)
def test_binomial_tail_is_scipys_survival_function(k, n, p):
    assert binomial_tail(k, n, p) == pytest.approx(stats.binom.sf(k - 1, n, p), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize(
    "shift,n,m", [(0.0, 200, 300), (0.3, 200, 300), (-0.3, 50, 1000), (0.1, 1000, 60), (1.0, 40, 40)]
)
def test_ks_greater_is_scipys_one_sided_asymptotic_test(shift, n, m):
    rng = np.random.default_rng(int(100 * shift) + n)
    reference, recent = rng.standard_normal(m), rng.standard_normal(n) + shift
    statistic, p_value = ks_greater(torch.from_numpy(recent), torch.from_numpy(reference))
    # scipy: "greater" means the first sample's CDF lies above the second's, i.e. the second runs higher
    expected = stats.ks_2samp(reference, recent, alternative="greater", method="asymp")
    assert statistic == pytest.approx(expected.statistic, abs=1e-12)
    assert p_value == pytest.approx(expected.pvalue, rel=1e-9)


def test_ks_greater_only_fires_towards_higher_values():
    rng = np.random.default_rng(1)
    reference = torch.from_numpy(rng.standard_normal(500))
    assert ks_greater(torch.from_numpy(rng.standard_normal(500) + 0.5), reference)[1] < 1e-6
    assert ks_greater(torch.from_numpy(rng.standard_normal(500) - 0.5), reference)[1] > 0.5  # lower: not drift


def test_population_stability_on_the_reference_deciles_by_hand():
    rng = np.random.default_rng(2)
    reference, recent = rng.standard_normal(1000), rng.standard_normal(400) + 0.4
    edges = np.quantile(reference, np.arange(1, 10) / 10)
    e = np.bincount(np.searchsorted(edges, reference, side="right"), minlength=10) / len(reference)
    a = np.bincount(np.searchsorted(edges, recent, side="right"), minlength=10) / len(recent)
    e, a = np.maximum(e, 1e-4), np.maximum(a, 1e-4)
    expected = float(np.sum((a - e) * np.log(a / e)))
    assert population_stability(torch.from_numpy(recent), torch.from_numpy(reference)) == pytest.approx(
        expected, rel=1e-9
    )
    assert population_stability(torch.from_numpy(reference), torch.from_numpy(reference)) == pytest.approx(
        0.0, abs=1e-3
    )


def test_histogram_puts_outliers_in_the_end_bins():
    assert histogram([-1.0, 0.05, 0.5, 0.99, 2.0], [0.0, 0.25, 0.5, 0.75, 1.0]) == [2, 0, 1, 2]
    assert histogram([], [0.0, 0.5, 1.0]) == [0, 0]


def _calibration(rng, count=200, rate=0.02):
    scores = torch.from_numpy(rng.gumbel(10.0, 1.0, count))
    inputs = torch.from_numpy(rng.normal(100.0, 5.0, count))
    return Calibration.from_scores(scores, rate, input_distances=inputs)


def test_a_window_too_small_is_collecting_and_a_normal_one_is_normal():
    rng = np.random.default_rng(3)
    calibration = _calibration(rng)
    few = assess(torch.from_numpy(rng.gumbel(10.0, 1.0, 10)), calibration, min_images=30)
    assert few.status == "collecting" and few.flag_rate is None and "10 images of the 30" in few.verdict
    window = assess(
        torch.from_numpy(rng.gumbel(10.0, 1.0, 500)), calibration, torch.from_numpy(rng.normal(100.0, 5.0, 500))
    )
    assert window.status == "normal" and window.alarms == [] and window.flag_rate.basis == "promised"
    assert window.flag_rate.normal_rate == calibration.false_alarm_bound
    assert "within what the model promised" in window.verdict
    as_json = window.to_dict()
    assert (
        as_json["flag_rate"]["flags"] == window.flag_rate.flags and as_json["alarms"] == [] and as_json["images"] == 500
    )


def test_a_rate_above_the_bound_but_not_significant_is_not_called_within_it():
    rng = np.random.default_rng(5)
    calibration = _calibration(rng)
    bound, threshold = calibration.false_alarm_bound, calibration.threshold
    count = 40
    flags = int(np.floor(bound * count)) + 1  # just above the bound: rate > bound, far from significant
    scores = torch.tensor([threshold + 1.0] * flags + [threshold - 1.0] * (count - flags), dtype=torch.float64)
    window = assess(scores, calibration)
    assert window.flag_rate.rate > bound and not window.flag_rate.alarm
    assert window.flag_rate.p_value == pytest.approx(stats.binom.sf(flags - 1, count, bound))
    assert "within what" not in window.verdict and "above what the model promised" in window.verdict
    assert "not significantly" in window.verdict


def test_each_drift_moves_its_own_test():
    rng = np.random.default_rng(4)
    calibration = _calibration(rng)
    n = 400
    normal_scores, normal_inputs = rng.gumbel(10.0, 1.0, n), rng.normal(100.0, 5.0, n)
    # a defect wave: a tenth of the images score far above the threshold, inputs as before
    wave = normal_scores.copy()
    wave[: n // 10] += 20
    reading = assess(torch.from_numpy(wave), calibration, torch.from_numpy(normal_inputs))
    assert reading.flag_rate.alarm and not reading.input_drift.alarm and reading.status == "alarm"
    assert "more flags than normal images alone would give" in reading.verdict
    # lighting: every input distance up, scores a little
    reading = assess(torch.from_numpy(normal_scores + 0.8), calibration, torch.from_numpy(normal_inputs * 1.2))
    assert reading.input_drift.alarm and reading.score_drift.alarm and reading.input_drift.median_ratio > 1.15
    assert "look unlike the training images" in reading.verdict
    assert "padim train --expect" in reading.verdict and "padim train --resume" in reading.verdict  # the two fixes
    # without input distances (an older model): no input drift reading, said so
    reading = assess(torch.from_numpy(normal_scores), calibration, None)
    assert reading.input_drift is None and "predates input distances" in reading.verdict


def test_a_manual_threshold_is_tested_against_its_own_bound_on_the_normal_scores():
    rng = np.random.default_rng(5)
    manual = _calibration(rng).with_threshold(12.0)
    reading = assess(torch.from_numpy(rng.gumbel(10.0, 1.0, 300)), manual)
    assert reading.flag_rate.basis == "manual" and reading.flag_rate.normal_rate == manual.false_alarm_bound
    assert "manual threshold, no promise" in reading.verdict


def test_on_normal_images_each_alarm_fires_at_most_at_its_level_over_disjoint_windows():
    """Many calibration sets, many disjoint windows of new normal values each: alarms at most LEVEL (plus noise).

    Scores and input distances come from the distributions the calibration values came from, as new
    normal images do (out-of-fold scores run slightly high in a real model, which only lowers the rate).
    """
    rng = np.random.default_rng(6)
    windows, fired = 0, {"flag_rate": 0, "score_drift": 0, "input_drift": 0}
    for _ in range(20):
        calibration = _calibration(rng, count=300, rate=0.02)
        for _ in range(50):
            reading = assess(
                torch.from_numpy(rng.gumbel(10.0, 1.0, 200)), calibration, torch.from_numpy(rng.normal(100.0, 5.0, 200))
            )
            windows += 1
            for name in reading.alarms:
                fired[name] += 1
    # 1000 windows at level 0.01: 10 expected; above 20 would happen by chance with p < 0.003 (Poisson)
    for name, count in fired.items():
        assert count <= 2 * LEVEL * windows, (name, count)
    assert fired["flag_rate"] <= 10  # tested against the 95% bound: well under the level
