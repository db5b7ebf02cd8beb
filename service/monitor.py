"""What a served model answered lately, read against its calibration (:mod:`padim.core.drift`).

Per model, a ring of the last ``PADIM_MONITOR_WINDOW`` images' raw scores and input distances:
two float64 values an image (16 bytes; 32 KB at the default 2,000), allocated once. No image,
map or request detail is kept. The ring is per process and lost on restart; the Prometheus
counters and the score histogram (:mod:`padim.service.metrics`) are the durable record, and
aggregate across replicas.

Flags are counted at the model's own threshold, from the raw scores, whatever threshold a
request asked for (those requests are counted beside: ``threshold_overrides``), so that the
flag-rate test always compares like with like.
"""

from __future__ import annotations

import math
import threading
import time

import torch

from padim.core.calibration import MODEL_THRESHOLD, Calibration
from padim.core.drift import Drift, assess, histogram

#: Bins of the plotted score histograms, on the 0..1 score scale (the threshold, 0.5, is an edge).
SCORE_EDGES = tuple(i / 20 for i in range(21))
#: Bytes the ring keeps per image: a raw score and an input distance, float64 each.
BYTES_PER_IMAGE = 16


class Monitor:
    """The last ``window`` images of one model, and their reading (thread-safe).

    Args:
        calibration: the model's; its normal scores and input distances are the reference.
        window: images kept (the oldest is dropped for a new one).
        level, min_images: of the tests (:func:`padim.core.drift.assess`).
    """

    def __init__(self, calibration: Calibration, window: int, level: float, min_images: int):
        self.calibration, self.window, self.level, self.min_images = calibration, window, level, min_images
        self._values = torch.full((window, 2), math.nan, dtype=torch.float64)  # (window, [raw, input distance])
        # the reference the window is plotted against: the calibration's normal scores, binned once
        normal = calibration.normalise(torch.tensor(calibration.reference_scores, dtype=torch.float64))
        self._calibration_histogram = histogram(normal, SCORE_EDGES)
        self._lock = threading.Lock()
        self.reset()

    @property
    def nbytes(self) -> int:
        return self._values.numel() * self._values.element_size()

    def reset(self) -> None:
        """Forget every image (after a fix on the line, or a new model)."""
        with self._lock:
            self._values.fill_(math.nan)
            self._next = 0
            self._count = 0
            self.recorded = 0  # images since the reset (the window holds the last `window` of them)
            self.threshold_overrides = 0  # of them, scored for requests that set their own threshold
            self.since = time.time()

    def record(self, raw_scores: list[float], input_distances: list[float | None], own_threshold: bool) -> None:
        """Add one request's images: raw scores and input distances (``None`` where the scorer has none)."""
        values = self._values.numpy()  # the same memory: a NumPy element write costs far less than a torch one
        with self._lock:
            for raw, distance in zip(raw_scores, input_distances, strict=True):
                values[self._next, 0] = raw
                values[self._next, 1] = math.nan if distance is None else distance
                self._next = (self._next + 1) % self.window
                self._count = min(self._count + 1, self.window)
            self.recorded += len(raw_scores)
            if own_threshold:
                self.threshold_overrides += len(raw_scores)

    def recent(self) -> torch.Tensor:
        """``(n, 2)`` raw scores and input distances of the window, oldest first (a copy)."""
        with self._lock:
            if self._count < self.window:
                return self._values[: self._count].clone()
            return torch.cat([self._values[self._next :], self._values[: self._next]])

    def reading(self) -> tuple[Drift, torch.Tensor]:
        """The window's :class:`~padim.core.drift.Drift` reading, and the window itself."""
        values = self.recent()
        inputs = values[:, 1]
        has_inputs = bool(torch.isfinite(inputs).any())
        drift = assess(values[:, 0], self.calibration, inputs if has_inputs else None, self.level, self.min_images)
        return drift, values

    def to_dict(self) -> dict:
        """``GET /models/{name}/monitor``: the reading, the window, and histograms to plot."""
        drift, values = self.reading()
        calibration = self.calibration
        recent_scores = calibration.normalise(values[:, 0]) if len(values) else values[:, 0]
        return {
            **drift.to_dict(),
            "window": self.window,
            "recorded": self.recorded,
            "threshold_overrides": self.threshold_overrides,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
            "bytes": self.nbytes,
            "threshold": MODEL_THRESHOLD,
            "raw_threshold": calibration.threshold,
            "histogram": {
                "edges": list(SCORE_EDGES),
                "recent": histogram(recent_scores, SCORE_EDGES),
                "calibration": self._calibration_histogram,
            },
        }
