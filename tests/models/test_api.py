"""The Python API (``padim.fit``, ``padim.load``, ``Detector.predict``): the CLI's numbers, plain objects out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import IMAGE_SIZE, SCORE_ATOL, SCORE_RTOL, assert_same_verdict, run_cli
from PIL import Image

import padim
from padim.models import ConfigError, ImageError
from padim.models.errors import PrecisionGateFailed


@pytest.mark.load_sensitive
def test_predict_from_paths_pil_and_arrays_equals_padim_predict(model_file, dataset, tmp_path):
    run_cli("-q", "predict", model_file, dataset / "test", "--output", tmp_path, "--runtime", "torch", "--no-heatmaps")
    cli = {Path(r["path"]).resolve(): r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    detector = padim.load(model_file, runtime="torch")
    folder = detector.predict(dataset / "test")  # a folder: every image, sorted, a list back
    assert len(folder) == len(cli) == 18
    # another process: the same batches, but not bit for bit (SCORE_RTOL)
    for result in folder:
        line, got = cli[Path(result.source).resolve()], result.to_dict()
        assert got["raw_score"] == pytest.approx(line["raw_score"], rel=SCORE_RTOL)
        assert got["score"] == pytest.approx(line["score"], abs=SCORE_ATOL)
        assert got["threshold"] == line["threshold"]  # the model's 0.5, stored, not computed
        assert_same_verdict(got, line)
        assert got["anomalous_area"] == pytest.approx(line["anomalous_area"], abs=1e-3)  # a few boundary pixels at most
        np.testing.assert_allclose(result.anomaly_map, np.load(line["map"]), rtol=SCORE_RTOL, atol=1e-6)
    path = dataset / "test" / "hole" / "000.png"
    one = detector.predict(path)  # one path: one result
    pil = Image.open(path)
    from_pil, from_array = detector.predict([pil, np.asarray(pil.convert("RGB"))])
    # one batch, the same pixels twice: the rows may still take other kernel paths
    assert from_pil.raw_score == pytest.approx(from_array.raw_score, rel=SCORE_RTOL)
    # batches of other sizes may round differently in the last bits (the CPU's maths library)
    assert one.raw_score == pytest.approx(cli[path.resolve()]["raw_score"], rel=SCORE_RTOL)
    assert from_pil.raw_score == pytest.approx(one.raw_score, rel=SCORE_RTOL)
    assert from_pil.source == "<image 0>" and from_array.source == "<image 1>"
    assert one.anomaly_map.shape == (pil.height, pil.width) and one.anomaly_map.dtype == np.float32
    assert one.mask().size == pil.size and one.overlay().size == pil.size
    heat = one.heatmap()
    assert heat.width >= 2 * pil.width and heat.height > pil.height
    np.testing.assert_allclose(detector.scores([path, pil]), [one.score, one.score], rtol=0, atol=SCORE_ATOL)


def test_a_threshold_changes_the_verdict_as_the_service_would(model_file, dataset):
    detector = padim.load(model_file, runtime="torch")
    path = dataset / "test" / "hole" / "000.png"
    base = detector.predict(path)
    stricter, never = detector.predict(path, threshold=0.999), detector.predict(path, threshold=1.0)
    assert (
        base.is_anomaly
        and stricter.anomalous_area < base.anomalous_area
        and stricter.raw_threshold > base.raw_threshold
    )
    assert not never.is_anomaly and never.anomalous_area == 0 and never.to_dict()["raw_threshold"] is None
    good = detector.predict(dataset / "test" / "good" / "000.png", threshold=0.0)
    assert good.is_anomaly and good.anomalous_area == 1.0


def test_fit_from_a_folder_matches_padim_train(dataset, model_file, tmp_path):
    detector = padim.fit(
        dataset / "train" / "good",
        tmp_path / "api.padim",
        weights="random",
        image_size=IMAGE_SIZE,
        batch_size=8,
        progress=False,
    )
    assert detector.report.fitted == 30
    cli = padim.load(model_file, runtime="torch")
    assert detector.calibration.threshold == pytest.approx(cli.calibration.threshold, rel=1e-5)
    again = padim.load(tmp_path / "api.padim", runtime="torch")
    path = dataset / "test" / "hole" / "001.png"
    assert again.predict(path).score == pytest.approx(cli.predict(path).score, rel=1e-5)


def test_fit_from_in_memory_images_and_bad_input_errors(dataset):
    images = [np.asarray(Image.open(p).convert("RGB")) for p in sorted((dataset / "train" / "good").glob("*.png"))]
    detector = padim.fit(images, weights="random", image_size=IMAGE_SIZE, progress=False)
    assert detector.report.fitted == len(images) and detector.runtime == "torch"
    with pytest.raises(TypeError, match="uint8"):
        detector.predict(images[0].astype(np.float32))
    with pytest.raises(TypeError, match="shape"):
        detector.predict(np.zeros((4, 4, 2), dtype=np.uint8))
    with pytest.raises(ConfigError, match="allowed"):
        padim.fit(images, weights="random", bogus=1)
    with pytest.raises(ImageError, match="no such file"):
        detector.predict("nowhere/part.png")


def test_fit_at_a_reduced_precision_takes_the_gate_of_train(dataset, tmp_path):
    """``padim.fit(precision="fp16", max_score_error=..., force=...)``: as ``train --max-score-error`` and ``--force``;
    a refused model leaves no file."""
    folder = dataset / "train" / "good"
    options = {"weights": "random", "image_size": IMAGE_SIZE, "precision": "fp16", "progress": False}
    with pytest.raises(PrecisionGateFailed, match="fp16"):  # fp16 scores differ from fp32's by more than 1e-9
        padim.fit(folder, tmp_path / "refused.padim", max_score_error=1e-9, **options)
    assert not (tmp_path / "refused.padim").exists()
    with pytest.raises(ConfigError, match="positive"):
        padim.fit(folder, max_score_error=0, **options)
    kept = padim.fit(folder, tmp_path / "kept.padim", max_score_error=1e-9, force=True, **options)
    check = kept.describe()["precision_check"]
    assert check["forced"] and not check["passed"] and check["tolerance"] == 1e-9
    assert padim.fit(folder, **options).describe()["precision_check"]["passed"]  # the default 2%


def test_a_large_jpeg_is_decoded_smaller_but_its_map_is_at_the_pictures_size(model_file, tmp_path):
    import io

    rng = np.random.default_rng(3)
    pixels = np.kron(rng.integers(60, 200, (48, 64, 3)), np.ones((25, 25, 1))).astype(np.uint8)  # 1600 x 1200
    path = tmp_path / "large.jpg"
    Image.fromarray(pixels).save(path, quality=90)
    detector = padim.load(model_file, runtime="torch")
    (prediction,) = detector.predict([path])
    assert prediction.image.size == (200, 150)  # decoded at 1/8: its short side still twice the 64 px input
    assert prediction.anomaly_map.shape == (1200, 1600)  # the map is the picture's
    assert prediction.overlay().size == (200, 150) and prediction.mask().size == (1600, 1200)
    assert prediction.heatmap().size[1] > 150  # the figure shows the decoded picture and its overlay
    assert io.BytesIO(prediction._repr_png_()).getbuffer().nbytes > 0
