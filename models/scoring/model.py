"""The scoring model: normalised images in, anomaly maps and image scores out (PaDiM, Sec. III-C).

An ``nn.Module`` whose fitted statistics are buffers, so ``.to(device)`` moves everything and
``state_dict()`` holds everything; fitting (:mod:`padim.models.fit.in_progress`), the model file
(:mod:`padim.models.fit.model_file`) and distributed code (:mod:`padim.models.fit.distributed`) live
elsewhere. Shapes: ``B`` images, ``S`` the input side, ``P = H * W`` feature-grid pixels, ``D``
embedding channels.

:class:`CudaGraphs` replays the model's forward as CUDA graphs captured for fixed batch sizes (on a GPU a batch of
one picture is otherwise bound by the launch of each of its few hundred kernels, not by the GPU).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import NamedTuple

import torch
from torch import nn

from padim.core.scoring import image_scores, squared_mahalanobis
from padim.core.tiling import Tiling, picture_maps
from padim.models.features.embedding import FeatureEmbedder
from padim.models.options import ScoringOptions

log = logging.getLogger(__name__)

#: Eager passes on a side stream before a size is captured (cudnn's tuning, lazily made constants).
GRAPH_WARMUP = 2
#: The captured graphs' scores against eager scoring of the same pictures, checked once after capture: they run
#: the same kernels, so anything past this is a capture gone wrong, and the graphs are dropped.
GRAPH_CHECK_RTOL = 1e-4


class ScoreOutput(NamedTuple):
    """Scores of a batch.

    Attributes:
        raw_scores: ``(B,)`` image scores (Mahalanobis distance units; the maximum of each map
            unless the model reads them another way, :func:`padim.core.scoring.image_scores`).
        maps: ``(B, S, S)`` anomaly maps at the model's input size (``(B, H_in, W_in)`` tiled).
        input_distances: ``(B,)`` mean squared distance over every feature pixel of each picture (the
            input drift statistic, :mod:`padim.core.drift`); ``None`` from exports older than version 4.
    """

    raw_scores: torch.Tensor
    maps: torch.Tensor
    input_distances: torch.Tensor | None = None

    def non_finite(self) -> list[int]:
        """Indices of the images whose score or map holds a NaN or an infinity."""
        finite = torch.isfinite(self.maps).flatten(1).all(dim=1) & torch.isfinite(self.raw_scores)
        return torch.nonzero(~finite).flatten().tolist()


class PadimModel(nn.Module):
    """Backbone features, embedding, per-pixel Mahalanobis distance, map and score.

    Args:
        embedder: images -> ``(B, P, D)`` embeddings.
        mean: ``(p, D)`` per-pixel mean (``p``: :attr:`FeatureEmbedder.pixels`).
        precision_factor: ``(p, D, D)`` lower-triangular ``W`` with precision ``W^T W``; float16
            factors (as a model file may store them) are kept float16 and upcast chunk by chunk
            when scoring (:func:`padim.core.scoring.squared_mahalanobis`), other dtypes become
            float32.
        scoring: how a map and an image score are read from the distances (smoothing, ``map_max``,
            ``patch_max`` or ``top_mean``: :func:`padim.core.scoring.image_scores`).
    """

    mean: torch.Tensor  # buffers, declared for the type checker (nn.Module's attributes are untyped)
    precision_factor: torch.Tensor

    def __init__(
        self,
        embedder: FeatureEmbedder,
        mean: torch.Tensor,
        precision_factor: torch.Tensor,
        scoring: ScoringOptions,
    ):
        super().__init__()
        self.embedder = embedder
        self.scoring = scoring
        self.register_buffer("mean", mean.to(torch.float32))  # (P, D)
        kept = torch.float16 if precision_factor.dtype == torch.float16 else torch.float32
        self.register_buffer("precision_factor", precision_factor.to(kept))  # (P, D, D)

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def upcast_factors(self) -> PadimModel:
        """Keep float16 factors as float32 from now on (once, at load, on a GPU).

        On a CPU the chunked upcast costs nothing measurable and halves the memory; on a GPU it
        would move every factor twice per batch (for wide_resnet50_2 at 224 px about 9.5 GB of
        memory traffic a batch), so there they are upcast once and kept: twice the GPU memory.
        """
        if self.precision_factor.dtype != torch.float32:
            self.precision_factor = self.precision_factor.to(torch.float32)
        return self

    @property
    def grid_shape(self) -> tuple[int, int]:
        return self.embedder.grid_shape

    @property
    def image_size(self) -> int:
        return self.embedder.image_size

    @torch.inference_mode()
    def score_embeddings(self, embedding: torch.Tensor) -> ScoreOutput:
        """``(N, p, D)`` embeddings (a picture's rows consecutive) -> raw image scores ``(B,)`` and maps
        ``(B, H_in, W_in)``."""
        squared = squared_mahalanobis(embedding, self.mean, self.precision_factor)  # (N, p)
        return score_distances(squared, self.embedder.tiling, self.scoring)

    @torch.inference_mode()
    def forward(self, batch: torch.Tensor) -> ScoreOutput:
        """``(B, 3, H_in, W_in)`` normalised images -> raw image scores ``(B,)`` and maps ``(B, H_in, W_in)``."""
        return self.score_embeddings(self.embedder(batch))


def score_distances(squared: torch.Tensor, tiling: Tiling, scoring: ScoringOptions) -> ScoreOutput:
    """``(N, p)`` squared distances (a picture's rows consecutive) -> image scores ``(B,)``, maps ``(B, H_in, W_in)``
    and input distances ``(B,)``.

    What the scorer and the calibration both compute: tiles stitched into one map
    (:func:`padim.core.tiling.picture_maps`), the image score read from the whole picture's map, the
    input distance the mean of the picture's squared distances.
    """
    per_picture, maps = picture_maps(squared, tiling, scoring.blur_sigma)  # (B, T * P), (B, H_in, W_in)
    scores = image_scores(maps, scoring.image_score, per_picture, scoring.top_fraction)
    return ScoreOutput(scores, maps, per_picture.mean(1))


def graph_sizes(largest: int) -> tuple[int, ...]:
    """The batch sizes captured for a scorer whose batches hold at most ``largest`` pictures: 1, 2, 4 and 8, every
    multiple of 8 up to ``largest``, and ``largest``. A batch pads to the next size: past 8, at most 7 pictures of
    work are wasted, and a batch of one runs at batch one's pace."""
    sizes = {s for s in (1, 2, 4, 8) if s <= largest} | set(range(16, largest + 1, 8)) | {max(1, largest)}
    return tuple(sorted(sizes))


class CudaGraphs:
    """A :class:`PadimModel`'s forward captured as one CUDA graph per batch size, and replayed.

    Each size's graph reads a static ``(size, 3, H, W)`` uint8 input on the GPU and writes static outputs; the
    graphs share one memory pool (they never run at once: a lock holds a replay and the copies out of it). A
    batch of ``n`` pictures is copied into the smallest captured size ``>= n`` (the rows past ``n`` keep whatever
    they held: every picture is scored on its own, so they change nothing of the first ``n``), replayed, and its
    first ``n`` results copied out. Capture is checked against eager scoring of the same random pictures; a capture
    that fails or disagrees leaves no graphs (the caller scores eagerly, as before) and says why once.

    Attributes:
        sizes: the captured batch sizes, ascending (empty: none, score eagerly).
        reason: why there are none, when there are none.
    """

    def __init__(self, model: PadimModel, sizes: tuple[int, ...], input_shape: tuple[int, int]):
        self.model, self.input_shape = model, tuple(input_shape)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, ScoreOutput]] = {}
        self._lock = threading.Lock()
        self.reason = ""
        try:
            self._capture(sorted(set(sizes)))
            self._check(max(self._graphs))
        except (RuntimeError, ValueError) as error:  # torch's CUDA errors, an out-of-memory among them
            self._graphs.clear()
            self.reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            with contextlib.suppress(RuntimeError):  # what failed may fail again here: the log line says it
                torch.cuda.synchronize(model.device)
                torch.cuda.empty_cache()
            log.warning("CUDA graphs not captured (%s); scoring eagerly", self.reason)
        self.sizes = tuple(sorted(self._graphs))

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> None:
        device = self.model.device
        pool = None
        for size in reversed(sizes):  # the largest first: its pool serves every smaller size
            static = torch.zeros(size, 3, *self.input_shape, dtype=torch.uint8, device=device)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP):
                    self.model(static)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the service captures on its loader thread while another version scores on the GPU
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self.model(static)
            pool = graph.pool()
            self._graphs[size] = (graph, static, out)
        self._graphs = dict(sorted(self._graphs.items()))  # ascending: a batch takes the smallest that holds it
        torch.cuda.synchronize(device)

    def _check(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        pictures = torch.randint(0, 256, (size, 3, *self.input_shape), generator=generator, dtype=torch.uint8)
        for n in sorted({1, size}):
            replayed = self(pictures[:n])
            eager = self.model(pictures[:n].to(self.model.device))
            if replayed is None:
                raise ValueError(f"no graph for a batch of {n}")
            for name, got, expected in zip(ScoreOutput._fields, replayed, eager, strict=True):
                if got is None or expected is None:
                    continue
                error = float(
                    ((got.double() - expected.double()).abs() / expected.double().abs().clamp_min(1e-12)).max()
                )
                if not error <= GRAPH_CHECK_RTOL:
                    raise ValueError(f"the graph's {name} differ from eager scoring by {error:.1e} at a batch of {n}")

    def __call__(self, batch: torch.Tensor) -> ScoreOutput | None:
        """``(n, 3, H, W)`` uint8 pixels (host or GPU) -> the model's output for them, or ``None`` where no graph
        fits (more pictures than the largest size, another shape or dtype): score those eagerly."""
        n = len(batch)
        size = next((s for s in self._graphs if s >= n), None) if n else None
        if size is None or batch.dtype != torch.uint8 or tuple(batch.shape[1:]) != (3, *self.input_shape):
            return None
        graph, static, out = self._graphs[size]
        with self._lock, torch.inference_mode():
            static[:n].copy_(batch, non_blocking=True)
            graph.replay()
            raw_scores, maps, inputs = out
            return ScoreOutput(raw_scores[:n].clone(), maps[:n].clone(), None if inputs is None else inputs[:n].clone())
