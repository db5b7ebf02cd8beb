"""Multi-layer feature extraction and PaDiM embeddings (Sec. III-A).

The backbone is cut after the deepest requested stage by torchvision's
``create_feature_extractor`` (torch.fx), its BatchNorms are folded into the preceding
convolutions for inference, and it runs channels_last. Deeper maps are brought to the first
layer's grid by nearest upsampling with an integer scale factor and concatenated; the channel
reduction (random subset, or semi-orthogonal projection) is applied per layer *before*
upsampling, which gives the same embedding for less work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.fx.experimental.optimization import fuse
from torchvision.models.feature_extraction import create_feature_extractor

from .backbones import IMAGENET_MEAN, IMAGENET_STD, BackboneSpec
from .images import to_model_input


class FeatureExtractor(nn.Module):
    """Backbone stages as a list of feature maps.

    Args:
        backbone: a torchvision ResNet-family model (eval mode).
        layers: stages to return, shallowest first.
        fold_batchnorm: fold conv+BN pairs (inference only; changes outputs by < 1e-4).
    """

    def __init__(self, backbone: nn.Module, layers: tuple[str, ...], fold_batchnorm: bool = True):
        super().__init__()
        self.layers = tuple(layers)
        graph = create_feature_extractor(backbone.eval(), return_nodes={l: l for l in layers})
        # in place: deep-copying torchvision's DualGraphModule puts it back in training mode
        self.body = fuse(graph, inplace=True) if fold_batchnorm else graph
        self.body.eval()

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        """``(B, 3, S, S)`` normalised images -> ``[(B, C_l, S / stride_l, S / stride_l)]``."""
        outputs = self.body(images.contiguous(memory_format=torch.channels_last))
        return [outputs[layer] for layer in self.layers]


class Embedding(nn.Module):
    """Concatenated, reduced multi-layer embedding ``(B, D, H, W)`` on the first layer's grid.

    Exactly one of ``channel_index`` (sorted indices into the concatenated channels, the
    paper's random subset) and ``projection`` (``(C, D)`` with orthonormal columns, Kim et al.
    2021) is set.
    """

    def __init__(
        self,
        channels: tuple[int, ...],
        strides: tuple[int, ...],
        channel_index: torch.Tensor | None = None,
        projection: torch.Tensor | None = None,
    ):
        super().__init__()
        if (channel_index is None) == (projection is None):
            raise ValueError("give exactly one of channel_index and projection")
        self.channels = tuple(channels)
        self.scales = tuple(s // strides[0] for s in strides)
        offsets = [sum(channels[:i]) for i in range(len(channels))]
        if channel_index is not None:
            self.register_buffer("channel_index", channel_index.to(torch.int64))
            self.projection = None
            # per-layer pieces as (non-saved) buffers, so that .to(device) moves them once
            for i, (o, c) in enumerate(zip(offsets, channels)):
                local = channel_index[(channel_index >= o) & (channel_index < o + c)] - o
                self.register_buffer(f"_part{i}", local.to(torch.int64), persistent=False)
            self.dim = int(channel_index.numel())
        else:
            self.register_buffer("projection", projection.to(torch.float32))
            self.channel_index = None
            for i, (o, c) in enumerate(zip(offsets, channels)):  # (D, C_l, 1, 1) 1x1-convolution weights
                weight = projection[o : o + c].T.contiguous()[:, :, None, None].to(torch.float32)
                self.register_buffer(f"_part{i}", weight, persistent=False)
            self.dim = int(projection.shape[1])

    @classmethod
    def create(cls, spec: BackboneSpec, layers: tuple[str, ...], dim: int, reduction: str, seed: int) -> Embedding:
        """A seeded random channel subset or semi-orthogonal projection of ``dim`` channels."""
        channels = spec.channels_of(layers)
        strides = tuple(spec.stride_of(layer) for layer in layers)
        total = sum(channels)
        generator = torch.Generator().manual_seed(seed)
        if reduction == "random":
            index = torch.randperm(total, generator=generator)[:dim].sort().values
            return cls(channels, strides, channel_index=index)
        gaussian = torch.randn(total, dim, generator=generator, dtype=torch.float64)
        q, _ = torch.linalg.qr(gaussian)  # (C, D), orthonormal columns
        return cls(channels, strides, projection=q.to(torch.float32))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        """``[(B, C_l, H_l, W_l)]`` -> ``(B, D, H_0, W_0)``."""
        parts = []
        for i, (feature, scale) in enumerate(zip(features, self.scales)):
            part = getattr(self, f"_part{i}")
            if self.channel_index is not None:
                reduced = feature.index_select(1, part)
            else:
                reduced = F.conv2d(feature, part.to(feature.dtype))
            if scale != 1:
                reduced = F.interpolate(reduced, scale_factor=scale, mode="nearest")
            parts.append(reduced)
        if self.channel_index is not None:
            return torch.cat(parts, dim=1)
        return torch.stack(parts).sum(0)


class FeatureEmbedder(nn.Module):
    """Images to PaDiM embeddings ``(B, P, D)``: the backbone's stages, then the channel reduction.

    What a fitted detector and a fit in progress share. ``P = H * W`` is the first layer's
    feature grid (:attr:`grid_shape`), ``D`` the reduced embedding size.

    Args:
        config: the detector configuration (backbone, layers, image size).
        backbone_state: the parameters and buffers of the stages used (see :func:`used_state`).
        embedding: the seeded channel subset or projection.
    """

    def __init__(self, config, backbone_state: dict[str, torch.Tensor], embedding: Embedding):
        super().__init__()
        self.image_size = config.image_size
        self.grid_shape = grid_shape(config)
        self.extractor = build_extractor(config, backbone_state)
        self.embedding = embedding

    @property
    def dim(self) -> int:
        return self.embedding.dim

    @property
    def device(self) -> torch.device:
        return next(self.extractor.parameters()).device

    def preprocess(self, images) -> torch.Tensor:
        """PIL images -> ``(B, 3, S, S)`` normalised model input."""
        return to_model_input(images, self.image_size, IMAGENET_MEAN, IMAGENET_STD)

    @torch.inference_mode()
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        """``(B, 3, S, S)`` model input -> ``(B, P, D)`` embeddings."""
        features = self.extractor(batch.to(self.device, non_blocking=True))
        embedding = self.embedding(features)  # (B, D, H, W)
        return embedding.permute(0, 2, 3, 1).reshape(batch.shape[0], -1, self.embedding.dim)


def grid_shape(config) -> tuple[int, int]:
    """``(H, W)`` of the first layer's feature grid at the configured input size."""
    side = config.image_size // config.spec.stride_of(config.layers[0])
    return side, side


def used_keys(backbone: nn.Module, config) -> list[str]:
    """State-dict keys of the stages up to the deepest configured layer (no ``fc``, no deeper stages)."""
    deepest = config.layers[-1]
    stages = list(config.spec.layers)
    unused = tuple(f"{s}." for s in stages[stages.index(deepest) + 1 :]) + ("fc.",)
    return [k for k in backbone.state_dict() if not k.startswith(unused)]


def used_state(backbone: nn.Module, config) -> dict[str, torch.Tensor]:
    """The parameters and buffers a detector of ``config`` uses, detached copies."""
    state = backbone.state_dict()
    return {k: state[k].detach().clone().contiguous() for k in used_keys(backbone, config)}


def build_extractor(config, backbone_state: dict[str, torch.Tensor]) -> FeatureExtractor:
    """The feature extractor of ``config.backbone`` with ``backbone_state`` loaded (no weights download)."""
    from padim.core.artifact import ArtifactError

    with torch.device("meta"):
        backbone = getattr(torchvision.models, config.backbone)(weights=None)
    missing = [k for k in used_keys(backbone, config) if k not in backbone_state]
    if missing:
        raise ArtifactError(f"backbone weights incomplete: missing {missing[:3]}")
    backbone.load_state_dict(backbone_state, strict=False, assign=True)
    return FeatureExtractor(backbone, config.layers)
