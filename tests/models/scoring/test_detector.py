"""The fitted detector: file round trip, integrity, batch independence."""

import json

import numpy as np
import pytest
import torch
from helpers import defaults_as, older_format, older_format_of, tensor_byte_ranges
from PIL import Image

from padim.core.artifact import FORMAT_VERSION, ArtifactError, load_artifact, save_artifact
from padim.core.scoring import squared_mahalanobis
from padim.models import PadimConfig, PadimDetector, TrainingImage, fit_detector, list_images
from padim.models.features.embedding import FeatureEmbedder, model_input, model_input_array, stacked
from padim.models.fit.model_file import load_detector, load_fit, save_detector

# neighbourhood 1: what every file before format 4 was fitted with, standardise none: before format 12 (the
# older-format tests below relabel its files)
CONFIG = PadimConfig(
    weights="random",
    image_size=64,
    batch_size=8,
    decode_workers=0,
    calibration_folds=5,
    neighbourhood=1,
    standardise="none",
)


@pytest.fixture(scope="module")
def images(dataset) -> list[TrainingImage]:
    return [TrainingImage(p, p.name) for p in list_images(dataset / "train" / "good")]


@pytest.fixture(scope="module")
def detector(images) -> PadimDetector:
    return fit_detector(CONFIG, images, progress=False)[0]


def pictures(images, count):
    return [Image.open(i.path).convert("RGB") for i in images[:count]]


def test_round_trip_and_float16_storage(detector, images, tmp_path):
    batch = detector.preprocess(pictures(images, 6))
    exact = detector.score(batch)
    for dtype in (torch.float32, torch.float16):
        path = tmp_path / f"{dtype}.padim"
        save_detector(detector, path, precision_dtype=dtype)
        loaded = load_detector(path, device="cpu", with_statistics=True)
        out = loaded.score(batch)
        tolerance = 1e-6 if dtype == torch.float32 else 1e-3  # the promise for float16 (docs/file-format.md)
        rel = ((out.raw_scores - exact.raw_scores).abs() / exact.raw_scores).max()
        assert rel <= tolerance, (dtype, float(rel))
        # kept as stored: float16 factors take half the memory when loaded, not only on disk
        assert loaded.model.precision_factor.dtype == dtype
        if dtype == torch.float16:  # chunked upcast == upcasting the same values first
            embedding = loaded.model.embedder(batch)
            first = squared_mahalanobis(embedding, loaded.model.mean, loaded.model.precision_factor.float())
            torch.testing.assert_close(
                squared_mahalanobis(embedding, loaded.model.mean, loaded.model.precision_factor),
                first,
                rtol=1e-6,
                atol=0,
            )
        assert loaded.calibration == detector.calibration
        # stored tensors read back: exact by construction
        assert torch.equal(loaded.statistics.comoment, detector.statistics.comoment)
        assert torch.equal(loaded.image_digests, detector.image_digests)
    slim = tmp_path / "slim.padim"
    save_detector(detector, slim, with_statistics=False)
    accumulator_bytes = 16 * 16 * (100 * 101 // 2) * 8  # packed float64 comoment, P=16x16, D=100
    saved = (tmp_path / "torch.float16.padim").stat().st_size - slim.stat().st_size
    assert accumulator_bytes <= saved < accumulator_bytes * 1.1

    with pytest.raises(ArtifactError, match="slim"):
        load_fit(slim)


def test_a_flipped_bit_in_each_stored_tensor_is_refused(detector, tmp_path):
    clean = tmp_path / "clean.padim"
    save_detector(detector, clean)
    data = clean.read_bytes()
    ranges = tensor_byte_ranges(clean)
    assert {"mean", "precision_factor", "calibration.scores", "statistics.comoment"} <= set(ranges)
    broken = tmp_path / "broken.padim"
    for name, (start, end) in ranges.items():
        flipped = bytearray(data)
        flipped[(start + end) // 2] ^= 0x10
        broken.write_bytes(bytes(flipped))
        with pytest.raises(ArtifactError, match=f"tensor '{name}' does not match its digest"):
            load_detector(broken, device="cpu", with_statistics=True)


def test_a_nan_in_the_mean_is_refused_even_with_a_valid_digest(detector, tmp_path):
    path = tmp_path / "m.padim"
    save_detector(detector, path)
    tensors, header = load_artifact(path)
    tensors["mean"][3, 7] = float("nan")
    save_artifact(path, tensors, header)  # digests now match the NaN
    with pytest.raises(ArtifactError, match="'mean' holds NaN"):
        load_detector(path, device="cpu")


def test_non_finite_scores_are_found(detector, images):
    batch = detector.preprocess(pictures(images, 3))
    mean = detector.model.mean.clone()
    detector.model.mean[5, 0] = float("nan")
    try:
        out = detector.score(batch)
    finally:
        detector.model.mean.copy_(mean)
    assert out.non_finite() == [0, 1, 2]
    assert detector.score(batch).non_finite() == []


def test_scores_do_not_depend_on_the_batch(detector, images):
    pics = pictures(images, 5)
    together = detector.score(detector.preprocess(pics)).raw_scores
    alone = torch.cat([detector.score(detector.preprocess([p])).raw_scores for p in pics])
    np.testing.assert_allclose(together.numpy(), alone.numpy(), rtol=1e-5)


def test_the_scorer_takes_8_bit_pixels_and_normalised_float_input_alike(detector, images):
    """``preprocess`` hands on uint8 pixels (a quarter of float32's bytes to a device); ``score`` normalises them
    where it scores. A caller's own float32 input, already normalised, scores the same."""
    pixels = detector.preprocess(pictures(images, 3))
    assert pixels.dtype == torch.uint8
    normalised = model_input(pixels)
    assert normalised.dtype == torch.float32 and float(normalised.abs().max()) > 1  # ImageNet's mean and std
    torch.testing.assert_close(detector.score(pixels).raw_scores, detector.score(normalised).raw_scores)
    stacked_batch = stacked(list(pixels), torch.device("cpu"))  # how the service forms a batch for the CPU
    assert torch.equal(stacked_batch, pixels)
    # a graph runtime is handed the same numbers, made in NumPy (model_input_array)
    assert np.array_equal(model_input_array(pixels), normalised.numpy())
    assert model_input_array(normalised).dtype == np.float32 and np.array_equal(
        model_input_array(normalised), normalised
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_batch_for_the_gpu_is_stacked_in_page_locked_memory_and_scores_as_on_the_cpu(detector, images, tmp_path):
    pixels = detector.preprocess(pictures(images, 3))
    batch = stacked(list(pixels), torch.device("cuda"))
    assert batch.is_pinned() and torch.equal(batch, pixels)
    path = tmp_path / "m.padim"
    save_detector(detector, path)
    on_gpu = load_detector(path, device="cuda").score(batch).raw_scores.cpu()
    torch.testing.assert_close(on_gpu, detector.score(pixels).raw_scores, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "largest, sizes",
    [
        (1, (1,)),
        (3, (1, 2, 3)),
        (8, (1, 2, 4, 8)),
        (12, (1, 2, 4, 8, 12)),
        (20, (1, 2, 4, 8, 16, 20)),
        (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
    ],
)
def test_cuda_graphs_are_captured_for_powers_of_two_to_8_then_every_multiple_of_8(largest, sizes):
    from padim.models.scoring.model import graph_sizes

    assert graph_sizes(largest) == sizes
    waste = [min(s for s in sizes if s >= n) - n for n in range(1, largest + 1)]
    assert max(waste[8:], default=0) <= 7  # past 8 pictures, a batch pads by at most 7


def test_cuda_graphs_are_none_on_the_cpu_and_scores_stay_eager(detector, images):
    pixels = detector.preprocess(pictures(images, 3))
    before = detector.score(pixels).raw_scores
    assert detector.capture_graphs(8) == () and detector.graphs is None
    assert "cuda_graphs" not in detector.describe()
    torch.testing.assert_close(detector.score(pixels).raw_scores, before, rtol=0, atol=0)


def test_semi_orthogonal_reduction_fits(images):
    config = CONFIG.replace(reduction="semi_orthogonal", embedding_dim=40)
    detector, _ = fit_detector(config, images[:10], progress=False)
    assert detector.embedding.projection.shape == (448, 40)
    assert detector.model.precision_factor.shape == (16 * 16, 40, 40)


def test_format_one_models_still_load_and_resume(detector, images, tmp_path, caplog):
    """A file as the first version wrote it: held-out calibration, no digests."""
    from safetensors.torch import save_file

    path = tmp_path / "new.padim"
    save_detector(detector, path)
    tensors, header = load_artifact(path)
    tensors["calibration.normal_scores"] = tensors.pop("calibration.scores")[:5]
    del tensors["image_digests"]
    for name in ("count", "mean", "comoment"):  # format 1 called the statistics accumulators
        tensors[f"accumulator.{name}"] = tensors.pop(f"statistics.{name}")
    old = {
        k: v
        for k, v in header.items()
        if k
        not in (
            "tensor_sha256",
            "header_sha256",
            "verified",
            "calibration",
            "fits",
            "calibration_source",
            "unreadable_image_count",
            "has_statistics",
        )
    }
    old["config"] = {
        k: v for k, v in old["config"].items() if k not in ("false_alarm_rate", "calibration_folds", "embedding_dim")
    }
    old["config"].update(holdout_fraction=0.1, min_holdout=3, threshold_quantile=0.99, features=100)
    old.update(
        format_version=1,
        training_image_count=30,
        holdout_image_count=5,
        has_accumulators=True,
        calibration={"quantile": 0.99, "threshold": 21.5, "scale": 1.5, "holdout_count": 5},
    )
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(tmp_path / "old.padim"),
        metadata={"padim": json.dumps(old)},
    )
    with caplog.at_level("WARNING"):
        loaded = load_detector(tmp_path / "old.padim", device="cpu")
    assert "integrity is not verified" in caplog.text and "train it again" in caplog.text
    assert loaded.calibration.threshold == 21.5 and loaded.calibration.method == "quantile"
    assert loaded.describe()["verified"] is False and loaded.provenance.calibration_source == "held_out"
    batch = detector.preprocess(pictures(images, 2))
    torch.testing.assert_close(
        loaded.score(batch).raw_scores, detector.score(batch).raw_scores, rtol=1e-3, atol=0
    )  # float16 factors
    resumed, report = fit_detector(CONFIG, images[:4], resume=load_fit(tmp_path / "old.padim"), progress=False)
    assert resumed.calibration.earlier_scores == 5
    assert int(resumed.statistics.count) == int(detector.statistics.count) + 4 * resumed.config.rows_per_picture


def test_format_two_models_load_score_resume_and_take_a_new_threshold(detector, images, dataset, tmp_path):

    save_detector(detector, tmp_path / "new.padim")
    older_format(tmp_path / "new.padim", tmp_path / "two.padim", 2)
    loaded = load_detector(tmp_path / "two.padim", device="cpu", with_statistics=True)
    assert loaded.provenance.verified
    assert loaded.calibration == detector.calibration and torch.equal(
        loaded.statistics.comoment, detector.statistics.comoment
    )
    batch = detector.preprocess(pictures(images, 2))
    torch.testing.assert_close(loaded.score(batch).raw_scores, detector.score(batch).raw_scores, rtol=1e-6, atol=0)
    # evaluate --calibrate on it: written again, in this format
    from padim.core.artifact import read_header
    from padim.models.fit.model_file import store_calibration

    store_calibration(tmp_path / "two.padim", loaded.calibration.with_threshold(21.5))
    header = read_header(tmp_path / "two.padim")
    assert header["format_version"] == FORMAT_VERSION and header["has_statistics"]
    assert header["calibration"]["threshold"] == 21.5 and header["calibration"]["method"] == "manual"
    fresh = [TrainingImage(p, f"more/{p.name}") for p in list_images(dataset / "test" / "good")]
    resumed, _ = fit_detector(CONFIG, fresh, resume=load_fit(tmp_path / "two.padim"), progress=False)
    assert int(resumed.statistics.count) == (30 + len(fresh)) * resumed.config.rows_per_picture
    assert resumed.calibration.earlier_scores == 30


def test_scoring_options_travel_in_the_file_and_the_scorer_honours_them(images, tmp_path):
    config = CONFIG.replace(neighbourhood=5, image_score="top_mean", top_fraction=0.05, blur_sigma=2.0)
    fitted = fit_detector(config, images, progress=False)[0]
    save_detector(fitted, tmp_path / "options.padim")
    _, header = load_artifact(tmp_path / "options.padim")
    assert header["format_version"] == FORMAT_VERSION
    assert {k: header["config"][k] for k in ("neighbourhood", "image_score", "top_fraction", "blur_sigma")} == {
        "neighbourhood": 5,
        "image_score": "top_mean",
        "top_fraction": 0.05,
        "blur_sigma": 2.0,
    }
    loaded = load_detector(tmp_path / "options.padim", device="cpu")
    assert loaded.model.embedder.embedding.neighbourhood == 5 and loaded.model.scoring.image_score == "top_mean"
    batch = fitted.preprocess(pictures(images, 4))
    out = loaded.score(batch)
    # the score is the mean of the top 5% of each map, whatever the map's own maximum
    k = round(0.05 * 64 * 64)
    expected = out.maps.flatten(1).double().sort(dim=1).values[:, -k:].mean(1)
    torch.testing.assert_close(out.raw_scores.double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.raw_scores, fitted.score(batch).raw_scores, rtol=1e-3, atol=0)  # float16 factors
    # the embedding averaged 5 x 5 neighbours: an unaveraged detector of the same seed scores otherwise
    plain = fit_detector(config.replace(neighbourhood=1), images, progress=False)[0]
    assert not torch.allclose(plain.score(batch).raw_scores, out.raw_scores, rtol=1e-2)


@pytest.mark.parametrize("sigma, had_sigma", [(2.0, True), (4.0, False)], ids=["sigma-written", "sigma-missing"])
def test_a_format_three_file_scores_as_it_did_whatever_the_defaults(images, tmp_path, monkeypatch, sigma, had_sigma):
    # fitted as every model was before the options: no neighbourhood, the map's maximum (a header
    # without blur_sigma, which none was, would have meant the default of then: 4)
    before = fit_detector(
        CONFIG.replace(neighbourhood=1, image_score="map_max", blur_sigma=sigma), images, progress=False
    )[0]
    save_detector(before, tmp_path / "new.padim")
    tensors, header = load_artifact(tmp_path / "new.padim")
    for key in ("neighbourhood", "image_score", "top_fraction") + (() if had_sigma else ("blur_sigma",)):
        del header["config"][key]
    older_format_of(tensors, header, tmp_path / "three.padim", 3)
    assert (
        PadimConfig().gaussian.neighbourhood == 3 and PadimConfig().scoring.blur_sigma == 0
    )  # today's defaults differ
    loaded = load_detector(tmp_path / "three.padim", device="cpu")
    assert (
        loaded.config.gaussian.neighbourhood,
        loaded.config.scoring.image_score,
        loaded.config.scoring.blur_sigma,
    ) == (1, "map_max", sigma)
    # whatever the defaults: an old file is read with what it computed, not with today's default
    defaults_as(monkeypatch, image_score="patch_max", blur_sigma=8.0)
    batch = before.preprocess(pictures(images, 3))
    torch.testing.assert_close(loaded.score(batch).raw_scores, before.score(batch).raw_scores, rtol=1e-3, atol=0)
    # and resumed, it stays what it was
    resumed = load_fit(tmp_path / "three.padim")
    assert resumed.config.gaussian.neighbourhood == 1 and resumed.embedding.neighbourhood == 1


def test_the_framing_travels_in_the_file_and_a_format_four_file_squashes_the_whole_picture(images, tmp_path):
    framed = fit_detector(CONFIG.replace(roi=(8, 16, 80, 64), resize="pad"), images, progress=False)[0]
    save_detector(framed, tmp_path / "framed.padim")
    _, header = load_artifact(tmp_path / "framed.padim")
    assert header["format_version"] >= 5 and header["config"]["roi"] == [8, 16, 80, 64]
    loaded = load_detector(tmp_path / "framed.padim", device="cpu")
    assert loaded.config.framing.roi == (8, 16, 80, 64) and loaded.framing.resize == "pad"
    batch = pictures(images, 3)
    assert torch.equal(loaded.preprocess(batch), framed.preprocess(batch))
    # the region is what was fitted: another framing of the same pictures is another input
    assert not torch.equal(
        framed.preprocess(batch), fit_detector(CONFIG, images[:3], progress=False)[0].preprocess(batch)
    )
    # a format-4 file (no roi, no resize) is read as it was fitted: the whole picture, squashed
    plain = fit_detector(CONFIG, images, progress=False)[0]
    save_detector(plain, tmp_path / "plain.padim")
    tensors, header = load_artifact(tmp_path / "plain.padim")
    for key in ("roi", "resize"):
        del header["config"][key]
    older_format_of(tensors, header, tmp_path / "four.padim", 4)
    four = load_detector(tmp_path / "four.padim", device="cpu")
    assert four.config.framing.roi is None and four.config.framing.resize == "squash" and four.framing.is_whole_picture
    torch.testing.assert_close(
        four.score(plain.preprocess(batch)).raw_scores,
        plain.score(plain.preprocess(batch)).raw_scores,
        rtol=1e-6,
        atol=0,
    )


@pytest.mark.parametrize("statistics", ["position", "shared"])
def test_tiles_travel_in_the_file_and_a_format_five_file_is_untiled(images, tmp_path, statistics):
    config = CONFIG.replace(tiles=(2, 3), tile_overlap=0.25, tile_statistics=statistics)
    tiled = fit_detector(config, images, progress=False)[0]
    save_detector(tiled, tmp_path / "tiled.padim")
    tensors, header = load_artifact(tmp_path / "tiled.padim")
    assert header["format_version"] == FORMAT_VERSION and header["config"]["tiles"] == [2, 3]
    grid = tiled.model.grid_shape[0] * tiled.model.grid_shape[1]
    assert tensors["mean"].shape[0] == (6 * grid if statistics == "position" else grid)  # statistics per tile position
    loaded = load_detector(tmp_path / "tiled.padim", device="cpu")
    assert loaded.config.framing.tiles == (2, 3) and loaded.config.framing.tile_statistics == statistics
    batch = loaded.preprocess(pictures(images, 3))
    height, width = config.input_shape
    assert batch.shape == (3, 3, height, width) and width > height  # two rows, three columns of tiles
    out = loaded.score(batch)
    assert out.maps.shape == (3, height, width)
    torch.testing.assert_close(out.raw_scores, tiled.score(batch).raw_scores, rtol=1e-6, atol=0)
    assert loaded.describe()["tiles"] == [2, 3] and loaded.describe()["input_shape"] == [height, width]
    # a format-5 file (no tiles) is read as it was fitted: one tile, the whole input
    plain = fit_detector(CONFIG, images, progress=False)[0]
    save_detector(plain, tmp_path / "plain.padim")
    tensors, header = load_artifact(tmp_path / "plain.padim")
    for key in ("tiles", "tile_overlap", "tile_statistics"):
        del header["config"][key]
    older_format_of(tensors, header, tmp_path / "five.padim", 5)
    five = load_detector(tmp_path / "five.padim", device="cpu")
    assert five.config.framing.tiles == (1, 1) and five.config.input_shape == (CONFIG.features.image_size,) * 2
    plain_batch = plain.preprocess(pictures(images, 3))
    torch.testing.assert_close(
        five.score(plain_batch).raw_scores, plain.score(plain_batch).raw_scores, rtol=1e-6, atol=0
    )


def test_each_tile_position_is_scored_as_that_crop_of_the_input(images):
    # a tiled model's embedding of a tile is the untiled embedding of that crop of its input: the same backbone
    tiled = fit_detector(CONFIG.replace(tiles=(2, 2)), images, progress=False)[0]
    untiled = FeatureEmbedder(CONFIG, tiled.backbone_weights, tiled.embedding)
    batch = tiled.preprocess(pictures(images, 2))
    rows = tiled.model.embedder(batch)  # (B, T * P, D)
    size = CONFIG.features.image_size
    for t, (top, left) in enumerate(tiled.config.tiling.origins):
        crop = untiled(batch[:, :, top : top + size, left : left + size])  # (B, P, D)
        pixels = crop.shape[1]
        torch.testing.assert_close(rows[:, t * pixels : (t + 1) * pixels], crop, rtol=1e-5, atol=1e-5)


def test_input_distances_travel_in_the_file_and_a_format_six_file_has_none(detector, images, tmp_path):
    calibration = detector.calibration
    assert len(calibration.input_distances) == calibration.count == 30  # one per out-of-fold score
    batch = detector.preprocess(pictures(images, 3))
    out = detector.score(batch)
    # the scorer's input distance: the mean of the picture's squared distances over every feature pixel
    squared = squared_mahalanobis(detector.model.embedder(batch), detector.model.mean, detector.model.precision_factor)
    torch.testing.assert_close(out.input_distances, squared.mean(1), rtol=1e-5, atol=0)
    save_detector(detector, tmp_path / "seven.padim")
    tensors, header = load_artifact(tmp_path / "seven.padim")
    assert (
        header["calibration"]["input_distances"] == 30 and tensors["calibration.input_distances"].dtype == torch.float64
    )
    assert load_detector(tmp_path / "seven.padim", device="cpu").calibration == calibration
    # a format-6 file: no input distances, everything else as it was
    del tensors["calibration.input_distances"], header["calibration"]["input_distances"]
    older_format_of(tensors, header, tmp_path / "six.padim", 6)
    six = load_detector(tmp_path / "six.padim", device="cpu")
    assert six.calibration.input_distances == () and six.calibration.scores == calibration.scores
    assert six.calibration.threshold == calibration.threshold
    from padim.core.drift import assess

    reading = assess(six.score(batch).raw_scores.repeat(20), six.calibration, None)
    assert reading.input_drift is None and reading.flag_rate is not None


def test_expected_changes_travel_in_the_file_and_a_format_seven_file_has_none(images, tmp_path, monkeypatch):
    from padim.models.data.changes import Expected

    declared = fit_detector(
        CONFIG.replace(expect="typical", fit_changes=True, trim_cover=False), images, progress=False
    )[0]
    save_detector(declared, tmp_path / "declared.padim", with_statistics=True)
    _, header = load_artifact(tmp_path / "declared.padim")
    assert header["format_version"] == FORMAT_VERSION
    assert header["config"]["expect"] == str(Expected.parse("typical")) and header["config"]["fit_changes"] is True
    loaded = load_detector(tmp_path / "declared.padim", device="cpu")
    assert loaded.config.expected == Expected.parse("typical") and loaded.describe()["calibration"]["fit_changes"]
    # the copies' scores set the threshold; the pictures' own travel beside them (read back exactly)
    assert loaded.calibration == declared.calibration and len(loaded.calibration.taken_scores) == len(images)
    assert loaded.calibration.reference_scores == loaded.calibration.taken_scores != loaded.calibration.scores
    assert load_fit(tmp_path / "declared.padim").config.copies_fitted  # a resume goes on with the same copies
    # a format-7 file (no expect, no fit_changes) is read as it was calibrated, whatever today's defaults
    plain = fit_detector(CONFIG.replace(expect="", fit_changes=False), images, progress=False)[0]
    save_detector(plain, tmp_path / "plain.padim")
    tensors, header = load_artifact(tmp_path / "plain.padim")
    for key in ("expect", "fit_changes"):
        del header["config"][key]
    older_format_of(tensors, header, tmp_path / "seven.padim", 7)
    defaults_as(monkeypatch, expect="rough", fit_changes=True)
    assert PadimConfig().gaussian.expect and PadimConfig().gaussian.fit_changes  # as if the defaults declared changes
    seven = load_detector(tmp_path / "seven.padim", device="cpu")
    assert seven.config.gaussian.expect == "" and not seven.config.copies_fitted
    assert seven.describe()["calibration"]["covers"].startswith("pictures like the training pictures")
    assert load_fit(tmp_path / "seven.padim").config.gaussian.expect == ""
    batch = plain.preprocess(pictures(images, 3))
    torch.testing.assert_close(seven.score(batch).raw_scores, plain.score(batch).raw_scores, rtol=1e-6, atol=0)
    assert seven.calibration == plain.calibration and seven.calibration.taken_scores == ()


def test_shrinkage_travels_in_the_file_and_a_format_nine_file_has_none(images, tmp_path, monkeypatch):
    """Format 10 stores ``shrinkage``; a file of format 9 or older was fitted without it and is read so, whatever
    today's default; a resume of a shrunk model goes on shrunk."""
    shrunk = fit_detector(CONFIG.replace(shrinkage=0.5), images, progress=False)[0]
    save_detector(shrunk, tmp_path / "shrunk.padim", with_statistics=True)
    _, header = load_artifact(tmp_path / "shrunk.padim")
    assert header["format_version"] == FORMAT_VERSION and header["config"]["shrinkage"] == 0.5
    loaded = load_detector(tmp_path / "shrunk.padim", device="cpu")
    assert loaded.config.gaussian.shrinkage == 0.5 and loaded.describe()["shrinkage"] == 0.5
    assert load_fit(tmp_path / "shrunk.padim").config.gaussian.shrinkage == 0.5
    plain = fit_detector(CONFIG.replace(shrinkage=0.0), images, progress=False)[0]
    batch = plain.preprocess(pictures(images, 3))
    assert not torch.allclose(loaded.score(batch).raw_scores, plain.score(batch).raw_scores, rtol=1e-3)
    save_detector(plain, tmp_path / "plain.padim")
    tensors, header = load_artifact(tmp_path / "plain.padim")
    del header["config"]["shrinkage"]
    older_format_of(tensors, header, tmp_path / "nine.padim", 9)
    defaults_as(monkeypatch, shrinkage=0.5)
    assert PadimConfig().gaussian.shrinkage == 0.5  # as if the default shrank
    nine = load_detector(tmp_path / "nine.padim", device="cpu")
    assert nine.config.gaussian.shrinkage == 0.0 and load_fit(tmp_path / "nine.padim").config.gaussian.shrinkage == 0
    torch.testing.assert_close(nine.score(batch).raw_scores, plain.score(batch).raw_scores, rtol=1e-6, atol=0)
    assert nine.calibration == plain.calibration


def test_standardise_travels_in_the_file_and_a_format_eleven_file_has_none(images, tmp_path, monkeypatch):
    """Format 12 stores ``standardise``; a file of format 11 or older was fitted without it and is read so, whatever
    today's default. A standardised model reads a brighter picture as the same picture; one without does not."""
    from padim.models.data.changes import Draw, apply

    lit = fit_detector(CONFIG.replace(standardise="channels"), images, progress=False)[0]
    save_detector(lit, tmp_path / "lit.padim", with_statistics=True)
    _, header = load_artifact(tmp_path / "lit.padim")
    assert header["format_version"] == FORMAT_VERSION >= 12 and header["config"]["standardise"] == "channels"
    loaded = load_detector(tmp_path / "lit.padim", device="cpu")
    assert loaded.config.features.standardise == "channels" and loaded.describe()["standardise"] == "channels"
    assert load_fit(tmp_path / "lit.padim").config.features.standardise == "channels"
    plain = fit_detector(CONFIG, images, progress=False)[0]
    taken = pictures(images, 4)
    brighter = [apply(picture, Draw(brightness=1.15)) for picture in taken]

    def moved(detector) -> float:  # the largest relative change of a picture's raw score, 15% more light
        before = detector.score(detector.preprocess(taken)).raw_scores
        after = detector.score(detector.preprocess(brighter)).raw_scores
        return float(((after - before).abs() / before).max())

    assert moved(loaded) < 0.05 and moved(plain) > 4 * moved(loaded), (moved(loaded), moved(plain))
    save_detector(plain, tmp_path / "plain.padim")
    tensors, header = load_artifact(tmp_path / "plain.padim")
    del header["config"]["standardise"]
    older_format_of(tensors, header, tmp_path / "eleven.padim", 11)
    defaults_as(monkeypatch, standardise="channels")
    assert PadimConfig().features.standardise == "channels"  # as if the default standardised
    eleven = load_detector(tmp_path / "eleven.padim", device="cpu")
    assert eleven.config.features.standardise == "none"
    batch = plain.preprocess(taken)
    torch.testing.assert_close(eleven.score(batch).raw_scores, plain.score(batch).raw_scores, rtol=1e-6, atol=0)
    assert eleven.calibration == plain.calibration


def test_gain_travels_in_the_file_and_a_format_eighteen_file_scores_as_it_did(detector, images, tmp_path, monkeypatch):
    """Format 19: ``standardise`` may be ``gain`` (each picture's brightness set, its contrast kept). A file of
    format 18 or older stored its mode (or none before 12) and is read with it, whatever today's default."""
    from padim.models.data.changes import Draw, apply

    gained = fit_detector(CONFIG.replace(standardise="gain"), images, progress=False)[0]
    save_detector(gained, tmp_path / "gain.padim")
    _, header = load_artifact(tmp_path / "gain.padim")
    assert header["format_version"] == FORMAT_VERSION >= 19 and header["config"]["standardise"] == "gain"
    loaded = load_detector(tmp_path / "gain.padim", device="cpu")
    assert loaded.config.features.standardise == "gain" and loaded.describe()["standardise"] == "gain"
    taken = pictures(images, 4)

    def moved(model, draw: Draw) -> float:  # the largest relative change of a picture's raw score
        before = model.score(model.preprocess(taken)).raw_scores
        after = model.score(model.preprocess([apply(picture, draw) for picture in taken])).raw_scores
        return float(((after - before).abs() / before).max())

    lamp = Draw(brightness=1.15)
    assert moved(loaded, lamp) < 0.05 and moved(detector, lamp) > 4 * moved(loaded, lamp)
    assert moved(loaded, Draw(contrast=0.7)) > 2 * moved(loaded, lamp)  # a contrast is the picture's own
    save_detector(detector, tmp_path / "plain.padim")
    tensors, header = load_artifact(tmp_path / "plain.padim")
    older_format_of(tensors, header, tmp_path / "eighteen.padim", 18)
    defaults_as(monkeypatch, standardise="gain")
    assert PadimConfig().features.standardise == "gain"  # as if the default were the gain
    eighteen = load_detector(tmp_path / "eighteen.padim", device="cpu")
    assert eighteen.config.features.standardise == "none"
    batch = detector.preprocess(taken)
    torch.testing.assert_close(eighteen.score(batch).raw_scores, detector.score(batch).raw_scores, rtol=1e-6, atol=0)
    assert eighteen.calibration == detector.calibration


def test_decode_workers_is_stored_so_and_a_format_fifteen_file_spelled_it_workers(detector, images, tmp_path):
    """Format 16 spells the decoding threads ``decode_workers`` (serve's ``--workers`` are API processes); a file
    of format 15 or older wrote ``workers``, and is read as before."""
    save_detector(detector, tmp_path / "new.padim", with_statistics=True)
    tensors, header = load_artifact(tmp_path / "new.padim")
    assert header["format_version"] == FORMAT_VERSION >= 16
    assert "decode_workers" in header["config"] and "workers" not in header["config"]
    header["config"]["workers"] = header["config"].pop("decode_workers")
    older_format_of(tensors, header, tmp_path / "fifteen.padim", 15)
    fifteen = load_detector(tmp_path / "fifteen.padim", device="cpu")
    assert load_fit(tmp_path / "fifteen.padim").config.run.decode_workers == header["config"]["workers"]
    batch = detector.preprocess(pictures(images, 3))
    torch.testing.assert_close(fifteen.score(batch).raw_scores, detector.score(batch).raw_scores, rtol=1e-6, atol=0)
    assert PadimConfig(workers=3).run.decode_workers == 3  # the Python keyword's earlier spelling too


def test_the_backbone_is_described_in_the_file_and_a_format_sixteen_file_reads_it_from_the_table(
    detector, images, tmp_path
):
    """Format 17 writes the family and the stages read, with their channels and strides, and checks them against
    this padim's table on reading; a file of format 16 or older has none, and gets the table's."""
    save_detector(detector, tmp_path / "new.padim", with_statistics=True)
    tensors, header = load_artifact(tmp_path / "new.padim")
    assert header["format_version"] == FORMAT_VERSION >= 17
    assert header["backbone"] == {
        "family": "resnet",
        "stages": [
            {"name": "layer1", "channels": 64, "stride": 4},
            {"name": "layer2", "channels": 128, "stride": 8},
            {"name": "layer3", "channels": 256, "stride": 16},
        ],
    }
    batch = detector.preprocess(pictures(images, 3))
    old = {k: v for k, v in header.items() if k != "backbone"}
    older_format_of(tensors, old, tmp_path / "sixteen.padim", 16)
    sixteen = load_detector(tmp_path / "sixteen.padim", device="cpu")
    assert sixteen.describe()["backbone_family"] == "resnet"
    assert sixteen.describe()["stages"] == header["backbone"]["stages"]
    torch.testing.assert_close(sixteen.score(batch).raw_scores, detector.score(batch).raw_scores, rtol=1e-6, atol=0)
    # a file whose stages are not the ones this padim's table gives its backbone is refused, not misread
    wrong = {**header, "backbone": {**header["backbone"], "stages": header["backbone"]["stages"][:2]}}
    older_format_of(tensors, wrong, tmp_path / "wrong.padim", FORMAT_VERSION)
    with pytest.raises(ArtifactError, match="inconsistent model file .*is not resnet18's as this padim knows it"):
        load_detector(tmp_path / "wrong.padim", device="cpu")


def test_an_estimated_shrinkage_is_told_in_the_file_and_a_format_seventeen_file_gave_its_weight(
    detector, images, tmp_path
):
    """Format 18: ``--shrinkage auto`` (the default) stores ``auto`` and the weight it estimated, with what from;
    the model is the one a fit given that weight makes. A file of format 17 or older gave a weight, and reads so."""
    save_detector(detector, tmp_path / "new.padim", with_statistics=True)
    tensors, header = load_artifact(tmp_path / "new.padim")
    assert header["format_version"] == FORMAT_VERSION >= 18 and header["config"]["shrinkage"] == "auto"
    estimated = header["shrinkage_estimated"]
    rows = len(images) * detector.config.rows_per_picture  # the pictures and their fitted copies (--expect)
    assert 0 < estimated["weight"] <= 0.95 and estimated["rows"] == rows == 2 * len(images)
    assert estimated["samples"] == len(images) and estimated["pixels"] == 16 * 16 and estimated["tails"] > 0
    chosen = detector.describe()["shrinkage_chosen"]
    assert chosen["chosen"] == "estimated" and chosen["weight"] == estimated["weight"]
    assert f"{len(images)} samples a pixel" in chosen["why"]  # a picture's changed copy is not another picture
    given = fit_detector(CONFIG.replace(shrinkage=estimated["weight"]), images, progress=False)[0]
    batch = detector.preprocess(pictures(images, 3))
    # the stored weight is rounded to 4 digits: the scores agree to about that
    torch.testing.assert_close(given.score(batch).raw_scores, detector.score(batch).raw_scores, rtol=1e-3, atol=0)
    old = {k: v for k, v in header.items() if k != "shrinkage_estimated"}
    old["config"] = {**header["config"], "shrinkage": estimated["weight"]}
    older_format_of(tensors, old, tmp_path / "seventeen.padim", 17)
    seventeen = load_detector(tmp_path / "seventeen.padim", device="cpu")
    assert seventeen.config.gaussian.shrinkage == estimated["weight"]
    assert seventeen.describe()["shrinkage_chosen"] == {
        "weight": estimated["weight"], "chosen": "given", "why": "given (--shrinkage WEIGHT)"
    }  # fmt: skip
    torch.testing.assert_close(seventeen.score(batch).raw_scores, detector.score(batch).raw_scores, rtol=1e-6, atol=0)
    assert load_fit(tmp_path / "seventeen.padim").config.gaussian.shrinkage == estimated["weight"]
