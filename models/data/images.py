"""Reading images and turning them into model input.

Every mode Pillow reads (grayscale, RGBA, palette, 16-bit, CMYK, float) becomes 8-bit RGB,
and the EXIF orientation is applied, so a photo from a phone is scored the way it is seen.

Large JPEGs are decoded at a reduced scale (Pillow's draft mode: 1/2, 1/4 or 1/8, done inside
the JPEG decoder) as long as both sides of the part the model uses (its region of interest, else
the picture) stay at least :func:`decode_side` pixels, twice the model input's longer side (all its tiles
together, when tiled). Fitting, ``padim predict`` and the service decode the same way, so they
score an image alike; other formats are decoded at full size.
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from padim.models.data.framing import PICTURE_SIZE, Framing
from padim.models.errors import ImageError as ImageError  # re-exported: raised here
from padim.models.errors import ImageTooLarge as ImageTooLarge

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
EXIF_ORIENTATION = 0x0112


def list_images(root: str | os.PathLike) -> list[Path]:
    """Every image under ``root`` (recursively), sorted; or ``[root]`` if it is an image file."""
    root = Path(root)
    if root.is_file():
        if root.suffix.lower() not in IMAGE_SUFFIXES:
            raise ImageError(str(root), f"not an image file (expected {', '.join(IMAGE_SUFFIXES)})")
        return [root]
    if not root.is_dir():
        raise ImageError(str(root), "no such file or directory")
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def decode_side(input_shape: int | tuple[int, int]) -> int:
    """Smallest side a JPEG is drafted down to for a model input of ``input_shape`` (``(H_in, W_in)``, or a
    square's side): twice the input's longer side, so that a tiled model's tiles stay as sharp as an
    untiled model's input."""
    return 2 * (max(input_shape) if isinstance(input_shape, tuple) else input_shape)


def image_dimensions(source: bytes, max_pixels: int | None = None, limit_name: str | None = None) -> tuple[int, int]:
    """``(width, height)`` from the header alone, nothing decoded.

    Raises:
        ImageTooLarge: over ``max_pixels`` (the message names the limit as ``limit_name`` when given).
        ImageError: not an image Pillow can identify.
    """
    with _opened(source, max_pixels, limit_name) as (name, image):
        _check_pixels(name, image, max_pixels, limit_name)
        return image.size


def open_image(
    source: str | os.PathLike | bytes,
    max_pixels: int | None = None,
    draft_to: int | None = None,
    limit_name: str | None = None,
    roi: tuple[int, int, int, int] | None = None,
) -> Image.Image:
    """Decode a file or bytes into an 8-bit RGB image with EXIF orientation applied.

    Args:
        max_pixels: refuse larger images before decoding them.
        draft_to: decode a JPEG at the smallest scale that keeps both sides of the part used
            (``roi``, else the picture) at least this long; the picture's own size is then in
            ``image.info[PICTURE_SIZE]`` (see :mod:`padim.models.data.framing`).
        limit_name: how the limit is named in the error (e.g. ``PADIM_MAX_IMAGE_PIXELS``).
        roi: ``(x, y, width, height)`` of the part of the picture the model uses.

    Raises:
        ImageTooLarge: larger than ``max_pixels`` (or than Pillow's own bomb limit).
        ImageError: unreadable or truncated.
    """
    with _opened(source, max_pixels, limit_name) as (name, image):
        _check_pixels(name, image, max_pixels, limit_name)
        full = image.size
        used = min(image.size) if roi is None else min(roi[2], roi[3])  # the shorter side of what is used
        if draft_to is not None and image.format == "JPEG" and used >= 2 * draft_to:
            # both picture sides scaled alike, to keep the used part's shorter side at least draft_to
            image.draft("RGB", (math.ceil(draft_to * full[0] / used), math.ceil(draft_to * full[1] / used)))
        drafted = image.size != full
        turned = image.getexif().get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8)  # a quarter turn swaps the sides
        if roi is not None:  # the picture as seen must hold the region: a clear error now, not a bad crop later
            Framing(roi).region(*((full[1], full[0]) if turned else full), name)
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # not a copy: that would double the peak memory
        rgb = to_rgb(image)
        if drafted:
            rgb.info[PICTURE_SIZE] = (full[1], full[0]) if turned else full
        return rgb


@contextmanager
def _opened(
    source: str | os.PathLike | bytes, max_pixels: int | None = None, limit_name: str | None = None
) -> Iterator[tuple[str, Image.Image]]:
    """The image with its header read, and Pillow's errors as :class:`ImageError` without object reprs."""
    name = "image" if isinstance(source, bytes) else str(source)
    try:
        handle = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")
    except OSError as error:
        raise ImageError(name, error.strerror or type(error).__name__) from None
    with handle:
        try:
            with Image.open(handle) as image:
                yield name, image
        except ImageError:
            raise
        except Image.DecompressionBombError as error:
            if max_pixels is not None:  # Pillow refuses absurd sizes before we see them: quote our limit
                raise ImageTooLarge(name, f"over the limit of {_limit(max_pixels, limit_name)} pixels") from None
            raise ImageTooLarge(name, _without_reprs(str(error))) from None
        except Image.UnidentifiedImageError:
            raise ImageError(name, "not a readable image (not a format Pillow knows, or damaged)") from None
        except (OSError, ValueError, SyntaxError) as error:
            raise ImageError(name, f"not a readable image ({_without_reprs(str(error))})") from None


def _check_pixels(name: str, image: Image.Image, max_pixels: int | None, limit_name: str | None) -> None:
    if max_pixels is not None and image.width * image.height > max_pixels:
        raise ImageTooLarge(
            name, f"{image.width}x{image.height} pixels is over the limit of {_limit(max_pixels, limit_name)} pixels"
        )


def _limit(max_pixels: int, limit_name: str | None) -> str:
    return f"{limit_name} = {max_pixels}" if limit_name else str(max_pixels)


def bounded_copy(image: Image.Image, max_side: int) -> Image.Image:
    """``image`` itself if both sides are at most ``max_side``, else a copy scaled down to fit."""
    width, height = bounded_size(image.size, max_side)
    if (width, height) == image.size:
        return image
    return image.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=2.0)


def bounded_size(size: tuple[int, int], max_side: int) -> tuple[int, int]:
    """``(width, height)`` scaled down (never up) so that neither is over ``max_side``."""
    scale = min(1.0, max_side / max(size))
    return max(1, round(size[0] * scale)), max(1, round(size[1] * scale))


def _without_reprs(message: str) -> str:
    """Pillow quotes file objects (``<_io.BytesIO object at 0x...>``); users need none of that."""
    return re.sub(r"<[^<>]*(?: object at 0x|_io\.)[^<>]*>", "the data", message)


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB from any Pillow mode; 16-bit and float images are rescaled, not clipped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image, dtype=np.float64)
        if image.mode.startswith("I;16"):
            array = array / 257.0
        else:
            low, high = float(array.min()), float(array.max())
            array = (array - low) / (high - low) * 255.0 if high > low else np.zeros_like(array)
        image = Image.fromarray(np.clip(array + 0.5, 0, 255).astype(np.uint8), mode="L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image)
    return image.convert("RGB") if image.mode != "RGB" else image


def to_pixels(images: Sequence[Image.Image], framing: Framing) -> torch.Tensor:
    """Frame each picture as the model's ``S x S`` square (region, resize mode; bilinear, antialiased):
    ``(B, 3, S, S)`` uint8, the model input as it travels (to shared memory, to the device: a quarter of
    float32's bytes); :func:`normalise` makes it what the backbone reads, where it is to be scored.

    Raises:
        ImageError: a picture does not hold the framing's region of interest.

    NumPy only until the final ``from_numpy``: this runs on decode threads beside the inference
    thread, and torch ops there would each start an OpenMP team and oversubscribe the cores.
    """
    arrays = [np.asarray(framing.to_square(image), dtype=np.uint8).transpose(2, 0, 1) for image in images]
    return torch.from_numpy(np.ascontiguousarray(np.stack(arrays)))


def normalisation_arrays(mean: Sequence[float], std: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, offset)``, ``(1, 3, 1, 1)`` float32 arrays: ``1 / (255 std)`` and ``mean / std``, each rounded to
    float32 once (:func:`normalise_array` takes them; :func:`normalisation` puts them on a device)."""
    std32 = np.asarray(std, dtype=np.float32)
    scale = (1.0 / (255.0 * std32)).astype(np.float32).reshape(1, 3, 1, 1)
    offset = (np.asarray(mean, dtype=np.float32) / std32).astype(np.float32).reshape(1, 3, 1, 1)
    return scale, offset


def normalisation(
    mean: Sequence[float], std: Sequence[float], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`normalisation_arrays` as tensors on ``device``, so that :func:`normalise` computes the same numbers on
    every device."""
    scale, offset = normalisation_arrays(mean, std)
    return torch.from_numpy(scale).to(device), torch.from_numpy(offset).to(device)


def normalise(pixels: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``(B, 3, H, W)`` uint8 pixels -> float32 ``pixels * scale - offset`` (:func:`normalisation`), on the
    pixels' device: two correctly rounded float32 operations, so the CPU and a GPU agree to the bit."""
    return pixels.to(torch.float32, copy=True).mul_(scale).sub_(offset)  # one new tensor, not three


def normalise_array(pixels: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """:func:`normalise` in NumPy on the calling thread (``scale`` and ``offset`` from :func:`normalisation_arrays`):
    the same two correctly rounded float32 operations, so the same numbers to the bit. For a graph runtime
    that reads the array next: a torch op before it would start torch's OpenMP team, whose threads then spin for
    milliseconds on the cores the runtime's own threads need (docs/performance.md)."""
    normalised = np.multiply(pixels, scale, out=np.empty(pixels.shape, np.float32))
    return np.subtract(normalised, offset, out=normalised)


def iter_batches(
    paths: Sequence[Path],
    batch_size: int,
    workers: int = 2,
    unreadable: list[tuple[Path, str]] | None = None,
    draft_to: int | None = None,
    roi: tuple[int, int, int, int] | None = None,
) -> Iterator[tuple[list[Path], list[Image.Image]]]:
    """Decode images in a thread pool, ahead of the consumer, and yield them in order by batch.

    Args:
        unreadable: when given, an image that cannot be read is appended here as
            ``(path, reason)`` and left out of its batch, instead of raising :class:`ImageError`.
        draft_to, roi: as for :func:`open_image`.
    """
    chunks = [list(paths[i : i + batch_size]) for i in range(0, len(paths), batch_size)]
    return iter_decoded(chunks, workers, unreadable, draft_to, roi)


def iter_for_model(
    paths: Sequence[Path],
    config,
    batch_size: int,
    workers: int = 2,
    unreadable: list[tuple[Path, str]] | None = None,
) -> Iterator[tuple[list[Path], list[Image.Image]]]:
    """:func:`iter_batches` for a model of ``config`` (a :class:`~padim.models.config.PadimConfig`): each picture
    drafted towards its input side and cut to its region of interest, as training read them."""
    return iter_batches(
        paths, batch_size, workers, unreadable, draft_to=decode_side(config.input_shape), roi=config.framing.roi
    )


def iter_decoded(
    batches: Sequence[Sequence[Path]],
    workers: int = 2,
    unreadable: list[tuple[Path, str]] | None = None,
    draft_to: int | None = None,
    roi: tuple[int, int, int, int] | None = None,
    then: Callable[[Path, Image.Image], Any] | None = None,
) -> Iterator[tuple[list[Path], list[Any]]]:
    """:func:`iter_batches` over batches chosen by the caller (e.g. never across two folds).

    Args:
        then: work on each decoded picture that belongs beside its decoding, on the same threads (a fit's changed
            copy, :meth:`~padim.models.fit.passes.Reading.decoded`); its result is yielded in the picture's place.
    """

    def decode(path: Path) -> Any:
        try:
            image = open_image(path, draft_to=draft_to, roi=roi)
        except ImageError as error:
            if unreadable is None:
                raise
            return error
        return image if then is None else then(path, image)

    def sort_out(chunk: Sequence[Path], decoded) -> tuple[list[Path], list[Any]]:
        kept_paths, kept = [], []
        for path, image in zip(chunk, decoded, strict=True):
            if isinstance(image, ImageError):
                assert unreadable is not None, "decode raises where no list is given"
                unreadable.append((path, image.reason))
            else:
                kept_paths.append(path)
                kept.append(image)
        return kept_paths, kept

    batches = [list(b) for b in batches if len(b)]
    # one picture in all: nothing to decode beside it, and a pool's threads cost more than they could overlap
    # (predict of one path: 2-5 ms a call on the 2-core VM, docs/performance.md)
    if workers <= 0 or sum(len(b) for b in batches) == 1:
        for chunk in batches:
            kept_paths, kept = sort_out(chunk, [decode(p) for p in chunk])
            if kept:
                yield kept_paths, kept
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="decode") as pool:
        pending = [pool.map(decode, chunk) for chunk in batches[:2]]
        for i, chunk in enumerate(batches):
            decoded = list(pending[i])
            if i + 2 < len(batches):
                pending.append(pool.map(decode, batches[i + 2]))
            kept_paths, kept = sort_out(chunk, decoded)
            if kept:
                yield kept_paths, kept
