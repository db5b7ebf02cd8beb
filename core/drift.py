"""Is the line still what the model was fitted on? Three tests of recent scores against the calibration.

A model keeps the out-of-fold raw scores of its normal images, the promise made from them and,
from model format 7, their *input distances*. Recent images (a window of the service, or a folder
given to ``padim drift``) are compared with those:

- **Flag rate.** ``k`` of ``n`` recent images at or above the model's threshold. If the images
  were normal, ``k`` would be ``Binomial(n, p)`` with ``p`` at most the model's false-alarm bound
  (the :data:`~padim.core.calibration.CONFIDENCE` upper bound the calibration states). The
  one-sided p-value ``P(X >= k)`` small means *more flags than normal images alone would give*: a
  defect wave or drift, which a flag rate cannot tell apart. A manual threshold has no requested
  rate, but the same bound at that threshold (from the same scores) is what normal images give.
- **Score drift.** A one-sided two-sample Kolmogorov-Smirnov test: are recent raw scores
  stochastically *higher* than the calibration's? One-sided because out-of-fold scores come from
  models fitted on fewer images and run slightly high by design: a two-sided test would call a
  stable line "drifting down". The population stability index on the calibration's deciles is
  given beside it, as an effect size (it is two-sided; the test is the KS).
- **Input drift.** The same one-sided KS on input distances: the mean squared Mahalanobis
  distance over *every* feature pixel of an image (a picture's tiles together). Lighting, a moved
  camera or another material move every pixel; a defect moves a few, and the image score (the
  map's maximum) is what it moves. Out-of-fold input distances of the training images are the
  reference, as for the scores. Chosen over the distance of the window's mean embedding from the
  training mean, which needs the ``D x D`` spread of per-image mean embeddings (estimated from
  about as many images as channels, so singular) and a new statistic stored from the fit; the
  input distance costs one mean of what the scorer computes anyway (benchmarks/drift.py).

Each test is for one window: its p-value is exact (binomial) or asymptotic (KS, Hodges'
approximation, as ``scipy.stats.ks_2samp(..., method="asymp")``) for the images in it. Readings of
a rolling window overlap and are not independent tests; on disjoint windows of normal images
each alarm fires at most at :data:`LEVEL` (tested).

Example:
    >>> import torch
    >>> round(binomial_tail(3, 10, 0.1), 4)        # P(X >= 3), X ~ Binomial(10, 0.1)
    0.0702
    >>> reference = torch.arange(100.0)
    >>> statistic, p = ks_greater(reference + 50, reference)    # half the reference passed
    >>> statistic, p < 1e-6
    (0.5, True)
    >>> ks_greater(reference - 50, reference)                   # lower scores: no drift towards defects
    (0.0, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from .calibration import CONFIDENCE, Calibration, betainc

#: Level of each test: an alarm when its p-value is below this.
LEVEL = 0.01
#: Fewest images in a window before the tests are read (fewer: ``collecting``).
MIN_IMAGES = 30
#: Bins of the population stability index: the calibration's deciles.
PSI_BINS = 10
#: Share a PSI bin is floored at (an empty bin would give an infinite index).
PSI_FLOOR = 1e-4


# ---------------------------------------------------------------------- tests
def binomial_tail(k: int, n: int, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``: ``I_p(k, n - k + 1)`` (regularised incomplete beta)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    return betainc(k, n - k + 1, p)


def ks_greater(recent: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """One-sided two-sample Kolmogorov-Smirnov test: are ``recent`` values higher than ``reference``?

    Statistic ``D+ = max_x (F_reference(x) - F_recent(x))`` (``scipy.stats.ks_2samp(reference,
    recent, alternative="greater")``), p-value by Hodges' approximation (Eq. 5.3, ``m >= n`` the
    sample sizes): ``exp(-2 z^2 - 2 z (m + 2 n) / sqrt(m n (m + n)) / 3)``, ``z = sqrt(m n / (m + n)) D+``.

    Args:
        recent: ``(n,)`` values of the recent images.
        reference: ``(m,)`` values of the calibration's normal images.

    Returns:
        ``(D+, p_value)``.
    """
    recent = recent.detach().to(torch.float64).flatten().sort().values
    reference = reference.detach().to(torch.float64).flatten().sort().values
    n1, n2 = reference.numel(), recent.numel()
    if n1 == 0 or n2 == 0:
        raise ValueError("ks_greater needs values in both samples")
    points = torch.cat([reference, recent])
    cdf_reference = torch.searchsorted(reference, points, right=True).to(torch.float64) / n1
    cdf_recent = torch.searchsorted(recent, points, right=True).to(torch.float64) / n2
    statistic = max(0.0, float((cdf_reference - cdf_recent).max()))
    m, n = (float(n1), float(n2)) if n1 >= n2 else (float(n2), float(n1))
    z = math.sqrt(m * n / (m + n)) * statistic
    exponent = -2.0 * z * z - 2.0 * z * (m + 2.0 * n) / math.sqrt(m * n * (m + n)) / 3.0
    return statistic, min(1.0, math.exp(exponent))


def population_stability(recent: torch.Tensor, reference: torch.Tensor, bins: int = PSI_BINS) -> float:
    """Population stability index of ``recent`` on the ``bins``-quantile bins of ``reference``.

    ``sum_i (a_i - e_i) ln(a_i / e_i)`` with ``e_i``, ``a_i`` the shares of the reference and of the
    recent values in bin ``i`` (floored at :data:`PSI_FLOOR`). Read by habit as: below 0.1 stable,
    0.1-0.25 a moderate shift, above 0.25 a large one.
    """
    reference = reference.detach().to(torch.float64).flatten().sort().values
    recent = recent.detach().to(torch.float64).flatten().contiguous()
    if reference.numel() == 0 or recent.numel() == 0:
        raise ValueError("population_stability needs values in both samples")
    edges = torch.quantile(reference, torch.arange(1, bins, dtype=torch.float64) / bins)  # (bins - 1,)
    expected = torch.bincount(torch.bucketize(reference, edges, right=True), minlength=bins).to(torch.float64)
    actual = torch.bincount(torch.bucketize(recent, edges, right=True), minlength=bins).to(torch.float64)
    e = (expected / reference.numel()).clamp_min(PSI_FLOOR)
    a = (actual / recent.numel()).clamp_min(PSI_FLOOR)
    return float(((a - e) * torch.log(a / e)).sum())


# ---------------------------------------------------------------------- the reading of a window
@dataclass(frozen=True)
class FlagRate:
    """Flags of the window against what normal images alone would give.

    Attributes:
        flags: images at or above the model's threshold (whatever threshold a request asked for).
        rate: ``flags / images``.
        normal_rate: the most normal images would give: the calibration's false-alarm bound.
        basis: ``promised`` (a requested rate, its bound) or ``manual`` (a threshold set by hand:
            the bound that threshold has on the same normal scores).
        p_value: ``P(X >= flags)``, ``X ~ Binomial(images, normal_rate)``.
        alarm: ``p_value < level``.
    """

    flags: int
    rate: float
    normal_rate: float
    basis: str
    p_value: float
    alarm: bool


@dataclass(frozen=True)
class Shift:
    """A one-sided KS test of recent values against the calibration's (scores, or input distances).

    Attributes:
        statistic: ``D+`` (0 .. 1): how much of the reference's distribution the recent values passed.
        p_value: of ``D+`` (:func:`ks_greater`).
        alarm: ``p_value < level``.
        median_ratio: median of the recent values over the reference's median (1: unchanged).
        psi: population stability index on the reference's deciles (scores only).
    """

    statistic: float
    p_value: float
    alarm: bool
    median_ratio: float
    psi: float | None = None


@dataclass(frozen=True)
class Drift:
    """One reading of recent images against a model's calibration (what ``/monitor`` and ``padim drift`` say).

    Attributes:
        images: images in the window.
        status: ``collecting`` (fewer than ``min_images``), ``normal``, or ``alarm`` (a test fired).
        level: each test's level.
        flag_rate: the flag-rate test (``None`` while collecting).
        score_drift: KS of raw scores (``None`` while collecting).
        input_drift: KS of input distances (``None`` while collecting, or without them: a model
            older than format 7, an export older than version 4).
        verdict: what a person is told, in one or two sentences.
    """

    images: int
    status: str
    level: float
    min_images: int
    flag_rate: FlagRate | None
    score_drift: Shift | None
    input_drift: Shift | None
    verdict: str

    @property
    def alarms(self) -> list[str]:
        """Names of the tests that fired: ``flag_rate``, ``score_drift``, ``input_drift``."""
        return [
            name
            for name, test in (
                ("flag_rate", self.flag_rate),
                ("score_drift", self.score_drift),
                ("input_drift", self.input_drift),
            )
            if test is not None and test.alarm
        ]

    def to_dict(self) -> dict:
        return {**asdict(self), "alarms": self.alarms}


def assess(
    raw_scores: torch.Tensor,
    calibration: Calibration,
    input_distances: torch.Tensor | None = None,
    level: float = LEVEL,
    min_images: int = MIN_IMAGES,
) -> Drift:
    """Read recent images against ``calibration``: flag rate, score drift and input drift.

    Args:
        raw_scores: ``(n,)`` raw scores of the recent images, oldest first.
        calibration: the model's; its scores (and input distances, if any) are the reference.
        input_distances: ``(n,)`` input distances of the same images (``None``: the scorer has none).
        level: each test's level.
        min_images: below this many images nothing is tested.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    raw_scores = raw_scores.detach().to(torch.float64).flatten().contiguous()
    n = raw_scores.numel()
    if n < max(1, min_images):
        return Drift(
            n,
            "collecting",
            level,
            min_images,
            None,
            None,
            None,
            f"{n} image{'s' if n != 1 else ''} of the {min_images} a first reading needs",
        )
    flags = int((raw_scores >= calibration.threshold).sum())
    normal_rate = calibration.false_alarm_bound
    p_flags = binomial_tail(flags, n, normal_rate)
    basis = "manual" if calibration.false_alarm_rate is None else "promised"
    flag_rate = FlagRate(flags, flags / n, normal_rate, basis, p_flags, p_flags < level)
    reference = torch.tensor(calibration.reference_scores, dtype=torch.float64)  # normal images as taken
    score_drift = _shift(raw_scores, reference, level, with_psi=True)
    input_drift = None
    if input_distances is not None and calibration.input_distances:
        values = input_distances.detach().to(torch.float64).flatten().contiguous()
        values = values[torch.isfinite(values)]
        if values.numel() >= min_images:
            input_drift = _shift(values, torch.tensor(calibration.input_distances, dtype=torch.float64), level)
    drift = Drift(n, "normal", level, min_images, flag_rate, score_drift, input_drift, "")
    words = _words(n, flag_rate, score_drift, input_drift)
    return replace(drift, status="alarm" if drift.alarms else "normal", verdict=words)


def _shift(recent: torch.Tensor, reference: torch.Tensor, level: float, with_psi: bool = False) -> Shift:
    statistic, p_value = ks_greater(recent, reference)
    median = float(reference.quantile(0.5))
    ratio = float(recent.quantile(0.5)) / median if median > 0 else math.nan
    psi = population_stability(recent, reference) if with_psi else None
    return Shift(statistic, p_value, p_value < level, ratio, psi)


def _words(n: int, flag: FlagRate, score_drift: Shift, input_drift: Shift | None) -> str:
    """What the reading of ``n`` images says, for a person: the flag rate first, then each drift."""
    said = (
        "promised"
        if flag.basis == "promised"
        else "would give (a manual threshold, no promise; its bound on the normal scores)"
    )
    bound = f"at most {flag.normal_rate:.1%} ({CONFIDENCE:.0%} bound)"
    rate = f"flag rate {flag.rate:.1%} over the last {n:,} images"
    if flag.alarm:
        sentences = [
            f"{rate}, the model {said} {bound}: more flags than normal images alone would give, "
            f"likely drift or a defect wave (p = {flag.p_value:.2g})"
        ]
    elif flag.rate > flag.normal_rate:  # above the bound, but so few images cannot tell it from chance
        sentences = [
            f"{rate}, above what the model {said} ({bound}) but not significantly over so few images "
            f"(p = {flag.p_value:.2g}): keep watching"
        ]
    else:
        sentences = [f"{rate}, within what the model {said} ({bound})"]
    if score_drift.alarm:
        sentences.append(
            f"scores run higher than the calibration's (KS D+ {score_drift.statistic:.2f}, p = "
            f"{score_drift.p_value:.2g}; "
            f"median x{score_drift.median_ratio:.2f}, PSI {score_drift.psi:.2f})"
        )
    else:
        sentences.append(f"scores as the calibration's (KS D+ {score_drift.statistic:.2f})")
    if input_drift is None:
        sentences.append("no input drift reading (the model or export predates input distances)")
    elif input_drift.alarm:
        sentences.append(
            f"the images look unlike the training images: input distances run higher "
            f"(KS D+ {input_drift.statistic:.2f}, p = {input_drift.p_value:.2g}; median "
            f"x{input_drift.median_ratio:.2f}): "
            f"lighting, camera or material may have changed. {FIXES}"
        )
    else:
        sentences.append(f"inputs like the training images (KS D+ {input_drift.statistic:.2f})")
    return "; ".join(sentences) + "."


#: What to do when the images look unlike the training images and that is the line's new normal.
FIXES = (
    "If the line will keep making this change, either declare it so that the threshold covers it "
    "(padim train --expect, e.g. typical: light, placement, focus; docs/calibration.md) or teach the model the "
    "new normal (padim train --resume MODEL with normal pictures as the line takes them now)"
)


def histogram(values: Sequence[float] | torch.Tensor, edges: Sequence[float]) -> list[int]:
    """Counts of ``values`` in the bins ``[e_0, e_1), ..., [e_k-1, e_k]``, outliers in the end bins."""
    values = torch.as_tensor(values, dtype=torch.float64).flatten().contiguous()
    edges_t = torch.as_tensor(edges, dtype=torch.float64)
    if values.numel() == 0:
        return [0] * (len(edges_t) - 1)
    index = torch.bucketize(values, edges_t[1:-1], right=True)
    return torch.bincount(index, minlength=len(edges_t) - 1).tolist()
