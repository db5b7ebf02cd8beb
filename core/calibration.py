"""The threshold, from out-of-fold scores of normal images, and what it can promise.

**Cross-fitting.** Every training image belongs to one of ``K`` folds, chosen by a hash of its
name (its path relative to the data directory) alone. The detector is fitted on every image,
and each image is also scored by the model of "every image but its fold". Each of the ``N``
normal images so gives one *out-of-fold* score: the raw score of a normal image that the
scoring model has not seen, as a new image on the line will be.

**The threshold** for a requested false-alarm rate ``alpha`` is the ``1 - alpha`` quantile of
a Gumbel distribution fitted to those scores by its moments (an image score is the maximum of
a map, and maxima have Gumbel tails); once there are enough of them for about
:data:`EMPIRICAL_EXCEEDANCES` to lie above it, their own (conformal) quantile instead. This
was chosen by measurement (``benchmarks/calibration.py``, docs/calibration.md): a normal fit gave up to
2.4% false alarms for a requested 1% where the out-of-fold scores are unbiased, the maximum of
a few scores up to 8% in one category; the Gumbel fit stayed at or below the requested rate.
Out-of-fold models hold ``1/K`` fewer images than the final one, so their scores run slightly
high and the threshold errs towards fewer false alarms, the less so the more images.

**What is promised** needs no assumption about the score distribution. If ``j`` of the ``N``
scores lie at or below the threshold, a new normal score is at or above it with probability at
most ``(N + 1 - j) / (N + 1)`` on average over calibration sets (the order-statistics argument
of conformal prediction), and at most the ``confidence`` quantile of ``Beta(N + 1 - j, j)`` for
this calibration set, with that confidence.

**The score** a user sees maps raw scores through a logistic curve: the threshold is 0.5, the
median normal score is 0.1, the order is kept, and the width is never below
:data:`MIN_SCALE_FRACTION` of the threshold.

Example:
    >>> import torch
    >>> scores = torch.linspace(10.0, 20.0, 50, dtype=torch.float64)
    >>> cal = Calibration.from_scores(scores, false_alarm_rate=0.01)
    >>> cal.method, round(cal.threshold, 2)
    ('gumbel_tail', 24.33)
    >>> float(cal.normalise(torch.tensor(cal.threshold)))
    0.5
    >>> round(float(cal.normalise(torch.tensor(15.0))), 3)     # the median normal score
    0.1
    >>> cal.promised_false_alarm_rate == 1 / 51                # every score is below the threshold
    True
    >>> images_needed(0.01)
    99
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

import torch

from . import FALSE_ALARM_RATE_RANGE
from .errors import CalibrationError as CalibrationError  # re-exported: raised here

#: Confidence of the upper bound stored with every model.
CONFIDENCE = 0.95
#: The empirical quantile is used once about this many scores lie above the threshold.
EMPIRICAL_EXCEEDANCES = 10
#: The logistic width is at least this share of the threshold.
MIN_SCALE_FRACTION = 0.01
#: The median normal image gets this score.
MEDIAN_SCORE = 0.1
#: Raw thresholds below this (Mahalanobis units) mean the normal images do not vary at all.
MIN_THRESHOLD = 1e-3
EULER_GAMMA = 0.5772156649015329

#: A threshold the line sets leaves at least this many of its pictures above it (:func:`line_pictures_needed`).
LINE_EXCEEDANCES = 5
#: How a threshold was set; ``quantile``: model format 1, a quantile of a few held-out scores; ``line``: the
#: conformal quantile of what the line's normal pictures scored (:meth:`Calibration.tightened`, model format 13).
METHODS = ("gumbel_tail", "empirical", "maximum", "manual", "quantile", "line")
#: The model's own threshold on the 0..1 score scale: its calibrated raw threshold normalises to it.
MODEL_THRESHOLD = 0.5


def threshold_at(threshold: float | None) -> float:
    """The threshold (0..1 score scale) a request, a line or a picture is judged at: its own, or the model's
    (:data:`MODEL_THRESHOLD`) where it names none. Every verdict asks this, so that the default is worked out once."""
    return MODEL_THRESHOLD if threshold is None else float(threshold)


def named_threshold(threshold: float | None) -> float | None:
    """``threshold`` where it is a request's own, ``None`` where it is the model's (a threshold equal to the model's
    is the model's: its answers and metrics read as the model's)."""
    return None if threshold is None or abs(float(threshold) - MODEL_THRESHOLD) < 1e-12 else float(threshold)


def fold_of(name: str, folds: int) -> int:
    """The calibration fold (``0 .. folds - 1``) of an image, from its name alone.

    The name is the image's path relative to the data directory. Which fold an image is in
    does not depend on the other images of the run, so a resumed or merged fit puts every image
    in the fold a one-shot fit would.
    """
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") * folds >> 64


# ---------------------------------------------------------------------- order statistics
def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function ``I_x(a, b)`` (continued fraction, modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges quickly on this side only
        return 1.0 - betainc(b, a, 1.0 - x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h / a


def beta_quantile(a: float, b: float, q: float) -> float:
    """``x`` with ``I_x(a, b) = q``: the ``q`` quantile of ``Beta(a, b)`` (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if betainc(a, b, middle) < q:
            low = middle
        else:
            high = middle
        if high - low < 1e-15:
            break
    return 0.5 * (low + high)


def promised_false_alarm_rate(count: int, covered: int) -> float:
    """Distribution-free false-alarm rate of a threshold with ``covered`` of ``count`` normal scores at or below it.

    The threshold is at least the ``covered``-th smallest score ``s_(j)``. For exchangeable
    (continuous) scores, a new normal score exceeds ``s_(j)`` with probability
    ``(count + 1 - j) / (count + 1)``, on average over calibration sets.
    """
    return (count + 1 - covered) / (count + 1)


def false_alarm_bound(count: int, covered: int, confidence: float = CONFIDENCE) -> float:
    """Upper ``confidence`` bound of that rate for one calibration set.

    The chance that a new normal score exceeds the ``j``-th smallest of ``n`` is
    ``Beta(n + 1 - j, j)``-distributed over calibration sets; this is its ``confidence``
    quantile (1 when no score is at or below the threshold).
    """
    if covered <= 0:
        return 1.0
    return beta_quantile(count + 1 - covered, covered, confidence)


def empirical_minimum(false_alarm_rate: float) -> int:
    """Fewest scores from which the threshold is their own (conformal) quantile."""
    return math.ceil(EMPIRICAL_EXCEEDANCES / false_alarm_rate - 1e-9)


def images_needed(false_alarm_rate: float) -> int:
    """Fewest calibration scores with which a rate of ``false_alarm_rate`` can be promised.

    With every score below the threshold, the promise is ``1 / (n + 1)``.
    """
    return max(1, math.ceil(1.0 / false_alarm_rate - 1.0 - 1e-9))


# ---------------------------------------------------------------------- the threshold
def conformal_threshold(scores: torch.Tensor, false_alarm_rate: float) -> float:
    """The ``ceil((N + 1)(1 - alpha))``-th smallest of ``N`` normal scores: a new exchangeable normal score is at or
    above it with probability at most ``alpha`` (no assumption about their distribution).

    Raises:
        CalibrationError: fewer than :func:`images_needed` scores (the rank would lie above the largest), or
            scores that are not finite.
    """
    values = scores.detach().to(torch.float64).flatten().sort().values
    needed = images_needed(false_alarm_rate)
    if values.numel() < needed:
        raise CalibrationError(
            f"{values.numel()} normal score(s) cannot set a threshold for {false_alarm_rate:.2%} false alarms by their "
            f"own quantile: {needed} are needed"
        )
    if not bool(torch.isfinite(values).all()):
        raise CalibrationError("some normal scores are not finite")
    return float(values[conformal_rank(values.numel(), false_alarm_rate) - 1])


def conformal_rank(count: int, false_alarm_rate: float) -> int:
    """``ceil((count + 1)(1 - alpha))``: the rank (from 1, smallest first) of the conformal quantile of ``count``
    scores."""
    return math.ceil((count + 1) * (1.0 - false_alarm_rate))


def checked_rate(false_alarm_rate: float) -> float:
    """``false_alarm_rate`` when within :data:`~padim.core.FALSE_ALARM_RATE_RANGE`.

    Raises:
        CalibrationError: out of range.
    """
    low, high = FALSE_ALARM_RATE_RANGE
    if not low <= false_alarm_rate <= high:
        raise CalibrationError(f"false_alarm_rate must be in [{low:g}, {high:g}], got {false_alarm_rate}")
    return false_alarm_rate


def line_pictures_needed(false_alarm_rate: float) -> int:
    """Fewest line pictures a threshold the line sets is taken from: enough that :data:`LINE_EXCEEDANCES` of them lie
    above their conformal quantile. Fewer make the promise hold on average but not for one proposal: after 100
    pictures (the largest of them, at 1%) one proposal of 20 flagged 10% of unseen normal pictures, after 500 at
    most 2.5% (``benchmarks/tightening.py``); the bound at 95% confidence is then 1.8%."""
    return max(images_needed(false_alarm_rate), math.ceil(LINE_EXCEEDANCES / false_alarm_rate - 1.0 - 1e-9))


def gumbel_quantile(values: torch.Tensor, probability: float) -> float:
    """The ``probability`` quantile of a Gumbel distribution with the mean and spread of ``values``.

    Moments: scale ``beta = std * sqrt(6) / pi``, location ``mean - gamma * beta``
    (Euler-Mascheroni ``gamma``); quantile ``location - beta * log(-log(probability))``.
    """
    beta = float(values.std()) * math.sqrt(6.0) / math.pi
    location = float(values.mean()) - EULER_GAMMA * beta
    return location - beta * math.log(-math.log(probability))


def estimate_threshold(scores: torch.Tensor, false_alarm_rate: float) -> tuple[float, str]:
    """Raw threshold for a requested false-alarm rate, and the method that gave it.

    - ``empirical``: with at least ``EMPIRICAL_EXCEEDANCES / alpha`` scores, the
      ``ceil((N + 1)(1 - alpha))``-th smallest (the conformal quantile; no assumption).
    - ``gumbel_tail``: otherwise the ``1 - alpha`` quantile of a Gumbel fitted by moments.
    - ``maximum``: a single score.

    Args:
        scores: ``(N,)`` out-of-fold raw scores of normal images.
        false_alarm_rate: ``alpha``, the share of normal images allowed to be flagged.
    """
    values = scores.detach().to(torch.float64).flatten().sort().values
    count = values.numel()
    if count == 0:
        raise CalibrationError("no calibration scores")
    if count >= empirical_minimum(false_alarm_rate):
        return float(values[conformal_rank(count, false_alarm_rate) - 1]), "empirical"
    if count == 1:
        return float(values[0]), "maximum"
    return gumbel_quantile(values, 1.0 - false_alarm_rate), "gumbel_tail"


@dataclass(frozen=True)
class Calibration:
    """Normal scores, the threshold taken from them, and what it promises.

    Attributes:
        scores: raw scores of normal images the scoring model did not see (out-of-fold, or a
            separate calibration set), sorted.
        threshold: raw score at which an image is called anomalous (normalised score 0.5).
        scale: raw-score width of the logistic mapping.
        method: how the threshold was set: ``gumbel_tail``, ``empirical``, ``maximum``
            (see :func:`estimate_threshold`), ``manual`` (``evaluate --calibrate``) or
            ``quantile`` (model format 1).
        false_alarm_rate: the rate that was asked for (``None`` for a manual threshold).
        earlier_scores: how many of ``scores`` were kept from an earlier fit (``--resume``):
            they were scored by that fit's models, which had seen fewer images.
        input_distances: out-of-fold input distances of the same normal images, sorted (the mean
            squared distance over every pixel, :mod:`padim.core.drift`); empty before model format 7.
        taken_scores: out-of-fold scores of the same normal images as taken, sorted, where ``scores`` are their
            changed copies' (``train --expect``: the threshold covers the line's changes); empty otherwise, the
            scores being the images' own. See :attr:`reference_scores`.
        pictures: ``(digest, score, input distance, taken score)`` of each picture whose values are among the
            above (NaN where it has none), unsorted: what :meth:`without` removes when a picture must go (a review
            found it was not normal). Empty before model format 9, and for scores whose pictures are not known
            (the held-out calibration images of ``merge``).
        line_scores: raw scores of the line's normal pictures, sorted, where the threshold is their own quantile
            (method ``line``, :meth:`tightened`): the promise is then made on them, and they are what normal
            pictures score (:attr:`reference_scores`). Empty otherwise, and before model format 13.
    """

    scores: tuple[float, ...]
    threshold: float
    scale: float
    method: str
    false_alarm_rate: float | None
    earlier_scores: int = 0
    input_distances: tuple[float, ...] = ()
    taken_scores: tuple[float, ...] = ()
    pictures: tuple[tuple[int, float, float, float], ...] = field(default=(), compare=False)
    line_scores: tuple[float, ...] = ()

    @classmethod
    def from_scores(
        cls,
        scores: torch.Tensor,
        false_alarm_rate: float,
        earlier_scores: int = 0,
        input_distances: torch.Tensor | None = None,
        taken_scores: torch.Tensor | None = None,
        pictures: tuple[tuple[int, float, float, float], ...] = (),
    ) -> Calibration:
        """Threshold and scale for ``false_alarm_rate`` from ``(N,)`` normal scores.

        Raises:
            CalibrationError: no scores, non-finite scores, or scores that are all (nearly)
                zero (the normal images do not differ from each other).
        """
        checked_rate(false_alarm_rate)
        values = scores.detach().to(torch.float64).flatten().sort().values
        if values.numel() and not bool(torch.isfinite(values).all()):
            raise CalibrationError("some calibration scores are not finite")
        threshold, method = estimate_threshold(values, false_alarm_rate)
        if threshold < MIN_THRESHOLD:
            raise CalibrationError(
                f"the normal images do not vary: their out-of-fold scores are all below {MIN_THRESHOLD:g}, "
                "so no threshold can separate normal variation from a defect"
            )
        taken = _sorted(taken_scores)
        if taken and len(taken) != values.numel():
            raise CalibrationError(
                f"{len(taken)} scores of the images as taken for {values.numel()} calibration scores"
            )
        reference = torch.tensor(taken, dtype=torch.float64) if taken else values
        return cls(
            tuple(values.tolist()),
            threshold,
            _scale(reference, threshold),
            method,
            false_alarm_rate,
            earlier_scores,
            _sorted(input_distances),
            taken,
            tuple(pictures),
        )

    def without(self, digests: set[int]) -> tuple[Calibration, int]:
        """The calibration without the values of the pictures ``digests`` names, the threshold set again from the
        rest for the same rate (a manual threshold stays); and how many pictures were found among :attr:`pictures`.

        A picture whose values are not linked (a file older than format 9) cannot be found: its score stays.

        Raises:
            CalibrationError: too few scores would be left to set a threshold.
        """
        return _without(self, digests)

    def with_threshold(self, threshold: float) -> Calibration:
        """Same normal scores, a threshold chosen elsewhere (e.g. F1-optimal on a test set)."""
        threshold = float(threshold)
        if not math.isfinite(threshold):
            raise CalibrationError(f"threshold must be finite, got {threshold}")
        plain = replace(self, line_scores=())
        scale = _scale(torch.tensor(plain.reference_scores, dtype=torch.float64), threshold)
        return replace(plain, threshold=threshold, scale=scale, method="manual", false_alarm_rate=None)

    def tightened(self, line_scores: torch.Tensor, false_alarm_rate: float | None = None) -> Calibration:
        """The same model's threshold set from what its line's normal pictures scored (method ``line``).

        The threshold is their conformal quantile (:func:`conformal_threshold`) for ``false_alarm_rate`` (the
        calibration's own by default): the promise is restated on the line's pictures, with no cover of changes
        the line did not make. The training pictures' values are kept (a review can still take one out).

        Raises:
            CalibrationError: fewer line scores than :func:`line_pictures_needed`, a rate out of range, or no rate (a
                manual threshold and none given).
        """
        rate = self.false_alarm_rate if false_alarm_rate is None else false_alarm_rate
        if rate is None:
            raise CalibrationError("a manual threshold has no false-alarm rate: give the rate to tighten it for")
        checked_rate(rate)
        values = line_scores.detach().to(torch.float64).flatten().sort().values
        _enough_line_pictures(values.numel(), rate)
        threshold = conformal_threshold(values, rate)
        return replace(
            self,
            threshold=threshold,
            scale=_scale(values, threshold),
            method="line",
            false_alarm_rate=rate,
            line_scores=tuple(values.tolist()),
        )

    # ------------------------------------------------------------------ what it promises
    @property
    def promised_on(self) -> tuple[float, ...]:
        """The scores the promise is made on: the line's (method ``line``), else the calibration's."""
        return self.line_scores or self.scores

    @property
    def count(self) -> int:
        """How many calibration scores there are (the line's are :attr:`line_scores`)."""
        return len(self.scores)

    @property
    def reference_scores(self) -> tuple[float, ...]:
        """What normal images as taken score: the score-drift reference (:mod:`padim.core.drift`) and the scores whose
        median maps to :data:`MEDIAN_SCORE`. The line's where the threshold is theirs, else the calibration's own
        scores unless they are changed copies'."""
        return self.line_scores or self.taken_scores or self.scores

    @property
    def covered(self) -> int:
        """How many of the scores the promise is made on are at or below the threshold."""
        return sum(1 for s in self.promised_on if s <= self.threshold)

    @property
    def promised_false_alarm_rate(self) -> float:
        """Distribution-free false-alarm rate (see :func:`promised_false_alarm_rate`)."""
        return promised_false_alarm_rate(len(self.promised_on), self.covered)

    @property
    def false_alarm_bound(self) -> float:
        """Upper :data:`CONFIDENCE` bound of the false-alarm rate (see :func:`false_alarm_bound`)."""
        return false_alarm_bound(len(self.promised_on), self.covered)

    @property
    def can_promise(self) -> bool:
        """Whether the requested rate is promised without assuming a score distribution."""
        return self.false_alarm_rate is not None and self.promised_false_alarm_rate <= self.false_alarm_rate + 1e-12

    def shortfall(self) -> str | None:
        """One line saying why the requested rate is not promised, or ``None`` when it is."""
        if self.false_alarm_rate is None or self.can_promise:
            return None
        needed = images_needed(self.false_alarm_rate)
        if self.count >= needed:  # enough scores, but the fitted tail put the threshold among them
            needed, how = empirical_minimum(self.false_alarm_rate), " (the threshold is then their own quantile)"
        else:
            how = ""
        return (
            f"{self.count} calibration score(s) cannot promise {self.false_alarm_rate:.2%} false alarms without "
            f"assuming how normal scores are distributed (promised: {self.promised_false_alarm_rate:.2%}, at most "
            f"{self.false_alarm_bound:.2%} with {CONFIDENCE:.0%} confidence); {needed} normal images would{how}"
        )

    # ------------------------------------------------------------------ scores
    def normalise(self, raw: torch.Tensor) -> torch.Tensor:
        """Map raw scores (or maps) to ``[0, 1]``; ``threshold -> 0.5``, order kept."""
        return torch.sigmoid((raw - self.threshold) / self.scale)

    def score(self, raw: float) -> float:
        """:meth:`normalise` of one raw score, in plain Python (no torch op)."""
        z = (float(raw) - self.threshold) / self.scale
        return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))

    def raw_threshold(self, normalised_threshold: float | None = None) -> float:
        """Raw score whose normalised score is ``normalised_threshold`` (inverse of normalise); ``None``: the
        model's (:func:`threshold_at`), :attr:`threshold` itself."""
        normalised_threshold = threshold_at(normalised_threshold)
        if not 0.0 <= normalised_threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {normalised_threshold}")
        if normalised_threshold in (0.0, 1.0):
            return -math.inf if normalised_threshold == 0.0 else math.inf
        logit = math.log(normalised_threshold / (1.0 - normalised_threshold))
        return self.threshold + self.scale * logit

    # ------------------------------------------------------------------ file
    def summary(self) -> dict:
        """What a user is told (``train``, ``padim info``, ``GET /models``) and the file header holds."""
        return {
            "method": self.method,
            "threshold": self.threshold,
            "scale": self.scale,
            "scores": self.count,
            "earlier_scores": self.earlier_scores,
            "false_alarm_rate": self.false_alarm_rate,
            "promised_false_alarm_rate": self.promised_false_alarm_rate,
            "false_alarm_bound": self.false_alarm_bound,
            "confidence": CONFIDENCE,
            "input_distances": len(self.input_distances),
            "taken_scores": len(self.taken_scores),
            "line_scores": len(self.line_scores),
        }

    def to_header(self) -> dict:
        return self.summary()

    @classmethod
    def from_header(
        cls,
        header: dict,
        scores: torch.Tensor,
        input_distances: torch.Tensor | None = None,
        taken_scores: torch.Tensor | None = None,
        digests: torch.Tensor | None = None,
        linked: torch.Tensor | None = None,
        line_scores: torch.Tensor | None = None,
    ) -> Calibration:
        """As a model file stores it: the header's summary and the tensors beside it, each count checked against
        the header's (a ``ValueError`` names the one that is not)."""
        return cls(*_stored(header, scores, input_distances, taken_scores, digests, linked, line_scores))

    def picture_tensors(self) -> dict[str, torch.Tensor]:
        """:attr:`pictures` as a file stores them: ``digests`` ``(N,)`` int64 and ``linked`` ``(N, 3)`` float64."""
        if not self.pictures:
            return {}
        return {
            "digests": torch.tensor([p[0] for p in self.pictures], dtype=torch.int64),
            "linked": torch.tensor([p[1:] for p in self.pictures], dtype=torch.float64),
        }


def _enough_line_pictures(count: int, rate: float) -> None:
    """Refuse fewer line scores than a threshold for ``rate`` by their own quantile needs."""
    needed = line_pictures_needed(rate)
    if count < needed:
        raise CalibrationError(
            f"{count} line picture(s) cannot set a threshold for {rate:.2%} false alarms: {needed} are needed, so "
            f"that {LINE_EXCEEDANCES} of them lie above it"
        )


def _without(calibration: Calibration, digests: set[int]) -> tuple[Calibration, int]:
    """:meth:`Calibration.without`."""
    gone = [p for p in calibration.pictures if p[0] in digests]
    if not gone:
        return calibration, 0
    scores, inputs, taken = list(calibration.scores), list(calibration.input_distances), list(calibration.taken_scores)
    for _, score, distance, own in gone:
        scores.remove(score)
        if inputs and not math.isnan(distance):
            inputs.remove(distance)
        if taken and not math.isnan(own):
            taken.remove(own)
    kept = tuple(p for p in calibration.pictures if p[0] not in digests)
    earlier = min(calibration.earlier_scores, len(scores))
    if calibration.false_alarm_rate is None or calibration.line_scores:  # set by hand or by the line: kept
        reference = calibration.line_scores or taken or scores
        scale = _scale(torch.tensor(reference, dtype=torch.float64), calibration.threshold)
        rest = replace(calibration, scores=tuple(scores), scale=scale, earlier_scores=earlier, pictures=kept)
        return replace(rest, input_distances=tuple(inputs), taken_scores=tuple(taken)), len(gone)
    return Calibration.from_scores(
        torch.tensor(scores, dtype=torch.float64),
        calibration.false_alarm_rate,
        earlier,
        _tensor(inputs),
        _tensor(taken),
        kept,
    ), len(gone)


def _stored(
    header: dict,
    scores: torch.Tensor,
    input_distances: torch.Tensor | None,
    taken_scores: torch.Tensor | None,
    digests: torch.Tensor | None,
    linked: torch.Tensor | None,
    line_scores: torch.Tensor | None,
) -> tuple:
    """:meth:`Calibration.from_header`'s fields, in order."""
    method = header["method"]
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}")
    values = scores.to(torch.float64).sort().values
    _counted(header, "scores", values.numel(), "calibration scores")
    distances = _sorted(input_distances)
    _counted(header, "input_distances", len(distances), "input distances")
    taken = _sorted(taken_scores)
    _counted(header, "taken_scores", len(taken), "scores of images as taken")
    line = _sorted(line_scores)
    _counted(header, "line_scores", len(line), "line scores")
    if (method == "line") != bool(line):
        raise ValueError(f"a calibration of method {method!r} with {len(line)} line scores")
    pictures = linked_pictures(digests, linked)
    if "pictures" in header:
        _counted(header, "pictures", len(pictures), "pictures' values")
    rate = header["false_alarm_rate"]
    return (
        tuple(values.tolist()),
        float(header["threshold"]),
        float(header["scale"]),
        method,
        None if rate is None else float(rate),
        int(header.get("earlier_scores", 0)),
        distances,
        taken,
        pictures,
        line,
    )


def linked_pictures(
    digests: torch.Tensor | None, linked: torch.Tensor | None
) -> tuple[tuple[int, float, float, float], ...]:
    """``(digest, score, input distance, taken score)`` rows from a file's ``(N,)`` digests and ``(N, 3)`` values."""
    if digests is None or linked is None:
        return ()
    if linked.shape != (digests.shape[0], 3):
        raise ValueError(f"{digests.shape[0]} picture digests but values of shape {tuple(linked.shape)}")
    return tuple(
        (int(d), float(score), float(distance), float(taken))
        for d, (score, distance, taken) in zip(digests.tolist(), linked.tolist(), strict=True)
    )


def _counted(header: dict, key: str, found: int, what: str) -> None:
    """A file whose tensors hold another count of ``what`` than its header says is refused (absent: none)."""
    said = int(header.get(key, 0))
    if found != said:
        raise ValueError(f"the header counts {said} {what}, the file holds {found}")


def _tensor(values: list[float]) -> torch.Tensor | None:
    return torch.tensor(values, dtype=torch.float64) if values else None


def _sorted(values: torch.Tensor | None) -> tuple[float, ...]:
    return () if values is None else tuple(values.detach().to(torch.float64).flatten().sort().values.tolist())


def _scale(values: torch.Tensor, threshold: float) -> float:
    """Logistic width that puts the median normal score at :data:`MEDIAN_SCORE`, floored."""
    median = float(values.quantile(0.5)) if values.numel() else threshold  # torch.median is the lower median
    spread = (threshold - median) / math.log((1.0 - MEDIAN_SCORE) / MEDIAN_SCORE)
    return max(spread, MIN_SCALE_FRACTION * abs(threshold), MIN_THRESHOLD)
