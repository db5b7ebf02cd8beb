"""The changes a line's own training pictures show, measured: what ``train --expect auto`` covers.

A line's training pictures were taken over some time; how far their light, placement, focus and compression
already wander is the best estimate of how far the line's next pictures will. :func:`measure` reads that spread
from the pictures themselves, :meth:`Spread.cover` turns it into the bounds of
:class:`~padim.models.data.changes.Expected`, each how far the pictures wander (the :data:`EDGE` quantile of
their deviations from the median: the largest, but for a picture misread) times :data:`MARGIN`.

=============  =========================================================================================
change         measured on each picture, against the pictures' median
=============  =========================================================================================
brightness     mean grey level (a lamp or exposure multiplies it)
contrast       spread of the grey levels over their mean (brightness leaves it alone; contrast scales it)
shift          offset of the picture from the pictures' median picture, by phase correlation; only where
               the pictures share a position (a placed part), not where they do not (a texture's crops:
               there the cover keeps :data:`UNMEASURED`'s bound, as the ``rough`` preset)
rotate         the turn that best registers the picture to the median picture (the same condition)
blur           sharpness (the spread of the Laplacian over the spread of the grey levels): how far a
               Gaussian blur of the median picture would have to go to be as soft as the softest pictures
jpeg           the JPEG quality its quantisation tables were made with (lossless files: none)
=============  =========================================================================================

The cover is centred on the pictures as taken: each training picture's changed copy is one draw within the
bounds (:meth:`Expected.draw`), so a margin above 1 makes the edge of what the line showed lie inside the
cover, not at the edge where a uniform draw rarely lands (docs/calibration.md measures it).

NumPy and Pillow only; at most :data:`SAMPLE` pictures are read (chosen by name, so every rank agrees).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageFilter, ImageOps

from padim.models.choices import EXPECT_AUTO_MARGIN, EXPECT_PRESETS
from padim.models.data.changes import JPEG_BEST, LIMITS, Expected

#: Each bound is how far the training pictures wander times this: the line's edge inside the cover.
MARGIN = EXPECT_AUTO_MARGIN
#: The quantile of the pictures' deviations taken as how far they wander.
EDGE = 0.95
#: At most this many pictures are measured (the ones whose names hash lowest): the spread, not every picture.
SAMPLE = 200
#: Bounds of what cannot be measured (pictures that share no position: a texture's placement): ``rough``'s.
UNMEASURED = Expected.parse(EXPECT_PRESETS["rough"])
#: Side of the grey picture the light and the placement are measured on, and of the crop focus is measured on.
GREY_SIDE = 96
FOCUS_SIDE = 256
#: A picture registers to the median picture when the phase correlation's peak stands this many times above
#: the correlation's own spread; placement is measured when half the pictures register.
REGISTERS = 12.0
#: Turns tried when registering (degrees): from none, a step at a time toward the better side while it registers
#: better, then a parabola through the best three.
MAX_TURN = 10.0
TURN_STEP = 1.25
#: Blurs the median picture is softened by to read a softer picture's blur from its sharpness (pixels).
BLURS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)
#: The IJG luminance quantisation table at quality 50 (libjpeg's; the quality scales it).
_LUMA_50 = np.array(
    [16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56, 14, 17, 22, 29]
    + [51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92, 49, 64, 78, 87, 103]
    + [121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99],
    dtype=np.float64,
)


@dataclass(frozen=True)
class Spread:
    """How far the training pictures wander: each change's deviations from their median, at :data:`EDGE`.

    Attributes:
        pictures: how many were measured.
        brightness: ``|mean grey / median - 1|``.
        contrast: ``|relative spread / median - 1|``.
        shift: offset from the median picture, pixels of the picture (``None``: not measurable).
        rotate: turn from the median picture, degrees (``None``: not measurable).
        blur: the Gaussian sigma (pixels) that softens the median picture to the softest pictures' sharpness.
        jpeg: the lowest JPEG quality among the pictures (``None``: stored losslessly).
        registered: the share of pictures that registered to the median picture (placement's condition).
    """

    pictures: int
    brightness: float
    contrast: float
    shift: float | None
    rotate: float | None
    blur: float
    jpeg: int | None
    registered: float

    def cover(self, margin: float = MARGIN) -> Expected:
        """The bounds ``--expect auto`` declares: each measured change times ``margin`` (within what ``--expect``
        allows), :data:`UNMEASURED`'s where placement could not be measured; JPEG at the lowest quality seen
        less what the margin adds to a deviation from the best quality."""

        def bounded(name: str, value: float, digits: int) -> float:
            return round(min(LIMITS[name], value * margin), digits)

        jpeg = 0.0
        if self.jpeg is not None:
            jpeg = float(max(10, min(JPEG_BEST, round(JPEG_BEST - (JPEG_BEST - self.jpeg) * margin))))
        return Expected(
            brightness=bounded("brightness", self.brightness, 3),
            contrast=bounded("contrast", self.contrast, 3),
            shift=UNMEASURED.shift if self.shift is None else bounded("shift", self.shift, 1),
            rotate=UNMEASURED.rotate if self.rotate is None else bounded("rotate", self.rotate, 2),
            blur=bounded("blur", self.blur, 2),
            jpeg=jpeg,
        )

    def shown(self, expected: Expected) -> list[str]:
        """The changes of ``expected`` these pictures already show at least as far as its bound (``train
        --trim-cover``): their light, contrast or focus wander as far, they are placed or turned as far apart, or
        compressed as hard. Pictures that share no position (fewer than half register: a texture's crops) show every
        shift already (a shifted crop is another crop) but not a turn. A change not expected is not listed."""
        measured = {
            "brightness": self.brightness,
            "contrast": self.contrast,
            "shift": math.inf if self.shift is None else self.shift,
            "rotate": self.rotate,
            "blur": self.blur,
        }
        shown = [name for name, value in measured.items() if getattr(expected, name) and value is not None
                 and value >= getattr(expected, name)]  # fmt: skip
        if expected.jpeg and self.jpeg is not None and self.jpeg <= expected.jpeg:
            shown.append("jpeg")
        return shown

    def trimmed(self, expected: Expected) -> Expected:
        """``expected`` without the changes these pictures already show (:meth:`shown`): their own out-of-fold
        scores cover them, and a copy changed further than the line goes would only raise the threshold."""
        return dataclasses.replace(expected, **dict.fromkeys(self.shown(expected), 0.0))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Spread:
        return cls(**{k: values[k] for k in cls.__dataclass_fields__})

    def describe(self, margin: float = MARGIN) -> str:
        """One line: what was measured and what the cover declares."""
        measured = self.measured("covered as rough's")
        return f"{measured}; covered with a margin of {margin:g}x: {self.cover(margin) or 'nothing'}"

    def measured(self, texture: str) -> str:
        """What was measured, in words; ``texture``: what follows where placement could not be measured."""
        placement = (
            f"placement up to {self.shift:g} px and {self.rotate:g} degrees"
            if self.shift is not None and self.rotate is not None
            else f"placement not measurable (only {self.registered:.0%} of them share a position: a texture), {texture}"
        )
        jpeg = f"JPEG down to quality {self.jpeg}" if self.jpeg is not None else "stored losslessly"
        return (
            f"{self.pictures} training pictures measured: light within {self.brightness:.1%}, contrast within "
            f"{self.contrast:.1%}, {placement}, focus softer by up to sigma {self.blur:g} px, {jpeg}"
        )


def trim_sentence(spread: Spread | None, trimmed: dict | None, cover: str) -> str:
    """One line for ``train --trim-cover``: what the training pictures showed of the declared changes, what was
    left out and what the cover draws."""
    if spread is None or trimmed is None:
        return "fewer than two training pictures could be read to measure their spread: the cover is kept whole"
    measured = spread.measured("whose crops show every shift")
    if not trimmed["left_out"]:
        return f"{measured}; they show none of the declared changes as far: the cover draws all of them"
    return (
        f"{measured}; they already show {', '.join(trimmed['left_out'])} at least as far as declared, left to "
        f"their own out-of-fold scores (--no-trim-cover draws them too); the cover draws {cover or 'nothing'}"
    )


def sampled(names: Sequence[str], count: int = SAMPLE) -> list[int]:
    """Indices of at most ``count`` of ``names``: those whose names hash lowest (the same on every rank)."""
    keyed = sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode()).digest())
    return sorted(keyed[:count])


def measure(
    pictures: Iterable[Image.Image], region: Callable[[int, int], tuple[int, int, int, int]] | None = None
) -> Spread:
    """The spread of ``pictures`` (each as :func:`PIL.Image.open` gave it: a JPEG's tables are read before it is
    converted), read one at a time and kept only reduced, so any number of large pictures fits in memory;
    ``region``: the box ``(left, top, right, bottom)`` of a picture of ``(width, height)`` that the model sees
    (its region of interest), where the measuring is done.

    Raises:
        ValueError: fewer than two pictures.
    """
    smalls: list[np.ndarray] = []
    crops: list[np.ndarray] = []
    qualities: list[int | None] = []
    scale = 1.0  # the first picture's reduction: the others are measured on its shape
    for image in pictures:
        qualities.append(jpeg_quality(image))
        image = ImageOps.exif_transpose(image)  # as the fit sees it
        if region is not None:
            image = image.crop(region(*image.size))
        grey = np.asarray(image.convert("RGB").convert("L"), dtype=np.float64)
        crops.append(_centre(grey, FOCUS_SIDE).copy())
        if not smalls:
            scale = min(1.0, GREY_SIDE / max(grey.shape))
        smalls.append(_reduced(grey, min(1.0, GREY_SIDE / max(grey.shape))))
    if len(smalls) < 2:
        raise ValueError("measuring a spread takes at least two pictures")
    if len({g.shape for g in smalls}) > 1:  # pictures of different sizes: measured on the first one's shape
        smalls = [_resized(g, smalls[0].shape) for g in smalls]
    means = np.array([g.mean() for g in smalls])
    spreads = np.array([g.std() for g in smalls]) / np.maximum(means, 1e-6)
    shift, rotate, registered = _placement(smalls, scale)
    jpegs = [q for q in qualities if q is not None]
    return Spread(
        pictures=len(smalls),
        brightness=round(_ratio_edge(means), 4),
        contrast=round(_ratio_edge(spreads), 4),
        shift=None if shift is None else round(shift, 2),
        rotate=None if rotate is None else round(rotate, 2),
        blur=round(_softest_blur(crops), 2),
        jpeg=min(jpegs) if jpegs and len(jpegs) == len(qualities) else None,
        registered=round(registered, 3),
    )


def jpeg_quality(image: Image.Image) -> int | None:
    """The IJG quality a JPEG's luminance table was scaled from (``None``: not a JPEG)."""
    tables = getattr(image, "quantization", None)
    if image.format != "JPEG" or not tables:
        return None
    luma = np.asarray(tables[min(tables)], dtype=np.float64)
    scale = 100.0 * luma.sum() / _LUMA_50.sum()  # libjpeg: table = std * scale / 100
    quality = 5000.0 / scale if scale > 100 else (200.0 - scale) / 2.0
    return int(min(100, max(1, round(quality))))


def _ratio_edge(values: np.ndarray) -> float:
    middle = float(np.median(values))
    return _edge(np.abs(values / max(middle, 1e-9) - 1.0)) if middle > 0 else 0.0


def _edge(deviations: np.ndarray | list[float]) -> float:
    """How far the pictures wander: the :data:`EDGE` quantile of their deviations (the largest, but for the odd
    picture a measurement misread)."""
    return float(np.quantile(np.asarray(deviations, dtype=np.float64), EDGE))


def _centre(grey: np.ndarray, side: int) -> np.ndarray:
    h, w = grey.shape
    top, left = max(0, (h - side) // 2), max(0, (w - side) // 2)
    return grey[top : top + side, left : left + side]


def _reduced(grey: np.ndarray, scale: float) -> np.ndarray:
    if scale >= 1.0:
        return grey
    size = (max(8, round(grey.shape[1] * scale)), max(8, round(grey.shape[0] * scale)))
    return np.asarray(Image.fromarray(grey.astype(np.float32), mode="F").resize(size, Image.Resampling.BOX))


def _resized(grey: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(
        Image.fromarray(grey.astype(np.float32), mode="F").resize((shape[1], shape[0]), Image.Resampling.BILINEAR)
    )


def _sharpness(grey: np.ndarray) -> float:
    """The spread of the Laplacian over the spread of the grey levels (light and contrast cancel)."""
    grey = np.asarray(grey, dtype=np.float64)
    lap = 4 * grey[1:-1, 1:-1] - grey[:-2, 1:-1] - grey[2:, 1:-1] - grey[1:-1, :-2] - grey[1:-1, 2:]
    return float(lap.std() / max(grey.std(), 1e-6))


def _softest_blur(crops: Sequence[np.ndarray]) -> float:
    """The blur sigma that takes the picture of median sharpness to the softest pictures' sharpness (:data:`EDGE`)."""
    sharp = np.array([_sharpness(c) for c in crops])
    middle = int(np.argsort(sharp)[len(sharp) // 2])
    softest = float(np.quantile(sharp, 1 - EDGE)) / max(float(sharp[middle]), 1e-9)
    if softest >= 1.0:
        return 0.0
    reference = Image.fromarray(np.clip(crops[middle], 0, 255).astype(np.uint8))
    curve = [
        _sharpness(np.asarray(reference.filter(ImageFilter.GaussianBlur(s)))) / sharp[middle] if s else 1.0
        for s in BLURS
    ]
    # the curve falls with sigma: the sigma where it meets the softest ratio, linearly between the blurs tried
    for (s0, r0), (s1, r1) in itertools.pairwise(zip(BLURS, curve, strict=True)):
        if r1 <= softest <= r0:
            return float(s0 + (s1 - s0) * (r0 - softest) / max(r0 - r1, 1e-12))
    return BLURS[-1]


def _placement(small: Sequence[np.ndarray], scale: float) -> tuple[float | None, float | None, float]:
    """How far the pictures are offset (pixels of the picture) and turned (degrees) from their median picture, and
    the share that registered; ``None`` for both when fewer than half registered."""
    template = np.median(np.stack(small), axis=0)
    window = np.outer(np.hanning(template.shape[0]), np.hanning(template.shape[1]))
    weighted = (template - template.mean()) * window  # the median picture as every picture is compared with it
    reference = np.fft.fft2(weighted)
    offsets, turns, registered = [], [], 0
    for found in (_register(grey, weighted, reference, window) for grey in small):
        if found is None:
            continue
        registered += 1
        (dy, dx), angle = found
        offsets.append(math.hypot(dx, dy) / scale)
        turns.append(abs(angle))
    share = registered / len(small)
    if share < 0.5:
        return None, None, share
    return _edge(offsets), _edge(turns), share


def _register(
    grey: np.ndarray, weighted: np.ndarray, reference: np.ndarray, window: np.ndarray
) -> tuple[tuple[float, float], float] | None:
    """The offset ``(dy, dx)`` and turn of ``grey`` against the median picture (``weighted``: less its mean, times
    ``window``; ``reference``: its Fourier transform), or ``None`` when the phase
    correlation's peak does not stand out (:data:`REGISTERS`: the pictures share no position).

    The offset is the whitened (phase) correlation's peak, to a tenth of a pixel by a parabola through it; the turn
    the one whose correlation with the median picture is highest once the offset is undone, by a parabola through
    the turns tried."""
    height, offset = _peak(grey, reference, window, whitened=True)
    if height < REGISTERS:
        return None
    dy, dx = offset
    aligned = Image.fromarray(grey.astype(np.float32), mode="F").transform(
        grey.shape[::-1], Image.Transform.AFFINE, (1, 0, dx, 0, 1, dy), resample=Image.Resampling.BILINEAR
    )
    norm = max(float(np.linalg.norm(weighted)), 1e-12)
    scores: dict[float, float] = {}

    def score(angle: float) -> float:
        if angle not in scores:
            turned = np.asarray(aligned.rotate(angle, Image.Resampling.BILINEAR), dtype=np.float64)
            turned = (turned - turned.mean()) * window
            scores[angle] = float((turned * weighted).sum() / max(float(np.linalg.norm(turned)) * norm, 1e-12))
        return scores[angle]

    best = 0.0  # parts sit nearly straight: climb from no turn, a step at a time, while a turn registers better
    while abs(best) < MAX_TURN:
        step = max((best - TURN_STEP, best + TURN_STEP), key=score)
        if score(step) <= score(best):
            break
        best = step
    angle = best
    if abs(best) < MAX_TURN:
        angle += TURN_STEP * _vertex(score(best - TURN_STEP), score(best), score(best + TURN_STEP))
    return offset, -angle  # the turn that registers it, undone: the picture's own


def _peak(
    grey: np.ndarray, reference: np.ndarray, window: np.ndarray, whitened: bool
) -> tuple[float, tuple[float, float]]:
    """The correlation surface's peak over its spread, and where it lies ``(dy, dx)`` to a tenth of a pixel."""
    spectrum = np.fft.fft2((grey - grey.mean()) * window) * np.conj(reference)
    if whitened:
        spectrum = spectrum / np.maximum(np.abs(spectrum), 1e-12)
    surface = np.real(np.fft.ifft2(spectrum))
    rows, cols = surface.shape
    y, x = np.unravel_index(int(np.argmax(surface)), surface.shape)
    height = float(surface[y, x] / max(float(surface.std()), 1e-12))
    fy = _vertex(surface[(y - 1) % rows, x], surface[y, x], surface[(y + 1) % rows, x])
    fx = _vertex(surface[y, (x - 1) % cols], surface[y, x], surface[y, (x + 1) % cols])
    dy = (y if y <= rows // 2 else y - rows) + fy
    dx = (x if x <= cols // 2 else x - cols) + fx
    return height, (float(dy), float(dx))


def _vertex(left: float, middle: float, right: float) -> float:
    """Where a parabola through three equally spaced values peaks, from the middle one (-0.5 to 0.5 steps)."""
    curvature = left - 2 * middle + right
    return 0.0 if curvature >= 0 else float(np.clip(0.5 * (left - right) / curvature, -0.5, 0.5))
