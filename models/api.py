"""The Python API, for notebooks and scripts: fit, load, predict; plain objects out.

>>> import padim                                                    # doctest: +SKIP
>>> detector = padim.fit("data/weave/train/good", weights="random")  # doctest: +SKIP
>>> detector.save("weave.padim")                                    # doctest: +SKIP
>>> detector = padim.load("weave.padim")                            # doctest: +SKIP
>>> result = detector.predict("data/weave/test/hole/000.png")       # doctest: +SKIP
>>> result.score, result.is_anomaly, result.anomaly_map.shape       # doctest: +SKIP
(0.93, True, (256, 256))
>>> result.heatmap().save("hole.png")                               # doctest: +SKIP

The numbers are those of ``padim predict`` and ``POST /score``: the same scorer, the same
:func:`~padim.models.scoring.verdicts.verdict`, the map resized to the image's size the same way.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from PIL import Image

from padim.core.artifact import copy_artifact, read_header
from padim.core.calibration import Calibration
from padim.core.scoring import resize_map
from padim.models.choices import DEFAULT_BATCH_SIZE, DEFAULT_WORKERS
from padim.models.config import ConfigError, PadimConfig, read_config_file
from padim.models.data.framing import PICTURE_SIZE
from padim.models.data.images import iter_for_model, list_images, open_image, to_rgb
from padim.models.deploy.runtimes import load_scorer
from padim.models.fit.model_file import load_detector
from padim.models.fit.precision import PrecisionGate
from padim.models.fit.training import FitError, FitReport, TrainingImage, train, training_images
from padim.models.options import OPTIONS
from padim.models.scorer import Scorer
from padim.models.scoring.heatmaps import figure, mask_image, overlay
from padim.models.scoring.verdicts import NonFiniteScoreError, Verdict, verdict

#: What :meth:`Detector.predict` takes as one image: a path, a PIL image, or an ``(H, W)`` /
#: ``(H, W, 3)`` / ``(H, W, 4)`` uint8 array (RGB order, as PIL and imageio give; 0..255).
ImageInput = str | os.PathLike | Image.Image | np.ndarray


@dataclass(frozen=True, eq=False)
class Prediction(Verdict):
    """One image's result: its :class:`~padim.models.Verdict` (``score``, ``raw_score``,
    ``is_anomaly``, ``threshold``, ``raw_threshold``, ``anomalous_area``), and:

    Attributes:
        source: the path, or ``"<image N>"`` for an in-memory image (N: its place in the call).
        anomaly_map: ``(H, W)`` float32 raw map at the picture's own size (a large JPEG decoded at a
            reduced scale too: its map is at the full size; heat maps resize it to the image).
        image: the RGB image that was scored (as decoded).
        calibration: the model's, which turns raw values into scores.
        weights_label: where the backbone weights came from (a random-weights model says so).
        stamp: the label a heat map carries (random weights only).
        scored_box: ``(left, top, right, bottom)`` pixels of ``image`` the model scored (its region
            of interest), ``None`` when it scored the whole picture; heat maps mark the rest.
    """

    source: str
    anomaly_map: np.ndarray = field(repr=False)
    image: Image.Image = field(repr=False)
    calibration: Calibration = field(repr=False)
    weights_label: str = field(repr=False, default="")
    stamp: str | None = field(repr=False, default=None)
    scored_box: tuple[int, int, int, int] | None = field(repr=False, default=None)

    @property
    def normalised_map(self) -> np.ndarray:
        """``(H, W)`` calibrated score of every pixel, 0..1 (the model's threshold at 0.5)."""
        return self.calibration.normalise(torch.from_numpy(self.anomaly_map).double()).numpy()

    def mask(self) -> Image.Image:
        """White where the map is at or above the threshold (an ``L`` image at the image's size)."""
        return mask_image(self.normalised_map, self.threshold)

    def overlay(self) -> Image.Image:
        """The image, tinted only where the map nears or passes the threshold, outline at the threshold."""
        return overlay(self.image, self._on_image(self.normalised_map), self.threshold, scored=self.scored_box)

    def _on_image(self, values: np.ndarray) -> np.ndarray:
        """``values`` at :attr:`image`'s size (a drafted JPEG's map is at the picture's larger size)."""
        if values.shape == (self.image.height, self.image.width):
            return values
        return resize_map(torch.from_numpy(values), self.image.height, self.image.width).numpy()

    def heatmap(self, max_side: int | None = 1024) -> Image.Image:
        """Verdict band, original beside overlay, colour bar with the threshold: what ``padim predict`` saves.

        Args:
            max_side: each half at most this many pixels a side (``None``: the image's own size);
                :attr:`anomaly_map` keeps the full resolution.
        """
        image, values, box = self.image, self._on_image(self.normalised_map), self.scored_box
        if max_side is not None and max(image.size) > max_side:
            scale = max_side / max(image.size)
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(size, Image.Resampling.BILINEAR)
            values = resize_map(torch.from_numpy(values), size[1], size[0]).numpy()
            box = (
                None
                if box is None
                else (round(box[0] * scale), round(box[1] * scale), round(box[2] * scale), round(box[3] * scale))
            )
        return figure(image, values, self, label=self.stamp, title=self.source, scored=box)

    def to_dict(self) -> dict:
        """The verdict keys of a ``results.jsonl`` line (no arrays)."""
        return {"path": self.source, **super().to_dict(), "weights": self.weights_label}

    def _repr_png_(self) -> bytes:  # Jupyter shows the heat map
        buffer = io.BytesIO()
        self.heatmap().save(buffer, format="PNG")
        return buffer.getvalue()


class Detector:
    """A fitted detector on a runtime (torch, onnxruntime or OpenVINO).

    Made by :func:`fit` or :func:`load`. ``scorer`` is the underlying
    :class:`~padim.models.PadimDetector` or :class:`~padim.models.DeployedDetector`; ``source``
    the model file it was read from (a temporary one, removed with the detector, after a
    :func:`fit` without ``output``).
    """

    def __init__(
        self,
        scorer: Scorer,
        report: FitReport | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        workers: int = DEFAULT_WORKERS,
        source: Path | None = None,
    ):
        self.scorer = scorer
        self.report = report
        self.batch_size, self.workers = batch_size, workers
        self.source = source

    @property
    def calibration(self) -> Calibration:
        return self.scorer.calibration

    @property
    def config(self) -> PadimConfig:
        return self.scorer.config

    @property
    def runtime(self) -> str:
        return self.scorer.runtime

    def describe(self) -> dict:
        """What ``padim info`` shows: backbone, weights, calibration and its promises, runtime."""
        return self.scorer.describe()

    def __repr__(self) -> str:
        d = self.describe()
        tiles = d.get("tiles", [1, 1])
        size = f"{d['image_size']} px" if tiles == [1, 1] else f"{tiles[0]}x{tiles[1]} tiles of {d['image_size']} px"
        return (
            f"Detector({d['backbone']}, {size}, {d['weights']}, runtime={d['runtime']}, "
            f"fitted on {d['fit_image_count']} images)"
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write the model file (atomically): the file it was read from, statistics included, verified on the way."""
        if self.source is None or self.source.is_dir():
            raise TypeError("an exported detector cannot be saved as a .padim file; save the one it was exported from")
        copy_artifact(self.source, path, read_header(self.source))
        return Path(path)

    def predict(
        self, images: ImageInput | Sequence[ImageInput], threshold: float | None = None
    ) -> Prediction | list[Prediction]:
        """Score images: one input gives one :class:`Prediction`, a list (or a folder) gives a list.

        Args:
            images: a path (an image, or a folder: every image under it, sorted), a PIL image, an
                ``(H, W[, C])`` uint8 array, or a list of these.
            threshold: on the score scale, instead of the model's (0.5).

        Raises:
            ImageError: an image that cannot be read (its path is named).
            NonFiniteScoreError: the model gave a NaN or infinite score (no verdict is made from it).
        """
        single = not isinstance(images, (list, tuple)) and not (
            isinstance(images, (str, os.PathLike)) and Path(images).is_dir()
        )
        results = self._predicted(_listed(images), threshold)
        return results[0] if single else results

    def scores(self, images: ImageInput | Sequence[ImageInput]) -> np.ndarray:
        """``(N,)`` calibrated scores, in the order given (folders expanded, sorted)."""
        return np.array([p.score for p in self._predicted(_listed(images))], dtype=np.float64)

    def _predicted(self, images: list[ImageInput], threshold: float | None = None) -> list[Prediction]:
        results = []
        for item in self.iter_predict(images, threshold):
            if isinstance(item, NonFiniteScoreError):
                raise item
            results.append(item)
        return results

    def iter_predict(
        self,
        images: Sequence[ImageInput],
        threshold: float | None = None,
        unreadable: list[tuple[Path, str]] | None = None,
    ) -> Iterator[Prediction | NonFiniteScoreError]:
        """Predictions in order, batch by batch; a non-finite score comes as its error, not raised.

        Args:
            unreadable: when given, an image file that cannot be read is appended here as
                ``(path, reason)`` and skipped, instead of raising.
        """
        paths: list[Path] = []
        loaded: list[tuple[str, Image.Image]] = []
        for i, item in enumerate(images):  # consecutive files, and consecutive in-memory images, share batches
            if isinstance(item, (str, os.PathLike)):
                yield from self._predict_memory(loaded, threshold)
                loaded = []
                paths += list_images(item)
            else:
                yield from self._predict_paths(paths, threshold, unreadable)
                paths = []
                loaded.append((f"<image {i}>", _as_image(item)))
        yield from self._predict_paths(paths, threshold, unreadable)
        yield from self._predict_memory(loaded, threshold)

    def _predict_memory(
        self, loaded: list[tuple[str, Image.Image]], threshold
    ) -> Iterator[Prediction | NonFiniteScoreError]:
        for start in range(0, len(loaded), self.batch_size):
            chunk = loaded[start : start + self.batch_size]
            yield from self._predict_loaded([image for _, image in chunk], [name for name, _ in chunk], threshold)

    def _predict_paths(self, paths: list[Path], threshold, unreadable) -> Iterator[Prediction | NonFiniteScoreError]:
        if not paths:
            return
        for chunk, loaded in iter_for_model(paths, self.config, self.batch_size, self.workers, unreadable):
            yield from self._predict_loaded(loaded, [str(p) for p in chunk], threshold)

    def _predict_loaded(
        self, loaded: list[Image.Image], names: list[str], threshold
    ) -> Iterator[Prediction | NonFiniteScoreError]:
        out = self.scorer.score(self.scorer.preprocess(loaded))
        raw_scores, maps = out.raw_scores.cpu().tolist(), out.maps.cpu()
        calibration, weights = self.calibration, self.scorer.weights
        for name, image, raw, small in zip(names, loaded, raw_scores, maps, strict=True):
            try:
                found = verdict(raw, small, calibration, threshold)
            except NonFiniteScoreError as error:
                error.source = name
                yield error
                continue
            # at the picture's size and place (0 outside the region of interest), a drafted JPEG's too
            framing, picture = self.scorer.framing, image.info.get(PICTURE_SIZE)
            width, height = picture or image.size
            full = framing.to_picture(small, width, height, picture).numpy().astype(np.float32)
            yield Prediction(
                **asdict(found),
                source=name,
                anomaly_map=full,
                image=image,
                calibration=calibration,
                weights_label=weights.label,
                stamp=weights.stamp,
                scored_box=framing.shown_box(image.width, image.height, picture),
            )


def load(
    path: str | os.PathLike,
    runtime: str = "auto",
    device: str = "auto",
    batch_size: int = DEFAULT_BATCH_SIZE,
    workers: int = DEFAULT_WORKERS,
) -> Detector:
    """A model file (``padim train``) or an export directory (``padim export``), verified, on a runtime.

    Args:
        runtime: ``auto`` (onnxruntime on a CPU when installed, else torch), ``torch``,
            ``onnxruntime`` or ``openvino``.
        device: ``auto``, ``cpu`` or ``cuda``.
    """
    return Detector(load_scorer(Path(path), runtime, device), batch_size=batch_size, workers=workers, source=Path(path))


def fit(
    images: str | os.PathLike | Sequence[ImageInput],
    output: str | os.PathLike | None = None,
    *,
    config: PadimConfig | str | os.PathLike | None = None,
    progress: bool = True,
    max_score_error: float | None = None,
    force: bool = False,
    **options: Any,
) -> Detector:
    """Fit a detector on normal images, calibrated as ``padim train`` does (same folds, same threshold).

    Args:
        images: a folder (every image under it), or a list of image paths, PIL images or arrays
            (in-memory images are written as PNG files to a temporary folder for the fit, named
            ``image-00000.png`` ... in the order given, which decides their calibration folds).
        output: write the model file here too.
        config: a :class:`PadimConfig`, a YAML file of options or a preset's name (as ``padim train --config``).
        progress: progress bars on stderr.
        max_score_error, force: the gate of a reduced ``precision`` (``bf16``, ``fp16``, ``int8``), as ``padim train
            --max-score-error`` and ``--force``: the largest relative difference of its image scores from fp32's on
            16 training pictures (default 0.02; int8 0.25), and whether to keep a model past it.
        **options: :class:`PadimConfig` options (:mod:`padim.models.options`), e.g. ``backbone="wide_resnet50_2"``,
            ``weights="random"``, ``image_size=256``, ``false_alarm_rate=0.005``.

    Raises:
        FitError: too few readable images, or images that do not vary; ``PrecisionGateFailed`` (a FitError) when a
            reduced precision's scores are past ``max_score_error`` and not ``force``.
        ConfigError: an unknown option or a value out of range (the message lists what is allowed).
    """
    gate = PrecisionGate(max_score_error, force)  # ConfigError for a tolerance that is not a positive number
    config = _configuration(config, options)
    kept = None
    if output is None:  # a model file all the same: the detector reads it, and save() copies it
        kept = Path(tempfile.mkdtemp(prefix="padim-model-"))
        output = kept / "model.padim"
    try:
        with tempfile.TemporaryDirectory(prefix="padim-fit-") as scratch:
            found = _training_images(images, Path(scratch))
            if not found:
                raise FitError(f"{images}: no images found (looked for png, jpg, jpeg, bmp, tif)")
            report = train(config, found, Path(output), progress=progress, scratch_dir=scratch, gate=gate)
        scorer = load_detector(Path(output), device=config.run.device)
    except BaseException:
        if kept is not None:
            shutil.rmtree(kept, ignore_errors=True)
        raise
    detector = Detector(
        scorer, report, batch_size=config.run.batch_size, workers=config.run.decode_workers, source=Path(output)
    )
    if kept is not None:
        weakref.finalize(detector, shutil.rmtree, kept, True)
    return detector


def _configuration(config: PadimConfig | str | os.PathLike | None, options: dict[str, Any]) -> PadimConfig:
    """``fit``'s configuration: ``config`` (a preset's name or a YAML file's path too) with ``options`` applied."""
    if config is None:
        config = PadimConfig()
    elif not isinstance(config, PadimConfig):
        config = read_config_file(Path(config), label="config")[0]  # a preset's name is a Path of its name
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(OPTIONS)}")
    return config.replace(**options)


def _training_images(images, scratch: Path) -> list[TrainingImage]:
    if isinstance(images, (str, os.PathLike)):
        return training_images(Path(images))
    found = []
    for i, item in enumerate(images):
        if isinstance(item, (str, os.PathLike)):
            found += [TrainingImage(p, p.as_posix()) for p in list_images(item)]
        else:
            path = scratch / f"image-{i:05d}.png"
            _as_image(item).save(path)
            found.append(TrainingImage(path, path.name))
    return found


def _listed(images: ImageInput | Sequence[ImageInput]) -> list[ImageInput]:
    """Several inputs as a list; one (a path, a folder, a picture, an array) as a list of one."""
    if isinstance(images, (list, tuple)):
        return list(images)
    return [cast(ImageInput, images)]  # not a list or a tuple: one input (a str is one path)


def _as_image(item) -> Image.Image:
    if isinstance(item, Image.Image):
        return to_rgb(item)
    if isinstance(item, np.ndarray):
        array = item
        if array.dtype != np.uint8:
            raise TypeError(
                f"an image array must be uint8 (0..255), got {array.dtype}; "
                "convert with (array * 255).round().astype('uint8') if it is 0..1"
            )
        if array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3, 4)):
            return to_rgb(Image.fromarray(array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array))
        raise TypeError(f"an image array must be (H, W), (H, W, 3) or (H, W, 4), got shape {array.shape}")
    if isinstance(item, (str, os.PathLike)):
        return open_image(item)
    raise TypeError(f"cannot read an image from {type(item).__name__}: give a path, a PIL image or a uint8 array")
