"""Backbone families: what a detector reads of each torchvision classifier, declared once. Torch-free (``padim
--help`` and the options' checks read it).

torchvision already knows every classifier (``torchvision.models.get_model``), its ImageNet weights
(``get_model_weights``) and its graph's nodes (``get_graph_node_names``); this table says only what torchvision
cannot: which nodes are a detector's **stages** (the last node of the network at each stride from 4 to 32, before
the classifier's own layers), their channels and strides (as timm's ``FeatureInfo``: stated here so that no torch is
needed to check an option, and checked against the network for every backbone by
tests/models/test_families.py), the stages a detector reads by default (the first three, at strides 4, 8 and 16:
the paper's), its default ``D``, which state-dict keys lie before a given stage, the head that is never read, and
what the memory plan needs of the activations.

A stage's name is its torchvision node (``torchvision.models.feature_extraction.create_feature_extractor``
takes it): ResNet ``layer1`` to ``layer4``; VGG ``features.N`` (the last ReLU at strides 4, 8, 16, then the last
max-pool); EfficientNet, MobileNetV3 and ConvNeXt ``features.N`` (the last block at each stride, before the final
1x1 convolution of EfficientNet and MobileNet, which feeds the classifier).

Example:
    >>> spec = BACKBONES["vgg16"]
    >>> spec.family, spec.default_stages, spec.channels_of(spec.default_stages), spec.default_embedding_dim
    ('vgg', ('features.15', 'features.22', 'features.29'), (256, 512, 512), 100)
    >>> [k for k in spec.used_keys(["features.0.weight", "features.24.weight", "classifier.0.weight"],
    ...                           spec.default_stages)]
    ['features.0.weight', 'features.24.weight']
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: The ImageNet weights ``--weights imagenet`` loads: torchvision's enum member, which every backbone here has.
IMAGENET_WEIGHTS = "IMAGENET1K_V1"
#: ``D`` when ``--embedding-dim`` is not given: the paper's 100 for resnet18 (and for every family but the
#: bottleneck ResNets, 550 as the paper's wide_resnet50_2), at most the default stages' channels.
DEFAULT_DIM = 100
BOTTLENECK_DIM = 550


@dataclass(frozen=True)
class BackboneSpec:
    """What a backbone gives, per stage (as timm's ``FeatureInfo``), and what a detector on it needs.

    Attributes:
        name: torchvision model name (``torchvision.models.get_model``).
        family: ``resnet``, ``vgg``, ``efficientnet``, ``mobilenet_v3`` or ``convnext`` (:data:`FAMILIES`).
        stages: node names usable as features, shallowest first.
        channels: output channels of each stage.
        strides: spatial stride of each stage relative to the input.
        default_stages: the stages read when ``--layers`` is not given.
        default_embedding_dim: embedding size ``D`` after reduction used by default.
        blocks: the network's parameter blocks in forward order (state-dict key prefixes): a stage lies in one, and
            a detector on it uses those up to it (:meth:`used_keys`).
        head: key prefixes of the classifier, never used.
        stem: ``(channels, stride)`` of the largest activations before the first stage, for the memory plan.
        activation_factor: the fit's peak activation bytes over the stem's and stages' outputs (the memory plan:
            measured by benchmarks/backbone_memory.py).
        imagenet_weights: torchvision's weights enum member ``--weights imagenet`` loads.
        random_batchnorm: ``--weights random`` sets the BatchNorms' running statistics from seeded noise pictures
            after torchvision's initialisation: without it EfficientNet's and MobileNetV3's features vanish with
            depth (1e-9 at the stride-16 stage of efficientnet_b0, where ``epsilon`` 0.01 outweighs every variance
            and the distances measure nothing); with it every stage's features are of unit scale.
    """

    name: str
    family: str
    stages: tuple[str, ...]
    channels: tuple[int, ...]
    strides: tuple[int, ...]
    default_stages: tuple[str, ...]
    default_embedding_dim: int
    blocks: tuple[str, ...]
    head: tuple[str, ...]
    stem: tuple[tuple[int, int], ...]
    activation_factor: float
    imagenet_weights: str = IMAGENET_WEIGHTS
    random_batchnorm: bool = False

    def channels_of(self, stages: Iterable[str]) -> tuple[int, ...]:
        return tuple(self.channels[self.stages.index(stage)] for stage in stages)

    def stride_of(self, stage: str) -> int:
        return self.strides[self.stages.index(stage)]

    def block_of(self, stage: str) -> str:
        """The parameter block ``stage`` ends in (``layer2``; ``features.15``)."""
        return next(b for b in self.blocks if stage == b or stage.startswith(b + "."))

    def used_keys(self, keys: Iterable[str], stages: tuple[str, ...]) -> list[str]:
        """The state-dict ``keys`` a detector on ``stages`` uses: none of the head or of blocks past the deepest."""
        deepest = max(self.blocks.index(self.block_of(stage)) for stage in stages)
        unused = tuple(f"{block}." for block in self.blocks[deepest + 1 :]) + tuple(f"{h}." for h in self.head)
        return [k for k in keys if not k.startswith(unused)]

    def described(self, stages: tuple[str, ...]) -> list[dict]:
        """``stages`` with their channels and strides, as ``padim info`` and ``GET /models`` show them."""
        return [{"name": s, "channels": self.channels_of((s,))[0], "stride": self.stride_of(s)} for s in stages]


@dataclass(frozen=True)
class Family:
    """A family of torchvision classifiers that share their stages' names and structure.

    Attributes:
        name: the family's name (``padim info``, ``GET /models``).
        title: in words, for ``--help`` and the docs.
        members: the backbones, by name.
    """

    name: str
    title: str
    members: tuple[str, ...]


def _features_spec(name, family, count, nodes, channels, stem, random_batchnorm) -> BackboneSpec:
    """A backbone whose stages are ``features.N`` modules at strides 4, 8, 16 and 32 (``count`` of them in all),
    the first three read by default, the classifier never."""
    stages = tuple(f"features.{i}" for i in nodes)
    return BackboneSpec(
        name, family, stages, tuple(channels), (4, 8, 16, 32), stages[:3], min(DEFAULT_DIM, sum(channels[:3])),
        tuple(f"features.{i}" for i in range(count)), ("classifier",), stem, ACTIVATION_FACTORS[family],
        random_batchnorm=random_batchnorm,
    )  # fmt: skip


# ResNet: the stem (conv1 at stride 2, the max-pool at 4), then layer1-4. Activations measured: 1.5x the outputs for
# the basic blocks (resnet18, 162 B/px), 3.7x for the bottleneck ones (wide_resnet50_2, 710 B/px).
_RESNET_BLOCKS = ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4")
_RESNETS = {
    "resnet18": "basic",
    "resnet34": "basic",
    "resnet50": "bottleneck",
    "resnet101": "bottleneck",
    "resnet152": "bottleneck",
    "resnext50_32x4d": "bottleneck",
    "resnext101_32x8d": "bottleneck",
    "resnext101_64x4d": "bottleneck",
    "wide_resnet50_2": "bottleneck",
    "wide_resnet101_2": "bottleneck",
}
# VGG: (the number of `features` modules, the node of the last ReLU at strides 4, 8, 16, the last max-pool).
_VGGS = {
    "vgg11": (21, (9, 14, 19, 20)),
    "vgg11_bn": (29, (13, 20, 27, 28)),
    "vgg13": (25, (13, 18, 23, 24)),
    "vgg13_bn": (35, (19, 26, 33, 34)),
    "vgg16": (31, (15, 22, 29, 30)),
    "vgg16_bn": (44, (22, 32, 42, 43)),
    "vgg19": (37, (17, 26, 35, 36)),
    "vgg19_bn": (53, (25, 38, 51, 52)),
}
# EfficientNet: (the number of `features` modules, the last block at strides 4, 8, 16, 32, their channels).
_EFFICIENTNETS = {
    "efficientnet_b0": (9, (2, 3, 5, 7), (24, 40, 112, 320)),
    "efficientnet_b1": (9, (2, 3, 5, 7), (24, 40, 112, 320)),
    "efficientnet_b2": (9, (2, 3, 5, 7), (24, 48, 120, 352)),
    "efficientnet_b3": (9, (2, 3, 5, 7), (32, 48, 136, 384)),
    "efficientnet_b4": (9, (2, 3, 5, 7), (32, 56, 160, 448)),
    "efficientnet_b5": (9, (2, 3, 5, 7), (40, 64, 176, 512)),
    "efficientnet_b6": (9, (2, 3, 5, 7), (40, 72, 200, 576)),
    "efficientnet_b7": (9, (2, 3, 5, 7), (48, 80, 224, 640)),
    "efficientnet_v2_s": (8, (2, 3, 5, 6), (48, 64, 160, 256)),
    "efficientnet_v2_m": (9, (2, 3, 5, 7), (48, 80, 176, 512)),
    "efficientnet_v2_l": (9, (2, 3, 5, 7), (64, 96, 224, 640)),
}
_MOBILENETS = {
    "mobilenet_v3_small": (13, (1, 3, 8, 11), (16, 24, 48, 96)),
    "mobilenet_v3_large": (17, (3, 6, 12, 15), (24, 40, 112, 160)),
}
# ConvNeXt: the stem at stride 4, then a stage and a down-sampling layer in turn.
_CONVNEXTS = {
    "convnext_tiny": (96, 192, 384, 768),
    "convnext_small": (96, 192, 384, 768),
    "convnext_base": (128, 256, 512, 1024),
    "convnext_large": (192, 384, 768, 1536),
}
#: Peak activation bytes over the stem's and stages' outputs, by family. ResNet's were measured in fits (resnet18
#: 162 B/px, wide_resnet50_2 710 B/px); the others are what benchmarks/backbone_memory.py measured of one batch (16
#: pictures of 224 px, BatchNorms folded; 2-core AMD EPYC, torch 2.14.1: vgg16 1.05, efficientnet_b5 1.52 (b0
#: 1.10), mobilenet_v3_large 1.02, convnext_tiny 5.18) times 1.3, the margin resnet18's fit measurement has over
#: that script's reading of it (1.15).
ACTIVATION_FACTORS = {
    "basic": 1.5,
    "bottleneck": 3.7,
    "vgg": 1.4,
    "efficientnet": 2.0,
    "mobilenet_v3": 1.4,
    "convnext": 6.8,
}

#: The families whose stages are ``features.N``: family -> (its backbones: name -> (``features`` modules, the stages'
#: indices, their channels), the largest activations before the first stage (``(channels, stride)``, from the
#: stages' channels), whether random weights set the BatchNorms from noise).
_FEATURES_FAMILIES = {
    "vgg": (
        {name: (count, nodes, (256, 512, 512, 512)) for name, (count, nodes) in _VGGS.items()},
        lambda channels: ((64, 1), (128, 2)),
        False,
    ),
    "efficientnet": (_EFFICIENTNETS, lambda channels: ((32, 2), (96, 2)), True),
    "mobilenet_v3": (_MOBILENETS, lambda channels: ((16, 2), (64, 2)), True),
    "convnext": (
        {name: (8, (1, 3, 5, 7), channels) for name, channels in _CONVNEXTS.items()},
        lambda channels: ((channels[0], 4),),  # its stem: the first stage's shape
        False,
    ),
}

BACKBONES: dict[str, BackboneSpec] = {
    **{
        name: BackboneSpec(
            name,
            "resnet",
            ("layer1", "layer2", "layer3", "layer4"),
            (64, 128, 256, 512) if kind == "basic" else (256, 512, 1024, 2048),
            (4, 8, 16, 32),
            ("layer1", "layer2", "layer3"),
            DEFAULT_DIM if kind == "basic" else BOTTLENECK_DIM,
            _RESNET_BLOCKS,
            ("fc",),
            ((64, 2), (64, 4)),
            ACTIVATION_FACTORS[kind],
        )
        for name, kind in _RESNETS.items()
    },
    **{
        name: _features_spec(name, family, count, nodes, channels, stem(channels), random_batchnorm)
        for family, (members, stem, random_batchnorm) in _FEATURES_FAMILIES.items()
        for name, (count, nodes, channels) in members.items()
    },
}

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("resnet", "ResNet, ResNeXt and Wide ResNet", tuple(_RESNETS)),
        Family("vgg", "VGG 11, 13, 16, 19 and their _bn (batch-normalised) versions", tuple(_VGGS)),
        Family("efficientnet", "EfficientNet B0-B7 and V2 S, M, L", tuple(_EFFICIENTNETS)),
        Family("mobilenet_v3", "MobileNetV3 small and large (for an inspection PC)", tuple(_MOBILENETS)),
        Family("convnext", "ConvNeXt tiny, small, base, large", tuple(_CONVNEXTS)),
    )
}
