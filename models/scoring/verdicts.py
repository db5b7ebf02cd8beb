"""The per-image result a line acts on, from a raw score, its map and the calibration.

One function for ``padim predict`` and the HTTP service, so both give the same keys and the
same verdict. It fails closed: a NaN or infinite score or map raises
:class:`NonFiniteScoreError` instead of becoming "not anomalous".

NumPy only (no torch op): the service runs this on decode threads beside the inference thread,
where torch ops would each start an OpenMP team.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import overload

import numpy as np
import torch

from padim.core.calibration import Calibration, threshold_at
from padim.models.errors import NonFiniteScoreError as NonFiniteScoreError  # re-exported: raised here


@dataclass(frozen=True)
class Verdict:
    """What is known of one image.

    Attributes:
        score: 0 to 1, the calibrated score; ``threshold`` is where it is called anomalous.
        raw_score: the image score (Mahalanobis distance units; the maximum of the map unless the
            model reads it otherwise: ``image_score``).
        is_anomaly: ``score >= threshold`` (equivalently ``raw_score >= raw_threshold``).
        threshold: the threshold on the score scale (0.5 unless a request overrides it).
        raw_threshold: the same threshold in raw units (-inf at threshold 0, +inf at 1; ``None``
            in :meth:`to_dict`, as JSON has no infinity).
        anomalous_area: share of map pixels at or above ``raw_threshold``.
    """

    score: float
    raw_score: float
    is_anomaly: bool
    threshold: float
    raw_threshold: float
    anomalous_area: float

    def to_dict(self) -> dict:
        """The verdict's keys (only these: a subclass's other fields are left out)."""
        result = {f.name: getattr(self, f.name) for f in fields(Verdict)}
        if not math.isfinite(self.raw_threshold):
            result["raw_threshold"] = None
        return result


def verdict(
    raw_score: float, anomaly_map: torch.Tensor | np.ndarray, calibration: Calibration, threshold: float | None = None
) -> Verdict:
    """The verdict on one image.

    Args:
        raw_score: the image's raw score (by default the maximum of its map).
        anomaly_map: ``(H, W)`` raw map, at any resolution (a CPU tensor or an array).
        calibration: the model's calibration.
        threshold: a threshold on the score scale for this image (default: the model's, 0.5).

    Raises:
        NonFiniteScoreError: the score or the map holds a NaN or an infinity.
    """
    values = anomaly_map.numpy() if isinstance(anomaly_map, torch.Tensor) else np.asarray(anomaly_map)
    finite = bool(np.isfinite(values).all())
    over = int(pixels_over(values.reshape(1, -1), [calibration.raw_threshold(threshold)])[0]) if finite else 0
    return verdict_of(raw_score, over, values.size, finite, calibration, threshold)


@overload
def pixels_over(maps: np.ndarray, raw_thresholds: Sequence[float]) -> np.ndarray: ...
@overload
def pixels_over(maps: torch.Tensor, raw_thresholds: Sequence[float]) -> torch.Tensor: ...
def pixels_over(maps: np.ndarray | torch.Tensor, raw_thresholds: Sequence[float]) -> np.ndarray | torch.Tensor:
    """``(B, N)`` maps -> ``(B,)`` counts of each map's pixels at or above its image's raw threshold: the
    anomalous area, counted here for ``padim predict`` and the service alike.

    Each threshold is rounded to the maps' type before comparing (float32: what NumPy does to a Python float), so a
    map counts the same pixels wherever it is counted. A NumPy array is counted in NumPy (no torch op on a decode
    thread); a tensor where it lies (a GPU batch: the counts stay there, to come back with the batch's other
    numbers in one transfer).
    """
    thresholds = np.asarray(raw_thresholds, dtype=np.float64)
    if isinstance(maps, torch.Tensor):
        limits = torch.from_numpy(thresholds).to(device=maps.device, dtype=maps.dtype).view(-1, 1)
        return (maps >= limits).sum(1)
    return np.count_nonzero(maps >= thresholds.astype(maps.dtype)[:, None], axis=1)


def verdict_of(
    raw_score: float, over: int, pixels: int, finite: bool, calibration: Calibration, threshold: float | None = None
) -> Verdict:
    """The verdict on one image from what a scored batch counted of its map (:mod:`padim.service.device.batching`):
    ``over`` of its ``pixels`` at or above the raw threshold of ``threshold``, and whether the map was all finite.

    Raises:
        NonFiniteScoreError: the score or the map holds a NaN or an infinity.
    """
    raw_score = float(raw_score)
    if not math.isfinite(raw_score) or not finite:
        raise NonFiniteScoreError("the model gave a NaN or infinite score; no verdict")
    threshold = threshold_at(threshold)
    raw_threshold = calibration.raw_threshold(threshold)
    return Verdict(
        score=calibration.score(raw_score),
        raw_score=raw_score,
        is_anomaly=raw_score >= raw_threshold,
        threshold=threshold,
        raw_threshold=raw_threshold,
        anomalous_area=float(over / pixels),
    )
