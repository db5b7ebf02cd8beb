"""Reading images and turning them into model input.

Every mode Pillow reads (grayscale, RGBA, palette, 16-bit, CMYK, float) becomes 8-bit RGB,
and the EXIF orientation is applied, so a photo from a phone is scored the way it is seen.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")


class ImageError(ValueError):
    """An input that is not a readable image: ``"<name>: <reason>"``, with both parts as attributes."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name, self.reason = name, reason


class ImageTooLarge(ImageError):
    """An image with more pixels than allowed (a decompression bomb, or just too big)."""


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


def open_image(source: str | os.PathLike | bytes, max_pixels: int | None = None) -> Image.Image:
    """Decode a file or bytes into an 8-bit RGB image with EXIF orientation applied.

    Raises:
        ImageTooLarge: larger than ``max_pixels`` (or than Pillow's own bomb limit).
        ImageError: unreadable or truncated.
    """
    name = "image" if isinstance(source, bytes) else str(source)
    try:
        handle = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")
    except OSError as error:
        raise ImageError(name, error.strerror or type(error).__name__) from None
    with handle:
        try:
            with Image.open(handle) as image:
                if max_pixels is not None and image.width * image.height > max_pixels:
                    raise ImageTooLarge(name, f"{image.width}x{image.height} pixels is over the limit of {max_pixels}")
                image.load()
                return to_rgb(ImageOps.exif_transpose(image))
        except ImageError:
            raise
        except Image.DecompressionBombError as error:
            raise ImageTooLarge(name, _without_reprs(str(error))) from None
        except Image.UnidentifiedImageError:
            raise ImageError(name, "not a readable image (not a format Pillow knows, or damaged)") from None
        except (OSError, ValueError, SyntaxError) as error:
            raise ImageError(name, f"not a readable image ({_without_reprs(str(error))})") from None


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


def to_model_input(
    images: Sequence[Image.Image], size: int, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """Resize to ``size x size`` (bilinear, antialiased) and normalise: ``(B, 3, S, S)`` float32.

    NumPy only until the final ``from_numpy``: this runs on decode threads beside the inference
    thread, and torch ops there would each start an OpenMP team and oversubscribe the cores.
    """
    scale = (1.0 / (255.0 * np.asarray(std, dtype=np.float32))).reshape(1, 1, 3)
    offset = (np.asarray(mean, dtype=np.float32) / np.asarray(std, dtype=np.float32)).reshape(1, 1, 3)
    arrays = []
    for image in images:
        pixels = np.asarray(image.resize((size, size), Image.BILINEAR), dtype=np.float32)  # (S, S, 3)
        arrays.append((pixels * scale - offset).transpose(2, 0, 1))  # (3, S, S)
    return torch.from_numpy(np.ascontiguousarray(np.stack(arrays)))


def iter_batches(
    paths: Sequence[Path], batch_size: int, workers: int = 2, unreadable: list[tuple[Path, str]] | None = None,
) -> Iterator[tuple[list[Path], list[Image.Image]]]:
    """Decode images in a thread pool, ahead of the consumer, and yield them in order by batch.

    Args:
        unreadable: when given, an image that cannot be read is appended here as
            ``(path, reason)`` and left out of its batch, instead of raising :class:`ImageError`.
    """
    chunks = [list(paths[i : i + batch_size]) for i in range(0, len(paths), batch_size)]
    return iter_decoded(chunks, workers, unreadable)


def iter_decoded(
    batches: Sequence[Sequence[Path]], workers: int = 2, unreadable: list[tuple[Path, str]] | None = None,
) -> Iterator[tuple[list[Path], list[Image.Image]]]:
    """:func:`iter_batches` over batches chosen by the caller (e.g. never across two folds)."""
    def decode(path: Path) -> Image.Image | ImageError:
        try:
            return open_image(path)
        except ImageError as error:
            if unreadable is None:
                raise
            return error

    def sort_out(chunk: Sequence[Path], decoded) -> tuple[list[Path], list[Image.Image]]:
        kept_paths, kept = [], []
        for path, image in zip(chunk, decoded):
            if isinstance(image, ImageError):
                unreadable.append((path, image.reason))
            else:
                kept_paths.append(path)
                kept.append(image)
        return kept_paths, kept

    batches = [list(b) for b in batches if len(b)]
    if workers <= 0:
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
