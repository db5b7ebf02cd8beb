"""Heat maps: the colour ramp, the blend over the image, the mask, the demo label."""

import numpy as np
from PIL import Image

from padim.models.visualize import _ANCHORS, colorize, mask_image, overlay


def test_ramp_runs_through_its_anchors_and_clips():
    positions = np.linspace(0, 1, len(_ANCHORS))
    np.testing.assert_array_equal(colorize(positions[None, :])[0], _ANCHORS.round().astype(np.uint8))
    np.testing.assert_array_equal(colorize(np.array([[-3.0, 7.0]]))[0], _ANCHORS[[0, -1]].astype(np.uint8))
    halfway = colorize(np.array([[0.5 / (len(_ANCHORS) - 1)]]))[0, 0]  # between the first two anchors
    np.testing.assert_array_equal(halfway, ((_ANCHORS[0] + _ANCHORS[1]) / 2).round().astype(np.uint8))


def test_overlay_blends_the_ramp_over_the_image_at_its_size():
    image = Image.new("RGB", (40, 30), (200, 100, 50))
    values = np.tile(np.linspace(0, 1, 40), (30, 1))  # (H, W) at the image's size
    blended = overlay(image, values, alpha=0.25)
    assert blended.size == image.size and blended.mode == "RGB"
    expected = Image.blend(image, Image.fromarray(colorize(values)), 0.25)  # Pillow's own blend
    np.testing.assert_array_equal(np.asarray(blended), np.asarray(expected))


def test_a_label_is_drawn_and_only_where_it_is():
    image = Image.new("RGB", (120, 40), (90, 90, 90))
    values = np.zeros((40, 120))
    plain, labelled = (np.asarray(overlay(image, values, label=label)) for label in (None, "RANDOM WEIGHTS"))
    changed = np.argwhere((plain != labelled).any(axis=2))
    assert len(changed) and changed[:, 0].max() < 20  # a band at the top, the rest untouched


def test_mask_is_white_at_or_above_the_threshold():
    values = np.array([[0.2, 0.5], [0.7, 0.49]])
    mask = mask_image(values, 0.5)
    assert mask.mode == "L"
    np.testing.assert_array_equal(np.asarray(mask), [[0, 255], [255, 0]])
