"""The int8 scorer a float32 model carries: its threshold from its own out-of-fold int8 scores against float64
refits, its gate, the file (format 20 and older ones), ``--runtime auto``'s choice by the CPU, a threshold set again."""

import json

import numpy as np
import pytest
import torch
from helpers import older_format_of, pooled, reference_maps, refit_squared
from PIL import Image

from padim.core.artifact import FORMAT_VERSION, load_artifact, read_header
from padim.core.statistics import covariance
from padim.models import PadimConfig, TrainingImage, list_images, train
from padim.models.deploy.runtimes import DeployedDetector, load_scorer, runtime_choice
from padim.models.features.embedding import FeatureEmbedder
from padim.models.fit.model_file import (
    load_detector,
    load_fit,
    read_calibration,
    read_int8_calibration,
    store_calibration,
)
from padim.models.fit.precision import PrecisionGate

#: The pictures as taken (no cover), leave-one-out, a weight given: the int8 scores' reference is a refit a picture.
CONFIG = PadimConfig(
    weights="random", image_size=64, batch_size=8, decode_workers=0, shrinkage=0.5, expect="stable", embedding_dim=40
)
#: A CPU whose int8 kernels ONNX Runtime runs faster (AVX2), and one where it does not (none of those flags).
AVX2, PLAIN = frozenset({"sse4_2", "avx", "avx2", "fma"}), frozenset({"sse4_2"})


@pytest.fixture(scope="module")
def images(dataset) -> list[TrainingImage]:
    return [TrainingImage(p, p.name) for p in list_images(dataset / "train" / "good")][:24]


@pytest.fixture(scope="module")
def model(images, tmp_path_factory):
    path = tmp_path_factory.mktemp("int8") / "model.padim"
    report = train(CONFIG, images, path, progress=False)
    assert report.int8_scorer is not None and report.int8_scorer.usable, report.no_int8_scorer
    return path


@pytest.fixture
def cpu(monkeypatch):
    """Set the CPU's flags ``--runtime auto`` reads (no GPU)."""
    from padim.models import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return lambda flags: monkeypatch.setattr(devices, "cpu_flags", lambda: flags)


def test_its_threshold_comes_from_its_own_int8_scores_each_under_a_refit_without_its_picture(images, model):
    """The int8 scorer's calibration scores are its backbone's embedding of each picture (as the fit keeps it: in
    float16) scored under the float32 Gaussians fitted without that picture (float64 refits here); the float32 ones
    are the float32 embedding's."""
    detector = load_detector(model, "cpu", with_statistics=True)
    int8 = detector.int8_scorer
    assert int8 is not None and int8.usable and int8.check["passed"] and int8.check["precision"] == "int8"
    assert int8.quantiser["tool"] == "onnxruntime.quantization.quantize_static" and int8.quantiser["images"] == 24
    pictures = [Image.open(i.path).convert("RGB") for i in images]
    config = detector.config
    quantised = FeatureEmbedder(config.replace(precision="int8"), detector.backbone_weights, detector.embedding)
    assert quantised.quantised
    x = detector.model.embedder(detector.preprocess(pictures)).double().numpy()
    q = quantised(quantised.preprocess(pictures))
    target = pooled(x)

    def reference(rows: np.ndarray) -> np.ndarray:
        found = []
        for i in range(len(images)):
            rest = np.delete(x, i, axis=0)
            squared = refit_squared(np.concatenate([rest, rows[i : i + 1]]), [len(rest), 1], 0.01, 0.5, target)[-1]
            found.append(reference_maps(squared[None], config.tiling, config.scoring.blur_sigma).max())
        return np.sort(found)

    kept = q.half().double().numpy()  # pass 1's int8 rows wait in float16 (QUERY_ROWS_DTYPE)
    np.testing.assert_allclose(int8.calibration.scores, reference(kept), rtol=1e-4)
    # what float16 costs: within 1e-3 of the scores of the int8 rows unrounded
    np.testing.assert_allclose(int8.calibration.scores, reference(q.double().numpy()), rtol=1e-3)
    assert int8.calibration.count == detector.calibration.count == len(images)
    assert not np.allclose(int8.calibration.scores, detector.calibration.scores, rtol=1e-3)  # its own, not float32's


def test_runtime_auto_runs_it_where_the_cpu_computes_int8_faster_and_float32_elsewhere(model, cpu, tmp_path):
    header = read_header(model)
    cpu(AVX2)
    runtime, reason = runtime_choice("auto", "cpu", "fp32", header["int8_scorer"])
    assert runtime == "onnxruntime" and "int8 scorer" in reason and "avx2" in reason and "tolerance 25%" in reason
    scorer = load_scorer(model, "auto", "cpu", cache=tmp_path / "cache")
    assert isinstance(scorer, DeployedDetector) and scorer.file_scorer == "int8" and scorer.precision == "int8"
    assert scorer.calibration == read_int8_calibration(model) != read_calibration(model)
    described = scorer.describe()
    assert scorer.runtime_reason == reason and "int8 scorer" in described["calibration"]["threshold_of"]
    assert described["int8_scorer"]["check"]["passed"] and described["runtime_reason"] == reason
    detector = load_detector(model, "cpu")
    cpu(PLAIN)
    runtime, reason = runtime_choice("auto", "cpu", "fp32", header["int8_scorer"])
    assert runtime == "onnxruntime" and "float32" in reason and "not faster on this CPU" in reason
    plain = load_scorer(model, "auto", "cpu", cache=tmp_path / "cache")
    assert plain.file_scorer == "float32" and plain.calibration == detector.calibration
    cpu(AVX2)
    asked = load_scorer(model, "onnxruntime", "cpu", cache=tmp_path / "cache")  # a runtime asked for: float32
    assert asked.file_scorer == "float32" and asked.calibration == detector.calibration
    assert load_scorer(model, "torch", "cpu").file_scorer == "float32"


def test_the_int8_scorer_scores_as_its_threshold_was_set(model, images, cpu, tmp_path):
    """The graph ``auto`` runs scores a training picture as the fit's int8 embedding does under the full model."""
    cpu(AVX2)
    scorer = load_scorer(model, "auto", "cpu", cache=tmp_path / "cache")
    detector = load_detector(model, "cpu")
    pictures = [Image.open(i.path).convert("RGB") for i in images[:6]]
    quantised = FeatureEmbedder(
        detector.config.replace(precision="int8"), detector.backbone_weights, detector.embedding
    )
    expected = detector.model.score_embeddings(quantised(quantised.preprocess(pictures))).raw_scores
    got = scorer.score(scorer.preprocess(pictures)).raw_scores
    torch.testing.assert_close(torch.as_tensor(got).double(), expected.double(), rtol=1e-4, atol=1e-5)


def test_its_gate_compares_the_first_pictures_own_embeddings_by_both_backbones(images, tmp_path):
    """The gate reads pass 1's rows of the first 16 pictures (by name; their own, not their changed copies') instead of
    embedding them again: its figures are those of both backbones' embeddings of those pictures scored under the full
    model (to the float16 rounding of its factors)."""
    path = tmp_path / "copies.padim"
    train(CONFIG.replace(expect="brightness=0.3"), images, path, progress=False)  # each picture and a brighter copy
    detector = load_detector(path, "cpu")
    check = detector.int8_scorer.check
    assert check["images"] == 16
    pictures = [Image.open(i.path).convert("RGB") for i in sorted(images, key=lambda i: i.name)[:16]]
    quantised = FeatureEmbedder(
        detector.config.replace(precision="int8"), detector.backbone_weights, detector.embedding
    )
    float32 = detector.model.score_embeddings(detector.model.embedder(detector.preprocess(pictures))).raw_scores
    int8 = detector.model.score_embeddings(quantised(quantised.preprocess(pictures))).raw_scores
    error = ((int8 - float32).abs() / float32).double()
    assert check["max_score_error"] == pytest.approx(float(error.max()), abs=5e-4)
    assert check["median_score_error"] == pytest.approx(float(error.quantile(0.5)), abs=5e-4)
    assert float(error.max()) > 1e-2  # the two backbones differ: the figures say something


def test_a_gate_that_refuses_it_leaves_no_graph_and_auto_says_why(images, cpu, tmp_path):
    path = tmp_path / "refused.padim"
    report = train(CONFIG, images[:12], path, progress=False, gate=PrecisionGate(tolerance=1e-9))
    assert report.int8_scorer is not None and not report.int8_scorer.usable
    assert "refused by its gate" in report.int8_scorer.sentence()
    tensors, header = load_artifact(path)
    assert header["int8_scorer"]["calibration"] is None and not header["int8_scorer"]["check"]["passed"]
    assert not any(name.startswith("int8_scorer.") or name == "backbone.int8.onnx" for name in tensors)
    cpu(AVX2)
    runtime, reason = runtime_choice("auto", "cpu", "fp32", header["int8_scorer"])
    assert runtime == "onnxruntime" and "refused by its gate" in reason
    assert load_scorer(path, "auto", "cpu", cache=tmp_path / "cache").file_scorer == "float32"
    assert load_fit(path).earlier_int8 is None  # a resume of it makes none


def test_no_int8_scorer_is_made_when_not_asked_for_and_a_format_nineteen_file_has_none(images, model, cpu, tmp_path):
    path = tmp_path / "plain.padim"
    report = train(CONFIG.replace(int8_scorer=False), images[:12], path, progress=False)
    assert report.int8_scorer is None and report.no_int8_scorer == "not asked for (--no-int8-scorer)"
    tensors, header = load_artifact(path)
    assert header["int8_scorer"] is None and "backbone.int8.onnx" not in tensors
    assert header["config"]["int8_scorer"] is False
    # format 19 and older: no int8 scorer, and no such option (read as off: what they made)
    tensors, header = load_artifact(model)
    old = {k: v for k, v in header.items() if k != "int8_scorer"}
    old["config"] = {k: v for k, v in header["config"].items() if k != "int8_scorer"}
    kept = {k: v for k, v in tensors.items() if not k.startswith("int8_scorer.") and k != "backbone.int8.onnx"}
    older_format_of(kept, old, tmp_path / "nineteen.padim", 19)
    nineteen = load_detector(tmp_path / "nineteen.padim", "cpu")
    assert nineteen.int8_scorer is None and not nineteen.config.storage.int8_scorer
    assert nineteen.calibration == load_detector(model, "cpu").calibration
    cpu(AVX2)
    scorer = load_scorer(tmp_path / "nineteen.padim", "auto", "cpu", cache=tmp_path / "cache")
    assert scorer.file_scorer == "float32" and "float32" in scorer.runtime_reason
    assert read_header(model)["format_version"] == FORMAT_VERSION == 20


def test_a_threshold_set_again_replaces_its_own_scorers(model, cpu, tmp_path):
    """A float32 threshold set again (evaluate --calibrate, a line's) leaves the int8 scorer out; an int8 one (what
    the int8 scorer scored) replaces the int8 scorer's and keeps the float32 one."""
    float32, int8 = read_calibration(model), read_int8_calibration(model)
    assert int8 is not None
    store_calibration(model, int8.with_threshold(int8.threshold * 1.1), tmp_path / "int8.padim", scorer="int8")
    assert read_calibration(tmp_path / "int8.padim") == float32
    assert read_int8_calibration(tmp_path / "int8.padim") == int8.with_threshold(int8.threshold * 1.1)
    loaded = load_detector(tmp_path / "int8.padim", "cpu")
    assert loaded.int8_scorer.calibration.method == "manual" and loaded.int8_scorer.check == json.loads(
        json.dumps(load_detector(model, "cpu").int8_scorer.check)
    )
    cpu(AVX2)
    assert load_scorer(tmp_path / "int8.padim", "auto", "cpu", cache=tmp_path / "c").calibration.method == "manual"
    store_calibration(model, float32.with_threshold(float32.threshold * 1.1), tmp_path / "float32.padim")
    header = read_header(tmp_path / "float32.padim")
    assert header["int8_scorer"] is None and header["calibration"]["method"] == "manual"
    assert load_scorer(tmp_path / "float32.padim", "auto", "cpu", cache=tmp_path / "c").file_scorer == "float32"
    with pytest.raises(ValueError, match="no usable int8 scorer"):
        store_calibration(tmp_path / "float32.padim", int8, tmp_path / "x.padim", scorer="int8")


def test_on_a_cpu_its_fit_runs_the_float32_backbone_as_the_graph_it_quantised_and_fits_torchs_gaussians(
    images, tmp_path, monkeypatch
):
    """The fit exports the float32 backbone for its quantiser; on a CPU pass 1 then runs that graph in ONNX Runtime in
    place of torch's backbone. The model is torch's within float32 rounding: against a fit with ``--no-int8-scorer``
    (torch's backbone), the same Gaussians and calibration scores."""
    from padim.models.fit import in_progress

    ran = []

    class Counted(in_progress.GraphExtractor):
        def forward(self, images):
            ran.append(len(images))
            return super().forward(images)

    monkeypatch.setattr(in_progress, "GraphExtractor", Counted)
    chosen = images[:12]
    train(CONFIG, chosen, tmp_path / "graph.padim", progress=False)
    assert sum(ran) == len(chosen)  # every picture once, by the graph (no changed copies: expect stable)
    train(CONFIG.replace(int8_scorer=False), chosen, tmp_path / "torch.padim", progress=False)
    graph, plain = (load_fit(tmp_path / name).statistics for name in ("graph.padim", "torch.padim"))
    assert int(graph.count) == int(plain.count) == len(chosen)
    np.testing.assert_allclose(
        graph.mean.numpy(), plain.mean.numpy(), rtol=1e-4, atol=1e-5 * float(plain.mean.abs().max())
    )
    np.testing.assert_allclose(
        covariance(graph).numpy(),
        covariance(plain).numpy(),
        rtol=1e-3,
        atol=1e-5 * float(covariance(plain).abs().max()),
    )
    scores = [load_detector(tmp_path / name, "cpu").calibration.scores for name in ("graph.padim", "torch.padim")]
    np.testing.assert_allclose(*scores, rtol=1e-4)


def test_a_resume_goes_on_with_its_int8_scorer(images, tmp_path):
    first = tmp_path / "first.padim"
    train(CONFIG, images[:14], first, progress=False)
    earlier = read_int8_calibration(first)
    assert earlier is not None
    report = train(CONFIG, images[14:], tmp_path / "resumed.padim", resume=load_fit(first), progress=False)
    assert report.int8_scorer is not None and report.int8_scorer.usable
    resumed = read_int8_calibration(tmp_path / "resumed.padim")
    assert resumed.count == len(images) and resumed.earlier_scores == 14
    assert set(earlier.scores) <= set(resumed.scores)  # the earlier pictures' int8 scores are kept
    graphs = [load_artifact(p)[0]["backbone.int8.onnx"] for p in (first, tmp_path / "resumed.padim")]
    assert torch.equal(*graphs)  # the resumed model's own graph, with which its earlier scores were made
