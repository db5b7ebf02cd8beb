"""The per-image verdict, recomputed by hand; it fails closed on NaN and infinity."""

import json
import math

import numpy as np
import pytest
import torch

from padim.core.calibration import Calibration
from padim.models.scoring.verdicts import NonFiniteScoreError, pixels_over, verdict

CALIBRATION = Calibration.from_scores(torch.linspace(10.0, 20.0, 50, dtype=torch.float64), 0.01)


def test_verdict_against_a_hand_computation():
    anomaly_map = np.full((8, 8), 5.0, dtype=np.float32)
    anomaly_map[:2, :3] = CALIBRATION.threshold + 1  # 6 of 64 pixels over the threshold
    raw = float(anomaly_map.max())
    result = verdict(raw, torch.from_numpy(anomaly_map), CALIBRATION)
    assert (
        result.is_anomaly and result.threshold == 0.5 and result.raw_threshold == pytest.approx(CALIBRATION.threshold)
    )
    assert result.score == pytest.approx(1 / (1 + math.exp(-(raw - CALIBRATION.threshold) / CALIBRATION.scale)))
    assert result.anomalous_area == 6 / 64
    assert set(result.to_dict()) == {"score", "raw_score", "is_anomaly", "threshold", "raw_threshold", "anomalous_area"}


def test_a_stricter_threshold_for_one_image():
    anomaly_map = np.full((4, 4), CALIBRATION.threshold + 0.1)
    relaxed, strict = (verdict(float(anomaly_map.max()), anomaly_map, CALIBRATION, t) for t in (0.5, 0.9))
    assert relaxed.is_anomaly and relaxed.anomalous_area == 1.0
    assert not strict.is_anomaly and strict.anomalous_area == 0.0
    assert strict.raw_threshold == pytest.approx(CALIBRATION.threshold + CALIBRATION.scale * math.log(9))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scores_or_maps_give_no_verdict(bad):
    with pytest.raises(NonFiniteScoreError):
        verdict(bad, np.zeros((4, 4)), CALIBRATION)
    anomaly_map = np.zeros((4, 4))
    anomaly_map[1, 2] = bad
    with pytest.raises(NonFiniteScoreError):
        verdict(1.0, anomaly_map, CALIBRATION)


def test_threshold_zero_and_one_have_no_finite_raw_value():
    values = np.full((4, 4), 3.0)
    everything = verdict(3.0, values, CALIBRATION, threshold=0.0)
    nothing = verdict(3.0, values, CALIBRATION, threshold=1.0)
    assert everything.is_anomaly and everything.anomalous_area == 1.0
    assert not nothing.is_anomaly and nothing.anomalous_area == 0.0
    assert everything.to_dict()["raw_threshold"] is None and nothing.to_dict()["raw_threshold"] is None
    json.dumps(everything.to_dict(), allow_nan=False)  # valid JSON: no Infinity


def test_the_anomalous_area_is_counted_alike_in_numpy_and_in_torch():
    """One count for predict (NumPy) and a scored batch on its device (torch): each map against its own threshold,
    the threshold rounded to the map's float32 as NumPy rounds a Python float, the boundary pixel counted."""
    maps = np.array([[0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 2.0, 3.0]], dtype=np.float32)
    # a hair above float32(0.3) in float64: rounded to float32 it is that pixel's value, which is then at it
    thresholds = [float(np.float32(0.3)) + 1e-9, 1.0]
    counted = pixels_over(maps, thresholds)
    assert counted.tolist() == [2, 4]
    assert pixels_over(torch.from_numpy(maps), thresholds).tolist() == [2, 4]
    assert pixels_over(maps, [-math.inf, math.inf]).tolist() == [4, 0]
    result = verdict(3.0, maps[1].reshape(2, 2), CALIBRATION, threshold=0.0)  # a map as predict hands it
    assert result.anomalous_area == 1.0
