"""The gate of a reduced precision (``train --precision bf16|fp16|int8``): its image scores against fp32's.

A model fitted at bf16 or fp16 computes its statistics, its calibration and every later score with the backbone
at that arithmetic; its threshold is calibrated from those scores, so its false-alarm promise is about the numbers
it computes. What the arithmetic costs in accuracy is measured before the file is written: the first
:data:`CHECK_IMAGES` readable training pictures are embedded twice, by the backbone at the model's precision and by
the same weights in float32, and both embeddings are scored with the fitted model itself (its mean and float32
precision factors, its map and image score). The comparison is exact: the same pictures, the same Gaussians, the
same reading of a map; only the backbone's arithmetic differs. (The int8 scorer beside a float32 fit has both
embeddings already: pass 1 spooled them, and its gate reads them back, ``measure_precision``'s ``embedded``.) A
largest relative image-score difference past the
tolerance (``train --max-score-error``, default :data:`MAX_SCORE_ERROR`, :data:`INT8_MAX_SCORE_ERROR` for int8, chosen
by measurement: docs/gpu.md, docs/quantisation.md)
refuses the model with one line and the figures, and nothing is written (``--force`` writes it, marked forced).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from padim.core.packing import packed_length, unpack_lower
from padim.core.scoring import squared_mahalanobis
from padim.models.data.images import iter_decoded
from padim.models.errors import ConfigError
from padim.models.features.embedding import FeatureEmbedder
from padim.models.scoring.model import score_distances

#: Training pictures the gate embeds at both precisions.
CHECK_IMAGES = 16
#: The gate's default tolerance: largest relative image-score difference against fp32 (measured: docs/gpu.md).
MAX_SCORE_ERROR = 0.02
#: The default for an int8 backbone: as ``padim export --precision int8``'s gate (int8 moves raw scores by 7-16%,
#: median 1.5-5%; a quantiser gone wrong by far more; measured: docs/quantisation.md).
INT8_MAX_SCORE_ERROR = 0.25


def default_tolerance(precision: str) -> float:
    """The gate's tolerance for ``precision`` when ``--max-score-error`` is not given."""
    return INT8_MAX_SCORE_ERROR if precision == "int8" else MAX_SCORE_ERROR


#: Bytes of float32 factors unpacked at a time.
CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class PrecisionGate:
    """How a reduced precision is gated (``train --max-score-error``, ``--force``); ``tolerance`` ``None``: the
    precision's default (:func:`default_tolerance`)."""

    tolerance: float | None = None
    force: bool = False

    def __post_init__(self) -> None:
        if self.tolerance is None:
            return
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance > 0 and math.isfinite(self.tolerance)):
            raise ConfigError(f"--max-score-error must be a positive number, got {self.tolerance!r}")

    def tolerance_for(self, precision: str) -> float:
        return default_tolerance(precision) if self.tolerance is None else float(self.tolerance)


@dataclass(frozen=True)
class PrecisionCheck:
    """A reduced precision's image scores against fp32's on the same training pictures, with the fitted model.

    Attributes:
        precision: ``bf16``, ``fp16`` or ``int8``.
        images: pictures compared.
        max_score_error: largest ``|reduced - fp32| / fp32`` of their image scores (the gate's statistic).
        median_score_error: its median.
        verdict_changes: pictures whose verdict at the model's threshold differs between the two.
        threshold: the raw threshold (calibrated at ``precision``) the verdicts were compared at.
        tolerance, passed, forced: the gate.
    """

    precision: str
    images: int
    max_score_error: float
    median_score_error: float
    verdict_changes: int
    threshold: float
    tolerance: float
    passed: bool
    forced: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    def sentence(self) -> str:
        return (
            f"{self.precision} against fp32 on {self.images} training pictures: largest relative image-score "
            f"difference {self.max_score_error:.3%} (median {self.median_score_error:.3%}; tolerance "
            f"{self.tolerance:.2%}), {self.verdict_changes} verdict(s) changed at the threshold"
        )


def compare_scores(
    precision: str, reference: torch.Tensor, reduced: torch.Tensor, threshold: float, gate: PrecisionGate
) -> PrecisionCheck:
    """The gate's reading of ``(N,)`` image scores at fp32 (``reference``) and at ``precision`` (``reduced``)."""
    reference, reduced = reference.to(torch.float64), reduced.to(torch.float64)
    errors = (reduced - reference).abs() / reference.abs().clamp_min(torch.finfo(torch.float64).tiny)
    finite = bool(torch.isfinite(reduced).all())
    worst = float(errors.max()) if finite else math.inf
    return PrecisionCheck(
        precision=precision,
        images=len(reference),
        max_score_error=worst,
        median_score_error=float(errors.quantile(0.5)) if finite else math.inf,
        verdict_changes=int(((reference >= threshold) != (reduced >= threshold)).sum()),
        threshold=float(threshold),
        tolerance=gate.tolerance_for(precision),
        passed=finite and worst <= gate.tolerance_for(precision),
    )


def measure_precision(
    fit,
    mean: torch.Tensor,
    factors,
    paths: Sequence[Path],
    threshold: float,
    gate: PrecisionGate,
    reduced_embedder: FeatureEmbedder | None = None,
    embedded: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Score ``paths`` (at most :data:`CHECK_IMAGES`) at a reduced precision and at fp32 with the fitted model.

    Args:
        fit: the :class:`~padim.models.fit.in_progress.Fit` (its embedder at the model's precision, its weights).
        mean: ``(p, D)`` fitted mean.
        factors: the packed ``(p, T)`` float32 precision factors (a :class:`~padim.models.fit.spool.ScratchFile`).
        paths: readable training pictures.
        threshold: the reduced scorer's raw threshold.
        reduced_embedder: the reduced precision's embedder beside a float32 fit (its int8 scorer's:
            :mod:`padim.models.scoring.reduced`); ``None``: the fit itself is at the reduced precision, and its float32
            twin is the reference.
        embedded: the pictures' embeddings already made, ``(N, p, D)`` by float32 and by ``reduced_embedder``, as
            that embedder gives them (pass 1's spooled rows of the int8 scorer's pictures); ``paths`` are not read.
    """
    config = fit.config
    if embedded is not None:
        assert reduced_embedder is not None, "rows made beside a float32 fit"
        return _compared(config, fit.device, mean, factors, threshold, gate, reduced_embedder, *embedded)
    if reduced_embedder is None:
        reduced_embedder = fit.embedder
        reference_embedder = FeatureEmbedder(config.replace(precision="fp32"), fit.backbone_weights, fit.embedding)
        reference_embedder = reference_embedder.to(fit.device)
    else:
        reference_embedder = fit.embedder
    reduced, reference = [], []
    for _, images in iter_decoded(
        [list(paths[:CHECK_IMAGES])], config.run.decode_workers, None, fit.draft_to, config.framing.roi
    ):
        batch = reduced_embedder.preprocess(images)
        reduced.append(reduced_embedder(batch))
        reference.append(reference_embedder(batch))
    del reference_embedder
    reference_rows, reduced_rows = torch.cat(reference), torch.cat(reduced)
    return _compared(config, fit.device, mean, factors, threshold, gate, reduced_embedder, reference_rows, reduced_rows)


def _compared(
    config,
    device: torch.device,
    mean: torch.Tensor,
    factors,
    threshold: float,
    gate: PrecisionGate,
    reduced_embedder: FeatureEmbedder,
    reference: torch.Tensor,
    reduced: torch.Tensor,
):
    """The gate's figures from both embeddings of the same pictures, each scored with the fitted model on ``device``
    (the fit's)."""
    both = _distances(torch.cat([reference, reduced]), mean, factors, device)  # the factors read once for both
    first, second = both[: len(reference)], both[len(reference) :]
    tiling, scoring = reduced_embedder.tiling, config.scoring
    scores = [score_distances(d, tiling, scoring).raw_scores for d in (first, second)]
    return compare_scores(reduced_embedder.precision, scores[0], scores[1], threshold, gate)


def _distances(embeddings: torch.Tensor, mean: torch.Tensor, factors, device: torch.device) -> torch.Tensor:
    """``(N, p, D)`` embeddings -> ``(N, p)`` squared distances with the packed float32 factors, a chunk at a time."""
    pixels, dim = mean.shape
    length = packed_length(dim)
    step = max(1, CHUNK_BYTES // (4 * dim * dim))
    out = []
    for first in range(0, pixels, step):
        count = min(step, pixels - first)
        packed = factors.read(first * length * 4, (count, length), torch.float32).to(device)
        factor = unpack_lower(packed, dim)
        chunk = embeddings[:, first : first + count].to(device)
        out.append(squared_mahalanobis(chunk, mean[first : first + count].to(device), factor).cpu())
    return torch.cat(out, dim=1)
