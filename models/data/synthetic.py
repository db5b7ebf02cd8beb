"""Generated texture data sets with synthetic defects, in the MVTec AD layout.

For demos, tests and benchmarks that must run offline. Each category is a stationary texture
with natural variation between images (phase, period, brightness, noise); defects are drawn on
top, and their masks are written as ``ground_truth/<defect>/<stem>_mask.png``::

    OUT/<category>/train/good/000.png
    OUT/<category>/test/good/000.png
    OUT/<category>/test/<defect>/000.png
    OUT/<category>/ground_truth/<defect>/000_mask.png
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

CATEGORIES = ("weave", "carpet", "tiles", "leather", "wood")
DEFECTS = ("scratch", "stain", "hole")


def texture(category: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A normal ``(size, size, 3)`` float image in ``[0, 1]``."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) / size
    if category == "weave":
        period = rng.uniform(0.055, 0.065)
        phase = rng.uniform(0, 2 * np.pi, size=2)
        warp = np.sin(2 * np.pi * x / period + phase[0])
        weft = np.sin(2 * np.pi * y / period + phase[1])
        base = 0.5 + 0.22 * warp * weft + 0.08 * np.sign(warp * weft)
        tint = np.array([0.75, 0.68, 0.55]) * rng.uniform(0.95, 1.05)
    elif category == "carpet":
        field = np.zeros((size, size))
        for _ in range(24):
            freq = rng.uniform(6, 18, size=2) * rng.choice([-1, 1], size=2)
            field += np.sin(2 * np.pi * (freq[0] * x + freq[1] * y) + rng.uniform(0, 2 * np.pi))
        base = 0.5 + 0.06 * field
        tint = np.array([0.45, 0.5, 0.62]) * rng.uniform(0.95, 1.05)
    elif category == "tiles":
        period = rng.uniform(0.19, 0.21)
        offset = rng.uniform(0, period, size=2)
        gx = ((x + offset[0]) % period) / period
        gy = ((y + offset[1]) % period) / period
        grout = (np.minimum(gx, 1 - gx) < 0.06) | (np.minimum(gy, 1 - gy) < 0.06)
        base = np.where(grout, 0.3, 0.72)
        tint = np.array([0.8, 0.8, 0.78]) * rng.uniform(0.95, 1.05)
    elif category == "leather":
        # smooth random relief plus fine grain: blurred white noise at two scales
        coarse = _smooth_noise(size, size / 40, rng)
        fine = _smooth_noise(size, 1.2, rng)
        base = 0.45 + 0.07 * coarse + 0.035 * fine
        tint = np.array([0.62, 0.42, 0.28]) * rng.uniform(0.95, 1.05)
    elif category == "wood":
        # growth rings around a far-away centre, their phase bent by a slow random field
        centre = np.array([rng.uniform(-1.5, -0.8), rng.uniform(0.2, 0.8)])
        radius = np.hypot(x - centre[0], y - centre[1])
        bend = sum(rng.uniform(0.002, 0.006) * np.sin(2 * np.pi * (rng.uniform(1, 3) * y + rng.uniform(0, 1)))
                   for _ in range(3))
        rings = np.sin(2 * np.pi * (radius + bend) / rng.uniform(0.045, 0.055))
        base = 0.55 + 0.12 * rings + 0.05 * np.sin(2 * np.pi * 37 * y + rng.uniform(0, 2 * np.pi))
        tint = np.array([0.78, 0.55, 0.33]) * rng.uniform(0.95, 1.05)
    else:
        raise ValueError(f"unknown category {category!r}; choose one of: {', '.join(CATEGORIES)}")
    image = base[..., None] * tint[None, None, :] * 1.3
    image += rng.normal(0, 0.03, size=image.shape)
    return np.clip(image, 0, 1)


def _smooth_noise(size: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """White noise blurred by a Gaussian of ``sigma`` pixels, scaled to zero mean and unit spread."""
    noise = Image.fromarray(rng.uniform(0, 255, (size, size)).astype(np.uint8)).filter(ImageFilter.GaussianBlur(sigma))
    field = np.asarray(noise, dtype=np.float64)
    return (field - field.mean()) / max(field.std(), 1e-9)


def add_defect(image: np.ndarray, defect: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw a defect; returns the image and its boolean ``(H, W)`` mask."""
    size = image.shape[0]
    mask_img = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(mask_img)
    cx, cy = rng.uniform(0.25, 0.75, size=2) * size
    if defect == "scratch":
        angle = rng.uniform(0, np.pi)
        half = rng.uniform(0.15, 0.3) * size
        dx, dy = np.cos(angle) * half, np.sin(angle) * half
        draw.line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=255, width=max(2, size // 48))
        colour = np.array([0.95, 0.95, 0.9]) if rng.random() < 0.5 else np.array([0.08, 0.08, 0.1])
        alpha = np.asarray(mask_img, dtype=np.float64) / 255.0
    elif defect == "stain":
        rx, ry = rng.uniform(0.06, 0.12, size=2) * size
        draw.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=255)
        colour = np.array([0.45, 0.25, 0.08])
        alpha = np.asarray(mask_img.filter(ImageFilter.GaussianBlur(size / 100)), dtype=np.float64) / 255.0 * 0.8
    elif defect == "hole":
        r = rng.uniform(0.04, 0.08) * size
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        colour = np.array([0.02, 0.02, 0.02])
        alpha = np.asarray(mask_img, dtype=np.float64) / 255.0
    else:
        raise ValueError(f"unknown defect {defect!r}; choose one of: {', '.join(DEFECTS)}")
    out = image * (1 - alpha[..., None]) + colour[None, None, :] * alpha[..., None]
    return np.clip(out, 0, 1), np.asarray(mask_img) > 127


def _save(array: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((array * 255 + 0.5).astype(np.uint8)).save(path)


def generate(
    root: str | Path,
    categories: tuple[str, ...] = CATEGORIES,
    train: int = 40,
    test_good: int = 8,
    test_defect: int = 4,
    size: int = 256,
    seed: int = 0,
) -> list[Path]:
    """Write an MVTec-layout data set; returns the category directories."""
    root = Path(root)
    written = []
    for c, category in enumerate(categories):
        rng = np.random.default_rng([seed, c])
        base = root / category
        for i in range(train):
            _save(texture(category, size, rng), base / "train" / "good" / f"{i:03d}.png")
        for i in range(test_good):
            _save(texture(category, size, rng), base / "test" / "good" / f"{i:03d}.png")
        for defect in DEFECTS:
            for i in range(test_defect):
                image, mask = add_defect(texture(category, size, rng), defect, rng)
                _save(image, base / "test" / defect / f"{i:03d}.png")
                mask_path = base / "ground_truth" / defect / f"{i:03d}_mask.png"
                mask_path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(mask.astype(np.uint8) * 255).save(mask_path)
        written.append(base)
    return written
