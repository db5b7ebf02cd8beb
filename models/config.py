"""The detector's configuration: a small frozen dataclass, validated on construction.

Built from YAML (``configs/*.yaml``) and CLI flags by the CLI; no I/O here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from padim.core.calibration import FALSE_ALARM_RATE_RANGE
from padim.core.tiling import Tiling
from padim.models.choices import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_WORKERS,
    DEVICES,
    EXPECT_PRESETS,
    IMAGE_SCORES,
    NEIGHBOURHOODS,
    PRECISION_DTYPES,
    REDUCTIONS,
    RESIZES,
    TILE_STATISTICS,
    parse_tiles,
)
from padim.models.data.changes import Expected
from padim.models.errors import ConfigError  # noqa: F401 (part of this module's interface)
from padim.models.features.backbones import BACKBONES

#: Options of model format 1 (a held-out share for calibration), replaced by cross-fitting.
RETIRED = ("holdout_fraction", "min_holdout", "threshold_quantile")
#: Earlier spellings still read (YAML files, model format 1 headers).
RENAMED = {"features": "embedding_dim"}
#: Fields that decide the statistics: they cannot change between a fit and its resume or merge.
STATISTICS_FIELDS = (
    "backbone",
    "weights",
    "layers",
    "image_size",
    "reduction",
    "embedding_dim",
    "seed",
    "epsilon",
    "calibration_folds",
    "neighbourhood",
    "roi",
    "resize",
    "tiles",
    "tile_overlap",
    "tile_statistics",
    "expect",
    "fit_changes",
)
#: What a model file or export written before an option existed computed (format 4 and older), for the
#: keys its header lacks: read so, whatever today's default, so that it keeps scoring exactly as it did
#: (``blur_sigma`` has always been written; its default was 4 until neighbourhood 3 became the default).
BEFORE_OPTIONS = {
    "neighbourhood": 1,
    "image_score": "map_max",
    "top_fraction": 0.01,
    "blur_sigma": 4.0,
    "roi": None,
    "resize": "squash",
    "tiles": (1, 1),
    "tile_overlap": 0.0,
    "tile_statistics": "position",
    "expect": "",
    "fit_changes": False,
}
#: Fields that decide how a map and an image score are read from the distances (and so the calibration's scores).
SCORE_FIELDS = ("blur_sigma", "image_score", "top_fraction")
#: Fields that may differ from run to run of the same fit.
RUN_OPTIONS = ("batch_size", "device", "workers")


@dataclass(frozen=True)
class PadimConfig:
    """Everything that decides what a fitted detector computes.

    Attributes:
        backbone: torchvision ResNet-family name (see ``BACKBONES``).
        weights: ``imagenet`` (torchvision's weights and cache), ``random`` (seeded; demos and
            tests only) or the path of a ``state_dict`` file of the same architecture.
        layers: backbone stages whose feature maps are concatenated.
        image_size: side of the square model input (of each tile, when tiled), a multiple of 16.
        reduction: ``random`` channel subset (the paper) or ``semi_orthogonal`` projection
            (Kim et al. 2021).
        embedding_dim: embedding size ``D`` after reduction; ``None`` = the backbone's default
            (100 for resnet18, 550 for wide_resnet50_2). Read ``D`` of a built detector from its
            embedding.
        seed: seeds the channel subset / projection and ``random`` weights.
        epsilon: added to the covariance diagonal before the Cholesky factorisation.
        blur_sigma: Gaussian smoothing of the anomaly map, in input pixels (default 0: none; the
            neighbourhood average already smooths; the paper's 4 with ``neighbourhood`` 1).
        neighbourhood: each layer's features averaged over ``k x k`` neighbours on its own grid
            before the Gaussian (3, the default, as PatchCore: a patch then describes its
            surroundings; 1: none, the paper). docs/quality.md measures both.
        image_score: how the image score is read from the map: ``map_max`` (the maximum of the
            smoothed map, the paper), ``patch_max`` (the largest feature-grid distance, before
            smoothing) or ``top_mean`` (the mean of the ``top_fraction`` highest map pixels). The
            calibration scores the training images the same way.
        top_fraction: share of the map's pixels that ``top_mean`` averages.
        roi: region of interest ``(x, y, width, height)`` in pixels of the picture (as seen, EXIF
            orientation applied), or ``None`` for the whole picture; only it is fitted and scored,
            and maps come back at the picture's size, 0 outside it (:mod:`padim.models.data.framing`).
        resize: how the region becomes the square model input: ``squash`` (resized, the aspect
            ratio lost; the default, as before), ``crop`` (its largest centred square) or ``pad``
            (centred on a square of its longer side, filled with the ImageNet mean colour). With tiles,
            the region becomes a rectangle of the tiles' shape instead of a square.
        tiles: ``(rows, cols)`` tiles of ``image_size`` pixels the region is resized to (``(1, 1)``: no
            tiling); each tile goes through the backbone, the tiles' maps are stitched into one map
            (:mod:`padim.core.tiling`), the image score and the calibration read the stitched map.
        tile_overlap: share of a tile neighbouring tiles overlap (0 to 0.5, rounded to whole feature
            cells); the stitched map averages the tiles where they overlap.
        tile_statistics: ``position`` (every tile position its own Gaussians: placed parts, where
            each place looks different; statistics grow with the number of tiles) or ``shared``
            (one set of Gaussians every tile shares: uniform surfaces, textures, webs and sheets,
            where a defect looks the same anywhere; the statistics of one tile, fitted on ``T``
            times the samples).
        calibration_folds: the folds of cross-fitted calibration: every image is fitted, and
            scored by the model of every image outside its fold (see :mod:`padim.core.calibration`).
            ``"loo"`` (leave-one-out, the default): every image is its own fold; an integer ``K``:
            ``K`` folds by a hash of the image's name (more conservative thresholds, one more
            factorisation per distinct fold size; see :mod:`padim.core.out_of_fold`).
        expect: the small changes the line makes to its pictures that the calibration covers
            (:mod:`padim.models.data.changes`: ``brightness``, ``contrast``, ``shift``, ``rotate``, ``blur``,
            ``jpeg`` with their bounds, e.g. ``"brightness=0.1,shift=2"``, or a preset: ``stable`` (none),
            ``typical``, ``rough`` (the default since 2026-11-25, by benchmarks/quality.py --grid robust: the one
            setting whose false alarms stayed within the promise under every nuisance; docs/quality.md); stored as
            the list of bounds). Each training picture's out-of-fold score is
            then that of a copy of it under one seeded draw of those changes, so that the threshold promises its
            false-alarm rate on pictures within them; the statistics stay the pictures' as taken unless
            ``fit_changes``.
        fit_changes: with ``expect``, fit each picture's changed copy too (the Gaussians then learn the
            changes, and a picture and its copy are one calibration fold; the default); no effect without
            ``expect``.
        false_alarm_rate: share of normal images the threshold may flag (``alpha``).
        batch_size: images per forward pass.
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        precision_dtype: storage of the precision factor in the model file: ``auto``
            (float16 when scores stay within 1e-3 relative of float32), ``float16``, ``float32``.
        workers: threads decoding images.
    """

    backbone: str = "resnet18"
    weights: str = "imagenet"
    layers: tuple[str, ...] = ("layer1", "layer2", "layer3")
    image_size: int = 224
    reduction: str = "random"
    embedding_dim: int | None = None
    seed: int = 0
    epsilon: float = 0.01
    blur_sigma: float = 0.0
    neighbourhood: int = 3
    image_score: str = "map_max"
    top_fraction: float = 0.01
    roi: tuple[int, int, int, int] | None = None
    resize: str = "squash"
    tiles: tuple[int, int] = (1, 1)
    tile_overlap: float = 0.0
    tile_statistics: str = "position"
    calibration_folds: int | str = "loo"
    expect: str = "rough"
    fit_changes: bool = True
    false_alarm_rate: float = 0.01
    batch_size: int = DEFAULT_BATCH_SIZE
    device: str = "auto"
    precision_dtype: str = "auto"
    workers: int = DEFAULT_WORKERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if isinstance(self.roi, (list, tuple)):
            object.__setattr__(self, "roi", tuple(self.roi))
        if isinstance(self.tiles, str):
            object.__setattr__(self, "tiles", parse_tiles(self.tiles))
        elif isinstance(self.tiles, list):
            object.__setattr__(self, "tiles", tuple(self.tiles))
        if isinstance(self.expect, str) or self.expect is None:
            try:  # stored as its bounds, whatever preset named them
                object.__setattr__(self, "expect", str(Expected.parse(self.expect)))
            except ValueError as error:
                raise ConfigError(str(error)) from None
        _validate(self)

    @property
    def spec(self):
        return BACKBONES[self.backbone]

    @property
    def expected(self) -> Expected:
        """:attr:`expect` as :class:`~padim.models.data.changes.Expected` (falsy when nothing is expected)."""
        return Expected.parse(self.expect)

    @property
    def tiling(self) -> Tiling:
        """Where the tiles lie on the model input and how their maps are stitched (:class:`padim.core.tiling.Tiling`)."""
        cell = self.spec.stride_of(self.layers[0])
        cells = self.image_size // cell
        overlap = min(cells - 1, round(self.tile_overlap * cells)) if self.tiles != (1, 1) else 0
        return Tiling(self.tiles[0], self.tiles[1], self.image_size, cell, overlap)

    @property
    def input_shape(self) -> tuple[int, int]:
        """``(height, width)`` of the model input in pixels: ``image_size`` square, or the tiles together."""
        return self.tiling.input_shape

    @property
    def tile_count(self) -> int:
        """Tiles per picture (1 untiled)."""
        return self.tiles[0] * self.tiles[1]

    @property
    def rows_per_image(self) -> int:
        """Rows of the statistics' samples a picture gives: its tiles when they share statistics, else 1."""
        return self.tile_count if self.tile_statistics == "shared" else 1

    @property
    def copies_fitted(self) -> bool:
        """Whether each picture's changed copy is fitted beside it (``expect`` and ``fit_changes``)."""
        return bool(self.expect) and self.fit_changes

    @property
    def rows_per_picture(self) -> int:
        """Rows of the statistics' samples a picture gives: :attr:`rows_per_image`, twice when its copy is fitted."""
        return self.rows_per_image * (2 if self.copies_fitted else 1)

    @property
    def spooled_rows_per_picture(self) -> int:
        """Rows of embeddings a picture leaves in the fit's spools: its own, and its changed copy's (``expect``)."""
        return self.rows_per_image * (2 if self.expect else 1)

    def embedding_dim_or_default(self) -> int:
        """``D`` when :attr:`embedding_dim` is ``None``: the backbone's default."""
        return self.embedding_dim if self.embedding_dim is not None else self.spec.default_embedding_dim

    def differences(self, other: PadimConfig, names: tuple[str, ...] = STATISTICS_FIELDS) -> list[str]:
        """Which of ``names`` (default: the fields that decide the statistics) differ from ``other``'s."""
        return [name for name in names if getattr(self, name) != getattr(other, name)]

    def with_run_options(self, options: PadimConfig) -> PadimConfig:
        """This configuration with ``options``' run options (they do not change the statistics)."""
        return self.replace(**{k: getattr(options, k) for k in RUN_OPTIONS})

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "config") -> PadimConfig:
        """Build from a plain mapping (parsed YAML); unknown keys are an error."""
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a mapping of option: value, got {type(values).__name__}")
        values = {RENAMED.get(k, k): v for k, v in values.items()}
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        retired = sorted(set(unknown) & set(RETIRED))
        if retired:
            raise ConfigError(
                f"{source}: {', '.join(retired)} no longer exist{'s' if len(retired) == 1 else ''}: "
                "every image is now fitted and calibrated out-of-fold; set false_alarm_rate "
                "(default 0.01) and calibration_folds (default loo) instead"
            )
        if unknown:
            raise ConfigError(f"{source}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        return cls(**values)

    def replace(self, **changes: Any) -> PadimConfig:
        """A copy with ``changes`` applied (``None`` values are ignored), validated."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def read_config_file(path: str | Path, label: str = "--config") -> tuple[PadimConfig, set[str]]:
    """A configuration from a YAML file (as ``configs/*.yaml``), and the option names it sets.

    Raises:
        ConfigError: an unreadable file, invalid YAML, or an option or value not allowed; the
            message starts with ``label`` and the path.
    """
    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise ConfigError(f"{label} {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{label} {path}: not valid YAML ({str(error).splitlines()[0]})") from None
    config = PadimConfig.from_mapping(values, source=str(path))
    return config, {RENAMED.get(key, key) for key in values}


def _validate(c: PadimConfig) -> None:
    def fail(name: str, value: Any, allowed: str) -> None:
        raise ConfigError(f"{name}: {value!r} is not allowed; {allowed}")

    if c.backbone not in BACKBONES:
        fail("backbone", c.backbone, "choose one of: " + ", ".join(BACKBONES))
    if not isinstance(c.weights, str) or not c.weights:
        fail("weights", c.weights, "use imagenet, random or the path of a state_dict file")
    spec = BACKBONES[c.backbone]
    if not c.layers or any(layer not in spec.layers for layer in c.layers):
        fail("layers", list(c.layers), "choose from: " + ", ".join(spec.layers))
    if list(c.layers) != sorted(c.layers, key=spec.layers.index) or len(set(c.layers)) != len(c.layers):
        fail("layers", list(c.layers), "list each layer once, shallowest first")
    stride = max((spec.stride_of(layer) for layer in c.layers if layer in spec.layers), default=16)
    multiple = max(stride, 16)  # every layer's grid must divide the first one's evenly
    if (
        not isinstance(c.image_size, int)
        or c.image_size < 2 * multiple
        or c.image_size % multiple
        or c.image_size > 2048
    ):
        fail(
            "image_size",
            c.image_size,
            f"use a multiple of {multiple} between {2 * multiple} and 2048"
            + (f" (layer {c.layers[-1]} has stride {stride})" if stride > 16 else ""),
        )
    if c.reduction not in REDUCTIONS:
        fail("reduction", c.reduction, "choose one of: " + ", ".join(REDUCTIONS))
    total = sum(spec.channels_of(c.layers))
    if c.embedding_dim is not None and (not isinstance(c.embedding_dim, int) or not 1 <= c.embedding_dim <= total):
        fail(
            "embedding_dim",
            c.embedding_dim,
            f"use an integer from 1 to {total} (the channels of {', '.join(c.layers)})",
        )
    if c.embedding_dim is None and spec.default_embedding_dim > total:
        fail(
            "embedding_dim",
            None,
            f"set it: the default {spec.default_embedding_dim} exceeds the {total} channels of {', '.join(c.layers)}",
        )
    if not isinstance(c.seed, int):
        fail("seed", c.seed, "use an integer")
    if not c.epsilon >= 0:
        fail("epsilon", c.epsilon, "use a number >= 0 (the paper uses 0.01)")
    if not c.blur_sigma >= 0:
        fail("blur_sigma", c.blur_sigma, "use a number >= 0 (0 turns smoothing off)")
    if isinstance(c.neighbourhood, bool) or c.neighbourhood not in NEIGHBOURHOODS:
        fail(
            "neighbourhood",
            c.neighbourhood,
            "choose one of: " + ", ".join(map(str, NEIGHBOURHOODS)) + " (1 = no averaging)",
        )
    if c.image_score not in IMAGE_SCORES:
        fail("image_score", c.image_score, "choose one of: " + ", ".join(IMAGE_SCORES))
    if (
        isinstance(c.top_fraction, bool)
        or not isinstance(c.top_fraction, (int, float))
        or not 0 < c.top_fraction <= 0.5
    ):
        fail(
            "top_fraction", c.top_fraction, "use a number above 0 and at most 0.5 (default 0.01: the top 1% of pixels)"
        )
    if c.roi is not None and (
        not isinstance(c.roi, tuple)
        or len(c.roi) != 4
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in c.roi)
        or c.roi[0] < 0
        or c.roi[1] < 0
        or c.roi[2] < 16
        or c.roi[3] < 16
    ):
        fail(
            "roi",
            c.roi,
            "use x,y,width,height in pixels of the picture: integers, x and y >= 0, width and height "
            ">= 16 (or leave it out for the whole picture)",
        )
    if c.resize not in RESIZES:
        fail(
            "resize",
            c.resize,
            "choose one of: " + ", ".join(RESIZES) + " (squash: resized, aspect ratio lost; crop: "
            "largest centred square; pad: centred on a square)",
        )
    if (
        not isinstance(c.tiles, tuple)
        or len(c.tiles) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 8 for v in c.tiles)
    ):
        fail("tiles", c.tiles, "use ROWSxCOLS with 1 to 8 of each, e.g. 2x2 or 3x4 (1x1: no tiling)")
    if (
        isinstance(c.tile_overlap, bool)
        or not isinstance(c.tile_overlap, (int, float))
        or not 0 <= c.tile_overlap <= 0.5
    ):
        fail("tile_overlap", c.tile_overlap, "use a share of a tile from 0 to 0.5 (default 0: tiles side by side)")
    if c.tile_overlap and c.tiles == (1, 1):
        fail("tile_overlap", c.tile_overlap, "set tiles too (an overlap needs at least two tiles)")
    if c.tile_statistics not in TILE_STATISTICS:
        fail(
            "tile_statistics",
            c.tile_statistics,
            "choose one of: " + ", ".join(TILE_STATISTICS) + " (position: each "
            "tile position its own statistics, for placed parts; shared: one set for every tile, for uniform surfaces)",
        )
    if (
        isinstance(c.image_size, int)
        and isinstance(c.tiles, tuple)
        and len(c.tiles) == 2
        and max(c.tiles) * c.image_size > 8192
    ):
        fail(
            "tiles", c.tiles, f"keep the model input within 8192 pixels a side ({max(c.tiles)} tiles of {c.image_size})"
        )
    if c.calibration_folds != "loo" and (
        isinstance(c.calibration_folds, bool)
        or not isinstance(c.calibration_folds, int)
        or not 2 <= c.calibration_folds <= 1000
    ):
        fail("calibration_folds", c.calibration_folds, "use an integer from 2 to 1000, or loo (leave-one-out)")
    if not isinstance(c.expect, str):
        fail(
            "expect",
            c.expect,
            "use a list of change=bound (e.g. brightness=0.1,shift=2) or a preset: " + ", ".join(EXPECT_PRESETS),
        )
    if not isinstance(c.fit_changes, bool):
        fail("fit_changes", c.fit_changes, "use true or false")
    low, high = FALSE_ALARM_RATE_RANGE
    if (
        isinstance(c.false_alarm_rate, bool)
        or not isinstance(c.false_alarm_rate, (int, float))
        or not low <= c.false_alarm_rate <= high
    ):
        fail(
            "false_alarm_rate",
            c.false_alarm_rate,
            f"use a number from {low:g} to {high:g} (default 0.01: 1% of normal images flagged)",
        )
    if not isinstance(c.batch_size, int) or c.batch_size < 1:
        fail("batch_size", c.batch_size, "use an integer >= 1")
    if c.device not in DEVICES:
        fail("device", c.device, "choose one of: " + ", ".join(DEVICES))
    if c.precision_dtype not in PRECISION_DTYPES:
        fail("precision_dtype", c.precision_dtype, "choose one of: " + ", ".join(PRECISION_DTYPES))
    if not isinstance(c.workers, int) or c.workers < 0:
        fail("workers", c.workers, "use an integer >= 0")
