"""One loaded version of a model (:class:`ServedModel`), with what names and describes it."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from padim.core.calibration import MODEL_THRESHOLD
from padim.models.scorer import Scorer
from padim.models.scoring.model import ScoreOutput

from ..device.batching import Batcher
from ..edge.schemas import ModelDescription, ModelInfo
from ..monitor import Monitor

log = logging.getLogger("padim.service")


@dataclass(eq=False)
class ServedModel:
    """One loaded version of a model, with its own batcher and monitor.

    A request holds the version it was admitted by (:meth:`~padim.service.state.versions.LoadedVersions.using`)
    until it is answered: its images are scored by this version's batcher, which is bound to this scorer, and
    judged by this calibration, whatever is activated meanwhile. A replaced version is *retired*: it takes no new
    request and is closed once its last one is answered.

    ``serial`` names this load of a version among every version the process has loaded (the API processes of a
    service ask for it by that: :mod:`padim.service.processes`).
    """

    name: str
    path: Path
    sha256: str
    scorer: Scorer
    batcher: Batcher
    load_seconds: float
    monitor: Monitor
    version: int = 1
    serial: int = 0
    in_flight: int = 0  # requests admitted by this version and not yet answered
    retired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # in_flight, from any thread

    def info(self) -> ModelInfo:
        """Identity of the model, returned with every score."""
        return model_info(self.name, self.version, self.sha256, self.scorer)

    def identity(self) -> dict:
        """:meth:`info` as the JSON every answer carries, made once a version (it never changes)."""
        cached = self.__dict__.get("_identity")
        if cached is None or cached["version"] != self.version:
            cached = self.__dict__["_identity"] = self.info().model_dump()
        return cached

    def describe(self, versions: list | None = None) -> ModelDescription:
        """The model in full (``GET /models``); no server paths."""
        return ModelDescription(
            **{
                **self.scorer.describe(),
                **self.info().model_dump(),
                "threshold": MODEL_THRESHOLD,
                "load_seconds": round(self.load_seconds, 3),
                "versions": versions or [],
            }
        )

    def score_batch(self, batch: torch.Tensor, on_split=None) -> ScoreOutput:
        """Runs on the scheduler's thread: ``(B, 3, H, W)`` -> the scorer's output.

        Out of GPU memory, the cache is emptied and the batch scored again in two halves
        (``on_split`` is told); a half that still does not fit raises ``torch.OutOfMemoryError``.
        """
        try:
            return self.scorer.score(batch)
        except torch.OutOfMemoryError:
            release_device_memory()
            if batch.shape[0] == 1:
                raise
            log.warning(
                "out of GPU memory at batch %d; scoring it in two halves", batch.shape[0], extra={"model": self.name}
            )
            if on_split is not None:
                on_split()
            half = (batch.shape[0] + 1) // 2
            try:
                return joined(self.scorer.score(batch[:half]), self.scorer.score(batch[half:]))
            except torch.OutOfMemoryError:
                release_device_memory()
                raise


def model_info(name: str, version: int, sha256: str, scorer) -> ModelInfo:
    """Identity of a served version (``scorer``: the scorer or a view of it), returned with every score."""
    return ModelInfo(
        name=name,
        version=version,
        backbone=scorer.config.features.backbone,
        created=scorer.provenance.created,
        sha256=sha256,
        weights=scorer.weights.public_label,
    )  # no server paths for clients


def joined(first: ScoreOutput, second: ScoreOutput) -> ScoreOutput:
    """Two outputs of one scorer as one, in order."""
    inputs = (
        torch.cat([first.input_distances, second.input_distances])
        if first.input_distances is not None and second.input_distances is not None
        else None
    )
    return ScoreOutput(torch.cat([first.raw_scores, second.raw_scores]), torch.cat([first.maps, second.maps]), inputs)


def release_device_memory() -> None:
    """Hand the blocks torch's CUDA allocator caches back to the GPU (nothing without CUDA)."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def model_name(path: Path) -> str:
    return path.name.removesuffix(".padim") if path.name.endswith(".padim") else path.stem
