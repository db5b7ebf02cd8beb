"""Generated data sets with synthetic defects, in the MVTec AD layout.

For demos, tests and benchmarks that must run offline. A *texture* category (:data:`TEXTURES`)
is stationary, with natural variation between images (phase, period, brightness, noise); an
*object* category (:data:`OBJECTS`) is one placed part on a background, at nearly the same place
and angle in every picture, with its own variation (print, finish, small shifts). Defects
(:data:`DEFECTS`, and the smaller or thinner :data:`MORE_DEFECTS`) are drawn on top, and their
masks are written as ``ground_truth/<defect>/<stem>_mask.png``::

    OUT/<category>/train/good/000.png
    OUT/<category>/test/good/000.png
    OUT/<category>/test/<defect>/000.png
    OUT/<category>/ground_truth/<defect>/000_mask.png

**Regions.** ``region=r`` draws pictures from another region of the same material (another roll,
another lot) or, for a placed part, another placement: every parameter the generator draws
uniformly (period, phase, tint, relief, the part's shift and turn, ...) is drawn from its range
moved by ``r / 2`` of its width. Region 0 is the default; region 1 overlaps it by half: a mild,
systematic change of the kind a line meets, that the pictures of region 0 never show.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

TEXTURES = ("weave", "carpet", "tiles", "leather", "wood")
OBJECTS = ("pill", "nut", "board")
CATEGORIES = TEXTURES + OBJECTS
#: The defects :func:`generate` draws unless told otherwise.
DEFECTS = ("scratch", "stain", "hole")
#: Harder ones: a thin branching ``crack`` and a ``speck`` of 0.03-0.15% of the picture's area.
MORE_DEFECTS = ("crack", "speck")


class _Region:
    """``rng`` whose uniform draws come from their range moved by ``region / 2`` of its width (module docstring)."""

    def __init__(self, rng: np.random.Generator, region: float):
        self.rng, self.region = rng, region

    def uniform(self, low=0.0, high=1.0, size=None):
        shift = 0.5 * self.region * (np.asarray(high) - np.asarray(low))
        return self.rng.uniform(low + shift, high + shift, size)

    def __getattr__(self, name):  # normal, integers, choice: as drawn
        return getattr(self.rng, name)


def texture(category: str, size: int, rng: np.random.Generator, region: float = 0.0) -> np.ndarray:
    """A normal ``(size, size, 3)`` float image in ``[0, 1]`` (of another region of the material for ``region`` > 0)."""
    if region:
        rng = cast(np.random.Generator, _Region(rng, region))  # draws as a Generator does
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
        bend = sum(
            rng.uniform(0.002, 0.006) * np.sin(2 * np.pi * (rng.uniform(1, 3) * y + rng.uniform(0, 1)))
            for _ in range(3)
        )
        rings = np.sin(2 * np.pi * (radius + bend) / rng.uniform(0.045, 0.055))
        base = 0.55 + 0.12 * rings + 0.05 * np.sin(2 * np.pi * 37 * y + rng.uniform(0, 2 * np.pi))
        tint = np.array([0.78, 0.55, 0.33]) * rng.uniform(0.95, 1.05)
    elif category in OBJECTS:
        return _placed_part(category, size, rng)
    else:
        raise ValueError(f"unknown category {category!r}; choose one of: {', '.join(CATEGORIES)}")
    image = base[..., None] * tint[None, None, :] * 1.3
    image += rng.normal(0, 0.03, size=image.shape)
    return np.clip(image, 0, 1)


def _placed_part(category: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """One part on a plain background, shifted by up to 2% and turned by up to 3 degrees."""
    scale = 4  # drawn at 4x and reduced: smooth edges
    big = size * scale
    background = {"pill": (38, 40, 46), "nut": (24, 26, 30), "board": (205, 205, 200)}[category]
    canvas = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(canvas)
    c = big / 2
    if category == "pill":  # a capsule: two halves of different colour, a printed band of specks
        rx, ry = big * rng.uniform(0.33, 0.35), big * rng.uniform(0.15, 0.16)
        left, right = (214, 70, 60), tuple(int(v * rng.uniform(0.96, 1.0)) for v in (236, 232, 222))
        draw.rounded_rectangle([c - rx, c - ry, c + rx, c + ry], radius=ry, fill=right)
        draw.rounded_rectangle([c - rx, c - ry, c, c + ry], radius=ry, fill=left)
        draw.rectangle([c - ry * 1.01, c - ry, c, c + ry], fill=left)
        print_rng = getattr(rng, "rng", rng)  # the print sits on the part in every placement
        for _ in range(int(rng.integers(10, 18))):
            x, y = c + print_rng.uniform(0.15, 0.9) * rx, c + print_rng.uniform(-0.7, 0.7) * ry
            r = big * rng.uniform(0.004, 0.008)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=(150, 60, 50))
    elif category == "nut":  # a hexagonal nut: flat faces, a bore, a chamfer ring
        outer, bore = big * rng.uniform(0.36, 0.37), big * rng.uniform(0.15, 0.155)
        grey = int(rng.uniform(150, 165))
        corners = [(c + outer * np.cos(a), c + outer * np.sin(a)) for a in np.pi / 3 * np.arange(6) + np.pi / 6]
        draw.polygon(corners, fill=(grey, grey, grey + 6))
        ring = outer * 0.86
        draw.ellipse([c - ring, c - ring, c + ring, c + ring], outline=(grey - 35,) * 3, width=max(1, big // 150))
        draw.ellipse([c - bore * 1.2, c - bore * 1.2, c + bore * 1.2, c + bore * 1.2], fill=(grey - 50,) * 3)
        draw.ellipse([c - bore, c - bore, c + bore, c + bore], fill=background)
    else:  # board: a placed circuit board with components and traces at fixed places
        half = big * 0.4
        draw.rectangle([c - half, c - half, c + half, c + half], fill=(30, int(rng.uniform(105, 120)), 55))
        copper = (190, 150, 70)
        for k in range(5):
            y = c - half * 0.8 + k * half * 0.4
            draw.line([(c - half * 0.9, y), (c + half * 0.9, y)], fill=copper, width=max(1, big // 120))
        for x, y, w, h in [
            (-0.6, -0.6, 0.5, 0.3),
            (0.1, -0.55, 0.45, 0.45),
            (-0.55, 0.15, 0.3, 0.55),
            (0.2, 0.3, 0.5, 0.2),
        ]:
            draw.rectangle([c + x * half, c + y * half, c + (x + w) * half, c + (y + h) * half], fill=(20, 20, 24))
        for k in range(6):
            x = c + (-0.7 + 0.28 * k) * half
            draw.ellipse(
                [x - big * 0.012, c + 0.75 * half - big * 0.012, x + big * 0.012, c + 0.75 * half + big * 0.012],
                fill=(225, 225, 215),
            )
    shift = rng.uniform(-0.02, 0.02, size=2) * big
    canvas = canvas.rotate(
        float(rng.uniform(-3, 3)), resample=Image.Resampling.BILINEAR, translate=tuple(shift), fillcolor=background
    )
    image = np.asarray(canvas.resize((size, size), Image.Resampling.LANCZOS), dtype=np.float64) / 255.0
    image = image * rng.uniform(0.96, 1.04) + rng.normal(0, 0.02, size=image.shape)
    return np.clip(image, 0, 1)


def _smooth_noise(size: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """White noise blurred by a Gaussian of ``sigma`` pixels, scaled to zero mean and unit spread."""
    rng = getattr(rng, "rng", rng)  # white noise is white noise in every region
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
    elif defect == "crack":  # a jagged line with a branch, one or two pixels wide
        cx, cy = rng.uniform(0.35, 0.65, size=2) * size
        points = [(cx, cy)]
        angle = rng.uniform(0, 2 * np.pi)
        for _ in range(int(rng.integers(5, 9))):
            angle += rng.uniform(-0.7, 0.7)
            step = rng.uniform(0.02, 0.04) * size
            points.append((points[-1][0] + np.cos(angle) * step, points[-1][1] + np.sin(angle) * step))
        width = max(1, size // 150)
        draw.line(points, fill=255, width=width)
        fork = points[len(points) // 2]
        draw.line(
            [fork, (fork[0] + rng.uniform(-0.06, 0.06) * size, fork[1] + rng.uniform(-0.06, 0.06) * size)],
            fill=255,
            width=width,
        )
        colour = np.array([0.05, 0.04, 0.04])
        alpha = np.asarray(mask_img, dtype=np.float64) / 255.0 * 0.85
    elif defect == "speck":  # a small spot of foreign material, bright or dark
        cx, cy = rng.uniform(0.35, 0.65, size=2) * size
        r = rng.uniform(0.01, 0.022) * size
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        colour = np.array([0.9, 0.85, 0.3]) if rng.random() < 0.5 else np.array([0.1, 0.12, 0.3])
        alpha = np.asarray(mask_img, dtype=np.float64) / 255.0
    else:
        raise ValueError(f"unknown defect {defect!r}; choose one of: {', '.join(DEFECTS + MORE_DEFECTS)}")
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
    defects: tuple[str, ...] = DEFECTS,
    region: float = 0.0,
) -> list[Path]:
    """Write an MVTec-layout data set; returns the category directories.

    ``test_defect`` pictures of each of ``defects`` (:data:`DEFECTS`, :data:`MORE_DEFECTS`) per category.
    ``region``: every picture from another region of the material (module docstring); the same ``seed`` then
    draws the same noise and defects.
    """
    root = Path(root)
    written = []
    for c, category in enumerate(categories):
        rng = np.random.default_rng([seed, c])
        base = root / category
        for i in range(train):
            _save(texture(category, size, rng, region), base / "train" / "good" / f"{i:03d}.png")
        for i in range(test_good):
            _save(texture(category, size, rng, region), base / "test" / "good" / f"{i:03d}.png")
        for defect in defects:
            for i in range(test_defect):
                image, mask = add_defect(texture(category, size, rng, region), defect, rng)
                _save(image, base / "test" / defect / f"{i:03d}.png")
                mask_path = base / "ground_truth" / defect / f"{i:03d}_mask.png"
                mask_path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(mask.astype(np.uint8) * 255).save(mask_path)
        written.append(base)
    return written
