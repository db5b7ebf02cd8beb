"""Pictures in, model input out: decoding on a pool of threads, within a budget of decoded pixels.

The full-size picture lives only inside :meth:`Decoder.decode`; what leaves is the model input and, when a heat map
or a mask was asked for, a copy bounded to ``PADIM_HEATMAP_MAX_SIDE`` to draw on.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from padim.models.data.framing import PICTURE_SIZE
from padim.models.data.images import bounded_copy, bounded_size, decode_side, image_dimensions, open_image
from padim.models.errors import ImageError

from .errors import api_error

#: After decoding an image at least this large, freed memory is handed back to the system at once.
TRIM_AFTER_PIXELS = 4_000_000


class PixelBudget:
    """At most ``capacity`` decoded pixels in flight across the decode threads.

    A thread waits (outside the event loop) until its image fits; an image larger than the
    budget waits until it is alone. Decode memory is then about ``capacity`` x 4 bytes (Pillow
    keeps RGB as 4 bytes a pixel) plus one conversion copy, whatever the number of requests.
    """

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        pixels = min(pixels, self.capacity)
        with self._changed:
            self._changed.wait_for(lambda: self.used + pixels <= self.capacity)
            self.used += pixels
        try:
            yield
        finally:
            with self._changed:
                self.used -= pixels
                self._changed.notify_all()


def _find_malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; absent on musl and macOS
    except (AttributeError, OSError):
        return None


_MALLOC_TRIM = _find_malloc_trim()


def release_memory() -> None:
    """Give freed heap memory back to the system now (glibc ``malloc_trim``; a no-op elsewhere).

    glibc serves large blocks from its heaps once a block of that size has been freed, so the
    memory of decoded large images would otherwise stay with the process after a burst.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class Decoded:
    """One request image, decoded: its model input and, when asked for, a bounded copy to draw on."""

    tensor: torch.Tensor  # (3, H_in, W_in) model input
    shown: Image.Image | None  # at most heatmap_max_side a side; None unless a heat map was asked for
    shown_size: tuple[int, int]  # (width, height) of heat maps and masks
    large: bool  # decoded from at least TRIM_AFTER_PIXELS: hand freed memory back once done with it
    picture: tuple[int, int] = (0, 0)  # (width, height) of the picture as sent (EXIF orientation applied)


class Decoder:
    """Decodes request pictures for a scorer (anything with ``config`` and ``preprocess``, or a view of one).

    Args:
        threads: decoding threads (``PADIM_DECODE_WORKERS``).
        pixel_budget: decoded pixels in flight at once.
        max_image_pixels: larger pictures are refused (413).
        heatmap_max_side: the bound of the copy kept to draw heat maps on.
    """

    def __init__(self, threads: int, pixel_budget: int, max_image_pixels: int, heatmap_max_side: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="decode")
        self.pixels = PixelBudget(pixel_budget)
        self.max_image_pixels, self.heatmap_max_side = max_image_pixels, heatmap_max_side

    def decode(self, scorer, data: bytes, keep_image: bool, out: torch.Tensor | None = None) -> Decoded:
        """Runs on the pool: bytes -> model input, written into ``out`` when given (a shared-memory slot).

        Raises:
            ApiError: 413 when too large, 422 when not a picture the model can read.
        """
        limits = {"max_pixels": self.max_image_pixels, "limit_name": "PADIM_MAX_IMAGE_PIXELS"}
        config = scorer.config
        try:
            width, height = image_dimensions(data, **limits)
            with self.pixels.hold(width * height):
                image = open_image(data, draft_to=decode_side(config.input_shape), roi=config.framing.roi, **limits)
                picture = image.info.get(PICTURE_SIZE, image.size)
                tensor = scorer.preprocess([image])[0]
                shown = bounded_copy(image, self.heatmap_max_side) if keep_image else None
                shown_size = bounded_size(image.size, self.heatmap_max_side)
                del image
        except ImageError as error:  # 413 when too large, 422 otherwise (padim.models.errors.OUTCOMES)
            raise api_error(error) from None
        if out is not None:
            np.copyto(out.numpy(), tensor.numpy())  # NumPy: no torch op (and its OpenMP team) on a decode thread
            tensor = out
        large = width * height >= TRIM_AFTER_PIXELS
        if large:
            release_memory()
        return Decoded(tensor, shown, shown_size, large, picture)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
