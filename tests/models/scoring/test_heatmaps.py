"""Heat maps: the colour ramp, the blend over the image, the mask, the demo label."""

import numpy as np
from PIL import Image

from padim.models.scoring.heatmaps import (
    _ANCHORS,
    ANOMALOUS_COLOUR,
    NORMAL_COLOUR,
    TINT_AT_THRESHOLD,
    TINT_FROM,
    TINT_MAX,
    UNSCORED_FRAME,
    colorize,
    figure,
    mask_image,
    overlay,
    tint_opacity,
)
from padim.models.scoring.verdicts import Verdict


def test_ramp_runs_through_its_anchors_and_clips():
    positions = np.linspace(0, 1, len(_ANCHORS))
    np.testing.assert_array_equal(colorize(positions[None, :])[0], _ANCHORS.round().astype(np.uint8))
    np.testing.assert_array_equal(colorize(np.array([[-3.0, 7.0]]))[0], _ANCHORS[[0, -1]].astype(np.uint8))
    halfway = colorize(np.array([[0.5 / (len(_ANCHORS) - 1)]]))[0, 0]  # between the first two anchors
    np.testing.assert_array_equal(halfway, ((_ANCHORS[0] + _ANCHORS[1]) / 2).round().astype(np.uint8))


def test_overlay_leaves_normal_areas_untinted_and_tints_by_the_ramp_above():
    image = Image.new("RGB", (40, 30), (150, 90, 40))  # a brown stain colour
    values = np.tile(np.linspace(0, 1, 40), (30, 1))  # (H, W) at the image's size
    tinted = np.asarray(overlay(image, values, outline=False), dtype=np.float64)
    base = np.asarray(image, dtype=np.float64)
    low = values < TINT_FROM
    np.testing.assert_array_equal(tinted[low], base[low])  # normal pixels keep their own colour
    alpha = tint_opacity(values)[..., None]
    expected = base * (1 - alpha) + colorize(values) * alpha  # an independent blend of the same ramp
    np.testing.assert_allclose(tinted, expected, atol=0.51)
    assert tint_opacity(np.array([0.5]))[0] == TINT_AT_THRESHOLD and tint_opacity(np.array([1.0]))[0] == TINT_MAX


def test_overlay_outlines_the_area_at_or_above_the_threshold():
    image = Image.new("RGB", (60, 60), (0, 0, 0))
    values = np.zeros((60, 60))
    values[20:40, 20:40] = 0.9
    drawn = np.asarray(overlay(image, values, threshold=0.5))
    white = (drawn == 255).all(axis=2)
    assert white[20, 30] and white[30, 20] and not white[30, 30] and not white[5, 5]
    assert not (np.asarray(overlay(image, values, threshold=0.95)) == 255).all(axis=2).any()


def test_figure_puts_the_verdict_and_label_in_a_band_outside_the_pictures():
    image = Image.new("RGB", (300, 80), (90, 90, 90))
    values = np.zeros((80, 300))
    values[10:20, 10:20] = 0.9
    found = Verdict(score=0.8, raw_score=3.0, is_anomaly=True, threshold=0.5, raw_threshold=2.0, anomalous_area=0.01)
    plain = np.asarray(figure(image, values, found))
    labelled = np.asarray(figure(image, values, found, label="RANDOM WEIGHTS - DEMO ONLY"))
    gap = max(4, 300 // 80)
    band = plain.shape[0] - 80 - (plain.shape[0] - 80) // 2  # the band is as tall as the colour bar
    assert plain.shape[1] == 2 * 300 + gap
    np.testing.assert_array_equal(plain[band : band + 80, :300], np.asarray(image))  # the original, untouched
    np.testing.assert_array_equal(plain[band : band + 80, 300 + gap :], np.asarray(overlay(image, values, 0.5)))
    changed = np.argwhere((plain != labelled).any(axis=2))
    assert len(changed) and changed[:, 0].max() < band  # the label is in the band, never over a picture
    assert (plain[:band] == ANOMALOUS_COLOUR).all(axis=2).any()  # the verdict, in its colour


def test_mask_is_white_at_or_above_the_threshold():
    values = np.array([[0.2, 0.5], [0.7, 0.49]])
    mask = mask_image(values, 0.5)
    assert mask.mode == "L"
    np.testing.assert_array_equal(np.asarray(mask), [[0, 255], [255, 0]])


def test_small_images_are_enlarged_and_long_titles_shortened_to_fit():
    image = Image.new("RGB", (64, 48), (90, 90, 90))
    found = Verdict(score=0.2, raw_score=1.0, is_anomaly=False, threshold=0.5, raw_threshold=2.0, anomalous_area=0.0)
    title = "/very/long/path/" * 20 + "part.png"
    small = figure(image, np.zeros((48, 64)), found, label="RANDOM WEIGHTS - DEMO ONLY", title=title)
    assert small.width == 2 * 64 * 4 + max(4, 256 // 80)  # 64 px -> 256 px halves (a whole factor)
    assert (np.asarray(small)[:, :, :] == NORMAL_COLOUR).all(axis=2).any()  # the verdict is drawn


def test_what_was_not_scored_is_greyed_out_and_the_scored_box_framed():
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))
    values = np.zeros((60, 80))
    values[20:30, 30:40] = 0.9  # above the threshold, inside the box
    box = (20, 10, 60, 50)
    plain = np.asarray(overlay(image, values), dtype=int)
    marked = np.asarray(overlay(image, values, scored=box), dtype=int)
    outside = np.ones((60, 80), dtype=bool)
    outside[10:50, 20:60] = False
    assert np.ptp(marked[outside], axis=1).max() <= 1  # grey: the three channels alike
    assert np.array_equal(marked[11:49, 21:59], plain[11:49, 21:59])  # inside, as without a box
    assert tuple(marked[10, 30]) == UNSCORED_FRAME and tuple(marked[30, 59]) == UNSCORED_FRAME  # the frame
