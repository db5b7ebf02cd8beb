import math

import pytest
import torch

from padim.core.calibration import Calibration, holdout_key, split_holdout


def test_holdout_is_per_image_and_stable_when_images_are_added():
    names = [f"img_{i:04d}.png" for i in range(500)]
    fit, held = split_holdout(names, fraction=0.1, minimum=3)
    assert sorted(fit + held) == list(range(500))
    assert 30 <= len(held) <= 70  # about 10%
    more = names + [f"new_{i}.png" for i in range(100)]
    _, held_more = split_holdout(more, fraction=0.1, minimum=3)
    assert {names[i] for i in held} == {more[i] for i in held_more if i < 500}
    assert all(holdout_key(names[i]) < 0.1 for i in held)


def test_holdout_minimum_and_at_least_two_to_fit():
    names = [f"{i}.png" for i in range(6)]
    fit, held = split_holdout(names, fraction=0.0, minimum=3)
    assert len(held) == 3 and len(fit) == 3
    fit, held = split_holdout(names[:3], fraction=0.0, minimum=3)
    assert len(fit) == 2 and len(held) == 1


def test_threshold_is_quantile_and_maps_to_one_half():
    scores = torch.arange(1.0, 101.0)
    cal = Calibration.from_normal_scores(scores, quantile=0.99)
    assert cal.threshold == pytest.approx(float(torch.quantile(scores.double(), 0.99)))
    assert float(cal.normalise(torch.tensor(cal.threshold, dtype=torch.float64))) == pytest.approx(0.5)
    values = cal.normalise(torch.linspace(-100, 300, 50, dtype=torch.float64))
    assert torch.all(values[1:] >= values[:-1]) and values.min() >= 0 and values.max() <= 1


def test_raw_threshold_inverts_normalise():
    cal = Calibration.from_normal_scores(torch.tensor([1.0, 2.0, 4.0, 8.0]), quantile=0.9)
    for t in (0.1, 0.5, 0.9):
        raw = cal.raw_threshold(t)
        assert float(cal.normalise(torch.tensor(raw, dtype=torch.float64))) == pytest.approx(t)
    assert cal.raw_threshold(0.0) == -math.inf
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        cal.raw_threshold(1.5)


def test_with_threshold_keeps_scores():
    cal = Calibration.from_normal_scores(torch.tensor([1.0, 2.0, 3.0]), 0.5).with_threshold(7.0)
    assert cal.threshold == 7.0 and cal.quantile is None and cal.normal_scores == (1.0, 2.0, 3.0)
