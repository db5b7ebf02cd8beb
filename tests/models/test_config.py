from pathlib import Path

import pytest

from padim.models.config import ConfigError, PadimConfig, read_config_file
from padim.models.data.changes import Expected
from padim.models.options import OPTIONS


def test_defaults_follow_the_paper():
    c = PadimConfig()
    assert (
        c.features.backbone,
        c.features.stages,
        c.features.image_size,
        c.embedding_dim_or_default(),
        c.gaussian.epsilon,
    ) == (
        "resnet18",
        ("layer1", "layer2", "layer3"),
        224,
        100,
        0.01,
    )
    assert PadimConfig(backbone="wide_resnet50_2").embedding_dim_or_default() == 550
    # the default follows the backbone, also when it is changed later
    assert PadimConfig().replace(backbone="wide_resnet50_2").embedding_dim_or_default() == 550


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"backbone": "vgg"}, "choose one of: resnet18, resnet34"),
        ({"image_size": 100}, "multiple of 16"),
        ({"reduction": "pca"}, "random, semi_orthogonal"),
        ({"embedding_dim": 500}, "from 1 to 448"),
        ({"layers": ("layer1", "layer4"), "image_size": 48}, "multiple of 32 .*layer4 has stride 32"),
        ({"layers": ("layer3", "layer1")}, "shallowest first"),
        ({"layers": ("layer9",)}, "choose from resnet18's stages: layer1 \\(stride 4\\)"),
        ({"backbone": "vgg16", "layers": ("layer1",)}, "choose from vgg16's stages: features.15 \\(stride 4\\)"),
        ({"device": "tpu"}, "auto, cpu, cuda"),
        ({"false_alarm_rate": 0.9}, "from 1e-06 to 0.5"),
        ({"false_alarm_rate": True}, "from 1e-06 to 0.5"),
        ({"calibration_folds": 1}, "from 2 to 1000"),
        ({"epsilon": -1}, ">= 0"),
        ({"neighbourhood": 2}, "neighbourhood: 2 is not allowed; choose one of: 1, 3, 5"),
        ({"neighbourhood": True}, "choose one of: 1, 3, 5"),
        ({"image_score": "max"}, "image_score: 'max' is not allowed; choose one of: map_max, patch_max, top_mean"),
        ({"top_fraction": 0}, "above 0 and at most 0.5"),
        ({"top_fraction": 0.9}, "above 0 and at most 0.5"),
        ({"roi": (0, 0, 100)}, "roi: .* use x,y,width,height in pixels of the picture"),
        ({"roi": (-1, 0, 100, 100)}, "x and y >= 0"),
        ({"roi": (0, 0, 100, 8)}, "width and height >= 16"),
        ({"roi": (0, 0, 100.5, 100)}, "integers"),
        ({"resize": "stretch"}, "resize: 'stretch' is not allowed; choose one of: squash, crop, pad"),
        ({"tiles": "2by2"}, "tiles: '2by2' is not allowed; use ROWSxCOLS with 1 to 8 of each"),
        ({"tiles": (0, 2)}, "1 to 8 of each"),
        ({"tiles": (9, 1)}, "1 to 8 of each"),
        ({"tiles": (8, 8), "image_size": 1536}, "within 8192 pixels a side"),
        ({"tile_overlap": 0.6, "tiles": (2, 2)}, "from 0 to 0.5"),
        ({"tile_overlap": 0.25}, "set tiles too"),
        ({"tile_statistics": "each"}, "tile_statistics: 'each' is not allowed; choose one of: position, shared"),
        ({"expect": "lamp=0.1"}, "expect: 'lamp=0.1' is not a change; write NAME=VALUE with NAME one of brightness"),
        ({"expect": "shift=100"}, "expect: shift=100.0 is not allowed; use a number from 0 to 64"),
        ({"expect": 3}, "expect: 3 is not allowed; use a list of change=bound .* or a preset: stable, typical, rough"),
        ({"fit_changes": "yes"}, "fit_changes: 'yes' is not allowed; use true or false"),
    ],
)
def test_bad_values_say_what_is_allowed(changes, message):
    with pytest.raises(ConfigError, match=message):
        PadimConfig(**changes)


def test_expected_changes_are_kept_as_their_bounds_and_decide_the_calibration():
    assert (
        PadimConfig(expect="typical").gaussian.expect == "brightness=0.1,contrast=0.1,shift=3,rotate=1,blur=1,jpeg=80"
    )
    assert (
        PadimConfig(expect="stable").gaussian.expect == ""
        and PadimConfig(expect="shift=2, blur=0.5").gaussian.expect == "shift=2,blur=0.5"
    )
    base = PadimConfig(expect="", fit_changes=False)
    # the calibration's scores (and, fitted, the statistics) depend on them: --resume and merge keep them
    assert base.differences(base.replace(expect="typical", fit_changes=True)) == ["expect", "fit_changes"]
    assert not PadimConfig(expect="", fit_changes=True).copies_fitted  # nothing to fit without declared changes
    assert PadimConfig(expect="shift=1", fit_changes=True).rows_per_picture == 2
    assert PadimConfig(expect="shift=1", tiles=(2, 2), tile_statistics="shared").spooled_rows_per_picture == 8


def test_from_mapping_rejects_unknown_keys_listing_allowed():
    with pytest.raises(ConfigError, match="unknown option.*image_sise.*allowed: backbone, weights"):
        PadimConfig.from_mapping({"image_sise": 64})


def test_the_earlier_spelling_of_embedding_dim_is_read():
    assert PadimConfig.from_mapping({"features": 40}).features.embedding_dim == 40


def test_which_fields_shape_the_statistics():
    base = PadimConfig()
    assert base.differences(base.replace(batch_size=4, device="cpu", false_alarm_rate=0.05)) == []
    assert base.differences(base.replace(image_size=128, seed=3)) == ["image_size", "seed"]
    assert base.with_run_options(PadimConfig(batch_size=4, decode_workers=0)).run.batch_size == 4
    # averaging neighbours changes every embedding; how a score is read from the map does not
    assert base.differences(base.replace(neighbourhood=1, image_score="patch_max", blur_sigma=4.0)) == ["neighbourhood"]


def test_the_default_is_the_measured_winner_and_the_paper_is_one_file_away():
    # benchmarks/quality.py: neighbourhood 3 without smoothing won on most categories, and --expect rough with its
    # copies fitted was the one calibration within its promise under every nuisance (docs/quality.md)
    c = PadimConfig()
    assert (c.gaussian.neighbourhood, c.scoring.image_score, c.scoring.blur_sigma, c.gaussian.calibration_folds) == (
        3,
        "map_max",
        0.0,
        "loo",
    )
    assert c.expected == Expected.parse("rough") and c.copies_fitted
    # benchmarks/real.py (ELPV) beside benchmarks/shift.py (photographed and generated): the weight the statistics
    # ask for, and the cover trimmed of what the training pictures already show (docs/quality.md)
    assert c.gaussian.shrinkage == "auto" and c.gaussian.trim_cover
    # ELPV with random resnet18 and HED's VGG16 beside the drawn sets: each picture's brightness set by one gain, a
    # lamp's drift taken out (another region a fifth brighter: 2 of 125 flagged, 26 without; docs/quality.md)
    assert c.features.standardise == "gain"
    paper, _ = read_config_file(Path(__file__).resolve().parents[2] / "configs" / "paper.yaml")
    assert (
        paper.gaussian.neighbourhood,
        paper.scoring.image_score,
        paper.scoring.blur_sigma,
        paper.gaussian.expect,
    ) == (1, "map_max", 4.0, "")
    assert paper == PadimConfig(neighbourhood=1, blur_sigma=4.0, expect="stable", shrinkage=0.0, standardise="none")
    assert not paper.copies_fitted
    # the recipe on any backbone's own stages and D (the paper's: resnet18 100, wide_resnet50_2 550)
    on_vgg = read_config_file("paper")[0].replace(backbone="vgg16")
    assert on_vgg.features.stages == ("features.15", "features.22", "features.29")
    assert on_vgg.embedding_dim_or_default() == 100
    assert read_config_file("paper")[0].replace(backbone="wide_resnet50_2").embedding_dim_or_default() == 550


def test_retired_hold_out_options_say_what_replaced_them():
    with pytest.raises(ConfigError, match="holdout_fraction, min_holdout no longer exist.*false_alarm_rate"):
        PadimConfig.from_mapping({"holdout_fraction": 0.1, "min_holdout": 3})


def test_replace_ignores_none_and_is_frozen():
    c = PadimConfig().replace(image_size=64, backbone=None)
    assert c.features.image_size == 64 and c.features.backbone == "resnet18"
    with pytest.raises(AttributeError):
        c.image_size = 32


@pytest.mark.parametrize("name", ["demo", "resnet18", "wide_resnet50_2"])
def test_the_shipped_configs_load_with_current_names(name):
    from pathlib import Path

    import yaml

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml"
    values = yaml.safe_load(path.read_text())
    assert set(values) <= set(OPTIONS), "configs use the current option names"
    config = PadimConfig.from_mapping(values, source=str(path))
    assert config.gaussian.calibration_folds == "loo" and config.embedding_dim_or_default() == values["embedding_dim"]


def test_tiles_from_yaml_or_text_lay_out_the_input_and_shape_the_statistics(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tiles: 2x3\ntile_overlap: 0.25\ntile_statistics: shared\n")
    config, given = read_config_file(path)
    assert config.framing.tiles == (2, 3) and given == {"tiles", "tile_overlap", "tile_statistics"}
    assert PadimConfig(tiles=[2, 3]).framing.tiles == (2, 3)  # a header's list
    # 224 px tiles on the 56-cell layer1 grid: a quarter is 14 cells = 56 px, so tiles start every 168 px
    assert config.tiling.overlap == 14 and config.tiling.step == 168 and config.input_shape == (392, 560)
    assert config.rows_per_image == 6 and config.replace(tile_statistics="position").rows_per_image == 1
    assert PadimConfig().input_shape == (224, 224) and PadimConfig().tile_count == 1
    assert PadimConfig().differences(config) == ["tiles", "tile_overlap", "tile_statistics"]  # resume/merge keep them


def test_a_region_from_yaml_is_a_tuple_and_shapes_the_statistics(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("roi: [10, 20, 300, 200]\nresize: pad\n")
    config, given = read_config_file(path)
    assert config.framing.roi == (10, 20, 300, 200) and config.framing.resize == "pad" and given == {"roi", "resize"}
    assert PadimConfig().differences(config) == ["roi", "resize"]  # a resume or merge must keep them


def test_the_stages_follow_the_backbone_unless_layers_names_them():
    vgg = PadimConfig(backbone="vgg16")
    assert vgg.features.layers is None and vgg.features.stages == ("features.15", "features.22", "features.29")
    assert vgg.embedding_dim_or_default() == 100 and vgg.tiling.cell == 4
    followed = PadimConfig().replace(backbone="efficientnet_b0").features.stages
    assert followed == ("features.2", "features.3", "features.5")
    assert PadimConfig(backbone="mobilenet_v3_small").embedding_dim_or_default() == 88  # 16 + 24 + 48: every channel
    # what a file stores is what was built: the stages, whatever the default becomes
    stored = vgg.stored(100)
    assert stored["layers"] == ["features.15", "features.22", "features.29"]
    assert PadimConfig.from_stored(stored, "file", older=False).features.layers == vgg.features.stages
    # named stages stay named: another backbone does not have them
    with pytest.raises(ConfigError, match=r"layers: \['layer2', 'layer3'\] is not allowed; choose from vgg16's stages"):
        PadimConfig(layers=("layer2", "layer3")).replace(backbone="vgg16")
    deep = PadimConfig(backbone="convnext_tiny", layers=("features.3", "features.7"), image_size=64)
    assert deep.features.stages == ("features.3", "features.7") and deep.embedding_dim_or_default() == 100
    with pytest.raises(ConfigError, match="multiple of 32 .*features.7 has stride 32"):
        deep.replace(image_size=48)
