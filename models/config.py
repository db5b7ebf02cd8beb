"""The detector's configuration: the option groups of :mod:`padim.models.options`, together, frozen and checked.

Built from YAML (``configs/*.yaml``), flags and keywords, all flat (``image_size: 128``), by option name; read
by group (``config.features.image_size``), and passed by group (``config.scoring`` to whatever reads maps).
No I/O but :func:`read_config_file` (a YAML file, or a preset shipped in the package: :func:`presets`).
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from padim.core.tiling import Tiling
from padim.models.choices import EXPECT_AUTO, presets
from padim.models.data.changes import Expected
from padim.models.errors import ConfigError as ConfigError  # re-exported: raised here
from padim.models.families import BACKBONES, BackboneSpec
from padim.models.options import (
    BEFORE,
    CALIBRATION,
    GROUPS,
    OPTIONS,
    RENAMED,
    STATISTICS,
    Features,
    Framing,
    Gaussian,
    RunOptions,
    ScoringOptions,
    Storage,
    Verdict,
    fail,
    json_value,
)

#: Options of model format 1 (a held-out share for calibration), replaced by cross-fitting.
RETIRED = ("holdout_fraction", "min_holdout", "threshold_quantile")

__all__ = ["CALIBRATION", "STATISTICS", "ConfigError", "PadimConfig", "presets", "read_config_file", "to_yaml"]


@dataclass(frozen=True, init=False)
class PadimConfig:
    """Everything that decides what a fitted detector computes, and how a run computes it.

    Every option is declared once, with its help and its check, in :mod:`padim.models.options`
    (docs/training.md has them as a table).
    """

    features: Features
    framing: Framing
    gaussian: Gaussian
    scoring: ScoringOptions
    verdict: Verdict
    storage: Storage
    run: RunOptions

    def __init__(self, **values: Any) -> None:
        """Options by name (``image_size=128``) or whole groups (``scoring=ScoringOptions(...)``); the rest default.

        Raises:
            ConfigError: a value not allowed (the message names the option and what is allowed).
            TypeError: a name that is neither an option nor a group.
        """
        # earlier spellings still read (a group's name is never one: ``features`` was embedding_dim's)
        values = {name if name in GROUPS else RENAMED.get(name, name): value for name, value in values.items()}
        options = {name: values.pop(name) for name in list(values) if name in OPTIONS}
        unknown = sorted(set(values) - set(GROUPS))
        if unknown:
            raise TypeError(f"PadimConfig got unexpected keyword argument(s): {', '.join(unknown)}")
        for name, group in GROUPS.items():
            base: Any = values.get(name) or group()
            mine = {k: v for k, v in options.items() if OPTIONS[k].group == name}
            if name == "gaussian":  # stored as its bounds, whatever preset named them
                mine["expect"] = _bounds(mine.get("expect", base.expect))
            object.__setattr__(self, name, dataclasses.replace(base, **mine) if mine else base)
        if max(self.framing.tiles) * self.features.image_size > 8192:
            fail(
                "tiles",
                self.framing.tiles,
                f"keep the model input within 8192 pixels a side ({max(self.framing.tiles)} tiles of "
                f"{self.features.image_size})",
            )

    @property
    def spec(self) -> BackboneSpec:
        return BACKBONES[self.features.backbone]

    @property
    def expected(self) -> Expected:
        """``expect`` as :class:`~padim.models.data.changes.Expected` (falsy when nothing is expected).

        Raises:
            ValueError: ``expect`` is ``auto``, which a fit measures before it starts (no bounds yet).
        """
        if self.gaussian.expect == EXPECT_AUTO:
            raise ValueError("expect auto has no bounds until a fit measures its training pictures")
        return Expected.parse(self.gaussian.expect)

    @property
    def tiling(self) -> Tiling:
        """The tiles on the model input and how their maps are stitched (:class:`~padim.core.tiling.Tiling`)."""
        tiles, size = self.framing.tiles, self.features.image_size
        cell = self.spec.stride_of(self.features.stages[0])
        cells = size // cell
        overlap = min(cells - 1, round(self.framing.tile_overlap * cells)) if tiles != (1, 1) else 0
        return Tiling(tiles[0], tiles[1], size, cell, overlap)

    @property
    def input_shape(self) -> tuple[int, int]:
        """``(height, width)`` of the model input in pixels: ``image_size`` square, or the tiles together."""
        return self.tiling.input_shape

    @property
    def tile_count(self) -> int:
        """Tiles per picture (1 untiled)."""
        return self.framing.tile_count

    @property
    def rows_per_image(self) -> int:
        """Rows of the statistics' samples a picture gives: its tiles when they share statistics, else 1."""
        return self.tile_count if self.framing.tile_statistics == "shared" else 1

    @property
    def copies_fitted(self) -> bool:
        """Whether each picture's changed copy is fitted beside it (``expect`` and ``fit_changes``)."""
        return bool(self.gaussian.expect) and self.gaussian.fit_changes

    @property
    def rows_per_picture(self) -> int:
        """Rows of the statistics' samples a picture gives: :attr:`rows_per_image`, twice when its copy is fitted."""
        return self.rows_per_image * (2 if self.copies_fitted else 1)

    @property
    def spooled_rows_per_picture(self) -> int:
        """Rows of embeddings a picture leaves in the fit's spools: its own, and its changed copy's (``expect``)."""
        return self.rows_per_image * (2 if self.gaussian.expect else 1)

    def embedding_dim_or_default(self) -> int:
        """``D`` when ``embedding_dim`` is ``None``: the backbone's default."""
        dim = self.features.embedding_dim
        return dim if dim is not None else self.spec.default_embedding_dim

    def differences(self, other: PadimConfig, groups: tuple[str, ...] = STATISTICS) -> list[str]:
        """The options of ``groups`` (default: those that decide the statistics) that differ from ``other``'s."""
        return [
            name
            for group in groups
            if getattr(self, group) != getattr(other, group)
            for name in _names(group)
            if getattr(getattr(self, group), name) != getattr(getattr(other, group), name)
        ]

    def with_run_options(self, options: PadimConfig) -> PadimConfig:
        """This configuration with ``options``' run options (they do not change the statistics)."""
        return dataclasses.replace(self, run=options.run)

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "config") -> PadimConfig:
        """From a flat mapping of option: value (parsed YAML, a header's ``config``); unknown keys are an error."""
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a mapping of option: value, got {type(values).__name__}")
        values = {RENAMED.get(k, k): v for k, v in values.items()}
        unknown = sorted(set(values) - set(OPTIONS))
        retired = sorted(set(unknown) & set(RETIRED))
        if retired:
            raise ConfigError(
                f"{source}: {', '.join(retired)} no longer exist{'s' if len(retired) == 1 else ''}: "
                "every image is now fitted and calibrated out-of-fold; set false_alarm_rate "
                "(default 0.01) and calibration_folds (default loo) instead"
            )
        if unknown:
            raise ConfigError(f"{source}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(OPTIONS)}")
        return cls(**values)

    @classmethod
    def from_stored(cls, values: dict[str, Any], source: str, older: bool) -> PadimConfig:
        """The configuration a model file or an export stored; an ``older`` one (of an earlier format) is read with
        what it computed for the options it lacks (their ``before``), whatever today's defaults."""
        return cls.from_mapping({**BEFORE, **values} if older else values, source=source)

    def replace(self, **changes: Any) -> PadimConfig:
        """A copy with ``changes`` (options by name, or groups) applied (``None`` values are ignored), checked."""
        changes = {k: v for k, v in changes.items() if v is not None}
        groups = {name: getattr(self, name) for name in GROUPS}
        return PadimConfig(
            **{**groups, **{k: v for k, v in changes.items() if k in GROUPS}},
            **{k: v for k, v in changes.items() if k not in GROUPS},
        )

    def to_dict(self) -> dict[str, Any]:
        """Every option, flat, by name."""
        return {name: getattr(getattr(self, d.group), name) for name, d in OPTIONS.items()}

    def stored(self, embedding_dim: int) -> dict[str, Any]:
        """The flat JSON a model file's header and an export's metadata hold: every option, with ``D`` and the stages
        as built."""
        built = self.replace(embedding_dim=embedding_dim, layers=self.features.stages)
        return {name: json_value(value) for name, value in built.to_dict().items()}

    def shown(self) -> dict[str, Any]:
        """The options a served model's description shows (``GET /models``), as JSON."""
        return {name: json_value(value) for name, value in self.to_dict().items() if OPTIONS[name].option.shown}


def _bounds(expect: Any) -> Any:
    if not (isinstance(expect, str) or expect is None):
        return expect  # the group's check names it
    if expect is not None and expect.strip() == EXPECT_AUTO:  # measured when a fit starts (padim.models.fit.training)
        return EXPECT_AUTO
    try:
        return str(Expected.parse(expect))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _names(group: str) -> list[str]:
    return [name for name, d in OPTIONS.items() if d.group == group]


def config_path(value: str | Path, label: str = "--config") -> Path:
    """The file ``--config VALUE`` names: a YAML file, or else a preset's name (``paper``).

    Raises:
        ConfigError: neither a file nor a preset (the message lists the presets).
    """
    path = Path(value)
    if path.is_file():
        return path
    shipped = presets()
    if str(value) in shipped:
        return shipped[str(value)]
    raise ConfigError(
        f"{label} {value}: no such file, and not a preset; the presets: {', '.join(shipped)} "
        "(docs/training.md#presets-and-yaml-files)"
    )


def read_config_file(path: str | Path, label: str = "--config") -> tuple[PadimConfig, set[str]]:
    """A configuration from a YAML file (as ``configs/*.yaml``) or a preset's name, and the option names it sets.

    Raises:
        ConfigError: neither a file nor a preset, an unreadable file, invalid YAML, or an option or value not
            allowed; the message starts with ``label`` and the path.
    """
    path = config_path(path, label)
    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise ConfigError(f"{label} {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{label} {path}: not valid YAML ({str(error).splitlines()[0]})") from None
    config = PadimConfig.from_mapping(values, source=str(path))
    return config, {RENAMED.get(key, key) for key in values}


def to_yaml(config: PadimConfig) -> str:
    """Every option of ``config`` as the YAML ``--config`` reads, each with its help as a comment above it."""
    lines = []
    for name, value in config.to_dict().items():
        lines += ["# " + line for line in textwrap.wrap(OPTIONS[name].option.help, 100)]
        lines.append(yaml.safe_dump({name: json_value(value)}, default_flow_style=True, width=10**6).strip()[1:-1])
    return "\n".join(lines) + "\n"
