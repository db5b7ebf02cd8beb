import io
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from padim.models.data.framing import PICTURE_SIZE, Framing
from padim.models.data.images import (
    ImageError,
    ImageTooLarge,
    bounded_copy,
    image_dimensions,
    iter_decoded,
    list_images,
    normalisation,
    normalisation_arrays,
    normalise,
    normalise_array,
    open_image,
    to_pixels,
)


def to_model_input(images, framing, mean, std):
    """Framed and normalised, as a scorer makes it from the pixels it is handed."""
    return normalise(to_pixels(images, framing), *normalisation(mean, std))


def encode(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK", "LA", "1"])
def test_modes_become_rgb(mode):
    image = Image.new("RGB", (8, 6), (200, 100, 50)).convert(mode)
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    out = open_image(encode(image, fmt))
    assert out.mode == "RGB" and out.size == (8, 6)


def test_sixteen_bit_is_rescaled_not_clipped():
    array = np.full((4, 4), 32768, dtype=np.uint16)
    out = open_image(encode(Image.fromarray(array)))
    assert abs(int(np.asarray(out)[0, 0, 0]) - 128) <= 1


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (20, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    out = open_image(encode(image, "JPEG", exif=exif.tobytes()))
    assert out.size == (10, 20)


def test_transparent_pixels_become_white():
    out = open_image(encode(Image.new("RGBA", (2, 2), (0, 0, 0, 0))))
    assert np.asarray(out)[0, 0].tolist() == [255, 255, 255]


def test_bad_inputs():
    good = encode(Image.new("RGB", (64, 64), (1, 2, 3)))
    with pytest.raises(ImageError, match="not a readable image"):
        open_image(b"")
    with pytest.raises(ImageError, match="not a readable image"):
        open_image(b"hello, not an image")
    with pytest.raises(ImageError):
        open_image(good[: len(good) // 2])
    with pytest.raises(ImageError, match="over the limit"):
        open_image(good, max_pixels=100)


def test_model_input_is_normalised(tmp_path):
    image = Image.new("RGB", (30, 20), (124, 116, 104))  # ~ the ImageNet mean
    batch = to_model_input([image, image], Framing(size=32), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert batch.shape == (2, 3, 32, 32)
    assert batch.abs().max() < 0.02


def test_pixels_travel_as_8_bits_and_normalise_to_the_float32_of_numpy():
    """The model input crosses to the device as the framed picture's bytes; normalised there it is, to the bit, what
    NumPy computes from the same pixels in float32 (a multiply and a subtraction, each correctly rounded)."""
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
    framing = Framing(size=32)
    pixels = to_pixels([image, image], framing)
    assert pixels.dtype == torch.uint8 and pixels.shape == (2, 3, 32, 32)
    assert np.array_equal(pixels[0].permute(1, 2, 0).numpy(), np.asarray(framing.to_square(image)))
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    std32 = np.asarray(std, dtype=np.float32)
    by_hand = np.asarray(framing.to_square(image), dtype=np.float32) * (1 / (255 * std32)).astype(np.float32)
    by_hand = (by_hand - (np.asarray(mean, dtype=np.float32) / std32)).transpose(2, 0, 1)
    model_input = to_model_input([image], framing, mean, std)
    assert model_input.dtype == torch.float32
    assert np.array_equal(model_input[0].numpy(), by_hand)
    # and in NumPy, for a graph runtime (no torch op before it): the same two operations, the same numbers
    in_numpy = normalise_array(pixels.numpy(), *normalisation_arrays(mean, std))
    assert in_numpy.dtype == np.float32 and in_numpy.flags.c_contiguous
    assert np.array_equal(in_numpy[0], by_hand)


def test_list_images_recursive_sorted(tmp_path):
    for name in ["b/2.PNG", "a/1.jpg", "c.bmp", "notes.txt", "z.tif"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert [p.relative_to(tmp_path).as_posix() for p in list_images(tmp_path)] == [
        "a/1.jpg",
        "b/2.PNG",
        "c.bmp",
        "z.tif",
    ]
    with pytest.raises(ImageError, match="no such file"):
        list_images(tmp_path / "missing")


def test_large_jpeg_is_drafted_down_but_never_below_the_asked_side():
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 255, (1500, 2000, 3), dtype=np.uint8))
    data = encode(photo, "JPEG", quality=90)
    full = open_image(data)
    drafted = open_image(data, draft_to=200)
    assert full.size == (2000, 1500)
    assert drafted.size == (500, 375)  # 1/4: the 1/8 scale would make the short side 188 < 200
    assert drafted.info[PICTURE_SIZE] == (2000, 1500) and PICTURE_SIZE not in full.info
    # the DCT-scaled decode is a low-pass of the full one: model input from both is close
    a = to_model_input([full], Framing(size=64), (0, 0, 0), (1, 1, 1))
    b = to_model_input([drafted], Framing(size=64), (0, 0, 0), (1, 1, 1))
    assert float((a - b).abs().mean()) < 0.02
    small = encode(Image.new("RGB", (300, 300)), "JPEG")
    assert open_image(small, draft_to=200).size == (300, 300)  # under twice the side: decoded as is
    png = encode(Image.new("RGB", (2000, 1500)))
    assert open_image(png, draft_to=200).size == (2000, 1500)  # not a JPEG: full size


def test_size_from_the_header_alone_and_the_limit_named_as_configured():
    data = encode(Image.new("RGB", (300, 200)))
    assert image_dimensions(data) == (300, 200)
    with pytest.raises(ImageTooLarge, match="300x200 pixels is over the limit of PADIM_MAX_IMAGE_PIXELS = 1000 pixels"):
        image_dimensions(data, max_pixels=1000, limit_name="PADIM_MAX_IMAGE_PIXELS")


def test_bounded_copy_keeps_the_aspect_ratio_and_small_images_as_they_are():
    wide = Image.new("RGB", (3000, 1000))
    copy = bounded_copy(wide, 1024)
    assert copy.size == (1024, 341)
    small = Image.new("RGB", (100, 50))
    assert bounded_copy(small, 1024) is small


def test_one_picture_is_decoded_where_it_is_asked_for_and_more_on_the_pool(tmp_path):
    """One picture in all (``predict`` of one path) is decoded on the calling thread: a pool's threads cost a call
    more than they could overlap; two or more go to the decode threads, unreadable ones reported either way."""
    paths = []
    for i in range(3):
        path = tmp_path / f"{i}.png"
        path.write_bytes(encode(Image.new("RGB", (32, 32), (i * 40, 0, 0))))
        paths.append(path)
    (tmp_path / "bad.png").write_bytes(b"not a picture")

    def decoded_on(batches, unreadable=None):
        out = list(iter_decoded(batches, 2, unreadable, then=lambda path, image: threading.current_thread().name))
        return [(names, [Path(p).name for p in chunk]) for chunk, names in out]

    here = threading.current_thread().name
    assert decoded_on([[paths[0]]]) == [([here], ["0.png"])]
    pooled = decoded_on([[paths[0], paths[1]], [paths[2]]])
    assert [files for _, files in pooled] == [["0.png", "1.png"], ["2.png"]]
    assert all(name.startswith("decode") for names, _ in pooled for name in names)
    unreadable: list = []
    assert decoded_on([[tmp_path / "bad.png"]], unreadable) == []
    assert [(path.name, bool(reason)) for path, reason in unreadable] == [("bad.png", True)]
    with pytest.raises(ImageError):
        decoded_on([[tmp_path / "bad.png"]])
