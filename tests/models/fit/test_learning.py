"""Learning from reviews: an update equals a one-shot fit with the confirmed pictures, an undo one without."""

import hashlib
import shutil

import pytest
import torch
from helpers import older_format_of

from padim.core.artifact import load_artifact
from padim.models import PadimConfig, TrainingImage, fit_detector, list_images, train
from padim.models.errors import FitError, NotUpdatable
from padim.models.fit.learning import picture_name, update_model
from padim.models.fit.model_file import load_detector

#: A weight given: an update re-estimates ``--shrinkage auto``'s weight from its statistics and the tails of the
#: pictures it reads, so it equals a one-shot fit for a weight given (docs/quality.md).
CONFIG = PadimConfig(weights="random", image_size=64, batch_size=8, decode_workers=0, shrinkage=0.5)
#: Statistics of the same pictures embedded in other batches agree to the last bits of a convolution (as resume's).
RTOL, ATOL = 1e-5, 1e-5


def named_by_content(paths) -> list[TrainingImage]:
    return [TrainingImage(p, picture_name(hashlib.sha256(p.read_bytes()).hexdigest())) for p in paths]


@pytest.fixture(scope="module")
def pictures(dataset):
    old = [TrainingImage(p, p.name) for p in list_images(dataset / "train" / "good")][:20]
    confirmed = named_by_content(sorted((dataset / "test" / "good").glob("*.png"))[:5])
    return old, confirmed


@pytest.fixture(scope="module")
def base(pictures, tmp_path_factory):
    path = tmp_path_factory.mktemp("learning") / "base.padim"
    train(CONFIG, pictures[0], path, progress=False)
    return path


def assert_same_statistics(got, expected):
    assert int(got.statistics.count) == int(expected.statistics.count)
    assert sorted(got.image_digests.tolist()) == sorted(expected.image_digests.tolist())
    torch.testing.assert_close(got.statistics.mean, expected.statistics.mean, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got.statistics.comoment, expected.statistics.comoment, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(
        got.model.precision_factor.float(), expected.model.precision_factor.float(), rtol=1e-3, atol=1e-3
    )


def test_an_update_equals_a_one_shot_fit_and_an_undo_a_fit_without(pictures, base, tmp_path):
    old, confirmed = pictures
    report = update_model(base, confirmed, [], tmp_path / "added.padim")
    assert sorted(report.added) == sorted(i.name for i in confirmed) and report.removed == []
    added = load_detector(tmp_path / "added.padim", "cpu", with_statistics=True)
    whole = fit_detector(CONFIG, old + confirmed, progress=False)[0]
    assert_same_statistics(added, whole)
    before = load_detector(base, "cpu")
    # the earlier pictures' out-of-fold scores are kept from their own fit; the new pictures' are scored now
    assert set(before.calibration.scores) <= set(added.calibration.scores)
    assert added.calibration.count == len(old) + len(confirmed) and added.calibration.earlier_scores == len(old)
    assert len(added.calibration.pictures) == added.calibration.count  # every score linked to its picture

    # a review was wrong: the picture is taken out of the statistics and the calibration, exactly
    wrong = confirmed[2]
    undo = update_model(tmp_path / "added.padim", [], [wrong], tmp_path / "undone.padim")
    assert undo.removed == [wrong.name] and undo.scores_removed == 1 and undo.scores_kept == 0
    undone = load_detector(tmp_path / "undone.padim", "cpu", with_statistics=True)
    without = fit_detector(CONFIG, [i for i in old + confirmed if i != wrong], progress=False)[0]
    assert_same_statistics(undone, without)
    digest = next(p[0] for p in added.calibration.pictures if p[0] not in {q[0] for q in undone.calibration.pictures})
    removed_score = next(p[1] for p in added.calibration.pictures if p[0] == digest)
    rest = list(added.calibration.scores)
    rest.remove(removed_score)
    assert list(undone.calibration.scores) == rest  # the same stored values, less the picture's
    assert undone.calibration == added.calibration.without({digest})[0]
    assert undone.provenance.fit_image_count == len(old) + len(confirmed) - 1


def test_nothing_to_update_slim_and_exports_are_refused(pictures, base, tmp_path):
    old, confirmed = pictures
    with pytest.raises(FitError, match="nothing to update"):
        update_model(base, old[:3], [confirmed[0]], tmp_path / "x.padim")  # fitted already; never fitted
    assert not (tmp_path / "x.padim").exists()
    train(CONFIG, old, tmp_path / "slim.padim", progress=False, with_statistics=False)
    with pytest.raises(NotUpdatable, match="--slim"):
        update_model(tmp_path / "slim.padim", confirmed, [], tmp_path / "y.padim")
    (tmp_path / "export").mkdir()
    with pytest.raises(NotUpdatable, match="export directory"):
        update_model(tmp_path / "export", confirmed, [], tmp_path / "y.padim")


def test_a_format_eight_file_loses_the_statistics_of_a_picture_but_keeps_its_score(pictures, base, tmp_path):
    old, confirmed = pictures
    update_model(base, confirmed[:3], [], tmp_path / "nine.padim")
    tensors, header = load_artifact(tmp_path / "nine.padim")
    for key in ("calibration.digests", "calibration.linked"):
        del tensors[key]
    del header["calibration"]["pictures"]
    older_format_of(tensors, header, tmp_path / "eight.padim", 8)
    eight = load_detector(tmp_path / "eight.padim", "cpu")
    assert eight.calibration.pictures == ()
    undo = update_model(tmp_path / "eight.padim", [], [confirmed[0]], tmp_path / "undone.padim")
    assert undo.scores_removed == 0 and undo.scores_kept == 1
    undone = load_detector(tmp_path / "undone.padim", "cpu", with_statistics=True)
    assert undone.calibration.scores == eight.calibration.scores
    assert (
        int(undone.statistics.count)
        == int(load_detector(tmp_path / "nine.padim", "cpu", with_statistics=True).statistics.count)
        - CONFIG.rows_per_picture
    )
    shutil.rmtree(tmp_path)


def test_a_line_threshold_travels_in_the_file_and_its_export_and_a_format_twelve_file_has_none(
    model_file, dataset, tmp_path
):
    """Format 13 and export version 10 carry the line's scores of a threshold the line set (method ``line``); the
    Gaussians and every other tensor are copied as they were; a file of format 12 is read with no line."""
    from padim.core.artifact import FORMAT_VERSION, read_header
    from padim.models.deploy import export
    from padim.models.deploy.runtimes import load_scorer
    from padim.models.fit.model_file import read_calibration, store_calibration

    calibration = read_calibration(model_file)
    assert calibration == load_detector(model_file, device="cpu").calibration and calibration.line_scores == ()
    line = torch.linspace(0.5, 0.9, 600, dtype=torch.float64) * calibration.threshold
    tightened = calibration.tightened(line)
    store_calibration(model_file, tightened, tmp_path / "line.padim")
    header = read_header(tmp_path / "line.padim")
    assert header["format_version"] == FORMAT_VERSION and header["calibration"]["method"] == "line"
    assert read_calibration(model_file) == calibration  # the version it came from is not touched
    loaded = load_detector(tmp_path / "line.padim", device="cpu")
    assert loaded.calibration == tightened and loaded.calibration.line_scores == tuple(line.tolist())
    before, after = load_artifact(model_file)[0], load_artifact(tmp_path / "line.padim")[0]
    # a float32 threshold set again leaves the int8 scorer out: its threshold was the one replaced, on its own scores
    int8 = {name for name in before if name.startswith("int8_scorer.")} | {"backbone.int8.onnx"}
    assert int8 <= set(before) and header["int8_scorer"] is None
    assert set(after) == (set(before) - int8) | {"calibration.line_scores"}
    assert all(torch.equal(before[name], after[name]) for name in set(before) - int8)
    assert "the line's 600 normal pictures" in loaded.describe()["calibration"]["covers"]
    export.export_detector(loaded, tmp_path / "exported", "onnx", tmp_path / "line.padim")
    exported = load_scorer(tmp_path / "exported", "onnxruntime", "cpu")
    assert exported.calibration == tightened and "line's 600" in exported.describe()["calibration"]["covers"]
    # pictures added to its statistics (a resume, an update): calibrated again from the training pictures' scores
    added = named_by_content(sorted((dataset / "test" / "good").glob("*.png"))[:2])
    update_model(tmp_path / "line.padim", added, [], tmp_path / "resumed.padim")
    resumed = read_calibration(tmp_path / "resumed.padim")
    assert resumed.method != "line" and resumed.line_scores == () and resumed.count == calibration.count + 2
    assert len(resumed.taken_scores) == len(calibration.taken_scores) + 2
    # a format-12 file holds no line's scores and reads as it did; its threshold set by the line is written as 13
    tensors, old = load_artifact(model_file)
    del old["calibration"]["line_scores"]
    older_format_of(tensors, old, tmp_path / "twelve.padim", 12)
    assert read_calibration(tmp_path / "twelve.padim") == calibration
    store_calibration(tmp_path / "twelve.padim", tightened, tmp_path / "twelve-line.padim")
    assert read_header(tmp_path / "twelve-line.padim")["format_version"] == FORMAT_VERSION
    assert read_calibration(tmp_path / "twelve-line.padim") == tightened
