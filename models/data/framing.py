"""Which part of a picture the model sees, and where its map lies on the picture.

A picture of ``W x H`` pixels (as seen: EXIF orientation applied) becomes the model input of
``S x S`` pixels (``H_in x W_in`` for a tiled model: its tiles together, :mod:`padim.core.tiling`)
in two steps, the same at fit and at scoring:

1. the **region of interest** (``roi``: ``x, y, width, height`` in the picture's pixels; default
   the whole picture) is cut out;
2. the region becomes the input's shape (``resize``; "square" below: a rectangle of the input's
   aspect ratio when tiled):

   - ``squash`` (default; what padim always did): the region is resized to ``S x S``, its
     aspect ratio lost;
   - ``crop``: the largest centred square of the region is resized to ``S x S`` (the rest of
     the region is not scored);
   - ``pad``: the region is centred on a square of its longer side, filled with the ImageNet
     mean colour (zero after normalisation), and resized to ``S x S``.

:meth:`Framing.to_picture` takes a map of the model input back to the picture: the map is
resized onto the square's place on the picture and cut to the region; pixels outside the scored
box (outside the region, or outside the square with ``crop``) are 0. :meth:`Framing.scored_box`
is that box, which heat maps mark.

A JPEG decoded at a reduced scale (:func:`padim.models.data.images.open_image`, ``draft_to``)
carries its picture's full size in ``image.info[PICTURE_SIZE]``: the region is given in the
picture's pixels and scaled to the decoded image here.

NumPy and Pillow only on the image side (decode threads), torch for maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from padim.models.choices import RESIZES as RESIZES  # re-exported: the framings this module makes
from padim.models.errors import ImageError

#: ``image.info`` key of a decoded image's picture size ``(W, H)`` when it was decoded smaller (JPEG draft).
PICTURE_SIZE = "padim.picture_size"
#: Fill of ``pad``: the ImageNet mean colour, 0 after normalisation.
PAD_FILL = (124, 116, 104)

Box = tuple[float, float, float, float]  # (left, top, right, bottom), pixels


@dataclass(frozen=True)
class Framing:
    """Region of interest and resize mode of a model with input side ``size``.

    Attributes:
        roi: ``(x, y, width, height)`` in picture pixels, or ``None`` for the whole picture.
        resize: one of :data:`RESIZES`.
        size: side ``S`` of the model input (of a tile, when tiled).
        tiled_shape: ``(H_in, W_in)`` of a tiled model's input, ``None`` for ``(S, S)``.
    """

    roi: tuple[int, int, int, int] | None = None
    resize: str = "squash"
    size: int = 224
    tiled_shape: tuple[int, int] | None = None

    @classmethod
    def of(cls, config) -> Framing:
        """The framing of a :class:`~padim.models.config.PadimConfig`."""
        shape = config.input_shape
        return cls(
            config.framing.roi,
            config.framing.resize,
            config.features.image_size,
            None if shape == (config.features.image_size,) * 2 else shape,
        )

    @property
    def input_shape(self) -> tuple[int, int]:
        """``(height, width)`` of the model input."""
        return self.tiled_shape or (self.size, self.size)

    @property
    def is_whole_picture(self) -> bool:
        """No region and ``squash``: the picture is resized as a whole, as padim always did."""
        return self.roi is None and self.resize == "squash"

    # ------------------------------------------------------------------ geometry, in picture pixels
    def region(self, width: int, height: int, name: str = "image") -> tuple[int, int, int, int]:
        """``(left, top, right, bottom)`` of the region of a ``width x height`` picture.

        Raises:
            ImageError: the region does not lie inside the picture.
        """
        if self.roi is None:
            return 0, 0, width, height
        x, y, w, h = self.roi
        if x + w > width or y + h > height:
            raise ImageError(
                name,
                f"the model's region of interest x={x}, y={y}, {w}x{h} does not lie inside this "
                f"{width}x{height} picture (the model was fitted on pictures that hold it)",
            )
        return x, y, x + w, y + h

    def square(self, width: int, height: int, name: str = "image") -> tuple[int, int, int, int]:
        """The picture box that becomes the model input (beyond the picture with ``pad``): the region
        (``squash``), or the largest box of the input's aspect ratio inside it (``crop``), or the
        smallest around it (``pad``), centred."""
        left, top, right, bottom = self.region(width, height, name)
        w, h = right - left, bottom - top
        box_w, box_h = self._box(w, h)
        left, top = left + (w - box_w) // 2, top + (h - box_h) // 2  # floor division: a pad offset is negative
        return left, top, left + box_w, top + box_h

    def _box(self, w: int, h: int) -> tuple[int, int]:
        """``(width, height)`` of the input-shaped box of a ``w x h`` region."""
        in_h, in_w = self.input_shape
        if self.resize == "squash" or w * in_h == h * in_w:
            return w, h
        wider = w * in_h > h * in_w  # the region is wider than the input
        if wider == (self.resize == "crop"):  # keep the height
            return max(1, round(h * in_w / in_h)), h
        return w, max(1, round(w * in_h / in_w))

    def scored_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """``(left, top, right, bottom)``: the picture pixels a map covers (the region; its square with crop)."""
        region, square = self.region(width, height), self.square(width, height)
        return (
            max(region[0], square[0]),
            max(region[1], square[1]),
            min(region[2], square[2]),
            min(region[3], square[3]),
        )

    def shown_box(
        self, width: int, height: int, picture: tuple[int, int] | None = None
    ) -> tuple[int, int, int, int] | None:
        """:meth:`scored_box` on a ``width x height`` view of the picture (``picture``: its own size), or
        ``None`` when the whole picture is scored (nothing to mark)."""
        picture = picture or (width, height)
        box = self.scored_box(*picture)
        if box == (0, 0, picture[0], picture[1]):
            return None
        sx, sy = width / picture[0], height / picture[1]
        return round(box[0] * sx), round(box[1] * sy), round(box[2] * sx), round(box[3] * sy)

    # ------------------------------------------------------------------ images
    def to_square(self, image: Image.Image, name: str = "image") -> Image.Image:
        """A decoded picture -> its ``S x S`` (``W_in x H_in``) model input: the region cut out, made square,
        resized (bilinear)."""
        return self._framed(image, Image.Resampling.BILINEAR, PAD_FILL, name)

    def to_square_mask(self, mask: Image.Image) -> np.ndarray:
        """A ground-truth mask of the picture (defect where above 127) -> ``(S, S)`` (``(H_in, W_in)``) bool on
        the model input (nearest)."""
        mask = mask.convert("L").point(lambda v: 255 if v > 127 else 0)
        return np.asarray(self._framed(mask, Image.Resampling.NEAREST, 0)) > 0

    def _framed(self, image: Image.Image, resample, fill, name: str = "image") -> Image.Image:
        size = self.input_shape[::-1]  # (W_in, H_in)
        if self.is_whole_picture:
            return image.resize(size, resample)
        picture: tuple[int, int] = image.info.get(PICTURE_SIZE, image.size)
        sx, sy = image.width / picture[0], image.height / picture[1]  # decoded / picture (JPEG draft)

        def scaled(box):
            return round(box[0] * sx), round(box[1] * sy), round(box[2] * sx), round(box[3] * sy)

        region = self.region(*picture, name)
        box = self.square(*picture, name)
        if self.resize != "pad" or box == region:
            return image.crop(scaled(box)).resize(size, resample)
        part = image.crop(scaled(region))
        if self.tiled_shape is None:  # a square of the part's longer side
            box_w = box_h = max(part.size)
        else:
            box_w, box_h = (
                max(part.width, round((box[2] - box[0]) * sx)),
                max(part.height, round((box[3] - box[1]) * sy)),
            )
        canvas = Image.new(image.mode, (box_w, box_h), fill)
        canvas.paste(part, ((canvas.width - part.width) // 2, (canvas.height - part.height) // 2))
        return canvas.resize(size, resample)

    # ------------------------------------------------------------------ maps
    def to_picture(
        self, anomaly_map: torch.Tensor, width: int, height: int, picture: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """An ``(S, S)`` (``(H_in, W_in)``) map of the model input -> ``(height, width)``: the picture's map, 0
        outside the scored box.

        Args:
            width, height: the map's size (the picture's, or a picture shown smaller).
            picture: the picture's own ``(W, H)`` when the map is wanted at another size (default:
                ``(width, height)``).
        """
        if self.is_whole_picture:
            return _bilinear(anomaly_map, height, width)
        picture = picture or (width, height)
        sx, sy = width / picture[0], height / picture[1]
        left, top, right, bottom = self.square(*picture)
        box = (left * sx, top * sy, right * sx, bottom * sy)
        bw, bh = max(1, round(box[2] - box[0])), max(1, round(box[3] - box[1]))
        placed = _bilinear(anomaly_map, bh, bw)  # the square at its size on the output
        out = torch.zeros((height, width), dtype=anomaly_map.dtype)
        s_left, s_top, s_right, s_bottom = self.scored_box(*picture)
        x0, y0 = round(s_left * sx), round(s_top * sy)
        x1, y1 = min(width, round(s_right * sx)), min(height, round(s_bottom * sy))
        ox, oy = round(box[0]), round(box[1])  # where the square's first pixel lands
        x1, y1 = min(x1, ox + bw), min(y1, oy + bh)
        if x1 > x0 and y1 > y0:
            out[y0:y1, x0:x1] = placed[y0 - oy : y1 - oy, x0 - ox : x1 - ox]
        return out

    def describe(self) -> dict:
        """What a client of an export does before the graph, in words and values."""
        steps = (
            "the whole picture"
            if self.roi is None
            else f"the region x={self.roi[0]}, y={self.roi[1]}, {self.roi[2]}x{self.roi[3]} pixels of the picture"
        )
        h, w = self.input_shape
        shape = "square" if h == w else f"{w}:{h} box"
        how = {
            "squash": f"resized to {w}x{h} (aspect ratio not kept)",
            "crop": f"its largest centred {shape} resized to {w}x{h}",
            "pad": (
                "centred on a square of its longer side" if h == w else f"centred on the smallest {shape} around it"
            )
            + f" filled with RGB {PAD_FILL}, resized to {w}x{h}",
        }[self.resize]
        return {
            "roi": None if self.roi is None else list(self.roi),
            "resize": self.resize,
            "steps": f"{steps}, {how}, bilinear with antialiasing (PIL Image.resize, BILINEAR)",
        }


def _bilinear(anomaly_map: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return F.interpolate(anomaly_map[None, None], size=(height, width), mode="bilinear", align_corners=False)[0, 0]
