"""Region of interest and resize modes: the square the model sees, and the way back to the picture.

Each is checked against an independent route (crop, then paste on a canvas with numpy, then
resize) and by a round trip: a marker placed on the picture is found where it was after going to
the model input and back as a map.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from padim.models.data.framing import PAD_FILL, PICTURE_SIZE, Framing
from padim.models.data.images import ImageError, open_image

SIZE = 64
ROI = (30, 20, 160, 90)  # x, y, width, height: wider than tall


def textured(width: int = 240, height: int = 180, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def reference_square(image: Image.Image, roi, resize: str, size: int = SIZE) -> np.ndarray:
    """Crop the region, make it square by hand, resize: the route the framing shortcuts."""
    x, y, w, h = roi if roi is not None else (0, 0, *image.size)
    region = np.asarray(image)[y : y + h, x : x + w]
    if resize == "crop":
        side = min(w, h)
        top, left = (h - side) // 2, (w - side) // 2
        region = region[top : top + side, left : left + side]
    elif resize == "pad":
        side = max(w, h)
        canvas = np.empty((side, side, 3), dtype=np.uint8)
        canvas[...] = PAD_FILL
        top, left = (side - h) // 2, (side - w) // 2
        canvas[top : top + h, left : left + w] = region
        region = canvas
    return np.asarray(
        Image.fromarray(np.ascontiguousarray(region)).resize((size, size), Image.BILINEAR), dtype=np.int16
    )


@pytest.mark.parametrize("resize", ["squash", "crop", "pad"])
@pytest.mark.parametrize("roi", [None, ROI], ids=["whole", "roi"])
def test_the_square_is_the_region_made_square_then_resized(roi, resize):
    image = textured()
    got = np.asarray(Framing(roi, resize, SIZE).to_square(image), dtype=np.int16)
    expected = reference_square(image, roi, resize)
    assert got.shape == (SIZE, SIZE, 3)
    # PIL's box resize and crop-then-resize sample the same pixels; at most rounding apart
    assert np.abs(got - expected).max() <= 1


def test_the_whole_picture_squashed_is_what_padim_always_did():
    image = textured()
    got = Framing(None, "squash", SIZE).to_square(image)
    assert np.array_equal(np.asarray(got), np.asarray(image.resize((SIZE, SIZE), Image.BILINEAR)))
    small = torch.rand(SIZE, SIZE)
    back = Framing(None, "squash", SIZE).to_picture(small, 240, 180)
    expected = torch.nn.functional.interpolate(
        small[None, None], size=(180, 240), mode="bilinear", align_corners=False
    )[0, 0]
    assert torch.equal(back, expected)


@pytest.mark.parametrize("resize", ["squash", "crop", "pad"])
@pytest.mark.parametrize("roi", [None, ROI, (100, 10, 60, 150)], ids=["whole", "wide-roi", "tall-roi"])
def test_a_marker_comes_back_where_it_was(roi, resize):
    """Picture -> model input -> map -> picture: a bright spot lands where it was, and nothing outside."""
    width, height = 240, 180
    framing = Framing(roi, resize, SIZE)
    left, top, right, bottom = framing.scored_box(width, height)
    spot = ((left + right) // 2 + 7, (top + bottom) // 2 - 5)  # inside what the model scores
    picture = np.zeros((height, width, 3), dtype=np.uint8)
    picture[spot[1] - 3 : spot[1] + 4, spot[0] - 3 : spot[0] + 4] = 255
    square = np.asarray(framing.to_square(Image.fromarray(picture)), dtype=np.float32)[..., 0]
    if resize == "pad":
        square = np.where(square == PAD_FILL[0], 0, square)  # the fill is not a marker
    back = framing.to_picture(torch.from_numpy(square), width, height).numpy()
    assert back.shape == (height, width)
    found = np.unravel_index(np.argmax(back), back.shape)
    assert abs(found[0] - spot[1]) <= 3 and abs(found[1] - spot[0]) <= 3
    outside = np.ones_like(back, dtype=bool)
    outside[top:bottom, left:right] = False
    assert not back[outside].any()  # 0 outside what was scored
    whole = (left, top, right, bottom) == (0, 0, width, height)
    assert framing.shown_box(width, height) == (None if whole else (left, top, right, bottom))  # marked unless all
    assert whole == (roi is None and resize != "crop")


def test_crop_scores_the_centred_square_and_pad_the_whole_region():
    wide = (30, 20, 160, 90)
    assert Framing(wide, "crop", SIZE).scored_box(240, 180) == (65, 20, 155, 110)
    assert Framing(wide, "pad", SIZE).scored_box(240, 180) == (30, 20, 190, 110)
    assert Framing(wide, "squash", SIZE).scored_box(240, 180) == (30, 20, 190, 110)
    assert Framing(None, "pad", SIZE).square(200, 100) == (0, -50, 200, 150)  # beyond the picture: filled


@pytest.mark.parametrize("resize", ["squash", "crop", "pad"])
@pytest.mark.parametrize("roi", [None, ROI, (100, 10, 60, 150)], ids=["whole", "wide-roi", "tall-roi"])
def test_a_tiled_input_keeps_the_tiles_shape_and_a_marker_comes_back_where_it_was(roi, resize):
    """Tiles of 2 rows x 3 columns: the input is 3:2, crop and pad keep that shape instead of a square."""
    width, height = 240, 180
    framing = Framing(roi, resize, SIZE, (2 * SIZE, 3 * SIZE))
    assert framing.input_shape == (128, 192)
    left, top, right, bottom = framing.square(width, height)
    if resize != "squash":
        assert abs((right - left) * 2 - (bottom - top) * 3) <= 2  # the box has the input's aspect ratio
    s_left, s_top, s_right, s_bottom = framing.scored_box(width, height)
    spot = ((s_left + s_right) // 2 + 7, (s_top + s_bottom) // 2 - 5)
    picture = np.zeros((height, width, 3), dtype=np.uint8)
    picture[spot[1] - 3 : spot[1] + 4, spot[0] - 3 : spot[0] + 4] = 255
    framed = np.asarray(framing.to_square(Image.fromarray(picture)), dtype=np.float32)[..., 0]
    assert framed.shape == (128, 192)
    if resize == "pad":
        framed = np.where(framed == PAD_FILL[0], 0, framed)
    back = framing.to_picture(torch.from_numpy(framed), width, height).numpy()
    found = np.unravel_index(np.argmax(back), back.shape)
    assert abs(found[0] - spot[1]) <= 3 and abs(found[1] - spot[0]) <= 3
    outside = np.ones_like(back, dtype=bool)
    outside[s_top:s_bottom, s_left:s_right] = False
    assert not back[outside].any()


def test_a_picture_must_hold_the_region():
    framing = Framing((100, 100, 200, 100), "squash", SIZE)
    with pytest.raises(ImageError, match=r"x=100, y=100, 200x100 does not lie inside this 240x180 picture"):
        framing.to_square(textured())
    buffer = io.BytesIO()
    textured().save(buffer, format="PNG")
    with pytest.raises(ImageError, match="does not lie inside"):  # refused at decode, before any work
        open_image(buffer.getvalue(), roi=(100, 100, 200, 100))


def jpeg(image: Image.Image, orientation: int | None = None) -> bytes:
    buffer = io.BytesIO()
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    image.save(buffer, format="JPEG", quality=95, exif=exif.tobytes())
    return buffer.getvalue()


def smooth(width: int, height: int) -> Image.Image:
    """A smooth picture (JPEG scaling and resizing agree on it within a few levels)."""
    y, x = np.mgrid[0:height, 0:width]
    r = (127 + 120 * np.sin(x / 97.0)).astype(np.uint8)
    g = (127 + 120 * np.cos(y / 83.0)).astype(np.uint8)
    b = ((x + y) * 255 // (width + height)).astype(np.uint8)
    return Image.fromarray(np.stack([r, g, b], axis=-1))


def test_a_large_jpeg_is_decoded_smaller_around_the_region_and_framed_alike():
    picture = smooth(1600, 1200)
    roi = (800, 600, 400, 300)  # the model input 64: the region's short side must stay >= 128
    data = jpeg(picture)
    drafted = open_image(data, draft_to=2 * SIZE, roi=roi)
    assert drafted.info[PICTURE_SIZE] == (1600, 1200) and drafted.size == (800, 600)  # 1/2: 150 px left of 300
    full = open_image(data)
    assert PICTURE_SIZE not in full.info
    framing = Framing(roi, "squash", SIZE)
    a = np.asarray(framing.to_square(drafted), dtype=np.int16)
    b = np.asarray(framing.to_square(full), dtype=np.int16)
    assert np.abs(a - b).mean() < 2.0  # the same part of the picture, decoded at two scales
    # a map comes back on the decoded picture, in the region's place
    back = framing.to_picture(torch.ones(SIZE, SIZE), *drafted.size, drafted.info[PICTURE_SIZE])
    assert back.shape == (600, 800) and back[300:450, 400:600].min() == 1 and back.sum() == 200 * 150
    # without a region the same picture is decoded at 1/8 (its short side 150 >= 128)
    assert open_image(data, draft_to=2 * SIZE).size == (200, 150)


def test_the_region_is_in_pixels_of_the_picture_as_seen():
    """A phone JPEG stored sideways (EXIF orientation 6): the region refers to the upright picture."""
    upright = smooth(600, 1000)
    data = jpeg(upright.transpose(Image.Transpose.ROTATE_90), orientation=6)  # stored 1000 x 600
    seen = open_image(data, draft_to=64, roi=(0, 0, 600, 1000))
    assert seen.info[PICTURE_SIZE] == (600, 1000) and seen.width < seen.height
    with pytest.raises(ImageError, match="does not lie inside this 600x1000 picture"):
        open_image(data, roi=(0, 0, 1000, 600))


def test_masks_are_framed_as_pictures_are():
    mask = Image.new("L", (240, 180), 0)
    mask.paste(255, (100, 50, 130, 80))  # a defect inside the region
    mask.paste(255, (0, 0, 20, 20))  # and one outside: the model never sees it
    framing = Framing(ROI, "squash", SIZE)
    got = framing.to_square_mask(mask)
    expected = np.asarray(mask.crop((30, 20, 190, 110)).resize((SIZE, SIZE), Image.NEAREST)) > 127
    assert got.dtype == bool and np.array_equal(got, expected) and got.any()
    padded = Framing(ROI, "pad", SIZE).to_square_mask(mask)
    assert padded.sum() == pytest.approx(expected.sum() * 90 / 160, rel=0.2)  # the region is 90/160 of the square
