"""Fitting: cross-fitted scores against models fitted from scratch, resume and merge against one-shot fits."""

import pytest
import torch
from PIL import Image

from padim.core.calibration import Calibration, fold_of
from padim.core.scoring import anomaly_maps, image_scores, squared_mahalanobis
from padim.core.statistics import GaussianAccumulator, finalise
from padim.models import Fit, FitError, PadimConfig, TrainingImage, fit_detector, fit_partial, list_images, merge_fits

CONFIG = PadimConfig(weights="random", image_size=64, batch_size=8, workers=0, calibration_folds=5)


@pytest.fixture(scope="module")
def images(dataset) -> list[TrainingImage]:
    return [TrainingImage(p, p.name) for p in list_images(dataset / "train" / "good")]


def embed(fit: Fit, paths) -> torch.Tensor:
    return fit.embedder(fit.embedder.preprocess([Image.open(p).convert("RGB") for p in paths]))


def test_out_of_fold_scores_equal_models_fitted_from_scratch_without_the_fold(images):
    fit = Fit.start(CONFIG)
    groups = fit.groups(images)
    assert not fit.accumulate(groups, progress=False).unreadable
    scores, unscored, _ = fit.out_of_fold_scores(groups, progress=False)
    assert len(scores) == len(images) and not unscored
    position = 0
    for k, group in enumerate(groups):
        assert all(fold_of(i.name, CONFIG.calibration_folds) == k for i in group)
        if not group:
            continue
        # from scratch: accumulate every image outside the fold, one at a time, in another order
        others = [i.path for i in images if fold_of(i.name, CONFIG.calibration_folds) != k][::-1]
        accumulator = GaussianAccumulator()
        for path in others:
            accumulator.partial_fit(embed(fit, [path]))
        mean, precision_factor = finalise(accumulator.state, CONFIG.epsilon, fit.embedder.grid_shape)
        squared = squared_mahalanobis(embed(fit, [i.path for i in group]), mean, precision_factor)
        reference = image_scores(anomaly_maps(squared, fit.embedder.grid_shape, CONFIG.image_size, CONFIG.blur_sigma))
        torch.testing.assert_close(scores[position : position + len(group)].float(), reference, rtol=1e-5, atol=0)
        position += len(group)


def test_threshold_comes_from_every_image_out_of_fold(images):
    detector, report = fit_detector(CONFIG, images, progress=False)
    assert report.fitted == len(images) == detector.provenance.fit_image_count == int(detector.statistics.count)
    cal = detector.calibration
    assert cal.count == len(images) and cal.earlier_scores == 0 and cal.method == "gumbel_tail"
    again = Calibration.from_scores(torch.tensor(cal.scores), CONFIG.false_alarm_rate)
    assert again.threshold == cal.threshold
    assert detector.describe()["calibration"]["promised_false_alarm_rate"] == pytest.approx(cal.promised_false_alarm_rate)
    assert any("cannot promise 1.00% false alarms" in w and "99 normal images" in w for w in report.warnings)


def test_resume_equals_one_shot_statistics_and_folds(images, tmp_path):
    first, second = images[:18], images[18:]
    whole, whole_report = fit_detector(CONFIG, images, progress=False)
    part, part_report = fit_detector(CONFIG, first, progress=False)
    part.save(tmp_path / "part.padim")
    resumed, resumed_report = fit_detector(CONFIG, second, resume=Fit.load(tmp_path / "part.padim"), progress=False)
    assert {**part_report.folds, **resumed_report.folds} == whole_report.folds
    assert int(resumed.statistics.count) == int(whole.statistics.count) == len(images)
    # the float32 backbone differs by ~1e-7 between batch compositions; the accumulators
    # themselves agree to float64 round-off (tests/core)
    torch.testing.assert_close(resumed.statistics.mean, whole.statistics.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resumed.statistics.comoment.tril(), whole.statistics.comoment.tril(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(resumed.model.precision_factor, whole.model.precision_factor, rtol=1e-4, atol=1e-4)
    # calibration: the earlier scores are kept as they were, and said to be earlier ones
    cal = resumed.calibration
    assert cal.count == len(images) and cal.earlier_scores == len(first)
    assert set(part.calibration.scores) <= set(cal.scores)
    assert any("kept from the resumed model" in w for w in resumed_report.warnings)
    # resuming with every image again adds only those the model has not seen (by content)
    again, again_report = fit_detector(CONFIG, images, resume=Fit.load(tmp_path / "part.padim"), progress=False)
    assert len(again_report.already_fitted) == len(first) and int(again.statistics.count) == len(images)
    torch.testing.assert_close(again.statistics.mean, whole.statistics.mean, rtol=1e-5, atol=1e-6)


def test_merge_equals_one_shot_and_calibrates_on_unseen_images(images, tmp_path):
    a, b, held = images[:11], images[11:24], images[24:]
    parts = []
    for name, chunk in (("a", a), ("b", b)):
        fit, _ = fit_partial(CONFIG, chunk, progress=False)
        fit.save_partial(tmp_path / f"{name}.part")
        parts.append(Fit.load(tmp_path / f"{name}.part"))
    merged = merge_fits(parts, ["a.part", "b.part"], [i.path for i in held], CONFIG, progress=False)
    one_shot, _ = fit_partial(CONFIG, a + b, progress=False)
    assert int(merged.statistics.count) == 24
    torch.testing.assert_close(merged.statistics.mean, one_shot.statistics.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.statistics.comoment.tril(), one_shot.statistics.comoment.tril(), rtol=1e-5, atol=1e-5)
    held_scores = merged.score(merged.preprocess([Image.open(i.path).convert("RGB") for i in held])).raw_scores
    expected = Calibration.from_scores(held_scores.double(), CONFIG.false_alarm_rate)
    assert merged.calibration.threshold == pytest.approx(expected.threshold, rel=1e-6)
    assert merged.provenance.calibration_source == "held_out"
    with pytest.raises(FitError, match="were fitted in the parts"):
        merge_fits(parts, ["a.part", "b.part"], [i.path for i in a[:2] + held], CONFIG, progress=False)


@pytest.mark.parametrize("count", [1, 2])
def test_too_few_images_is_a_one_line_error(images, count):
    with pytest.raises(FitError, match=r"needs at least 3 normal images") as info:
        fit_detector(CONFIG, images[:count], progress=False)
    assert "\n" not in str(info.value)


def test_three_images_give_a_working_model_that_says_what_it_cannot_promise(images):
    detector, report = fit_detector(CONFIG.replace(calibration_folds=20), images[:3], progress=False)
    assert detector.calibration.count + len(report.unscored) == 3
    assert any("cannot promise" in w for w in report.warnings)


def test_identical_images_are_refused(images, tmp_path):
    copies = []
    for i in range(12):
        path = tmp_path / f"{i:03d}.png"
        path.write_bytes(images[0].path.read_bytes())
        copies.append(TrainingImage(path, path.name))
    with pytest.raises(FitError, match="do not vary"):
        fit_detector(CONFIG, copies, progress=False)


def test_copies_are_named(images, tmp_path):
    copy = tmp_path / "copy-of-003.png"
    copy.write_bytes(images[3].path.read_bytes())
    _, report = fit_detector(CONFIG, images[:8] + [TrainingImage(copy, copy.name)], progress=False)
    assert report.copies == [["003.png", "copy-of-003.png"]]
    assert any("1 image(s) are copies of others (same content: 003.png = copy-of-003.png)" in w for w in report.warnings)


def test_unreadable_images_are_left_out_and_named(images, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    detector, report = fit_detector(CONFIG, images[:10] + [TrainingImage(bad, "broken.png")], progress=False)
    assert int(detector.statistics.count) == 10 and [n for n, _ in report.unreadable] == ["broken.png"]
    assert any("broken.png" in w for w in report.warnings)
    with pytest.raises(FitError, match=r"none of the 1 images could be read \(broken.png"):
        fit_detector(CONFIG, [TrainingImage(bad, "broken.png")], progress=False)
