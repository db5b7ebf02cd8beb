"""The int8 scorer a float32 model carries beside its own (``train --int8-scorer``, the default since model format 20).

Made by :func:`padim.models.fit.training.train`; kept in the model file by :mod:`padim.models.fit.model_file`.

A float32 model scores on any machine; an inspection PC with int8 dot products (AVX2, VNNI, AMX) scores 1.5-2x faster
with its backbone quantised (docs/performance.md). Such a scorer needs its own threshold: its scores are not float32's
(docs/quantisation.md), so no threshold carries over. The fit makes it beside the float32 model, from the same
pictures, once:

1. **its backbone**: the float32 backbone quantised from the training pictures, as ``--precision int8`` quantises it
   (:mod:`padim.models.features.quantised`; a resumed model's own graph is kept);
2. **its threshold, from its own scores**: pass 1 embeds every picture (and its changed copy, ``expect``) with that
   graph too, and the finish scores those rows out-of-fold under the float32 Gaussians, each under the model
   without its picture's fold, as the float32 rows are scored (:attr:`~padim.models.fit.passes.ScoringPass.queries`).
   The Gaussians are the float32 model's: only the backbone's arithmetic differs, and the int8 scores the
   threshold is read from are those the scorer will compute;
3. **its gate**: the first :data:`~padim.models.fit.precision.CHECK_IMAGES` training pictures scored by both
   backbones under the fitted model, the largest relative image-score difference against the tolerance
   (``--max-score-error``, int8's default :data:`~padim.models.fit.precision.INT8_MAX_SCORE_ERROR`), as
   ``--precision int8`` is gated. A refused scorer keeps only its gate's figures (the file holds no graph, and
   ``--runtime auto`` says why it scores at float32).

``--runtime auto`` then runs it where the CPU it finds computes int8 faster (:func:`~padim.models.devices.int8_flag`)
and ONNX Runtime is installed, whichever machine fitted the model. A new threshold set on the float32 scores
(``evaluate --calibrate``, a line's, a review's) leaves the int8 scorer out of the file: its threshold would no
longer be the same promise.
"""

from __future__ import annotations

from dataclasses import dataclass

from padim.core.calibration import Calibration

#: The header key of the int8 scorer, and the prefix of its calibration's tensors.
KEY = "int8_scorer"


@dataclass(frozen=True)
class Int8Scorer:
    """The int8 scorer of a float32 model: its gate, what made its backbone, and its threshold.

    Attributes:
        check: its image scores against float32's on training pictures under the model, as
            :class:`~padim.models.fit.precision.PrecisionCheck` gives them (the gate).
        quantiser: what made its backbone (the quantiser's settings, as ``--precision int8`` records them).
        calibration: its threshold, from its own out-of-fold scores; ``None`` where the gate refused it.
    """

    check: dict
    quantiser: dict
    calibration: Calibration | None

    @property
    def usable(self) -> bool:
        """Whether it may score: its gate passed (so its file keeps its graph and threshold)."""
        return self.calibration is not None

    def to_header(self) -> dict:
        calibration = None if self.calibration is None else self.calibration.summary()
        return {"check": self.check, "quantiser": self.quantiser, "calibration": calibration}

    def gate(self) -> str:
        """Its gate in words: the figures and the tolerance."""
        check = self.check
        return (
            f"against float32 on {check['images']} training pictures: largest relative image-score difference "
            f"{check['max_score_error']:.2%}, median {check['median_score_error']:.2%}, "
            f"tolerance {check['tolerance']:.0%}"
        )

    def sentence(self) -> str:
        """One line for ``train`` and ``padim info``."""
        if self.calibration is None:
            return f"int8 scorer refused by its gate ({self.gate()}): --runtime auto scores at float32"
        return (
            f"int8 scorer kept ({self.gate()}); its threshold from its own out-of-fold scores promises "
            f"{self.calibration.promised_false_alarm_rate:.2%} false alarms"
        )
