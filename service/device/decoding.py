"""Pictures in, model input out: decoding on a pool of threads, within a budget of decoded pixels.

The full-size picture lives only inside :meth:`Decoder.decode`; what leaves is the model input and, when a heat map
or a mask was asked for, a copy bounded to ``PADIM_HEATMAP_MAX_SIDE`` to draw on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from padim.models.data.framing import PICTURE_SIZE
from padim.models.data.images import bounded_copy, bounded_size, decode_side, image_dimensions, open_image
from padim.models.errors import ImageError, ImageTooLarge

from ..edge.errors import api_error
from .device_decoding import DeviceDecode

#: After decoding an image at least this large, freed memory is handed back to the system at once.
TRIM_AFTER_PIXELS = 4_000_000
#: A picture of at most this many bytes and pixels is decoded on the event loop: a hop to a decoding thread and back
#: (about 0.16 ms on the 2-core machine) costs more than decoding it (0.4 ms for a 64 px PNG of 12 KB).
INLINE_BYTES = 32 * 1024
INLINE_PIXELS = 256 * 256


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
    """One request image, decoded: its model input and, when asked for, a bounded copy to draw on; or, for the
    scoring device to decode (:mod:`padim.service.device.device_decoding`), the JPEG's bytes."""

    tensor: torch.Tensor | None  # (3, H_in, W_in) model input; None when the device decodes it
    shown: Image.Image | None  # at most heatmap_max_side a side; None unless a heat map was asked for
    shown_size: tuple[int, int]  # (width, height) of heat maps and masks
    large: bool  # decoded from at least TRIM_AFTER_PIXELS: hand freed memory back once done with it
    picture: tuple[int, int] = (0, 0)  # (width, height) of the picture as sent (EXIF orientation applied)
    jpeg: bytes | None = None  # the JPEG itself, when the scoring device decodes it


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

    async def decoded(
        self,
        scorer,
        data: bytes,
        keep_image: bool,
        out: torch.Tensor | None = None,
        device: DeviceDecode | None = None,
    ) -> Decoded:
        """:meth:`decode` where it costs least: a JPEG the scoring ``device`` takes is left to it (its header read);
        on the event loop for a small picture (at most :data:`INLINE_BYTES` and :data:`INLINE_PIXELS`; one at a time
        there, outside the pixel budget), else on the pool."""
        if device is not None and not keep_image:
            picture = device.takes(data, self.max_image_pixels)
            if picture is not None:
                return Decoded(None, None, bounded_size(picture, self.heatmap_max_side), False, picture, jpeg=data)
        if len(data) <= INLINE_BYTES and not keep_image:
            limits = {"max_pixels": INLINE_PIXELS, "limit_name": "PADIM_MAX_IMAGE_PIXELS"}
            try:
                return self._decoded(scorer, data, keep_image, out, limits, contextlib.nullcontext())
            except ImageTooLarge:  # a small body of many pixels (flat areas compress well): the pool's
                pass
            except ImageError as error:
                raise api_error(error) from None
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.decode, scorer, data, keep_image, out)

    def decode(self, scorer, data: bytes, keep_image: bool, out: torch.Tensor | None = None) -> Decoded:
        """Runs on the pool: bytes -> model input, written into ``out`` when given (a shared-memory slot), within
        the pixel budget. The full-size picture lives only inside this call.

        Raises:
            ApiError: 413 when too large, 422 when not a picture the model can read.
        """
        limits: dict[str, Any] = {"max_pixels": self.max_image_pixels, "limit_name": "PADIM_MAX_IMAGE_PIXELS"}
        try:
            width, height = image_dimensions(data, **limits)
            return self._decoded(scorer, data, keep_image, out, limits, self.pixels.hold(width * height))
        except ImageError as error:  # 413 when too large, 422 otherwise (padim.models.errors.OUTCOMES)
            raise api_error(error) from None

    def _decoded(self, scorer, data: bytes, keep_image: bool, out, limits: dict, held) -> Decoded:
        config = scorer.config
        with held:
            image = open_image(data, draft_to=decode_side(config.input_shape), roi=config.framing.roi, **limits)
            picture = image.info.get(PICTURE_SIZE, image.size)
            pixels = picture[0] * picture[1]
            tensor = scorer.preprocess([image])[0]
            shown = bounded_copy(image, self.heatmap_max_side) if keep_image else None
            shown_size = bounded_size(image.size, self.heatmap_max_side)
            del image
        if out is not None:
            np.copyto(out.numpy(), tensor.numpy())  # NumPy: no torch op (and its OpenMP team) on a decode thread
            tensor = out
        large = pixels >= TRIM_AFTER_PIXELS
        if large:
            release_memory()
        return Decoded(tensor, shown, shown_size, large, picture)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
