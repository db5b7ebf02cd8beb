"""The scoring model: normalised images in, anomaly maps and image scores out (PaDiM, Sec. III-C).

An ``nn.Module`` whose fitted statistics are buffers, so ``.to(device)`` moves everything and
``state_dict()`` holds everything; fitting (:mod:`padim.models.fit.in_progress`), the model file
(:mod:`padim.models.model_file`) and distributed code (:mod:`padim.models.fit.distributed`) live
elsewhere. Shapes: ``B`` images, ``S`` the input side, ``P = H * W`` feature-grid pixels, ``D``
embedding channels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from padim.core.scoring import image_scores, squared_mahalanobis
from padim.core.tiling import Tiling, picture_maps
from padim.models.features.embedding import FeatureEmbedder
from padim.models.options import ScoringOptions


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
