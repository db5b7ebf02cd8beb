"""A reduced precision (``train --precision bf16|fp16``): its backbone, its gate against fp32, its own threshold, its
file, and the older files that have none."""

import copy
import logging
import math

import numpy as np
import pytest
import torch
from helpers import defaults_as, older_format_of
from PIL import Image

from padim.core.artifact import FORMAT_VERSION, load_artifact
from padim.models import PadimConfig, TrainingImage, devices, fit_detector, list_images, train
from padim.models.errors import PrecisionGateFailed, UsageError
from padim.models.features.embedding import FeatureEmbedder, model_input
from padim.models.fit.model_file import load_detector, load_fit, save_detector
from padim.models.fit.precision import PrecisionGate, compare_scores

CONFIG = PadimConfig(weights="random", image_size=64, batch_size=8, decode_workers=0, calibration_folds=5, expect="")


@pytest.fixture(scope="module")
def images(dataset) -> list[TrainingImage]:
    return [TrainingImage(p, p.name) for p in list_images(dataset / "train" / "good")]


@pytest.fixture(scope="module")
def fitted(images):
    """The same pictures fitted at fp32 and at bf16."""
    # the gate's 16 pictures (CHECK_IMAGES) are then every picture, whatever order the fit reads them in; factors
    # kept in float32, as the gate reads them (auto may keep float16: 1e-3 of a score)
    config = CONFIG.replace(factor_dtype="float32")
    return {p: fit_detector(config.replace(precision=p), images[:16], progress=False)[0] for p in ("fp32", "bf16")}


def pictures(images, count):
    return [Image.open(i.path).convert("RGB") for i in images[:count]]


def test_the_backbone_runs_at_the_precision_and_hands_float32_maps_on(fitted, images):
    batch = model_input(fitted["fp32"].preprocess(pictures(images, 4)))  # what the backbone reads
    full, reduced = (fitted[p].model.embedder for p in ("fp32", "bf16"))
    assert {p.dtype for p in reduced.extractor.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in full.extractor.parameters()} == {torch.float32}
    maps = reduced.extractor(batch)
    assert all(m.dtype == torch.float32 for m in maps)
    # the same folded weights rounded to bfloat16, the same input rounded: what a bf16 backbone computes by hand
    rounded = copy.deepcopy(full.extractor.body).to(torch.bfloat16)
    with torch.inference_mode():
        by_hand = rounded(batch.to(torch.bfloat16).contiguous(memory_format=torch.channels_last))
    for layer, got in zip(reduced.extractor.layers, maps, strict=True):
        # the same module on the same batch: equal but for the kernels' summation order (a stated tolerance)
        torch.testing.assert_close(got, by_hand[layer].float(), rtol=1e-6, atol=1e-6)
    # close to float32's, not equal to it (bfloat16 keeps 8 bits of mantissa)
    exact = full(batch)
    relative = (reduced(batch) - exact).norm() / exact.norm()
    assert 0 < relative < 0.05


def test_a_reduced_model_keeps_its_precision_its_check_and_its_own_threshold(fitted, images, tmp_path):
    bf16, fp32 = fitted["bf16"], fitted["fp32"]
    # its threshold is calibrated from its own out-of-fold scores: not fp32's, and close to them
    assert bf16.calibration.scores != fp32.calibration.scores
    np.testing.assert_allclose(bf16.calibration.scores, fp32.calibration.scores, rtol=0.05)
    check = bf16.provenance.precision_check
    assert check["precision"] == "bf16" and check["passed"] and not check["forced"]
    assert check["images"] == min(16, len(images)) and 0 < check["max_score_error"] <= check["tolerance"] == 0.02
    assert check["threshold"] == bf16.calibration.threshold
    described = bf16.describe()
    assert described["precision"] == "bf16" and described["calibration"]["threshold_of"] == "bf16 scorer"
    assert described["precision_check"] == check and fp32.describe()["precision"] == "float32"
    assert "precision_check" not in fp32.describe()
    # the file: format 11 stores the option and the check; a resume keeps the precision
    save_detector(bf16, tmp_path / "bf16.padim", with_statistics=True)
    _, header = load_artifact(tmp_path / "bf16.padim")
    assert header["format_version"] == FORMAT_VERSION and header["config"]["precision"] == "bf16"
    assert header["precision_check"] == check and header["config"]["factor_dtype"] == "float32"
    loaded = load_detector(tmp_path / "bf16.padim", device="cpu")
    batch = bf16.preprocess(pictures(images, 5))
    # the same tensors read back, one batch: within float32 round-off of the detector in memory
    torch.testing.assert_close(loaded.score(batch).raw_scores, bf16.score(batch).raw_scores, rtol=1e-6, atol=0)
    assert load_fit(tmp_path / "bf16.padim").config.features.precision == "bf16"


def test_the_gate_reads_the_scores_as_a_reference_computes(fitted, images):
    """The stored check equals the comparison made by hand: both embeddings scored with the loaded model."""
    bf16 = fitted["bf16"]
    check = bf16.provenance.precision_check
    twin = FeatureEmbedder(bf16.config.replace(precision="fp32"), bf16.backbone_weights, bf16.embedding)
    batch = bf16.preprocess(pictures(images, check["images"]))
    scores = [bf16.model.score_embeddings(e(batch)).raw_scores.double() for e in (twin, bf16.model.embedder)]
    relative = ((scores[1] - scores[0]).abs() / scores[0]).numpy()
    # the fit checks with float32 factors, as this detector holds them (factor_dtype float32): the same comparison
    # but for the kernels' summation order
    assert bf16.model.precision_factor.dtype == torch.float32
    assert relative.max() == pytest.approx(check["max_score_error"], rel=1e-3, abs=1e-5)
    assert np.median(relative) == pytest.approx(check["median_score_error"], rel=1e-3, abs=1e-5)


def test_compare_scores_against_numpy():
    rng = np.random.default_rng(3)
    reference = rng.uniform(5, 20, 40)
    reduced = reference * (1 + rng.normal(0, 0.004, 40))
    gate = PrecisionGate(0.01)
    check = compare_scores("fp16", torch.from_numpy(reference), torch.from_numpy(reduced), 15.0, gate)
    relative = np.abs(reduced - reference) / reference
    assert check.max_score_error == pytest.approx(relative.max(), rel=1e-12)
    assert check.median_score_error == pytest.approx(np.median(relative), rel=1e-12)
    assert check.verdict_changes == int(((reference >= 15) != (reduced >= 15)).sum())
    assert check.passed == (relative.max() <= 0.01) and check.images == 40
    broken = compare_scores("bf16", torch.from_numpy(reference), torch.full((40,), math.nan), 15.0, gate)
    assert not broken.passed and math.isinf(broken.max_score_error)
    with pytest.raises(ValueError, match="positive"):
        PrecisionGate(0.0)


def test_a_model_past_the_tolerance_is_refused_and_nothing_is_written(images, tmp_path):
    target = tmp_path / "m.padim"
    config = CONFIG.replace(precision="fp16")
    with pytest.raises(PrecisionGateFailed, match=r"fp16 model is not accurate enough: .* nothing was written"):
        train(config, images, target, progress=False, gate=PrecisionGate(1e-9))
    assert not target.exists() and not list(tmp_path.iterdir())
    report = train(config, images, target, progress=False, gate=PrecisionGate(1e-9, force=True))
    assert report.precision_check.forced and not report.precision_check.passed
    assert load_artifact(target)[1]["precision_check"]["forced"] is True


def test_a_format_ten_file_reads_as_fp32_and_its_old_option_name_still_reads(fitted, tmp_path, monkeypatch):
    plain = fitted["fp32"]
    save_detector(plain, tmp_path / "plain.padim")
    tensors, header = load_artifact(tmp_path / "plain.padim")
    del header["config"]["precision"]
    header["config"]["precision_dtype"] = header["config"].pop("factor_dtype")  # as format 10 spelled it
    older_format_of(tensors, header, tmp_path / "ten.padim", 10)
    defaults_as(monkeypatch, precision="bf16")
    assert PadimConfig().features.precision == "bf16"  # as if the default were reduced
    ten = load_detector(tmp_path / "ten.padim", device="cpu")
    assert ten.config.features.precision == "fp32" and ten.describe()["precision"] == "float32"
    assert ten.config.storage.factor_dtype == plain.config.storage.factor_dtype
    assert ten.calibration == plain.calibration


def test_devices_name_what_they_run(monkeypatch, caplog):
    gpu = torch.device("cuda")
    with pytest.raises(UsageError, match=r"compute capability 7.5\) has no bfloat16: it runs fp16 and fp32"):
        devices.check_precision("bf16", gpu, capability=(7, 5))
    devices.check_precision("fp16", gpu, capability=(7, 5))
    devices.check_precision("bf16", gpu, capability=(9, 0))
    monkeypatch.setattr(devices, "_told_slow", set())
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    with caplog.at_level(logging.WARNING, logger="padim.models.devices"):
        for _ in range(3):
            devices.check_precision("bf16", torch.device("cpu"))
    assert [r.message.count("no native bf16") for r in caplog.records] == [1]  # said once
    caplog.clear()
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(devices, "_told_slow", set())
    with caplog.at_level(logging.WARNING, logger="padim.models.devices"):
        devices.check_precision("bf16", torch.device("cpu"))
        devices.check_precision("fp32", torch.device("cpu"))
    assert not caplog.records


def test_held_out_pictures_get_fp32s_verdicts_each_at_its_own_threshold(fitted, dataset):
    """Normal and defective pictures no model fitted: each model's verdicts at its own threshold agree but where a
    score lies within the gate's tolerance of its threshold, and the defects rank alike."""
    from sklearn.metrics import roc_auc_score

    paths = sorted((dataset / "test").rglob("*.png"))
    labels = np.array([p.parent.name != "good" for p in paths])
    batch = fitted["fp32"].preprocess([Image.open(p).convert("RGB") for p in paths])
    scores, verdicts = {}, {}
    for precision, detector in fitted.items():
        scores[precision] = detector.score(batch).raw_scores.double().numpy()
        verdicts[precision] = scores[precision] >= detector.calibration.threshold
    tolerance = fitted["bf16"].provenance.precision_check["tolerance"]
    near = np.abs(scores["fp32"] / fitted["fp32"].calibration.threshold - 1) <= 2 * tolerance
    assert np.array_equal(verdicts["fp32"][~near], verdicts["bf16"][~near])
    aurocs = [roc_auc_score(labels, scores[p]) for p in ("fp32", "bf16")]
    assert abs(aurocs[0] - aurocs[1]) <= 0.02
