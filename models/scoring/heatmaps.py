"""Heat maps for people: the anomaly map over the image, a colour bar and the verdict beside it.

Three pictures, from a normalised map (the calibrated score of every pixel, ``0..1``, the model's
threshold at 0.5):

* :func:`overlay` — the image at its own size, tinted only where the map rises towards the
  threshold (normal areas keep their own colours, so a brown stain stays brown), with the outline
  of the area at or above the threshold. The service's ``heatmap``.
* :func:`figure` — what ``padim predict`` and the evaluation report save: a band with the verdict,
  the score and the demo-weights label *above* the picture, the original and the overlay side by
  side, and a colour bar with the threshold and the image's score marked.
* :func:`mask_image` — white where at or above the threshold.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from padim.core.calibration import MODEL_THRESHOLD

# Anchor colours of a perceptually ordered blue -> green -> yellow -> red ramp ("turbo"-like).
_ANCHORS = np.array(
    [
        [48, 18, 59],
        [50, 101, 212],
        [26, 188, 210],
        [92, 243, 99],
        [210, 233, 53],
        [251, 157, 39],
        [226, 68, 14],
        [122, 4, 3],
    ],
    dtype=np.float64,
)

#: Normalised score below which a pixel is left untinted, and the tint's opacity at the threshold
#: and at 1: a pixel is shown only as it nears the threshold, and most strongly above it.
TINT_FROM, TINT_AT_THRESHOLD, TINT_MAX = 0.25, 0.55, 0.8
ANOMALOUS_COLOUR, NORMAL_COLOUR, LABEL_COLOUR = (255, 92, 80), (80, 210, 130), (255, 214, 0)
BAND_COLOUR, TEXT_COLOUR = (28, 28, 32), (235, 235, 235)
#: Frame of the scored box (a region of interest) on a heat map; outside it the picture is greyed out.
UNSCORED_FRAME = (120, 200, 255)
#: Narrowest half of a :func:`figure`, in pixels: smaller images are enlarged to at least this.
MIN_PANEL = 256


class VerdictLike(Protocol):
    """What :func:`figure` writes in its band (a :class:`padim.models.Verdict` has it)."""

    @property
    def score(self) -> float: ...
    @property
    def is_anomaly(self) -> bool: ...
    @property
    def threshold(self) -> float: ...
    @property
    def anomalous_area(self) -> float: ...


def colorize(values: np.ndarray) -> np.ndarray:
    """``(H, W)`` values in ``[0, 1]`` -> ``(H, W, 3)`` uint8 colours."""
    position = np.clip(values, 0.0, 1.0) * (len(_ANCHORS) - 1)
    low = np.floor(position).astype(int).clip(0, len(_ANCHORS) - 2)
    frac = (position - low)[..., None]
    colours = _ANCHORS[low] * (1 - frac) + _ANCHORS[low + 1] * frac
    return colours.round().astype(np.uint8)


def tint_opacity(values: np.ndarray, threshold: float = MODEL_THRESHOLD) -> np.ndarray:
    """``(H, W)`` opacity of the tint: 0 up to :data:`TINT_FROM`, rising to :data:`TINT_AT_THRESHOLD`
    at ``threshold`` and to :data:`TINT_MAX` at 1."""
    values = np.clip(values, 0.0, 1.0)
    start = min(TINT_FROM, threshold * 0.5)
    below = TINT_AT_THRESHOLD * np.clip((values - start) / max(threshold - start, 1e-9), 0.0, 1.0)
    above = TINT_AT_THRESHOLD + (TINT_MAX - TINT_AT_THRESHOLD) * np.clip(
        (values - threshold) / max(1.0 - threshold, 1e-9), 0.0, 1.0
    )
    return np.where(values >= threshold, above, below)


def overlay(
    image: Image.Image,
    normalised_map: np.ndarray,
    threshold: float = MODEL_THRESHOLD,
    outline: bool = True,
    scored: tuple[int, int, int, int] | None = None,
) -> Image.Image:
    """The image tinted where the map is high, at the image's size.

    Args:
        image: the picture.
        normalised_map: ``(H, W)`` normalised scores at the image's size (the model's threshold is 0.5).
        threshold: where the outline is drawn (the verdict's threshold, 0.5 unless overridden).
        outline: draw the outline of the area at or above ``threshold``.
        scored: ``(left, top, right, bottom)`` of what the model scored (a region of interest):
            the rest is greyed out and the box framed. ``None``: the whole picture was scored.
    """
    base = np.asarray(image.convert("RGB"), dtype=np.float64)
    values = np.asarray(normalised_map, dtype=np.float64)
    if values.shape != base.shape[:2]:
        raise ValueError(f"map {values.shape} and image {base.shape[:2]} differ in size")
    alpha = tint_opacity(values, threshold)[..., None]
    blended = (base * (1 - alpha) + colorize(values) * alpha).round().astype(np.uint8)
    result = Image.fromarray(blended)
    if outline:
        edge = _outline(values >= threshold, max(1, round(max(image.size) / 300)))
        result.paste((255, 255, 255), mask=edge)
    if scored is not None:
        result = _mark_unscored(result, scored)
    return result


def _mark_unscored(image: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
    """Grey out everything outside ``box`` (not scored: outside the region of interest) and frame the box."""
    pixels = np.asarray(image, dtype=np.float64).copy()
    inside = np.zeros(pixels.shape[:2], dtype=bool)
    inside[box[1] : box[3], box[0] : box[2]] = True
    grey = pixels.mean(axis=2, keepdims=True) * 0.35 + 40
    pixels[~inside] = np.broadcast_to(grey, pixels.shape)[~inside]
    result = Image.fromarray(pixels.round().astype(np.uint8))
    ImageDraw.Draw(result).rectangle(
        (box[0], box[1], box[2] - 1, box[3] - 1), outline=UNSCORED_FRAME, width=max(1, round(max(image.size) / 400))
    )
    return result


def mask_image(normalised_map: np.ndarray, threshold: float = MODEL_THRESHOLD) -> Image.Image:
    """Binary mask (white = anomalous) as an 8-bit image."""
    return Image.fromarray(((normalised_map >= threshold) * 255).astype(np.uint8), mode="L")


def figure(
    image: Image.Image,
    normalised_map: np.ndarray,
    result: VerdictLike,
    label: str | None = None,
    title: str | None = None,
    scored: tuple[int, int, int, int] | None = None,
) -> Image.Image:
    """Band (verdict, score, area, ``label``), original | overlay, colour bar: one picture to look at.

    Args:
        image: the picture.
        normalised_map: ``(H, W)`` normalised scores at the image's size.
        result: the image's verdict (score, verdict, threshold, anomalous area).
        label: e.g. the random-weights warning, written in the band, never over the picture.
        title: e.g. the file name, written in the band (shortened from the left when long).
        scored: the box the model scored (a region of interest), as for :func:`overlay`.

    Images under :data:`MIN_PANEL` pixels wide are enlarged for the picture (whole factors), so
    that the band's text fits and a small defect stays visible.
    """
    if image.width < MIN_PANEL:
        factor = -(-MIN_PANEL // image.width)
        image, normalised_map = _enlarged(image, normalised_map)
        scored = (
            None if scored is None else (scored[0] * factor, scored[1] * factor, scored[2] * factor, scored[3] * factor)
        )
    width, height = image.size
    gap = max(4, width // 80)
    total = 2 * width + gap
    font = _font(max(11, min(28, total // 55)))
    line = _text_size(font, "Ag")[1]
    pad = line // 2
    band, bar = line * 2 + 3 * pad, line * 2 + 3 * pad
    canvas = Image.new("RGB", (total, band + height + bar), BAND_COLOUR)
    draw = ImageDraw.Draw(canvas)
    _draw_band(draw, font, result, label, title, total, line, pad)
    canvas.paste(image.convert("RGB"), (0, band))
    canvas.paste(overlay(image, normalised_map, result.threshold, scored=scored), (width + gap, band))
    # colour bar under the overlay's half: the ramp, the threshold tick and the image's score
    _draw_colour_bar(canvas, draw, font, result, width + gap + pad, total - pad, band + height + pad, line, pad)
    return canvas


def _enlarged(image: Image.Image, normalised_map: np.ndarray) -> tuple[Image.Image, np.ndarray]:
    """The image and its ``(H, W)`` map enlarged by a whole factor to at least :data:`MIN_PANEL` wide."""
    factor = -(-MIN_PANEL // image.width)
    size = (image.width * factor, image.height * factor)
    enlarged = np.asarray(
        Image.fromarray(np.asarray(normalised_map, dtype=np.float32), mode="F").resize(size, Image.Resampling.BILINEAR),
        dtype=np.float64,
    )
    return image.convert("RGB").resize(size, Image.Resampling.BILINEAR), enlarged


def _draw_band(
    draw: ImageDraw.ImageDraw,
    font,
    result: VerdictLike,
    label: str | None,
    title: str | None,
    total: int,
    line: int,
    pad: int,
) -> None:
    """The band above the picture: verdict, score, threshold and area; then the title, and the label at the right."""
    verdict_text = "ANOMALOUS" if result.is_anomaly else "NORMAL"
    draw.text((pad, pad), verdict_text, font=font, fill=ANOMALOUS_COLOUR if result.is_anomaly else NORMAL_COLOUR)
    x = pad + _text_size(font, verdict_text + "  ")[0]
    draw.text(
        (x, pad),
        f"score {result.score:.3f}   threshold {result.threshold:.2f}   area {100 * result.anomalous_area:.1f}%",
        font=font,
        fill=TEXT_COLOUR,
    )
    second = 2 * pad + line
    room = total - 2 * pad
    if label:
        room -= _text_size(font, label)[0] + 2 * pad
        draw.text((total - pad - _text_size(font, label)[0], second), label, font=font, fill=LABEL_COLOUR)
    if title:
        while len(title) > 1 and _text_size(font, title)[0] > room:
            title = "…" + title[max(2, len(title) // 10) :]
        draw.text((pad, second), title, font=font, fill=(170, 170, 170))


def _draw_colour_bar(
    canvas: Image.Image,
    draw: ImageDraw.ImageDraw,
    font,
    result: VerdictLike,
    left: int,
    right: int,
    top: int,
    line: int,
    pad: int,
) -> None:
    """The colour ramp from ``left`` to ``right``, the threshold's tick and label, and a marker at the score."""
    ramp = colorize(np.linspace(0.0, 1.0, max(2, right - left))[None, :].repeat(line // 2 + 2, axis=0))
    canvas.paste(Image.fromarray(ramp), (left, top))
    bottom = top + ramp.shape[0]

    def at(value: float) -> int:
        return left + round(float(np.clip(value, 0.0, 1.0)) * (right - left - 1))

    tx = at(result.threshold)
    draw.line((tx, top - pad // 2, tx, bottom + pad // 2), fill=(255, 255, 255), width=2)
    sx = at(result.score)
    size = max(4, line // 3)
    draw.polygon(
        [(sx, bottom), (sx - size, bottom + size + 2), (sx + size, bottom + size + 2)],
        fill=ANOMALOUS_COLOUR if result.is_anomaly else NORMAL_COLOUR,
    )
    text_y = bottom + size + 3
    draw.text((left, text_y), "0", font=font, fill=TEXT_COLOUR)
    marker = f"threshold {result.threshold:.2f}"
    marker_x = min(max(left, tx - _text_size(font, marker)[0] // 2), right - _text_size(font, marker)[0])
    draw.text((marker_x, text_y), marker, font=font, fill=TEXT_COLOUR)
    draw.text((right - _text_size(font, "1")[0], text_y), "1", font=font, fill=TEXT_COLOUR)
    draw.text((pad, top), "original", font=font, fill=(170, 170, 170))


def _outline(region: np.ndarray, width: int) -> Image.Image:
    """``(H, W)`` boolean region -> an ``L`` image, 255 on its border (``width`` pixels outside, one inside)."""
    inside = Image.fromarray(region.astype(np.uint8) * 255, mode="L")
    grown = np.asarray(inside.filter(ImageFilter.MaxFilter(2 * width + 1))) > 0
    shrunk = np.asarray(inside.filter(ImageFilter.MinFilter(3))) > 0
    return Image.fromarray((grown & ~shrunk).astype(np.uint8) * 255, mode="L")


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the bitmap font
        return ImageFont.load_default()


def _text_size(font, text: str) -> tuple[int, int]:
    box = ImageDraw.Draw(Image.new("L", (1, 1))).textbbox((0, 0), text, font=font)
    return round(box[2] - box[0]), round(box[3] - box[1])
