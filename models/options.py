"""Every option of a detector, declared once, in the groups the code consumes them in.

A field of a group is an option. Its :func:`option` metadata holds, once: its help text, its check (the values
allowed, said in the error message), the ``train`` flag it becomes, the value a file written before the option
existed computed (``before``), and whether ``GET /models`` shows it. From these derive: ``padim train``'s flags
and their help (:func:`add_flags`), YAML reading and the model file's and the export's flat JSON
(:class:`~padim.models.config.PadimConfig`), the resume and merge checks (group equality: :data:`STATISTICS`),
``GET /models``' schema (:func:`shown_fields`) and the table of docs/training.md (:func:`markdown_table`).

The groups:

- ``features``: the backbone and the embedding (what a pixel's vector is).
- ``framing``: which part of a picture becomes the model input, and its tiles.
- ``gaussian``: how the Gaussians are fitted and calibrated out of fold.
- ``scoring`` (:class:`ScoringOptions`): how a map and an image score are read from the distances.
- ``verdict``: the false-alarm rate the threshold is set for (may change on ``--resume``).
- ``storage``: how the fitted state is stored in the file.
- ``run``: how a command runs, never what it computes (may change from run to run of the same fit).

Torch-, numpy- and PIL-free: ``padim --help`` builds its flags from here. Checks that need the other groups of a
configuration (a tile count times the input size) live in :mod:`padim.models.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from padim.core import FALSE_ALARM_RATE_RANGE, IMAGE_SCORES, SHRINKAGE_AUTO, SHRINKAGE_MAX
from padim.models.choices import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_WORKERS,
    DEVICES,
    EXPECT_AUTO,
    EXPECT_AUTO_MARGIN,
    EXPECT_PRESETS,
    NEIGHBOURHOODS,
    PRECISION_AUTO,
    PRECISION_DTYPES,
    PRECISIONS,
    REDUCTIONS,
    RESIZES,
    STANDARDISE,
    TILE_STATISTICS,
    parse_tiles,
)
from padim.models.errors import ConfigError
from padim.models.families import BACKBONES, BOTTLENECK_DIM, DEFAULT_DIM, FAMILIES


def fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    """The one shape of a bad option's message: its name, the value, what is allowed."""
    raise ConfigError(f"{name}: {value!r} is not allowed; {allowed}")


# ---------------------------------------------------------------------------------------------- checks
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Choice:
    """One of ``values`` (``note`` explains them in the message)."""

    values: tuple
    note: str = ""

    def allowed(self, value: Any) -> str | None:
        if isinstance(value, bool) or value not in self.values:
            return "choose one of: " + ", ".join(map(str, self.values)) + (f" ({self.note})" if self.note else "")
        return None


@dataclass(frozen=True)
class Number:
    """A number (an integer when ``integer``) from ``low`` to ``high`` (above ``low`` when ``above``)."""

    low: float | None
    high: float | None
    says: str
    integer: bool = False
    above: bool = False

    def allowed(self, value: Any) -> str | None:
        if not (_is_integer(value) if self.integer else _is_number(value)) or value != value:  # NaN too
            return self.says
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return self.says
        if self.high is not None and value > self.high:
            return self.says
        return None


@dataclass(frozen=True)
class Custom:
    """A check of its own: ``test(value)`` is true for allowed values."""

    test: Callable[[Any], bool]
    says: str

    def allowed(self, value: Any) -> str | None:
        return None if self.test(value) else self.says


Check = Choice | Number | Custom


# ------------------------------------------------------------------------------------- the declaration
#: ``before`` of an option every file has written.
ALWAYS_WRITTEN: Any = type("AlwaysWritten", (), {"__repr__": lambda self: "ALWAYS_WRITTEN"})()


@dataclass(frozen=True)
class Option:
    """What is said about an option once: see :func:`option`."""

    help: str
    check: Check | None = None
    flag: dict = field(default_factory=dict)
    before: Any = ALWAYS_WRITTEN
    shown: bool = False
    renamed_from: tuple[str, ...] = ()
    example: str | None = None
    brief: str | None = None


def option(
    default: Any,
    help: str,
    *,
    check: Check | None = None,
    flag: dict | None = None,
    before: Any = ALWAYS_WRITTEN,
    shown: bool = False,
    renamed_from: tuple[str, ...] = (),
    example: str | None = None,
    brief: str | None = None,
) -> Any:
    """A field of a group: ``default``, and its declaration.

    Args:
        help: what it does, for ``train --help``, docs/training.md and ``GET /models``' schema.
        check: the values allowed.
        flag: ``argparse`` keywords of its ``train`` flag beyond name, dest and help (``type``, ``metavar``,
            ``action``); ``choices`` and ``type`` come from a :class:`Choice` or :class:`Number` check.
        before: what a model file or export written before the option existed computed; such a file is read
            with it, whatever today's default, and keeps scoring as it did.
        shown: part of a served model's description (``GET /models``).
        renamed_from: earlier spellings still read (YAML, old headers) and accepted as flags.
        example: an allowed value other than the default, as the flag spells it, where the check cannot give one
            (a :class:`Custom` check, or none): the tests set every option to another value and follow it to the
            flag, the JSON and the resume check (:meth:`Declared.other_value`).
        brief: ``train --help``'s words where ``help`` is long and the option is one of :data:`ESSENTIAL` (the
            first screen of the help); ``help`` stays the whole story (docs/training.md, ``--print-config``).
    """
    declared = Option(help, check, flag or {}, before, shown, renamed_from, example, brief)
    return field(default=default, metadata={"option": declared})


def _layers_value(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def roi_value(text: str) -> tuple[int, int, int, int]:
    """``--roi``: ``x,y,width,height`` in pixels."""
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(","))
    except ValueError:
        values = ()
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"{text!r} is not x,y,width,height (four integers, e.g. 120,80,640,480)")
    return values[0], values[1], values[2], values[3]


def tiles_value(text: str) -> tuple[int, int]:
    """``--tiles``: ``ROWSxCOLS``."""
    tiles = parse_tiles(text)
    if not isinstance(tiles, tuple):
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxCOLS (e.g. 2x2 or 3x4)")
    return tiles


def shrinkage_value(text: str) -> float | str:
    """``--shrinkage``: a number, or ``auto``."""
    if text.strip().lower() == SHRINKAGE_AUTO:
        return SHRINKAGE_AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or auto") from None


def _shrinkage_ok(value: Any) -> bool:
    return value == SHRINKAGE_AUTO or (_is_number(value) and 0 <= value <= SHRINKAGE_MAX)


def folds_value(text: str) -> int | str:
    """``--calibration-folds``: an integer, or ``loo``."""
    if text.strip().lower() == "loo":
        return "loo"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or loo") from None


class Group:
    """A group of options: a frozen dataclass whose fields are :func:`option` s, checked on construction."""

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):  # type: ignore[arg-type]  # a Group is always a dataclass's base
            declared: Option = item.metadata["option"]
            value = getattr(self, item.name)
            says = declared.check.allowed(value) if declared.check is not None else None
            if says is not None:
                fail(item.name, value, says)
        self.check()

    def check(self) -> None:
        """Checks between this group's options (after each option's own)."""


def _set(group: Any, name: str, value: Any) -> None:
    object.__setattr__(group, name, value)


@dataclass(frozen=True)
class Features(Group):
    """The backbone and the embedding: what a pixel's vector is."""

    backbone: str = option(
        "resnet18",
        "a torchvision classifier of one of the families "
        + "; ".join(f"{f.title}: {', '.join(f.members)}" for f in FAMILIES.values())
        + " (default resnet18; docs/training.md#backbone-families)",
        check=Choice(tuple(BACKBONES)),
        flag={"choices": None, "metavar": "NAME"},  # 35 names: the check's message lists them when one is wrong
        brief="a torchvision ResNet, VGG, EfficientNet, MobileNetV3 or ConvNeXt (default resnet18)",
    )
    weights: str = option(
        "imagenet",
        "imagenet (default; torchvision's cache: padim fetch-weights offline), random (demo/tests only, seeded) or the "
        "path of a state_dict file",
        check=Custom(lambda v: isinstance(v, str) and bool(v), "use imagenet, random or the path of a state_dict file"),
        flag={"metavar": "W"},
        example="random",
        brief="imagenet (default), random (demos only) or a state_dict file",
    )
    layers: tuple[str, ...] | None = option(
        None,
        "comma-separated stages of the backbone, shallowest first (default: its first three, at strides 4, 8 and 16, "
        "as the paper: layer1,layer2,layer3 for a ResNet, features.15,features.22,features.29 for vgg16; a wrong "
        "name lists the backbone's stages, padim info shows a model's)",
        flag={"type": _layers_value},
        shown=True,
        example="layer1,layer2",
    )
    image_size: int = option(
        224,
        "side of the square model input, a multiple of 16 (of 32 with a stage at stride 32) (default 224)",
        flag={"type": int, "metavar": "PX"},
        shown=True,
        example="128",
    )
    reduction: str = option(
        "random",
        "how the channels are reduced: random (default; a random subset, as the paper) or semi_orthogonal (a "
        "projection)",
        check=Choice(REDUCTIONS),
        shown=True,
    )
    embedding_dim: int | None = option(
        None,
        f"embedding size after reduction (default {DEFAULT_DIM}, {BOTTLENECK_DIM} for the bottleneck ResNets: resnet50 "
        "and wider; at most the default stages' channels: 88 for mobilenet_v3_small)",
        flag={"type": int, "metavar": "D"},
        renamed_from=("features",),
        shown=True,
        example="40",
    )
    seed: int = option(
        0,
        "seed of the channel subset / projection and random weights (default 0)",
        check=Custom(lambda v: isinstance(v, int), "use an integer"),
        flag={"type": int},
        example="3",
    )
    standardise: str = option(
        "gain",
        "each picture's light set before the backbone, so that a brighter or darker picture of the same part reads"
        " as the same picture: gain (default: the picture's brightness alone set to one level by one gain, its "
        "contrast kept: a lamp's drift taken out, a crack's dark line kept; another region's pictures a fifth "
        "brighter flag 2 of 125 where none flags 26, and mono solar cells rank higher, poly ones a little lower, "
        "docs/quality.md), none (the pictures as they are, the paper; --config paper: where a part's brightness is "
        "itself the defect), channels (each channel of each picture set to one mean and "
        "spread) or picture (each channel to one mean, one gain for all three: a contrast change taken out too). "
        "channels and picture suit a material that looks alike all over; where the content's own spread varies "
        "from picture to picture they cost ranking (docs/calibration.md)",
        check=Choice(STANDARDISE),
        before="none",
        shown=True,
    )
    precision: str = option(
        "fp32",
        "the backbone's arithmetic when fitting, calibrating and scoring: fp32 (default; the same scores on a CPU "
        "and a GPU), bf16 or fp16 (a GPU runs them several times faster), int8 (the backbone quantised from the "
        "training pictures and run by ONNX Runtime: a CPU scores 1.3-1.5x faster, more with VNNI), or auto (chosen "
        "for the machine that fits, said in one line: bf16 on a GPU with bfloat16 or a CPU with AMX, int8 on a CPU "
        "with AVX2 or VNNI and ONNX Runtime, else fp32; fp32 after all where the chosen one's gate refuses it). The "
        "Gaussian part stays float32. A reduced precision is "
        "checked against fp32 on the training pictures and refused past --max-score-error; its threshold comes from "
        "its own scores (docs/quantisation.md, docs/gpu.md)",
        check=Choice(
            (*PRECISIONS, PRECISION_AUTO),
            "fp32: float32; bf16: bfloat16, Ampere GPUs and newer; fp16: float16; int8: the CPU, ONNX Runtime",
        ),
        flag={"metavar": "PRECISION"},
        before="fp32",
        brief="fp32 (default), bf16 or fp16 (GPUs), int8 (CPUs) or auto (the fastest that passes the gate)",
    )

    def __post_init__(self) -> None:
        if isinstance(self.layers, list):
            _set(self, "layers", tuple(self.layers))
        super().__post_init__()

    @property
    def stages(self) -> tuple[str, ...]:
        """The backbone's stages this detector reads: ``layers``, or the backbone's default stages."""
        return self.layers if self.layers is not None else BACKBONES[self.backbone].default_stages

    def check(self) -> None:
        spec = BACKBONES[self.backbone]
        layers = self.stages
        if not layers or not isinstance(layers, tuple) or any(layer not in spec.stages for layer in layers):
            fail(
                "layers",
                list(layers) if isinstance(layers, tuple) else layers,
                f"choose from {self.backbone}'s stages: "
                + ", ".join(f"{s} (stride {t})" for s, t in zip(spec.stages, spec.strides, strict=True)),
            )
        if list(layers) != sorted(layers, key=spec.stages.index) or len(set(layers)) != len(layers):
            fail("layers", list(layers), "list each layer once, shallowest first")
        stride = max(spec.stride_of(layer) for layer in layers)
        multiple = max(stride, 16)  # every layer's grid must divide the first one's evenly
        size = self.image_size
        if not _is_integer(size) or size < 2 * multiple or size % multiple or size > 2048:
            fail(
                "image_size",
                size,
                f"use a multiple of {multiple} between {2 * multiple} and 2048"
                + (f" (layer {layers[-1]} has stride {stride})" if stride > 16 else ""),
            )
        total = sum(spec.channels_of(layers))
        dim = self.embedding_dim
        if dim is not None and (not _is_integer(dim) or not 1 <= dim <= total):
            fail("embedding_dim", dim, f"use an integer from 1 to {total} (the channels of {', '.join(layers)})")
        if dim is None and spec.default_embedding_dim > total:
            fail(
                "embedding_dim",
                None,
                f"set it: the default {spec.default_embedding_dim} exceeds the {total} channels of {', '.join(layers)}",
            )


def _roi_ok(value: Any) -> bool:
    return value is None or (
        isinstance(value, tuple)
        and len(value) == 4
        and all(_is_integer(v) for v in value)
        and value[0] >= 0
        and value[1] >= 0
        and value[2] >= 16
        and value[3] >= 16
    )


def _tiles_ok(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(_is_integer(v) and 1 <= v <= 8 for v in value)


@dataclass(frozen=True)
class Framing(Group):
    """Which part of a picture becomes the model input, and its tiles (:mod:`padim.models.data.framing`)."""

    roi: tuple[int, int, int, int] | None = option(
        None,
        "region of interest in pixels of the picture (as seen: EXIF orientation applied): only it is fitted and "
        "scored, every picture must hold it, and maps come back at the picture's size, 0 outside it (default: the "
        "whole picture)",
        check=Custom(
            _roi_ok,
            "use x,y,width,height in pixels of the picture: integers, x and y >= 0, width and height >= 16 (or "
            "leave it out for the whole picture)",
        ),
        flag={"type": roi_value, "metavar": "X,Y,W,H"},
        example="0,0,200,100",
        before=None,
        shown=True,
    )
    resize: str = option(
        "squash",
        "how the picture (or --roi) becomes the square model input: squash (default: resized, the aspect ratio "
        "lost), crop (its largest centred square) or pad (centred on a square of its longer side, filled with the "
        "ImageNet mean colour); with --tiles, a box of the tiles' shape",
        check=Choice(
            RESIZES,
            "squash: resized, aspect ratio lost; crop: largest centred square; pad: centred on a square",
        ),
        before="squash",
        shown=True,
    )
    tiles: tuple[int, int] = option(
        (1, 1),
        "cut the picture (or --roi), resized to R x C tiles of --image-size pixels, into tiles that each go "
        "through the backbone, for small defects on big pictures: the tiles' maps are stitched into one map of "
        "the picture, whose maximum is the image score and the calibration's (default 1x1: no tiling). Costs the "
        "tiles' count in fit and scoring time",
        check=Custom(_tiles_ok, "use ROWSxCOLS with 1 to 8 of each, e.g. 2x2 or 3x4 (1x1: no tiling)"),
        flag={"type": tiles_value, "metavar": "RxC"},
        example="2x3",
        before=(1, 1),
        shown=True,
    )
    tile_overlap: float = option(
        0.0,
        "share of a tile its neighbours overlap, 0 to 0.5 (default 0); the stitched map averages the tiles where "
        "they overlap",
        check=Number(0, 0.5, "use a share of a tile from 0 to 0.5 (default 0: tiles side by side)"),
        flag={"metavar": "SHARE"},
        before=0.0,
        shown=True,
    )
    tile_statistics: str = option(
        "position",
        "position (default): each tile position its own statistics, for placed parts (a board, a pill in a "
        "fixture), memory x the tiles' count; shared: one set every tile shares, for uniform surfaces (textures, "
        "webs, sheets), the memory of an untiled model and T times the samples",
        check=Choice(
            TILE_STATISTICS,
            "position: each tile position its own statistics, for placed parts; shared: one set for every tile, "
            "for uniform surfaces",
        ),
        before="position",
        shown=True,
    )

    def __post_init__(self) -> None:
        if isinstance(self.roi, list):
            _set(self, "roi", tuple(self.roi))
        if isinstance(self.tiles, str):
            _set(self, "tiles", parse_tiles(self.tiles))
        elif isinstance(self.tiles, list):
            _set(self, "tiles", tuple(self.tiles))
        super().__post_init__()

    def check(self) -> None:
        if self.tile_overlap and self.tiles == (1, 1):
            fail("tile_overlap", self.tile_overlap, "set tiles too (an overlap needs at least two tiles)")

    @property
    def tile_count(self) -> int:
        """Tiles per picture (1 untiled)."""
        return self.tiles[0] * self.tiles[1]


def _folds_ok(value: Any) -> bool:
    return value == "loo" or (_is_integer(value) and 2 <= value <= 1000)


@dataclass(frozen=True)
class Gaussian(Group):
    """How the Gaussians are fitted, and how the training pictures' out-of-fold scores are drawn."""

    epsilon: float = option(
        0.01,
        "covariance regularisation (default 0.01)",
        check=Number(0, None, "use a number >= 0 (the paper uses 0.01)"),
        shown=True,
    )
    shrinkage: float | str = option(
        SHRINKAGE_AUTO,
        "shrink each pixel's covariance toward the covariance pooled over every pixel: auto (default: the weight "
        "the fit's own statistics ask for, a Ledoit-Wolf estimate, small with many pictures and larger with few; "
        "train and padim info say what it chose) or a weight from 0 (none, the paper; --config paper) to 0.95: few "
        "pictures leave a pixel's Gaussian too tight where they did not vary, and the pooled one lends it the "
        "variation seen elsewhere (docs/quality.md)",
        check=Custom(_shrinkage_ok, "use auto or a number from 0 (none) to 0.95"),
        flag={"type": shrinkage_value, "metavar": "WEIGHT"},
        before=0.0,
        shown=True,
        example="0.3",
    )
    neighbourhood: int = option(
        3,
        "average each layer's features over K x K neighbours before the Gaussian: 3 (default, as PatchCore: more "
        "defects found on most generated categories, docs/quality.md), 1 (none, the paper; --config paper) or 5",
        check=Choice(NEIGHBOURHOODS, "1 = no averaging"),
        flag={"metavar": "K"},
        before=1,
        shown=True,
    )
    calibration_folds: int | str = option(
        "loo",
        "folds of the cross-fitted calibration: loo (leave-one-out: every image its own fold; default) or an "
        "integer from 2 to 1000 (folds from a hash of each file name: fold models of fewer images, so a more "
        "cautious threshold; one more factorisation per distinct fold size)",
        check=Custom(_folds_ok, "use an integer from 2 to 1000, or loo (leave-one-out)"),
        flag={"type": folds_value, "metavar": "K"},
        example="7",
    )
    expect: str = option(
        "rough",
        "the small changes the line makes to its pictures, for the threshold to cover: a preset, "
        + ", ".join(f"{k} ({v or 'none'})" for k, v in EXPECT_PRESETS.items())
        + f", {EXPECT_AUTO} (each bound {EXPECT_AUTO_MARGIN:g}x how far the training pictures' own light, contrast, "
        "placement, focus and JPEG quality wander, measured when the fit starts; padim info shows what was measured)"
        + ", or your own list of change=bound from brightness, contrast (shares), shift (pixels of the picture), "
        "rotate (degrees), blur (sigma, pixels), jpeg (lowest quality). Each picture's calibration score is then "
        "that of a copy of it under one seeded draw of those changes, scored without it, so that the false-alarm "
        "promise holds on pictures within them (docs/calibration.md); costs a second backbone pass a picture and "
        "twice the spool",
        check=Custom(
            lambda v: isinstance(v, str),
            "use a list of change=bound (e.g. brightness=0.1,shift=2), auto, or a preset: " + ", ".join(EXPECT_PRESETS),
        ),
        flag={"metavar": "CHANGES"},
        example="shift=2",
        before="",
        brief="the line's changes (light, placement, focus, JPEG) the threshold covers: rough (default), typical, "
        "stable, auto or change=bound,...",
    )
    fit_changes: bool = option(
        True,
        "with --expect, fit each picture's changed copy too (default: on): the Gaussians learn the changes (fewer "
        "defects missed than a threshold widened alone; docs/quality.md); --no-fit-changes widens the threshold alone",
        check=Custom(lambda v: isinstance(v, bool), "use true or false"),
        flag={"action": argparse.BooleanOptionalAction},
        before=False,
    )
    trim_cover: bool = option(
        True,
        "leave out of --expect's cover each change the training pictures already show at least as far as its bound "
        "(their light, contrast, placement, focus and JPEG quality, measured when the fit starts as --expect auto "
        "measures them; train and padim info say what was left out): their own out-of-fold scores cover it, and "
        "copies changed further than the line goes would only raise the threshold (default: on; not with "
        "--partial, --resume or --expect auto; docs/calibration.md); --no-trim-cover draws every declared change",
        check=Custom(lambda v: isinstance(v, bool), "use true or false"),
        flag={"action": argparse.BooleanOptionalAction},
        before=False,
    )


@dataclass(frozen=True)
class ScoringOptions(Group):
    """How a map and an image score are read from the distances (and so the calibration's scores)."""

    blur_sigma: float = option(
        0.0,
        "Gaussian smoothing of the map, in input pixels (default 0: none, the neighbourhood average smooths "
        "already; the paper: 4)",
        check=Number(0, None, "use a number >= 0 (0 turns smoothing off)"),
        flag={"metavar": "PX"},
        before=4.0,
        shown=True,
    )
    image_score: str = option(
        "map_max",
        "how an image's score is read from its map: map_max (default, the map's maximum), patch_max (the largest "
        "feature-grid distance, unsmoothed) or top_mean (mean of the --top-fraction highest map pixels); the "
        "calibration reads its scores the same way",
        check=Choice(IMAGE_SCORES),
        before="map_max",
        shown=True,
    )
    top_fraction: float = option(
        0.01,
        "share of the map's pixels top_mean averages (default 0.01)",
        check=Number(0, 0.5, "use a number above 0 and at most 0.5 (default 0.01: the top 1% of pixels)", above=True),
        flag={"metavar": "SHARE"},
        before=0.01,
        shown=True,
    )


@dataclass(frozen=True)
class Verdict(Group):
    """What the threshold promises."""

    false_alarm_rate: float = option(
        0.01,
        "share of normal images the threshold may flag (default 0.01); may change on --resume",
        check=Number(
            FALSE_ALARM_RATE_RANGE[0],
            FALSE_ALARM_RATE_RANGE[1],
            f"use a number from {FALSE_ALARM_RATE_RANGE[0]:g} to {FALSE_ALARM_RATE_RANGE[1]:g} (default 0.01: 1% of "
            "normal images flagged)",
        ),
        flag={"metavar": "RATE"},
    )


@dataclass(frozen=True)
class Storage(Group):
    """How the fitted state is kept in the model file."""

    factor_dtype: str = option(
        "auto",
        "storage of the precision factors (default auto: float16 when scores stay within 1e-3)",
        check=Choice(PRECISION_DTYPES),
        renamed_from=("precision_dtype",),
    )
    int8_scorer: bool = option(
        True,
        "a float32 fit also makes the model's int8 scorer (default: on, where ONNX Runtime is installed): its "
        "backbone quantised from the training pictures, its own threshold from its out-of-fold int8 scores, gated "
        "against float32 as --precision int8 is (--max-score-error); --runtime auto runs it on a CPU that computes "
        "int8 faster (AVX2, VNNI, AMX: 1.5-2x float32) and float32 elsewhere, whichever machine fitted the model "
        "(docs/runtimes.md). Costs about 1.4x the float32 fit's time (200 pictures) and the graph's bytes in the "
        "file; --no-int8-scorer leaves it out",
        check=Custom(lambda v: isinstance(v, bool), "use true or false"),
        flag={"action": argparse.BooleanOptionalAction},
        before=False,
    )


@dataclass(frozen=True)
class RunOptions(Group):
    """How a command runs, never what it computes."""

    device: str = option(
        "auto", "where the model runs (default auto: cuda when torch sees a GPU)", check=Choice(DEVICES)
    )
    batch_size: int = option(
        DEFAULT_BATCH_SIZE,
        f"images per forward pass (default {DEFAULT_BATCH_SIZE})",
        check=Number(1, None, "use an integer >= 1", integer=True),
        flag={"metavar": "N"},
    )
    decode_workers: int = option(
        DEFAULT_WORKERS,
        f"threads decoding pictures (and in a fit making their changed copies: --expect) (default "
        f"{DEFAULT_WORKERS}; a fit on a GPU wants about the machine's cores: it says so when it waited for them). "
        "Spelled workers before model format 16 (still read)",
        check=Number(0, None, "use an integer >= 0", integer=True),
        flag={"metavar": "N"},
        renamed_from=("workers",),
    )


#: The groups of a configuration, by attribute name, in order.
GROUPS: dict[str, type[Group]] = {
    "features": Features,
    "framing": Framing,
    "gaussian": Gaussian,
    "scoring": ScoringOptions,
    "verdict": Verdict,
    "storage": Storage,
    "run": RunOptions,
}
#: Groups that decide the statistics: a resume or a merge keeps them.
STATISTICS = ("features", "framing", "gaussian")
#: ... and, beside those, the groups a resume or a merge keeps for the earlier calibration scores to stay valid.
CALIBRATION = (*STATISTICS, "scoring")
#: The options most fits need, first in ``train --help`` (with ``DATA_DIR``, ``--output``, ``--config``).
ESSENTIAL = ("backbone", "weights", "image_size", "false_alarm_rate", "expect", "precision", "device")
#: ``train --help``'s sections after those (each without the essential ones).
SECTIONS = {
    "what the detector computes (fixed once fitted: --resume and merge keep them)": STATISTICS + ("scoring",),
    "the verdict and the file": ("verdict", "storage"),
}


@dataclass(frozen=True)
class Declared:
    """An option as found by walking the declaration."""

    name: str
    group: str
    default: Any
    option: Option
    annotation: Any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def other_value(self) -> list[str]:
        """``train`` arguments that set this option to an allowed value other than its default."""
        check, default = self.option.check, self.default
        if self.option.flag.get("action") is argparse.BooleanOptionalAction:
            return [f"--no-{self.flag[2:]}" if default else self.flag]
        if self.option.example is not None:
            return [self.flag, self.option.example]
        if isinstance(check, Choice):
            return [self.flag, str(next(v for v in check.values if v != default))]
        if isinstance(check, Number):
            low, high = check.low or 0, check.high
            value = (low + high) / 2 if high is not None and not check.integer else default + 1
            return [self.flag, str(value)]
        raise ValueError(f"{self.name}: declare an example (its check cannot give another value)")


def declared() -> Iterator[Declared]:
    """Every option, group by group, in declaration order."""
    for group_name, group in GROUPS.items():
        hints = typing.get_type_hints(group)
        for item in dataclasses.fields(group):  # type: ignore[arg-type]  # GROUPS holds dataclasses
            yield Declared(item.name, group_name, item.default, item.metadata["option"], hints[item.name])


#: Option name -> its declaration.
OPTIONS: dict[str, Declared] = {d.name: d for d in declared()}
#: Earlier spellings -> option names.
RENAMED: dict[str, str] = {old: d.name for d in OPTIONS.values() for old in d.option.renamed_from}
#: Option -> what a file written before it existed computed.
BEFORE: dict[str, Any] = {d.name: d.option.before for d in OPTIONS.values() if d.option.before is not ALWAYS_WRITTEN}


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *groups: str, skip: tuple[str, ...] = ()
) -> None:
    """Add ``groups``' options but ``skip`` as flags (``--image-size``), each defaulting to ``None`` (not given)."""
    for d in OPTIONS.values():
        if d.group in groups and d.name not in skip:
            _add_flag(parser, d, d.option.help)


def add_essential_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the :data:`ESSENTIAL` options as flags, with their brief help where they have one."""
    for name in ESSENTIAL:
        _add_flag(parser, OPTIONS[name], OPTIONS[name].option.brief or OPTIONS[name].option.help)


def _add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, d: Declared, help: str) -> None:
    kwargs: dict[str, Any] = {"dest": d.name, "help": help, "default": None}
    check = d.option.check
    if isinstance(check, Choice):
        kwargs.update(choices=check.values, type=type(check.values[0]))
    elif isinstance(check, Number):
        kwargs.update(type=int if check.integer else float)
    kwargs.update(d.option.flag)
    parser.add_argument(d.flag, **kwargs)
    for old in d.option.renamed_from:  # an earlier spelling, still read, not shown
        parser.add_argument("--" + old.replace("_", "-"), **{**kwargs, "help": argparse.SUPPRESS})


def add_section(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """A ``--help`` section of :data:`SECTIONS` with its groups' flags (the :data:`ESSENTIAL` ones are shown first)."""
    section = parser.add_argument_group(title)
    add_flags(section, *SECTIONS[title], skip=ESSENTIAL)
    return section


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The options given as flags (not ``None``), by name."""
    return {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}


def json_value(value: Any) -> Any:
    """An option's value as JSON (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


def shown_fields() -> dict[str, tuple[Any, str]]:
    """``GET /models``' option fields: name -> (JSON type, description), for pydantic's ``create_model``."""
    fields = {}
    for d in OPTIONS.values():
        if d.option.shown:
            fields[d.name] = (_json_type(d.annotation, d.name), d.option.help)
    return fields


def _json_type(annotation: Any, name: str) -> Any:
    if name == "embedding_dim":  # a fitted detector's D as built: always a number
        return int
    if name == "layers":  # a fitted detector's stages as built: always a list
        return list[str]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple:
        return list[args[0]]  # type: ignore[valid-type]  # the element type is read at run time
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        return _json_type(next(a for a in args if a is not type(None)), name) | None
    return annotation


def markdown_table() -> str:
    """docs/training.md's table of options (tests/models/test_options.py keeps the two equal)."""
    rows = ["| option (YAML) | flag | group | default | what |", "|---|---|---|---|---|"]
    for d in OPTIONS.values():
        default = d.default if isinstance(d.default, str) else json.dumps(json_value(d.default))  # null: none
        what = d.option.help.replace("|", "\\|")
        rows.append(f"| `{d.name}` | `{d.flag}` | {d.group} | `{default}` | {what} |")
    return "\n".join(rows) + "\n"
