"""Multi-layer feature extraction and PaDiM embeddings (Sec. III-A).

The backbone is cut after the deepest requested stage by torchvision's
``create_feature_extractor`` (torch.fx), its BatchNorms are folded into the preceding
convolutions for inference, and it runs channels_last. Deeper maps are brought to the first
layer's grid by nearest upsampling with an integer scale factor and concatenated; the channel
reduction (random subset, or semi-orthogonal projection) is applied per layer *before*
upsampling, which gives the same embedding for less work. With ``neighbourhood`` ``k > 1``, each
layer's reduced map is averaged over ``k x k`` neighbours on that layer's own grid (borders
average the neighbours that exist), so that a feature describes its surroundings as PatchCore's
do; the average is per channel, so averaging after the reduction equals averaging before it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.optimization import fuse
from torchvision.models.feature_extraction import create_feature_extractor

from padim.core.errors import ArtifactError
from padim.models.data.framing import Framing
from padim.models.data.images import normalisation, normalisation_arrays, normalise, normalise_array, to_pixels
from padim.models.families import BackboneSpec
from padim.models.features.backbones import IMAGENET_MEAN, IMAGENET_STD, network
from padim.models.features.photometric import standardised
from padim.models.features.quantised import GRAPH_KEY, GraphExtractor, QuantisedExtractor


class SharedOrAlone:
    """A lock held by many at once (:meth:`shared`) or by one alone (:meth:`alone`); one waiting to be alone goes
    before those that come after it. Not re-entrant: a holder does not take it again."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._sharing = 0
        self._alone = False
        self._waiting_alone = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._changed:
            while self._alone or self._waiting_alone:
                self._changed.wait()
            self._sharing += 1
        try:
            yield
        finally:
            with self._changed:
                self._sharing -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self._changed:
            self._waiting_alone += 1
            while self._alone or self._sharing:
                self._changed.wait()
            self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._changed:
                self._alone = False
                self._changed.notify_all()


#: torch.fx traces a backbone alone: tracing patches ``torch.nn.Module.__call__`` for the whole process, so a
#: module that runs in another thread meanwhile fails ("module is not installed as a submodule"), and so does
#: ``torch.export`` (an ONNX export at load). A service that loads a model beside one that scores holds it shared
#: around each batch and each export, which run side by side (the traces of one backbone take 0.2-0.3 s on a
#: 2-core CPU, resnet18 to wide_resnet50_2; an export several seconds, which scoring need not wait for).
TRACING = SharedOrAlone()


class FeatureExtractor(nn.Module):
    """Backbone stages as a list of feature maps.

    Args:
        backbone: a torchvision model of a family of :mod:`padim.models.families` (eval mode).
        layers: stages to return, shallowest first.
        fold_batchnorm: fold conv+BN pairs (inference only; changes outputs by < 1e-4).
        dtype: the arithmetic of the stages (``train --precision``): the folded weights are cast to it, each
            batch enters in it, and the maps leave in float32 for the embedding and the Gaussians.
    """

    def __init__(
        self,
        backbone: nn.Module,
        layers: tuple[str, ...],
        fold_batchnorm: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.layers = tuple(layers)
        self.dtype = dtype
        with TRACING.alone():  # both trace: create_feature_extractor, and fuse (again, to fold the BatchNorms)
            graph = create_feature_extractor(backbone.eval(), return_nodes={layer: layer for layer in layers})
            # in place: deep-copying torchvision's DualGraphModule puts it back in training mode
            self.body = fuse(graph, inplace=True) if fold_batchnorm else graph
        self.body.eval()
        if dtype != torch.float32:  # after folding: the BatchNorms fold in float32
            self.body.to(dtype)

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        """``(B, 3, S, S)`` normalised images -> ``[(B, C_l, S / stride_l, S / stride_l)]`` float32 maps."""
        outputs = self.body(images.to(self.dtype).contiguous(memory_format=torch.channels_last))
        return [outputs[layer].float() for layer in self.layers]


class Embedding(nn.Module):
    """Concatenated, reduced multi-layer embedding ``(B, D, H, W)`` on the first layer's grid.

    Exactly one of ``channel_index`` (sorted indices into the concatenated channels, the
    paper's random subset) and ``projection`` (``(C, D)`` with orthonormal columns, Kim et al.
    2021) is set. ``neighbourhood``: side of the per-layer average (1: none; odd).
    """

    def __init__(
        self,
        channels: tuple[int, ...],
        strides: tuple[int, ...],
        channel_index: torch.Tensor | None = None,
        projection: torch.Tensor | None = None,
        neighbourhood: int = 1,
    ):
        super().__init__()
        if (channel_index is None) == (projection is None):
            raise ValueError("give exactly one of channel_index and projection")
        if neighbourhood < 1 or neighbourhood % 2 == 0:
            raise ValueError(f"neighbourhood must be an odd number >= 1, got {neighbourhood}")
        self.neighbourhood = int(neighbourhood)
        self.channels = tuple(channels)
        self.scales = tuple(s // strides[0] for s in strides)
        offsets = [sum(channels[:i]) for i in range(len(channels))]
        if channel_index is not None:
            self.register_buffer("channel_index", channel_index.to(torch.int64))
            self.projection = None
            # per-layer pieces as (non-saved) buffers, so that .to(device) moves them once
            for i, (o, c) in enumerate(zip(offsets, channels, strict=True)):
                local = channel_index[(channel_index >= o) & (channel_index < o + c)] - o
                self.register_buffer(f"_part{i}", local.to(torch.int64), persistent=False)
            self.embedding_dim = int(channel_index.numel())
        else:
            assert projection is not None
            self.register_buffer("projection", projection.to(torch.float32))
            self.channel_index = None
            for i, (o, c) in enumerate(zip(offsets, channels, strict=True)):  # (D, C_l, 1, 1) 1x1-convolution weights
                weight = projection[o : o + c].T.contiguous()[:, :, None, None].to(torch.float32)
                self.register_buffer(f"_part{i}", weight, persistent=False)
            self.embedding_dim = int(projection.shape[1])

    @classmethod
    def for_layers(
        cls,
        spec: BackboneSpec,
        layers: tuple[str, ...],
        channel_index: torch.Tensor | None = None,
        projection: torch.Tensor | None = None,
        neighbourhood: int = 1,
    ) -> Embedding:
        """The embedding of ``layers`` of ``spec`` with a given channel subset or projection."""
        strides = tuple(spec.stride_of(layer) for layer in layers)
        return cls(
            spec.channels_of(layers),
            strides,
            channel_index=channel_index,
            projection=projection,
            neighbourhood=neighbourhood,
        )

    @classmethod
    def create(
        cls,
        spec: BackboneSpec,
        layers: tuple[str, ...],
        embedding_dim: int,
        reduction: str,
        seed: int,
        neighbourhood: int = 1,
    ) -> Embedding:
        """A seeded random channel subset or semi-orthogonal projection of ``embedding_dim`` channels."""
        total = sum(spec.channels_of(layers))
        generator = torch.Generator().manual_seed(seed)
        if reduction == "random":
            index = torch.randperm(total, generator=generator)[:embedding_dim].sort().values
            return cls.for_layers(spec, layers, channel_index=index, neighbourhood=neighbourhood)
        gaussian = torch.randn(total, embedding_dim, generator=generator, dtype=torch.float64)
        q, _ = torch.linalg.qr(gaussian)  # (C, D), orthonormal columns
        return cls.for_layers(spec, layers, projection=q.to(torch.float32), neighbourhood=neighbourhood)

    def same_reduction(self, other: Embedding) -> bool:
        """Whether ``other`` keeps the same channels (or projects the same way) and averages the same neighbours."""
        if self.neighbourhood != other.neighbourhood:
            return False
        if self.channel_index is not None and other.channel_index is not None:
            return torch.equal(self.channel_index.cpu(), other.channel_index.cpu())
        return (
            self.projection is not None
            and other.projection is not None
            and torch.equal(self.projection.cpu(), other.projection.cpu())
        )

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        """``[(B, C_l, H_l, W_l)]`` -> ``(B, D, H_0, W_0)``."""
        parts = []
        for i, (feature, scale) in enumerate(zip(features, self.scales, strict=True)):
            part = getattr(self, f"_part{i}")
            if self.channel_index is not None:
                reduced = feature.index_select(1, part)
            else:
                reduced = F.conv2d(feature, part.to(feature.dtype))
            if self.neighbourhood > 1 and reduced.shape[1]:  # each layer on its own grid: deeper layers see farther
                reduced = self._averaged(reduced)
            if scale != 1:
                reduced = F.interpolate(reduced, scale_factor=scale, mode="nearest")
            parts.append(reduced)
        if self.channel_index is not None:
            return torch.cat(parts, dim=1)
        return torch.stack(parts).sum(0)

    def _averaged(self, reduced: torch.Tensor) -> torch.Tensor:
        """``(B, c, H_l, W_l)`` kept channels averaged over their ``neighbourhood`` on the layer's own grid (borders:
        the neighbours that exist)."""
        size = self.neighbourhood
        return F.avg_pool2d(reduced, size, stride=1, padding=size // 2, count_include_pad=False)

    def rows(self, features: list[torch.Tensor]) -> torch.Tensor:
        """``[(B, C_l, H_l, W_l)]`` -> ``(B, H_0 W_0, D)``: :meth:`forward`'s embedding with its channels last, as
        the statistics read it. A channel subset is written straight into that layout, each layer's kept channels
        repeated over the ``s x s`` pixels of the first grid they cover (what nearest upsampling by an integer ``s``
        gives, bit for bit) instead of upsampled, joined and transposed: fewer passes over the rows and fewer new
        tensors (on this project's 2-core VM, resnet18 at 224 px, 16 pictures: 1.1-12x less time in three runs, by
        the maps' layout and the neighbourhood; the VM's noise is that wide)."""
        first = features[0]
        batch, height, width = first.shape[0], first.shape[2], first.shape[3]
        if self.channel_index is None or any(scale & (scale - 1) for scale in self.scales):  # not powers of two
            return self(features).permute(0, 2, 3, 1).reshape(batch, height * width, self.embedding_dim)
        out = torch.empty(batch, height, width, self.embedding_dim, dtype=first.dtype, device=first.device)
        start = 0
        for i, (feature, scale) in enumerate(zip(features, self.scales, strict=True)):
            part = getattr(self, f"_part{i}")
            kept = part.numel()
            if self.neighbourhood > 1 and kept:
                last = self._averaged(feature.index_select(1, part)).permute(0, 2, 3, 1)
            elif feature.is_contiguous(memory_format=torch.channels_last):  # a gather along contiguous channels
                last = feature.permute(0, 2, 3, 1).index_select(3, part)
            else:
                last = feature.index_select(1, part).permute(0, 2, 3, 1)
            h, w = last.shape[1], last.shape[2]
            covered = out.view(batch, h, scale, w, scale, self.embedding_dim)[..., start : start + kept]
            covered.copy_(last.reshape(batch, h, 1, w, 1, kept).expand(batch, h, scale, w, scale, kept))
            start += kept
        return out.view(batch, height * width, self.embedding_dim)


class FeatureEmbedder(nn.Module):
    """Images to PaDiM embeddings ``(N, p, D)``: the backbone's stages, then the channel reduction.

    What a fitted detector and a fit in progress share. ``P = H * W`` is the first layer's
    feature grid (:attr:`grid_shape`, of one tile), ``D`` the reduced embedding size. Untiled,
    a picture is one row of ``P`` pixels. A tiled model (:attr:`tiling`) cuts each input into
    ``T`` tiles that go through the backbone as a batch; with ``tile_statistics`` ``position``
    a picture is one row of ``p = T * P`` pixels (each tile position its own Gaussians), with
    ``shared`` it is ``T`` rows of ``P`` (every tile a sample of the same Gaussians):
    :attr:`pixels` and :attr:`rows_per_image`.

    Args:
        config: the detector configuration (backbone, layers, image size).
        backbone_weights: the parameters and buffers of the stages used
            (:func:`padim.models.features.backbones.used_state`).
        embedding: the seeded channel subset or projection.
    """

    def __init__(self, config, backbone_weights: dict[str, torch.Tensor], embedding: Embedding):
        super().__init__()
        self.image_size = config.features.image_size
        self.framing = Framing.of(config)
        self.grid_shape = grid_shape(config)
        self.tiling = config.tiling
        self.rows_per_image = config.rows_per_image
        self.pixels = self.grid_shape[0] * self.grid_shape[1] * (self.tiling.count // self.rows_per_image)
        self.precision = config.features.precision
        self.standardise = config.features.standardise
        self.extractor: FeatureExtractor | GraphExtractor = build_extractor(config, backbone_weights)
        self.embedding = embedding

    @property
    def embedding_dim(self) -> int:
        return self.embedding.embedding_dim

    @property
    def device(self) -> torch.device:
        """Where the backbone runs (an int8 backbone, ONNX Runtime's, on the CPU: its anchor buffer is there)."""
        return next(itertools.chain(self.extractor.parameters(), self.extractor.buffers())).device

    @property
    def quantised(self) -> bool:
        """Whether the backbone is the int8 graph (``train --precision int8``; a new fit's until it is made: no)."""
        return isinstance(self.extractor, QuantisedExtractor)

    def preprocess(self, images) -> torch.Tensor:
        """PIL images -> ``(B, 3, H_in, W_in)`` uint8 model input (region of interest, resize mode), normalised on
        the device by :meth:`forward`."""
        return to_pixels(images, self.framing)

    def tiles(self, batch: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H_in, W_in)`` model input -> ``(B * T, 3, S, S)``: what the backbone reads, normalised."""
        if self.standardise == "none":
            return model_input(self.tiling.cut(batch))
        return self.tiling.cut(standardised(model_input(batch), self.standardise))  # the picture's light, then tiles

    @torch.inference_mode()
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H_in, W_in)`` model input (uint8 pixels, or float32 already normalised) ->
        ``(B * rows_per_image, pixels, D)`` embeddings."""
        batch = batch.to(self.device, non_blocking=True)
        return self.from_tiles(self.tiles(batch))

    @torch.inference_mode()
    def from_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """:meth:`tiles`' ``(B * T, 3, S, S)`` -> ``(B * rows_per_image, pixels, D)``: what :meth:`forward` gives, for
        tiles another embedder of the same framing made (a fit's two backbones)."""
        embedding = self.embedding.rows(self.extractor(tiles))  # (B * T, H W, D)
        rows = tiles.shape[0] // self.tiling.count * self.rows_per_image
        return embedding.reshape(rows, self.pixels, self.embedding.embedding_dim)


_NORMALISATION: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
#: ImageNet's normalisation as NumPy arrays, for :func:`model_input_array` (no torch op)
_NORMALISATION_ARRAYS = normalisation_arrays(IMAGENET_MEAN, IMAGENET_STD)


def model_input(batch: torch.Tensor) -> torch.Tensor:
    """What the backbone reads: uint8 pixels (:func:`~padim.models.data.images.to_pixels`) normalised with
    ImageNet's mean and standard deviation where they are (on a GPU after the 8-bit copy); float32 input, already
    normalised (a caller's own, as every scorer took before it took pixels), as it is."""
    if batch.dtype != torch.uint8:
        return batch
    constants = _NORMALISATION.get(batch.device)
    if constants is None:
        constants = _NORMALISATION[batch.device] = normalisation(IMAGENET_MEAN, IMAGENET_STD, batch.device)
    return normalise(batch, *constants)


def model_input_array(batch: torch.Tensor) -> np.ndarray:
    """:func:`model_input` of a CPU batch as the contiguous float32 array a graph runtime reads, the same numbers
    computed in NumPy (:func:`~padim.models.data.images.normalise_array`): no torch op, whose OpenMP threads would
    spin on the runtime's cores while it scores (measured on a 2-core Zen 4 VM: the int8 scorer at batch 1 took
    11.7-17.4 ms after torch's normalisation against 8.5 ms after NumPy's, docs/performance.md)."""
    if batch.dtype != torch.uint8:
        return np.ascontiguousarray(batch.detach().cpu().numpy(), dtype=np.float32)
    return normalise_array(batch.detach().cpu().numpy(), *_NORMALISATION_ARRAYS)


def stacked(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``tensors`` as one batch on its way to ``device``: for a GPU in page-locked host memory (torch's host cache
    reuses it), so that the copy to the device runs without the CPU, queued behind the work before it; CPU tensors
    for the CPU stacked in NumPy."""
    if device.type != "cuda" and all(t.device.type == "cpu" for t in tensors):
        # in NumPy: a torch copy this large runs on torch's OpenMP team, whose threads then spin on the cores a graph
        # runtime scoring the batch next needs (model_input_array)
        return torch.from_numpy(np.stack([t.detach().numpy() for t in tensors]))
    if device.type != "cuda" or tensors[0].device.type != "cpu":
        return torch.stack(list(tensors))
    first = tensors[0]
    batch = torch.empty((len(tensors), *first.shape), dtype=first.dtype, pin_memory=True)
    return torch.stack(list(tensors), out=batch)


def grid_shape(config) -> tuple[int, int]:
    """``(H, W)`` of the first layer's feature grid at the configured input size (of one tile)."""
    side = config.features.image_size // config.spec.stride_of(config.features.stages[0])
    return side, side


#: ``train --precision`` -> the backbone's dtype (int8: the float32 backbone it is quantised from).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}


def build_extractor(
    config, backbone_weights: dict[str, torch.Tensor], precision: str | None = None
) -> FeatureExtractor | GraphExtractor:
    """The feature extractor of ``config.features.backbone`` with ``backbone_weights`` loaded (no weights download),
    at ``precision`` (default: the configuration's). At int8 it is the quantised graph the weights hold
    (:data:`~padim.models.features.quantised.GRAPH_KEY`); a new fit's, before its graph is made, the float32
    backbone it is quantised from (:meth:`padim.models.fit.in_progress.Fit.quantise`)."""
    precision = precision or config.features.precision
    if precision == "int8" and GRAPH_KEY in backbone_weights:
        return QuantisedExtractor(backbone_weights[GRAPH_KEY], config.features.stages)
    backbone_weights = {k: v for k, v in backbone_weights.items() if k != GRAPH_KEY}
    with torch.device("meta"):
        backbone = network(config.features.backbone)
    missing = [
        k for k in config.spec.used_keys(backbone.state_dict(), config.features.stages) if k not in backbone_weights
    ]
    if missing:
        raise ArtifactError(f"backbone weights incomplete: missing {missing[:3]}")
    backbone.load_state_dict(backbone_weights, strict=False, assign=True)
    return FeatureExtractor(backbone, config.features.stages, dtype=DTYPES[precision])
