"""``--expect auto``: the spread of the training pictures, measured against changes made to them with known sizes."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from padim.models.choices import EXPECT_AUTO_MARGIN, EXPECT_PRESETS
from padim.models.data.changes import Draw, Expected, apply
from padim.models.data.spread import UNMEASURED, Spread, jpeg_quality, measure, sampled


def texture(seed: int, size: int = 96) -> Image.Image:
    """A crop of a random texture: no two share a position."""
    rng = np.random.default_rng(seed)
    noise = Image.fromarray(rng.uniform(40, 215, (size, size, 3)).astype(np.uint8))
    return noise.filter(ImageFilter.GaussianBlur(1.5))


def part(size: int = 160) -> Image.Image:
    """A placed part: a board with a few components on a plain background, the same every time."""
    canvas = Image.new("RGB", (size, size), (200, 200, 195))
    draw = ImageDraw.Draw(canvas)
    draw.rectangle([32, 32, 128, 128], fill=(30, 110, 55))
    for x, y, w, h in [(40, 40, 30, 18), (80, 44, 36, 36), (44, 80, 18, 40), (84, 96, 36, 14)]:
        draw.rectangle([x, y, x + w, y + h], fill=(20, 20, 24))
    draw.line([(36, 70), (124, 70)], fill=(190, 150, 70), width=2)
    return canvas.filter(ImageFilter.GaussianBlur(0.6))


def line(picture_of, changes: Expected, count: int = 24) -> list[Image.Image]:
    """``count`` pictures of a line that makes ``changes`` (one seeded draw each)."""
    rng = np.random.default_rng(3)
    return [apply(picture_of(i), changes.draw(rng)) for i in range(count)]


def test_a_lamp_that_wanders_is_measured_at_its_edge_and_covered_with_the_margin():
    """Brightness drawn within +-20% is read as about 20% (the 95th percentile of |mean / median - 1|); the cover is
    the margin times it; pictures that do not share a position leave placement at rough's bounds."""
    spread = measure(line(texture, Expected(brightness=0.2)))
    assert 0.15 < spread.brightness < 0.24 and spread.contrast < 0.1  # the crops' own contrast differs a little
    assert spread.shift is None and spread.rotate is None and spread.jpeg is None
    cover = spread.cover()
    assert cover.brightness == pytest.approx(EXPECT_AUTO_MARGIN * spread.brightness, abs=1e-3)
    assert (cover.shift, cover.rotate) == (UNMEASURED.shift, UNMEASURED.rotate) == (6, 2)
    assert Expected.parse(str(cover)) == cover  # what the model file stores parses back
    steady = measure([texture(0) for _ in range(5)])
    assert steady.brightness == 0 and steady.contrast == 0 and steady.blur == 0


def test_contrast_is_told_from_brightness():
    spread = measure(line(lambda i: texture(0), Expected(contrast=0.3)))
    assert 0.2 < spread.contrast < 0.36 and spread.brightness < 0.03


def test_a_placed_part_registers_and_its_offsets_and_turns_are_measured():
    moved = measure(line(lambda i: part(), Expected(shift=5)))
    assert moved.registered == 1.0
    assert moved.shift is not None and 4.0 < moved.shift < 8.0  # |(dx, dy)| of draws within +-5 px each way
    turned = measure(line(lambda i: part(), Expected(rotate=4)))
    assert turned.rotate is not None and 2.5 < turned.rotate < 5.5 and turned.shift < 2.0
    still = measure([part() for _ in range(6)])
    assert still.shift == 0 and still.rotate == 0
    textures = measure([texture(seed) for seed in range(12)])
    assert textures.registered < 0.5 and textures.shift is None


def test_focus_is_read_as_the_blur_that_softens_the_middle_picture_to_the_softest():
    sharp = texture(1)
    blurred = [sharp.filter(ImageFilter.GaussianBlur(float(s))) if s else sharp for s in np.linspace(0, 2.0, 21)]
    spread = measure(blurred)
    # the median picture is blurred by 1 px; the softest ones (95th percentile) by about 1.9: sqrt(1.9^2 - 1) ~ 1.6
    assert 1.0 < spread.blur < 2.2
    assert measure([sharp, sharp.copy()]).blur == 0


@pytest.mark.parametrize("quality", [35, 60, 85, 95])
def test_a_jpeg_quality_is_read_from_its_tables(quality):
    buffer = io.BytesIO()
    texture(2).save(buffer, format="JPEG", quality=quality)
    buffer.seek(0)
    with Image.open(buffer) as opened:
        assert jpeg_quality(opened) == quality
    assert jpeg_quality(texture(2)) is None


def test_the_lowest_quality_sets_the_jpeg_bound_and_a_lossless_picture_none():
    def saved(quality: int | None) -> Image.Image:
        buffer = io.BytesIO()
        texture(quality or 0).save(buffer, format="JPEG" if quality else "PNG", quality=quality or 0)
        buffer.seek(0)
        opened = Image.open(buffer)
        opened.load()
        return opened

    jpegs = measure([saved(q) for q in (90, 80, 85, 88)])
    assert jpegs.jpeg == 80 and jpegs.cover().jpeg == round(95 - (95 - 80) * EXPECT_AUTO_MARGIN)
    mixed = measure([saved(80), saved(None)])
    assert mixed.jpeg is None and mixed.cover().jpeg == 0


def test_the_cover_stays_within_what_expect_allows_and_the_spread_round_trips():
    wild = Spread(pictures=9, brightness=0.9, contrast=0.4, shift=80.0, rotate=9.0, blur=4.0, jpeg=12, registered=1.0)
    cover = wild.cover()
    assert (cover.brightness, cover.contrast, cover.shift, cover.rotate, cover.blur, cover.jpeg) == (
        0.5,
        0.5,
        64.0,
        10.0,
        5.0,
        10.0,
    )
    assert Spread.from_dict(wild.to_dict()) == wild
    assert "9 training pictures measured" in wild.describe() and str(cover) in wild.describe()
    assert "not measurable" in Spread(3, 0.1, 0.0, None, None, 0.0, None, 0.0).describe()


def test_the_sample_is_chosen_by_name_alone_and_needs_two_pictures():
    names = [f"{i:04d}.png" for i in range(500)]
    chosen = sampled(names, 50)
    assert len(chosen) == 50 and chosen == sorted(chosen)
    backwards = names[::-1]
    assert {backwards[i] for i in sampled(backwards, 50)} == {names[i] for i in chosen}  # by name, not by order
    assert sampled(names[:7], 50) == list(range(7))
    with pytest.raises(ValueError, match="two pictures"):
        measure([texture(0)])
    assert set(EXPECT_PRESETS["rough"].split(",")) >= {f"shift={UNMEASURED.shift:g}", f"rotate={UNMEASURED.rotate:g}"}


def test_pictures_of_different_sizes_are_measured_on_one_shape():
    spread = measure([texture(0, 96), apply(texture(0, 120), Draw(brightness=1.1)), texture(0, 80)])
    assert spread.pictures == 3 and 0.0 <= spread.brightness < 0.2


def test_only_the_region_the_model_sees_is_measured():
    """A lamp that lights only the right half: the left half (the region of interest) shows no change."""

    def lit(factor: float) -> Image.Image:
        array = np.asarray(texture(0), dtype=np.float64)
        array[:, 48:] *= factor
        return Image.fromarray(np.clip(array, 0, 255).astype(np.uint8))

    pictures = [lit(f) for f in np.linspace(0.8, 1.2, 9)]
    assert measure(pictures).brightness > 0.08
    assert measure(pictures, region=lambda width, height: (0, 0, 48, height)).brightness == 0


def test_a_trimmed_cover_leaves_out_what_the_pictures_already_show_as_far():
    """``--trim-cover``: a lamp wandering +-30% is wider than ``rough``'s 20%, so brightness is left out, and so is
    the shift of a texture's crops (they share no position: a shifted crop is another crop); contrast, the turn,
    focus and JPEG are not shown as far, and stay; a change not declared is never listed. Measured on pictures made
    with known changes."""
    rough = Expected.parse(EXPECT_PRESETS["rough"])
    lamp = measure(line(texture, Expected(brightness=0.3), count=40))
    assert lamp.brightness >= 0.2 and lamp.shift is None
    assert lamp.shown(rough) == ["brightness", "shift"]
    assert lamp.trimmed(rough) == Expected(contrast=0.2, rotate=2, blur=1.5, jpeg=60)
    assert lamp.shown(Expected(rotate=2)) == [] and lamp.trimmed(Expected()) == Expected()
    steady = measure(line(texture, Expected(brightness=0.05), count=40))
    assert steady.shown(rough) == ["shift"] and steady.trimmed(rough) == dataclasses.replace(rough, shift=0)
    still = measure([part() for _ in range(6)])  # a placed part that never moves keeps the whole cover
    assert still.shown(rough) == [] and still.trimmed(rough) == rough
    # a placed part moved +-5 px each way is placed as far apart as a declared 3 px, and turned less than 2 degrees;
    # pictures stored at JPEG 50 are compressed harder than rough's lowest quality, 60
    moved = measure(line(lambda i: part(), Expected(shift=5)))
    assert moved.shown(Expected(shift=3, rotate=2)) == ["shift"]
    compressed = dataclasses.replace(still, jpeg=50)
    assert compressed.shown(rough) == ["jpeg"] and compressed.trimmed(rough).jpeg == 0
