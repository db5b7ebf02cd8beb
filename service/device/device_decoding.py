"""JPEGs decoded where the model scores them: on the GPU (nvJPEG, batched), resized and normalised there.

A camera frame is a JPEG of a few hundred kilobytes that a CPU takes milliseconds to decode; the GPU that scores it
decodes a batch of them in a fraction of that (``torchvision.io.decode_jpeg(..., device="cuda")``). With
``PADIM_DEVICE_DECODE=auto`` and a model on CUDA (``on``: on any device), a JPEG whose answer needs nothing but the
verdict (no heat map or mask, which are drawn on the picture on the CPU) and whose model sees the whole picture (no
region of interest; ``squash``) travels to the scoring thread as its bytes; the batch's JPEGs are decoded together,
each resized (bilinear, antialiased, as Pillow's) and rounded to 8 bits as :func:`padim.models.data.images.to_pixels`
does, and joined with the batch's other pictures (the scorer normalises them all on the device). A JPEG the device's
decoder refuses (CMYK, a damaged file) is decoded on the CPU there instead; the answer does not change.

Not bit for bit the CPU's decode: Pillow decodes a large JPEG at a reduced scale (its DCT scaling) before resizing,
the device decodes it whole and resizes. ``benchmarks/device_decode.py`` measures what that does to scores on real
photographs: up to 0.27% of the raw score on 1920x1080 frames, 0.06% on pictures decoded whole on both (the
CPU's decoder standing in for nvJPEG; docs/gpu.md). That is more than the 1e-4 a GPU's scores keep to a CPU's, so
it is off by default.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from padim.models.data.framing import Framing
from padim.models.data.images import decode_side, open_image, to_pixels

JPEG_MAGIC = b"\xff\xd8\xff"


@dataclass(frozen=True)
class DeviceDecode:
    """JPEGs of one served version decoded on ``device`` into its model input (``framing``)."""

    device: torch.device
    framing: Framing

    def takes(self, data: bytes, max_pixels: int) -> tuple[int, int] | None:
        """The picture's ``(width, height)`` when it goes to the device as its bytes, else ``None``: a JPEG of RGB
        or grey pixels within ``max_pixels`` (the header read, nothing decoded)."""
        if not data.startswith(JPEG_MAGIC) or not self.framing.is_whole_picture:
            return None
        try:
            with Image.open(io.BytesIO(data)) as image:
                if image.format != "JPEG" or image.mode not in ("RGB", "L"):
                    return None
                width, height = image.size
                turned = image.getexif().get(0x0112, 1) in (5, 6, 7, 8)
        except (OSError, ValueError, Image.DecompressionBombError):
            return None
        if width * height > max_pixels:
            return None  # the CPU's decoder says why (413)
        return (height, width) if turned else (width, height)

    def decode(self, jpegs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """``(3, H_in, W_in)`` uint8 model inputs on the device, one for each JPEG (its bytes, a 1-D uint8 CPU
        tensor); ``None`` for one the device's decoder refuses."""
        try:
            images: list[torch.Tensor | None] = list(
                decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=self.device, apply_exif_orientation=True)
            )
        except RuntimeError:  # one of them: each alone, to find it
            images = []
            for jpeg in jpegs:
                try:
                    images.append(
                        decode_jpeg(jpeg, mode=ImageReadMode.RGB, device=self.device, apply_exif_orientation=True)
                    )
                except RuntimeError:
                    images.append(None)
        return [None if image is None else self.model_input(image) for image in images]

    def on_cpu(self, jpeg: torch.Tensor) -> torch.Tensor:
        """A JPEG the device's decoder refused, decoded as the API processes decode (Pillow), here."""
        image = open_image(bytes(jpeg.numpy()), draft_to=decode_side(self.framing.input_shape))
        return to_pixels([image], self.framing)[0]

    def model_input(self, image: torch.Tensor) -> torch.Tensor:
        """A decoded ``(3, h, w)`` uint8 picture -> ``(3, H_in, W_in)`` uint8 model input: resized as Pillow's
        bilinear resize does (antialiased, rounded to 8 bits)."""
        height, width = self.framing.input_shape
        resized = F.interpolate(
            image.unsqueeze(0).to(torch.float32), size=(height, width), mode="bilinear", antialias=True
        )
        return resized.round_().clamp_(0, 255)[0].to(torch.uint8)


def jpeg_tensor(data: bytes) -> torch.Tensor:
    """A JPEG's bytes as the 1-D uint8 tensor the decoder reads."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
