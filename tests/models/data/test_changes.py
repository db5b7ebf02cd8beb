"""The changes a line makes to its pictures (``--expect``): parsed, drawn within their bounds, made as described."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageFilter

from padim.models.choices import EXPECT_PRESETS
from padim.models.data.changes import Draw, Expected, apply, seeded
from padim.models.data.framing import PICTURE_SIZE


def noise_picture(width: int = 80, height: int = 64, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    smooth = Image.fromarray(rng.uniform(0, 255, (height, width, 3)).astype(np.uint8)).filter(
        ImageFilter.GaussianBlur(2)
    )
    return smooth


def test_presets_and_lists_parse_to_their_bounds_and_print_back():
    assert not Expected.parse("") and not Expected.parse("stable") and not Expected.parse(None)
    typical = Expected.parse("typical")
    assert (typical.brightness, typical.contrast, typical.shift, typical.rotate, typical.blur, typical.jpeg) == (
        0.1,
        0.1,
        3,
        1,
        1,
        80,
    )
    assert Expected.parse(str(typical)) == typical and typical.preset() == "typical"
    assert str(Expected.parse(" shift = 2 , brightness=0.05")) == "brightness=0.05,shift=2"
    assert set(EXPECT_PRESETS) == {"stable", "typical", "rough"}


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "bright=0.1",
            "'bright=0.1' is not a change; write NAME=VALUE with NAME one of brightness, contrast, shift, "
            "rotate, blur, jpeg, or a preset: stable, typical, rough",
        ),
        ("shift", "'shift' is not a change"),
        ("shift=two", "shift='two' is not a number"),
        ("brightness=0.7", "brightness=0.7 is not allowed; use a number from 0 to 0.5"),
        ("rotate=-1", "rotate=-1.0 is not allowed"),
        ("jpeg=5", "use a JPEG quality from 10 to 95 (0: none)"),
        ("blur=1,blur=2", "blur is given twice"),
    ],
)
def test_a_bad_declaration_says_what_is_allowed(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Expected.parse(text)


def test_draws_stay_within_the_bounds_cover_them_and_are_seeded_by_name():
    expected = Expected.parse("brightness=0.1,contrast=0.2,shift=3,rotate=1,blur=1,jpeg=80")
    draws = [expected.draw(seeded(f"{i:04d}.png")) for i in range(2000)]
    brightness = np.array([d.brightness for d in draws])
    assert brightness.min() >= 0.9 and brightness.max() <= 1.1 and brightness.min() < 0.91 and brightness.max() > 1.09
    assert max(abs(d.dx) for d in draws) <= 3 and max(abs(d.angle) for d in draws) <= 1
    assert all(0 <= d.sigma <= 1 for d in draws) and {d.quality for d in draws} <= set(range(80, 96))
    assert expected.draw(seeded("a.png")) == expected.draw(seeded("a.png")) != expected.draw(seeded("b.png"))
    assert expected.draw(seeded("a.png", 0)) != expected.draw(seeded("a.png", 1))  # a picture's second copy
    # what is not declared does not change
    assert Expected.parse("shift=2").draw(seeded("a.png")).brightness == 1.0


def test_a_move_shifts_the_content_and_fills_the_edges_from_the_picture():
    picture = noise_picture()
    moved = np.asarray(apply(picture, Draw(dx=3, dy=-2)), dtype=np.int16)
    original = np.asarray(picture, dtype=np.int16)
    # content moved 3 px right and 2 px up; bicubic at whole pixels reproduces it
    assert np.abs(moved[:-2, 3:] - original[2:, :-3]).max() <= 1
    # the revealed edge is the picture reflected, not black
    assert moved[:, :3].mean() > 0.5 * original.mean()


def test_a_turn_keeps_the_centre_and_the_size():
    picture = noise_picture(81, 81)
    turned = apply(picture, Draw(angle=1.0))
    assert turned.size == picture.size
    centre = np.asarray(turned, dtype=np.int16)[38:43, 38:43] - np.asarray(picture, dtype=np.int16)[38:43, 38:43]
    assert np.abs(centre).mean() < 6  # the centre barely moves; the corners do
    corner = np.asarray(turned, dtype=np.int16)[:6, :6] - np.asarray(picture, dtype=np.int16)[:6, :6]
    assert np.abs(corner).mean() > np.abs(centre).mean()


def test_light_focus_and_compression_change_the_pixels_as_declared():
    picture = noise_picture()
    pixels = np.asarray(picture, dtype=np.float64)
    brighter = np.asarray(apply(picture, Draw(brightness=1.1)), dtype=np.float64)
    assert brighter.mean() == pytest.approx(min(255, 1.1) * pixels.mean(), rel=0.02)
    flatter = np.asarray(apply(picture, Draw(contrast=0.9)), dtype=np.float64)
    assert flatter.std() == pytest.approx(0.9 * pixels.std(), rel=0.05)
    blurred = np.asarray(apply(picture, Draw(sigma=1.0)), dtype=np.float64)
    assert np.abs(np.diff(blurred, axis=1)).mean() < np.abs(np.diff(pixels, axis=1)).mean()
    jpeg = apply(picture, Draw(quality=80))
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=80)
    assert np.array_equal(np.asarray(jpeg), np.asarray(Image.open(buffer).convert("RGB")))
    same = apply(picture, Draw())
    assert same is not picture and np.array_equal(np.asarray(same), pixels.astype(np.uint8))


def test_a_drafted_jpeg_moves_by_the_pictures_pixels_scaled_down():
    picture = noise_picture(80, 64)
    picture.info[PICTURE_SIZE] = (160, 128)  # decoded at half its size
    moved = np.asarray(apply(picture, Draw(dx=4)), dtype=np.int16)
    assert np.abs(moved[:, 2:] - np.asarray(picture, dtype=np.int16)[:, :-2]).max() <= 1  # 4 px of the picture: 2 here
    assert apply(picture, Draw(dx=4)).info[PICTURE_SIZE] == (160, 128)
