"""The generated data sets: MVTec layout, masks where the defects are, placed parts that stay placed."""

import json

import numpy as np
import pytest
from helpers import run_cli
from PIL import Image

from padim.models.data.synthetic import MORE_DEFECTS, OBJECTS, add_defect, texture
from padim.models.evaluation.metrics import read_mvtec_category


def test_synth_writes_parts_and_the_harder_defects_in_the_mvtec_layout(tmp_path):
    result = run_cli(
        "-q",
        "synth",
        tmp_path,
        "--categories",
        "pill,board",
        "--defects",
        "crack,speck",
        "--train",
        3,
        "--test-good",
        2,
        "--test-defect",
        2,
        "--size",
        96,
    )
    written = json.loads(result.stdout)["categories"]
    assert [p.rsplit("/", 1)[-1] for p in written] == ["pill", "board"]
    samples = read_mvtec_category(tmp_path / "pill")
    assert sorted({s.defect for s in samples}) == ["crack", "good", "speck"]
    for sample in samples:
        if sample.defect == "good":
            continue
        mask = np.asarray(Image.open(sample.mask_path)) > 127
        assert mask.any() and Image.open(sample.path).size == (96, 96)


def test_unknown_defects_and_categories_list_what_exists(tmp_path):
    result = run_cli("synth", tmp_path, "--defects", "dent", check=False)
    assert result.returncode == 1 and "scratch, stain, hole, crack, speck" in result.stderr
    result = run_cli("synth", tmp_path, "--categories", "bottle", check=False)
    assert result.returncode == 1 and "pill, nut, board" in result.stderr


@pytest.mark.parametrize("category", OBJECTS)
def test_a_placed_part_stays_in_place_and_varies_a_little(category):
    rng = np.random.default_rng(0)
    images = np.stack([texture(category, 128, rng) for _ in range(6)])  # (6, S, S, 3)
    spread_between = images.std(axis=0).mean()
    # the same part at nearly the same place: pictures differ far less than the part differs from its background
    assert spread_between < 0.25 * images.std()
    assert not np.allclose(images[0], images[1], atol=0.01)


@pytest.mark.parametrize("defect", MORE_DEFECTS)
def test_the_harder_defects_are_small_and_change_the_pixels_their_mask_covers(defect):
    rng = np.random.default_rng(1)
    image = texture("carpet", 256, rng)
    changed, mask = add_defect(image, defect, rng)
    area = mask.mean()
    assert 0.0002 < area < 0.01, area  # a speck: 0.03-0.15% of the picture; a crack: thin
    inside = np.abs(changed - image).sum(-1)[mask].mean()
    outside = np.abs(changed - image).sum(-1)[~mask].mean()
    assert inside > 0.2 and outside < 0.01


@pytest.mark.parametrize("category", ["leather", "weave", "pill"])
def test_another_region_is_the_same_material_a_little_shifted(category):
    """``region``: every uniform draw moved by half its width per region; noise and print stay as drawn."""

    def pictures(region):
        rng = np.random.default_rng(3)
        return np.stack([texture(category, 64, rng, region) for _ in range(16)])

    here, there, same = pictures(0.0), pictures(1.0), pictures(0.0)
    assert np.array_equal(here, same)  # region 0: the generator as it always was
    assert there.min() >= 0 and there.max() <= 1 and abs(there.std() - here.std()) < 0.5 * here.std()
    assert not np.allclose(here, there)
    if category != "pill":  # a material's tint U(0.95, 1.05) moves to U(1.0, 1.1): brighter on average
        assert there.mean() > here.mean()
