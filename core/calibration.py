"""Threshold calibration on held-out normal images.

A share of the training images is never fitted on; their raw scores describe what a normal
score looks like for this model. The default threshold is a high quantile of them, and the
user-facing score maps raw scores through a logistic curve centred on the threshold, so that
the threshold is always at 0.5 and the order of scores is kept.

Example:
    >>> import torch
    >>> cal = Calibration.from_normal_scores(torch.tensor([1.0, 2.0, 3.0, 4.0]), quantile=0.5)
    >>> cal.threshold
    2.5
    >>> float(cal.normalise(torch.tensor(2.5)))
    0.5
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import torch


def holdout_key(name: str) -> float:
    """A stable pseudo-random number in ``[0, 1)`` for an image name (its relative path).

    Whether an image is held out depends on its name alone, not on which other images are in
    the run, so resuming a fit with more images never moves an earlier image between the fit
    and the held-out set.
    """
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_holdout(
    names: list[str], fraction: float, minimum: int
) -> tuple[list[int], list[int]]:
    """Indices of the images to fit on and of those held out for calibration.

    An image is held out when ``holdout_key(name) < fraction``; if that gives fewer than
    ``minimum``, the images with the smallest keys are added until it does. At least two
    images are always left to fit on.

    Returns:
        ``(fit_indices, holdout_indices)``, each sorted.
    """
    keys = [holdout_key(n) for n in names]
    held = {i for i, k in enumerate(keys) if k < fraction}
    if len(held) < minimum:
        for i in sorted(range(len(names)), key=keys.__getitem__):
            if len(held) >= minimum:
                break
            held.add(i)
    while len(names) - len(held) < 2 and held:
        held.remove(max(held, key=keys.__getitem__))
    holdout = sorted(held)
    fit = [i for i in range(len(names)) if i not in held]
    return fit, holdout


@dataclass(frozen=True)
class Calibration:
    """Normal-score distribution and the threshold taken from it.

    Attributes:
        normal_scores: raw image scores of the held-out normal images, sorted.
        quantile: which quantile of ``normal_scores`` the threshold was taken at, or ``None``
            when the threshold was set by hand (``evaluate --calibrate``).
        threshold: raw score at which an image is called anomalous (normalised score 0.5).
        scale: raw-score width of the logistic mapping (standard deviation of the normal scores).
    """

    normal_scores: tuple[float, ...]
    quantile: float | None
    threshold: float
    scale: float

    @classmethod
    def from_normal_scores(cls, scores: torch.Tensor, quantile: float) -> Calibration:
        if scores.numel() == 0:
            raise ValueError("calibration needs at least one held-out normal image")
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"threshold quantile must be in (0, 1], got {quantile}")
        values = scores.detach().to(torch.float64).flatten().sort().values
        threshold = float(torch.quantile(values, quantile))
        return cls(tuple(values.tolist()), quantile, threshold, _scale(values, threshold))

    def with_threshold(self, threshold: float) -> Calibration:
        """Same normal scores, a threshold chosen elsewhere (e.g. F1-optimal)."""
        return replace(self, quantile=None, threshold=float(threshold))

    def normalise(self, raw: torch.Tensor) -> torch.Tensor:
        """Map raw scores (or maps) to ``[0, 1]``; ``threshold -> 0.5``, order kept."""
        return torch.sigmoid((raw - self.threshold) / self.scale)

    def raw_threshold(self, normalised_threshold: float) -> float:
        """Raw score whose normalised score is ``normalised_threshold`` (inverse of normalise)."""
        if not 0.0 <= normalised_threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {normalised_threshold}")
        if normalised_threshold in (0.0, 1.0):
            return -math.inf if normalised_threshold == 0.0 else math.inf
        logit = math.log(normalised_threshold / (1.0 - normalised_threshold))
        return self.threshold + self.scale * logit

    def to_header(self) -> dict:
        return {"quantile": self.quantile, "threshold": self.threshold, "scale": self.scale,
                "holdout_count": len(self.normal_scores)}

    @classmethod
    def from_header(cls, header: dict, normal_scores: torch.Tensor) -> Calibration:
        return cls(tuple(normal_scores.to(torch.float64).tolist()), header["quantile"],
                   float(header["threshold"]), float(header["scale"]))


def _scale(values: torch.Tensor, threshold: float) -> float:
    spread = float(values.std()) if values.numel() > 1 else 0.0
    return max(spread, 1e-3 * abs(threshold), 1e-12)
