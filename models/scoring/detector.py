"""A fitted detector: the scoring model, its calibration, and what it was made from.

:class:`PadimDetector` is what ``padim predict``, ``evaluate`` and the service use. Its model
file is read and written by :mod:`padim.models.fit.model_file`; it is made by
:mod:`padim.models.fit.training`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime

import torch

from padim.core import __version__
from padim.core.calibration import Calibration
from padim.core.statistics import GaussianState
from padim.models.choices import EXPECT_AUTO_MARGIN, spelled_precision
from padim.models.config import PadimConfig
from padim.models.data.framing import Framing
from padim.models.features.backbones import WeightsInfo
from padim.models.features.embedding import Embedding
from padim.models.scoring.model import CudaGraphs, PadimModel, ScoreOutput, graph_sizes
from padim.models.scoring.reduced import Int8Scorer

#: Largest relative change of image scores allowed when storing precision factors as float16.
FLOAT16_TOLERANCE = 1e-3
#: Where out-of-fold scores come from: a fit's own images, or images no part fitted (merge).
CALIBRATION_SOURCES = ("out_of_fold", "held_out")


def shown_options(config: PadimConfig) -> dict:
    """The options a served model's description shows (declared ``shown``), and the model input they make."""
    return {**config.shown(), "input_shape": list(config.input_shape)}


def calibration_options(config: PadimConfig, line_scores: int = 0, measured: dict | None = None) -> dict:
    """The options of the calibration a user sees beside its threshold: its folds, and the changes of the line it
    covers (``expect``), or the line's pictures that set it (``line_scores`` of them); ``measured``: the training
    pictures' spread that ``--expect auto`` sized the cover by."""
    return {
        "folds": config.gaussian.calibration_folds,
        "expect": config.gaussian.expect,
        "fit_changes": config.copies_fitted,
        **({"measured": measured} if measured else {}),
        "covers": promise_covers(config.gaussian.expect, config.copies_fitted, line_scores, measured),
    }


def promise_covers(expect: str, fit_changes: bool = False, line_scores: int = 0, measured: dict | None = None) -> str:
    """Which normal pictures the false-alarm promise is about, in words (``line_scores``: the threshold is the
    quantile of that many of the line's pictures; ``measured``: ``expect`` was sized by the training pictures)."""
    if line_scores:
        return (
            f"pictures like the line's {line_scores} normal pictures, whose own quantile the threshold is (the "
            f"cover of the fit, {expect or 'none'}, replaced)"
        )
    fitted = "; each picture's changed copy fitted too" if fit_changes else ""
    if measured and "declared" in measured:  # --trim-cover (format 18)
        left = measured.get("left_out") or []
        drawn = f"{expect} drawn on each training picture (one seeded draw{fitted})" if expect else "no copies drawn"
        return (
            f"pictures within the declared changes {measured['declared']}: "
            + (
                f"{', '.join(left)} already as far among the {measured.get('pictures')} training pictures measured "
                f"(their own out-of-fold scores cover it), "
                if left
                else ""
            )  # fmt: skip
            + drawn
        )
    if measured:
        return (
            f"pictures within {expect or 'no change'}: {EXPECT_AUTO_MARGIN:g}x how far the "
            f"{measured.get('pictures')} training pictures measured wander (--expect auto; one seeded draw a "
            f"training picture{fitted})"
        )
    if not expect:
        return "pictures like the training pictures (no changes of the line declared: train --expect)"
    return f"pictures within the declared changes {expect} (one seeded draw a training picture{fitted})"


def shrinkage_chosen(shrinkage: float | str, estimated: dict | None) -> dict:
    """The weight of the pooled covariance a model was fitted with, and why, for ``train`` and ``padim info``:
    ``weight``, ``chosen`` (``given`` or ``estimated``) and a sentence (``why``); ``estimated`` is the header's
    ``shrinkage_estimated`` (format 18)."""
    if estimated:
        weight, samples = estimated["weight"], estimated.get("samples", estimated["rows"])
        amount = "little" if weight < 0.1 else "a fair amount" if weight < 0.4 else "much"
        tails = estimated.get("tails", 1.0)
        return {
            "weight": weight,
            "chosen": "estimated",
            "why": f"estimated from the statistics (--shrinkage auto): {samples} samples a pixel over "
            f"{estimated['pixels']} pixels, whose covariances vary {tails:.2g}x as much as a Gaussian's would, ask "
            f"for {amount} of the pooled covariance; more pictures ask for less",
        }
    if shrinkage == "auto":  # a partial fit: its merge estimates the weight
        return {"weight": None, "chosen": "estimated", "why": "estimated when the parts are merged"}
    weight = float(shrinkage)
    return {
        "weight": weight,
        "chosen": "given",
        "why": "none: the paper's sample covariances" if not weight else "given (--shrinkage WEIGHT)",
    }


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Provenance:
    """Where a detector came from; the model file's header holds it.

    Attributes:
        created: when the file's statistics were last extended (ISO 8601, UTC).
        padim_version: the version that made it.
        fit_image_count: images in its statistics.
        calibration_source: ``out_of_fold`` (its own images) or ``held_out`` (images no part
            fitted, after a merge); ``None`` for a partial fit.
        unreadable_image_count: images left out because they could not be read, over all fits.
        fit_seconds: wall time of the last fit.
        fits: one record per fit run (images, unreadable, already fitted, resumed, world size).
        merged_from: the partial files a merge combined.
        verified: whether the file's digests were checked when it was read (format 2).
        precision_check: a reduced precision's scores against fp32's (:mod:`padim.models.fit.precision`; format
            11), ``None`` at fp32.
        expect_measured: what ``--expect auto`` measured on the training pictures
            (:class:`~padim.models.data.spread.Spread`; format 14), ``None`` for a declared cover.
        shrinkage_estimated: the weight ``--shrinkage auto`` estimated from the statistics, and from what
            (``weight``, ``rows``, ``pixels``; format 18), ``None`` for a weight given.
    """

    created: str = field(default_factory=now)
    padim_version: str = __version__
    fit_image_count: int = 0
    calibration_source: str | None = None
    unreadable_image_count: int = 0
    fit_seconds: float | None = None
    fits: list[dict] = field(default_factory=list)
    merged_from: list[str] = field(default_factory=list)
    verified: bool = True
    precision_check: dict | None = None
    expect_measured: dict | None = None
    shrinkage_estimated: dict | None = None

    def to_header(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "verified"}

    @classmethod
    def from_header(cls, header: dict) -> Provenance:
        known = {f.name for f in fields(cls)}
        return cls(**{k: header[k] for k in known if k in header})


class PadimDetector:
    """A fitted detector, ready to score batches of model-input tensors.

    Attributes:
        config: what it was fitted with.
        weights: origin of the backbone weights.
        backbone_weights: the backbone parameters and buffers it uses (saved with it).
        model: the scoring ``nn.Module`` (embedder, mean and precision factors as buffers).
        calibration: normal scores, threshold and what it promises.
        provenance: image counts, fits, creation time.
        statistics: the fit's streamed statistics, kept for ``--resume`` (``None`` when not read).
        image_digests: content digests of the fitted images (``--resume`` leaves them out).
        precision_dtype: dtype of the precision factors in the file.
        int8_scorer: the int8 scorer the file carries beside the float32 model (:mod:`padim.models.scoring.reduced`;
            ``None``: none).
        runtime: ``torch``, what runs it (see :class:`~padim.models.scorer.Scorer`).
    """

    runtime = "torch"
    file_scorer = "float32"  # the model's own scorer (its int8 one runs on ONNX Runtime: models/deploy/runtimes.py)

    def __init__(
        self,
        config: PadimConfig,
        weights: WeightsInfo,
        backbone_weights: dict[str, torch.Tensor],
        model: PadimModel,
        calibration: Calibration,
        provenance: Provenance,
        statistics: GaussianState | None = None,
        image_digests: torch.Tensor | None = None,
        precision_dtype: torch.dtype = torch.float32,
        int8_scorer: Int8Scorer | None = None,
    ):
        self.config = config
        self.weights = weights
        self.backbone_weights = backbone_weights
        self.model = model
        self.calibration = calibration
        self.provenance = provenance
        self.statistics = statistics
        self.image_digests = torch.zeros(0, dtype=torch.int64) if image_digests is None else image_digests
        self.precision_dtype = precision_dtype
        self.int8_scorer = int8_scorer
        self.graphs: CudaGraphs | None = None  # capture_graphs: the forward as CUDA graphs, on a GPU
        self.runtime_reason: str | None = None  # why ``--runtime auto`` chose torch (set by the loader)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def embedding(self) -> Embedding:
        return self.model.embedder.embedding

    @property
    def framing(self) -> Framing:
        """Region of interest and resize mode (:mod:`padim.models.data.framing`)."""
        return self.model.embedder.framing

    # ------------------------------------------------------------------ scoring
    def preprocess(self, images) -> torch.Tensor:
        """PIL images -> ``(B, 3, S, S)`` normalised model input."""
        return self.model.embedder.preprocess(images)

    def score(self, batch: torch.Tensor) -> ScoreOutput:
        """``(B, 3, H_in, W_in)`` model input -> raw image scores ``(B,)`` and maps ``(B, H_in, W_in)``; through a
        captured CUDA graph where one holds the batch (:meth:`capture_graphs`)."""
        if self.graphs is not None and (out := self.graphs(batch)) is not None:
            return out
        return self.model(batch.to(self.device, non_blocking=True))

    def capture_graphs(self, largest: int) -> tuple[int, ...]:
        """Capture the forward as CUDA graphs for the batch sizes of
        :func:`~padim.models.scoring.model.graph_sizes` up to ``largest`` pictures (on a GPU; nothing elsewhere).
        Returns the sizes captured: none where capture failed or disagreed with eager scoring (said once in the
        log; scoring stays eager)."""
        if self.device.type != "cuda":
            return ()
        self.graphs = None
        graphs = CudaGraphs(self.model, graph_sizes(largest), self.config.input_shape)
        self.graphs = graphs if graphs.sizes else None
        return graphs.sizes

    # ------------------------------------------------------------------ metadata
    def describe(self) -> dict:
        """Metadata a user sees (``padim info``, ``GET /models``, results files)."""
        return {
            "backbone": self.config.features.backbone,
            "backbone_family": self.config.spec.family,
            "stages": self.config.spec.described(self.config.features.stages),
            "weights": self.weights.label,
            "weights_source": self.weights.source,
            **shown_options(self.config),
            "shrinkage_chosen": shrinkage_chosen(self.config.gaussian.shrinkage, self.provenance.shrinkage_estimated),
            "embedding_dim": self.embedding.embedding_dim,
            "grid": list(self.model.grid_shape),
            "fit_image_count": self.provenance.fit_image_count,
            "calibration": {
                **self.calibration.summary(),
                "source": self.provenance.calibration_source,
                **calibration_options(self.config, len(self.calibration.line_scores), self.provenance.expect_measured),
                "threshold_of": f"{spelled_precision(self.config.features.precision)} scorer",
            },
            "verified": self.provenance.verified,
            "runtime": self.runtime,
            **({"runtime_reason": self.runtime_reason} if self.runtime_reason else {}),
            **({"cuda_graphs": list(self.graphs.sizes)} if self.graphs is not None else {}),
            "precision": spelled_precision(self.config.features.precision),
            **({"precision_check": self.provenance.precision_check} if self.provenance.precision_check else {}),
            "created": self.provenance.created,
            "padim_version": self.provenance.padim_version,
        }
