"""Heat maps for people: the anomaly map coloured and blended over the image."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

# Anchor colours of a perceptually ordered blue -> green -> yellow -> red ramp ("turbo"-like).
_ANCHORS = np.array(
    [[48, 18, 59], [50, 101, 212], [26, 188, 210], [92, 243, 99], [210, 233, 53],
     [251, 157, 39], [226, 68, 14], [122, 4, 3]], dtype=np.float64)


def colorize(values: np.ndarray) -> np.ndarray:
    """``(H, W)`` values in ``[0, 1]`` -> ``(H, W, 3)`` uint8 colours."""
    position = np.clip(values, 0.0, 1.0) * (len(_ANCHORS) - 1)
    low = np.floor(position).astype(int).clip(0, len(_ANCHORS) - 2)
    frac = (position - low)[..., None]
    colours = _ANCHORS[low] * (1 - frac) + _ANCHORS[low + 1] * frac
    return colours.round().astype(np.uint8)


def overlay(image: Image.Image, normalised_map: np.ndarray, alpha: float = 0.5, label: str | None = None) -> Image.Image:
    """Blend the coloured map (normalised scores, threshold at 0.5) over ``image``.

    Args:
        image: RGB image.
        normalised_map: ``(H, W)`` in ``[0, 1]`` at the image's size.
        alpha: weight of the heat map.
        label: text stamped in the corner (e.g. the random-weights demo warning).
    """
    heat = Image.fromarray(colorize(normalised_map)).resize(image.size, Image.BILINEAR)
    blended = Image.blend(image.convert("RGB"), heat, alpha)
    if label:
        draw = ImageDraw.Draw(blended)
        box = draw.textbbox((4, 4), label)
        draw.rectangle((box[0] - 2, box[1] - 2, box[2] + 2, box[3] + 2), fill=(0, 0, 0))
        draw.text((4, 4), label, fill=(255, 255, 0))
    return blended


def mask_image(normalised_map: np.ndarray, threshold: float = 0.5) -> Image.Image:
    """Binary mask (white = anomalous) as an 8-bit image."""
    return Image.fromarray(((normalised_map >= threshold) * 255).astype(np.uint8), mode="L")
