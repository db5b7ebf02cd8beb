"""Small changes a line makes to its pictures, drawn on a picture: what ``train --expect`` declares.

A real line never shows the model its training pictures again: the lamp ages, the part sits a
pixel or two off, the lens is refocused, the camera compresses. :class:`Expected` names how far
each change may go, and :meth:`Expected.draw` draws one set of changes within it (uniformly,
seeded); :func:`apply` makes a picture look as the line would show it after those changes.

=============  ====================================================================================
change         a draw (every value uniform within the declared bound ``v``)
=============  ====================================================================================
brightness     every channel multiplied by ``1 + U(-v, v)`` (lamp, exposure)
contrast       the distance from the picture's mean grey multiplied by ``1 + U(-v, v)``
shift          moved by ``U(-v, v)`` pixels across and ``U(-v, v)`` down (placement, camera)
rotate         turned by ``U(-v, v)`` degrees about the centre
blur           Gaussian blur of sigma ``U(0, v)`` pixels (focus)
jpeg           re-encoded as JPEG at a quality ``U(v, 95)`` (``v`` is the lowest quality; 0: never)
=============  ====================================================================================

Pixels are the picture's own (a JPEG decoded at a reduced scale has its moves scaled down with
it). Moved and turned pictures are filled at their edges by reflection, as a camera would see
more of the same surface, not black corners. The changes are made in the order the light meets
them: lighting, then placement, then focus, then compression.

NumPy and Pillow only on the picture: this runs on decode threads.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, fields

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter

from padim.models.choices import EXPECT_PRESETS as PRESETS
from padim.models.data.framing import PICTURE_SIZE

#: The highest JPEG quality a ``jpeg`` change draws.
JPEG_BEST = 95
#: Largest bound of each change that ``--expect`` accepts (beyond these a picture is not "the same part").
LIMITS = {"brightness": 0.5, "contrast": 0.5, "shift": 64.0, "rotate": 10.0, "blur": 5.0, "jpeg": 95.0}


@dataclass(frozen=True)
class Draw:
    """One set of changes to make to one picture (:func:`apply`); the identity by default."""

    brightness: float = 1.0  # factor
    contrast: float = 1.0  # factor
    dx: float = 0.0  # pixels
    dy: float = 0.0
    angle: float = 0.0  # degrees, counter-clockwise
    sigma: float = 0.0  # pixels
    quality: int | None = None  # JPEG quality, None: not re-encoded


@dataclass(frozen=True)
class Expected:
    """How far each change may go on the line (0: not expected). ``str()`` gives the ``--expect`` text."""

    brightness: float = 0.0
    contrast: float = 0.0
    shift: float = 0.0
    rotate: float = 0.0
    blur: float = 0.0
    jpeg: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= LIMITS[f.name]:
                raise ValueError(
                    f"expect: {f.name}={value!r} is not allowed; use a number from 0 to "
                    f"{LIMITS[f.name]:g}{' (the lowest JPEG quality; 0: none)' if f.name == 'jpeg' else ''}"
                )
            if f.name == "jpeg" and value and value < 10:
                raise ValueError(f"expect: jpeg={value!r} is not allowed; use a JPEG quality from 10 to 95 (0: none)")

    @classmethod
    def parse(cls, text: str | None) -> Expected:
        """``"brightness=0.1,shift=2"`` or a preset name (:data:`PRESETS`); empty or ``None``: nothing expected.

        Raises:
            ValueError: an unknown change or preset, or a value out of range (the message lists what is allowed).
        """
        text = (text or "").strip()
        if text in PRESETS:
            text = PRESETS[text]
        values: dict[str, float] = {}
        names = [f.name for f in fields(cls)]
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, equals, value = part.partition("=")
            name = name.strip()
            if not equals or name not in names:
                raise ValueError(
                    f"expect: {part!r} is not a change; write NAME=VALUE with NAME one of "
                    f"{', '.join(names)}, or a preset: {', '.join(PRESETS)}"
                )
            if name in values:
                raise ValueError(f"expect: {name} is given twice")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"expect: {name}={value.strip()!r} is not a number") from None
        return cls(**values)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name):g}" for f in fields(self) if getattr(self, f.name))

    def preset(self) -> str | None:
        """The preset name this equals, if any."""
        return next((name for name, text in PRESETS.items() if Expected.parse(text) == self), None)

    def draw(self, rng: np.random.Generator) -> Draw:
        """One set of changes within the bounds, uniformly (every draw takes the same random numbers, so the
        draws of two declarations that differ in one change differ in that change alone)."""
        u = rng.uniform(-1.0, 1.0, size=5)
        unit = rng.uniform(0.0, 1.0, size=2)
        quality = None
        if self.jpeg:
            quality = int(round(self.jpeg + unit[1] * (JPEG_BEST - self.jpeg)))
        return Draw(
            brightness=1.0 + self.brightness * float(u[0]),
            contrast=1.0 + self.contrast * float(u[1]),
            dx=self.shift * float(u[2]),
            dy=self.shift * float(u[3]),
            angle=self.rotate * float(u[4]),
            sigma=self.blur * float(unit[0]),
            quality=quality,
        )


def seeded(name: str, copy: int = 0) -> np.random.Generator:
    """The random numbers of a picture's ``copy``-th changed copy, from its name alone (the same on every rank, in
    every pass, on a resume and whatever the channel seed)."""
    digest = hashlib.sha256(f"padim-expect\0{copy}\0{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "big"))


def apply(image: Image.Image, draw: Draw) -> Image.Image:
    """``image`` (8-bit RGB) as the line would show it after ``draw``'s changes; a new image."""
    out = image
    if draw.brightness != 1.0:
        out = ImageEnhance.Brightness(out).enhance(draw.brightness)
    if draw.contrast != 1.0:
        out = ImageEnhance.Contrast(out).enhance(draw.contrast)
    if draw.dx or draw.dy or draw.angle:
        full = image.info.get(PICTURE_SIZE, image.size)
        scale = image.size[0] / full[0]  # a drafted JPEG: the moves shrink with it
        out = _moved(out, draw.dx * scale, draw.dy * scale, draw.angle)
    if draw.sigma > 0:
        out = out.filter(ImageFilter.GaussianBlur(draw.sigma))
    if draw.quality is not None:
        buffer = io.BytesIO()
        out.save(buffer, format="JPEG", quality=int(draw.quality))
        buffer.seek(0)
        with Image.open(buffer) as decoded:
            out = decoded.convert("RGB")
    if out is image:
        out = image.copy()
    if PICTURE_SIZE in image.info:
        out.info[PICTURE_SIZE] = image.info[PICTURE_SIZE]
    return out


def _moved(image: Image.Image, dx: float, dy: float, angle: float) -> Image.Image:
    """Shifted by ``(dx, dy)`` and turned by ``angle`` degrees about the centre, the edges filled by reflection."""
    width, height = image.size
    reach = abs(math.sin(math.radians(angle))) * math.hypot(width, height) / 2 + math.hypot(dx, dy)
    margin = min(int(math.ceil(reach)) + 2, min(width, height) - 1)
    padded = Image.fromarray(np.pad(np.asarray(image), ((margin, margin), (margin, margin), (0, 0)), mode="reflect"))
    # the output pixel (x, y) reads the padded input at the inverse of "turn, then move"
    cx, cy = width / 2 + margin, height / 2 + margin
    theta = math.radians(angle)
    cos, sin = math.cos(theta), math.sin(theta)
    ox, oy = width / 2 + dx, height / 2 + dy  # where the picture's centre lands
    # input = R^-1 (output - centre_out) + centre_in, with y down: a counter-clockwise turn on screen
    a, b = cos, -sin
    d, e = sin, cos
    c = cx - a * ox - b * oy
    f = cy - d * ox - e * oy
    return padded.transform(
        (width, height), Image.Transform.AFFINE, (a, b, c, d, e, f), resample=Image.Resampling.BICUBIC
    )
