"""The one interface every scorer implements: the torch detector and each exported runtime.

:class:`Scorer` is shaped as its callers use it. The service decodes on a pool of threads and
calls :meth:`Scorer.preprocess` there, scores a stacked batch with :meth:`Scorer.score` on its
single inference thread, and gives verdicts from :attr:`Scorer.calibration`; ``padim predict``,
``padim evaluate`` and :class:`padim.Detector` do the same in one thread. Implementations:
:class:`~padim.models.scoring.detector.PadimDetector` (torch) and
:class:`~padim.models.deploy.runtimes.DeployedDetector` (ONNX Runtime, OpenVINO);
:func:`~padim.models.deploy.runtimes.load_scorer` gives the one asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from PIL import Image

from padim.core.calibration import Calibration
from padim.models.config import PadimConfig
from padim.models.data.framing import Framing
from padim.models.features.backbones import WeightsInfo
from padim.models.scoring.detector import Provenance
from padim.models.scoring.model import ScoreOutput


@runtime_checkable
class Scorer(Protocol):
    """What scores images: model input in, raw scores and anomaly maps out, with what makes verdicts.

    Attributes:
        config: what the detector was fitted with (``input_shape`` is the input: ``image_size`` square, or tiles).
        calibration: normal scores, threshold and what it promises; verdicts come from it.
        weights: where the backbone weights came from (its ``label`` is shown with every result).
        provenance: image counts, fits, creation time.
        runtime: what runs it: ``torch``, ``onnxruntime`` or ``openvino``.
        file_scorer: which of its model file's scorers it is, so whose threshold a new one replaces: ``float32``
            (the model's own, at whatever precision it was fitted) or ``int8`` (a float32 model's int8 scorer:
            :mod:`padim.models.scoring.reduced`).
    """

    config: PadimConfig
    calibration: Calibration
    weights: WeightsInfo
    provenance: Provenance
    runtime: str
    file_scorer: str

    @property
    def device(self) -> torch.device:
        """Where it computes (``cuda`` or ``cpu``); :meth:`score`'s outputs are there or on the CPU."""

    @property
    def framing(self) -> Framing:
        """What part of a picture the model sees and how (region of interest, resize mode); maps back to pictures."""

    def preprocess(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """RGB images -> ``(B, 3, H_in, W_in)`` uint8 pixels, framed as the model was fitted (thread-safe; the
        decode pool); ``H_in = W_in = S`` untiled."""

    def score(self, batch: torch.Tensor) -> ScoreOutput:
        """``(B, 3, H_in, W_in)`` pixels (or normalised float32 model input) -> raw image scores ``(B,)`` and
        anomaly maps ``(B, H_in, W_in)`` (a tiled model's tiles stitched into one map)."""

    def capture_graphs(self, largest: int) -> tuple[int, ...]:
        """Capture what :meth:`score` runs as CUDA graphs for batches of up to ``largest`` pictures, where this
        scorer can (torch on a GPU); returns the batch sizes captured (none elsewhere)."""

    def describe(self) -> dict:
        """What a user sees of it (``padim info``, ``GET /models``, results files)."""
