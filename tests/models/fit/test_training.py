"""Fitting: out-of-fold scores against brute-force refits, resume and merge against one-shot fits, the spool."""

import math
import os

import numpy as np
import pytest
import torch
from helpers import pooled, reference_maps, refit_squared

from padim.core.artifact import load_artifact
from padim.core.calibration import Calibration, fold_of
from padim.core.scoring import anomaly_maps, image_scores
from padim.core.spool import EmbeddingSpool
from padim.models import (
    DoesNotFit,
    Fit,
    FitError,
    PadimConfig,
    TrainingImage,
    fit_detector,
    fit_partial,
    list_images,
    merge_fits,
    train,
)
from padim.models.data.changes import apply, seeded
from padim.models.fit.model_file import load_detector, load_fit, save_fit
from padim.models.fit.passes import ScoringPass, SpooledRows

#: A weight given: the mechanics below are checked for a fixed weight (``--shrinkage auto`` has its own case).
CONFIG = PadimConfig(
    weights="random", image_size=64, batch_size=8, decode_workers=0, calibration_folds=5, shrinkage=0.5
)
#: The mechanics against brute-force refits of the pictures as taken: no changed copies (those have their own test).
AS_TAKEN = CONFIG.replace(expect="stable")
#: Rows a picture gives the statistics under the default: its own and its changed copy's.
ROWS = CONFIG.rows_per_picture


@pytest.fixture(scope="module")
def images(dataset) -> list[TrainingImage]:
    return [TrainingImage(p, p.name) for p in list_images(dataset / "train" / "good")]


def spooled_embeddings(spool: EmbeddingSpool) -> np.ndarray:
    """Every row of the spool, ``(N, P, D)`` float64: exactly what the fit accumulated."""
    return torch.cat([spool.read(i, 0, spool.rows) for i in range(len(spool.slices))], dim=1).double().numpy()


def ledoit_wolf_weight(x: np.ndarray) -> float:
    """The weight of the pooled covariance for ``(N, P, D)`` rows, from every row's outer product: the Gaussian
    formula's sampling variance (unbiased) scaled by Ledoit and Wolf's fourth-moment reading of it over a Gaussian's,
    over the pixels' squared distance to the pool (:func:`padim.core.statistics.shrinkage_intensity`)."""
    n = x.shape[0]
    centred = x - x.mean(axis=0)
    unbiased = np.einsum("npd,npe->pde", centred, centred) / (n - 1)
    biased = unbiased * (n - 1) / n
    outer = np.einsum("npd,npe->npde", centred, centred)
    fourth = ((outer - biased) ** 2).sum() / n**2
    gaussian = ((biased**2).sum() + (np.trace(biased, axis1=1, axis2=2) ** 2).sum()) / n
    m = n - 1
    squares, traces = (unbiased**2).sum(), (np.trace(unbiased, axis1=1, axis2=2) ** 2).sum()
    frobenius = (squares - traces / m) / (1 + 1 / m - 2 / m**2)
    error = fourth / gaussian * (frobenius + traces - 2 * frobenius / m) / m
    target = unbiased.mean(axis=0)
    return float(error / ((unbiased - target) ** 2).sum())


def refit_scores(
    x: np.ndarray,
    folds: list[int],
    epsilon: float,
    grid,
    size: int,
    sigma: float,
    method: str = "map_max",
    top_fraction: float = 0.01,
    shrinkage: float = 0.0,
) -> np.ndarray:
    """Each fold's images scored by a model fitted from scratch on the others (the same epsilon), in float64."""
    squared = torch.from_numpy(refit_squared(x, folds, epsilon, shrinkage))
    return image_scores(anomaly_maps(squared, grid, size, sigma), method, squared, top_fraction).numpy()


@pytest.mark.parametrize(
    "folds, neighbourhood, image_score, shrinkage",
    [
        (5, 1, "map_max", 0.0),
        ("loo", 3, "map_max", 0.0),
        ("loo", 1, "patch_max", 0.0),
        (5, 3, "top_mean", 0.0),
        ("loo", 1, "map_max", 0.5),
        (5, 3, "map_max", 0.3),
        ("loo", 3, "map_max", "auto"),
    ],
)
def test_out_of_fold_scores_equal_refits_on_the_real_pipeline(
    images, tmp_path, folds, neighbourhood, image_score, shrinkage
):
    # every scoring option: the calibration reads each image's score as the scorer will
    config = AS_TAKEN.replace(
        image_size=32,
        embedding_dim=12,
        calibration_folds=folds,
        neighbourhood=neighbourhood,
        image_score=image_score,
        top_fraction=0.05,
        shrinkage=shrinkage,
    )
    fit = Fit.start(config)
    groups = fit.groups(images)
    spool = fit.spool_or_none(tmp_path, len(images))
    assert spool is not None
    assert not fit.accumulate(groups, progress=False, spool=spool).unreadable
    assert (
        all(fold_of(i.name, 5) == k for k, g in enumerate(groups) for i in g)
        if folds == 5
        else all(len(g) == 1 for g in groups)
    )
    x, names, sizes = spooled_embeddings(spool), list(fit.spooled.names), list(fit.spooled.folds)
    scored = ScoringPass(SpooledRows(spool), names, sizes)
    finished = fit.finish([scored], tmp_path, progress=False)
    spool.close()
    assert finished.scored == names and not finished.unscored
    if shrinkage == "auto":  # the weight Ledoit and Wolf's estimate gives, computed brute force from the rows
        shrinkage = finished.shrinkage["weight"]
        assert shrinkage == pytest.approx(ledoit_wolf_weight(x), rel=1e-6) and 0 < shrinkage < 0.95
    expected = refit_scores(
        x,
        sizes,
        config.gaussian.epsilon,
        fit.embedder.grid_shape,
        config.features.image_size,
        config.scoring.blur_sigma,
        image_score,
        config.scoring.top_fraction,
        shrinkage,
    )
    np.testing.assert_allclose(finished.scores.numpy(), expected, rtol=1e-6)
    # input distances: the mean of each image's out-of-fold squared distances (input drift's reference)
    np.testing.assert_allclose(
        finished.input_distances.numpy(),
        refit_squared(x, sizes, config.gaussian.epsilon, shrinkage).mean(1),
        rtol=1e-6,
    )
    # the fitted model: statistics of every image, factors on disk in float32, packed
    assert int(fit.statistics.count) == len(images)
    np.testing.assert_allclose(fit.statistics.mean.numpy(), x.mean(axis=0), rtol=1e-10, atol=1e-10)
    finished.factors.close()


@pytest.mark.parametrize("statistics, folds", [("position", "loo"), ("shared", 5), ("shared", "loo")])
def test_tiled_out_of_fold_scores_equal_refits_on_the_stitched_map(images, tmp_path, statistics, folds):
    # the calibration of a tiled model: every picture's tiles out of the fold's model (in the shared mode a fold
    # is still whole pictures: all their tiles leave together), the score read from the stitched map
    images = images[:12]
    config = AS_TAKEN.replace(
        image_size=32,
        embedding_dim=8,
        calibration_folds=folds,
        tiles=(2, 2),
        tile_overlap=0.25,
        tile_statistics=statistics,
        blur_sigma=2.0,
    )
    fit = Fit.start(config)
    spool = fit.spool_or_none(tmp_path, len(images))
    assert not fit.accumulate(fit.groups(images), progress=False, spool=spool).unreadable
    x, names, sizes = spooled_embeddings(spool), list(fit.spooled.names), list(fit.spooled.folds)
    per_image = 4 if statistics == "shared" else 1
    assert x.shape == (len(images) * per_image, 64 * 4 // per_image, 8) and fit.count == len(images)
    assert all(size % per_image == 0 for size in sizes)
    finished = fit.finish([ScoringPass(SpooledRows(spool), names, sizes)], tmp_path, progress=False)
    spool.close()
    assert finished.scored == names[::per_image] and not finished.unscored
    squared = refit_squared(x, sizes, config.gaussian.epsilon, config.gaussian.shrinkage).reshape(
        len(images), 4 * 64
    )  # (B, T * P): rows of a picture
    tiling = config.tiling
    expected = reference_maps(squared, tiling, config.scoring.blur_sigma).reshape(len(images), -1).max(axis=1)
    np.testing.assert_allclose(finished.scores.numpy(), expected, rtol=1e-6)
    assert int(fit.statistics.count) == len(images) * per_image
    finished.factors.close()


@pytest.mark.parametrize(
    "folds, fit_changes, statistics",
    [
        ("loo", False, "position"),
        (5, False, "position"),
        ("loo", True, "position"),
        (5, True, "position"),
        ("loo", False, "shared"),
    ],
)
def test_expected_changes_are_scored_as_refits_without_their_picture(images, tmp_path, folds, fit_changes, statistics):
    """``--expect``: each picture's calibration score is its changed copy's, under a model fitted from scratch
    without that picture's fold (and without the fold's copies when they are fitted); its input distance stays
    the picture's own. The copies are the seeded draws of :mod:`padim.models.data.changes`, row after row."""
    from PIL import Image

    from padim.models.data.changes import apply, seeded

    images = images[:14]
    tiles = (2, 1) if statistics == "shared" else (1, 1)
    config = CONFIG.replace(
        image_size=32,
        embedding_dim=10,
        calibration_folds=folds,
        tiles=tiles,
        tile_statistics=statistics,
        expect="brightness=0.2,shift=2,rotate=2,blur=1",
        fit_changes=fit_changes,
    )
    fit = Fit.start(config)
    spool = fit.spool_or_none(tmp_path, len(images))
    assert not fit.accumulate(fit.groups(images), progress=False, spool=spool).unreadable
    x, names, sizes = spooled_embeddings(spool), list(fit.spooled.names), list(fit.spooled.folds)
    per = fit.rows_per_image  # a picture's rows; its copy's follow
    both = x.reshape(len(images), 2, per, *x.shape[1:])
    own, copies = both[:, 0].reshape(-1, *x.shape[1:]), both[:, 1].reshape(-1, *x.shape[1:])
    # the copies are the declared changes drawn from each picture's name, embedded as any picture is
    order = [names[i] for i in range(0, len(names), 2 * per)]
    by_name = {i.name: i for i in images}
    pictures = [Image.open(by_name[n].path).convert("RGB") for n in order]
    changed = [apply(p, config.expected.draw(seeded(n))) for p, n in zip(pictures, order, strict=True)]
    np.testing.assert_allclose(
        copies, fit.embedder(fit.embedder.preprocess(changed)).double().numpy(), rtol=1e-4, atol=1e-4
    )
    finished = fit.finish([ScoringPass(SpooledRows(spool), names, sizes)], tmp_path, progress=False)
    spool.close()
    assert finished.scored == order and not finished.unscored
    # the reference: per fold of pictures, a float64 refit on the rest (their copies too when fitted)
    fitted = x if fit_changes else own
    picture_folds = [m // (2 * per) for m in sizes]
    expected_copy, expected_own, start = [], [], 0
    for k in picture_folds:
        out_rows = np.arange(start * per, (start + k) * per)
        out_fitted = (
            np.concatenate([np.arange((start + j) * 2 * per, (start + j + 1) * 2 * per) for j in range(k)])
            if fit_changes
            else out_rows
        )
        rest = np.delete(fitted, out_fitted, axis=0)
        joined = np.concatenate([rest, copies[out_rows], own[out_rows]])  # scored as the last 2 k T rows
        squared = refit_squared(
            joined, [len(rest), 2 * k * per], config.gaussian.epsilon, config.gaussian.shrinkage, pooled(fitted)
        )[len(rest) :]
        expected_copy.append(squared[: k * per])
        expected_own.append(squared[k * per :])
        start += k
    squared_copy, squared_own = np.concatenate(expected_copy), np.concatenate(expected_own)
    pixels = squared_copy.shape[1] * per  # a picture's distances, tiles together
    expected = reference_maps(squared_copy.reshape(len(images), pixels), config.tiling, config.scoring.blur_sigma)
    np.testing.assert_allclose(finished.scores.numpy(), expected.reshape(len(images), -1).max(axis=1), rtol=1e-6)
    np.testing.assert_allclose(
        finished.input_distances.numpy(), squared_own.reshape(len(images), -1).mean(1), rtol=1e-6
    )
    # the pictures' own scores are kept beside: what a line that does not change scores (the score-drift reference)
    taken = reference_maps(squared_own.reshape(len(images), pixels), config.tiling, config.scoring.blur_sigma)
    np.testing.assert_allclose(finished.taken_scores.numpy(), taken.reshape(len(images), -1).max(axis=1), rtol=1e-6)
    assert int(fit.statistics.count) == len(images) * per * (2 if fit_changes else 1) and fit.count == len(images)
    np.testing.assert_allclose(fit.statistics.mean.numpy(), fitted.mean(axis=0), rtol=1e-10, atol=1e-10)
    finished.factors.close()


@pytest.mark.parametrize(
    "folds, expect, fit_changes, statistics",
    [
        ("loo", "", False, "position"),
        ("loo", "brightness=0.2,shift=2", False, "position"),
        ("loo", "brightness=0.2,shift=2", True, "position"),
        (5, "brightness=0.2,shift=2", True, "position"),
        (5, "", False, "shared"),
    ],
)
def test_query_rows_are_scored_as_refits_without_their_picture(
    images, tmp_path, folds, expect, fit_changes, statistics
):
    """A pass of query rows (the int8 scorer's threshold reads the int8 backbone's embeddings so): each query row
    (one for each of a picture's rows and its copy's) scored under a model fitted from scratch without that picture's
    fold, its changed copies too where they are fitted, beside the pass that scores the pictures themselves and under
    the same factors; they give scores, input distances and own scores as the pictures' rows do."""
    from padim.models.fit.passes import HeldRows

    images = images[:12]
    tiles = (2, 1) if statistics == "shared" else (1, 1)
    config = CONFIG.replace(
        image_size=32, embedding_dim=8, calibration_folds=folds, tiles=tiles, tile_statistics=statistics,
        expect=expect, fit_changes=fit_changes, trim_cover=False,
    )  # fmt: skip
    fit = Fit.start(config)
    spool = fit.spool_or_none(tmp_path, len(images))
    assert not fit.accumulate(fit.groups(images), progress=False, spool=spool).unreadable
    x, names, sizes = spooled_embeddings(spool), list(fit.spooled.names), list(fit.spooled.folds)
    per, spooled, pictures = fit.rows_per_image, fit.spooled_rows, len(images)
    generator = np.random.default_rng(0)  # the queries: the rows, changed as another arithmetic would change them
    queries = (x * generator.uniform(0.9, 1.1, x.shape) + generator.normal(0, 0.05, x.shape)).astype(np.float32)
    asked = ScoringPass(SpooledRows(spool), names, sizes, HeldRows(torch.from_numpy(queries)))
    finished = fit.finish([asked], tmp_path, progress=False)
    spool.close()
    order = [names[i] for i in range(0, len(names), spooled)]
    assert finished.queried.names == order == finished.scored
    fitted_rows = spooled if (fit_changes or not expect) else per  # a picture's rows in the statistics
    layout = x.reshape(pictures, spooled // per, per, *x.shape[1:])
    fitted = x if fitted_rows == spooled else layout[:, 0].reshape(-1, *x.shape[1:])
    expected, start = [], 0
    for k in [m // spooled for m in sizes]:
        rest = np.delete(fitted, np.arange(start * fitted_rows, (start + k) * fitted_rows), axis=0)
        q = queries[start * spooled : (start + k) * spooled].astype(np.float64)
        squared = refit_squared(
            np.concatenate([rest, q]), [len(rest), k * spooled], config.gaussian.epsilon, config.gaussian.shrinkage,
            pooled(fitted),
        )[len(rest) :]  # fmt: skip
        expected.append(squared.reshape(k, spooled // per, per, -1))
        start += k
    squared = np.concatenate(expected)  # (pictures, own / copy, T, P)
    own, scored = squared[:, 0], squared[:, -1]  # with expect the copies' rows give the score
    maps = reference_maps(scored.reshape(pictures, -1), config.tiling, config.scoring.blur_sigma)
    np.testing.assert_allclose(finished.queried.scores.numpy(), maps.reshape(pictures, -1).max(axis=1), rtol=1e-6)
    np.testing.assert_allclose(finished.queried.input_distances.numpy(), own.reshape(pictures, -1).mean(1), rtol=1e-6)
    if expect:
        taken = reference_maps(own.reshape(pictures, -1), config.tiling, config.scoring.blur_sigma)
        np.testing.assert_allclose(
            finished.queried.taken_scores.numpy(), taken.reshape(pictures, -1).max(axis=1), rtol=1e-6
        )
    else:
        assert finished.queried.taken_scores is None
    assert not np.allclose(finished.queried.scores.numpy(), finished.scores.numpy(), rtol=1e-3)  # its own
    finished.factors.close()


DECLARED = "brightness=0.15,contrast=0.15,shift=2,blur=1"


@pytest.fixture(scope="module")
def line_pictures(tmp_path_factory):
    """80 normal training pictures (64 px model input), and 600 fresh ones as a line shows them: each after its own
    draw of :data:`DECLARED`'s changes."""
    from PIL import Image

    from padim.models.data.changes import Expected, apply, seeded
    from padim.models.data.synthetic import texture

    folder = tmp_path_factory.mktemp("line")
    rng = np.random.default_rng(0)
    train = []
    for i in range(80):
        path = folder / f"{i:03d}.png"
        Image.fromarray((texture("leather", 96, rng) * 255).astype(np.uint8)).save(path)
        train.append(TrainingImage(path, path.name))
    declared = Expected.parse(DECLARED)
    fresh = [
        apply(Image.fromarray((texture("leather", 96, rng) * 255).astype(np.uint8)), declared.draw(seeded(f"x{i}")))
        for i in range(600)
    ]
    return train, fresh


@pytest.mark.parametrize("expect, fit_changes", [("", False), (DECLARED, False), (DECLARED, True)])
def test_with_expect_the_flag_rate_on_changed_pictures_stays_within_the_promise(line_pictures, expect, fit_changes):
    """The image-level flag-rate test: pictures drawn within the declared changes are flagged at most as often as the
    calibration's bound says; without the declaration the same pictures blow the promise up."""
    train, fresh = line_pictures
    config = CONFIG.replace(
        calibration_folds="loo", batch_size=32, false_alarm_rate=0.05, expect=expect, fit_changes=fit_changes
    )
    detector, _ = fit_detector(config, train, progress=False)
    scores = torch.cat([detector.score(detector.preprocess(fresh[i : i + 100])).raw_scores for i in range(0, 600, 100)])
    realised = float((scores >= detector.calibration.threshold).double().mean())
    bound = detector.calibration.false_alarm_bound
    slack = 2 * math.sqrt(bound * (1 - bound) / len(fresh))  # the fresh pictures' own binomial error
    if expect:
        assert realised <= bound + slack, (realised, bound)
        # a texture's crops share no position, so they already show every shift: --trim-cover leaves it out of the
        # cover, and the promise holds on the shifted pictures all the same
        assert detector.describe()["calibration"]["expect"] == "brightness=0.15,contrast=0.15,blur=1"
        assert detector.describe()["calibration"]["measured"]["left_out"] == ["shift"]
    else:
        # measured 0.31 against a bound of 0.11: the default gain takes the brightness out, the contrast and the
        # blur are left (0.59 with --standardise none)
        assert realised > 2 * bound, (realised, bound)


def test_threshold_comes_from_every_image_out_of_fold(images):
    detector, report = fit_detector(CONFIG, images, progress=False)
    assert report.fitted == len(images) == detector.provenance.fit_image_count == int(detector.statistics.count) // ROWS
    cal = detector.calibration
    assert cal.count == len(images) and cal.earlier_scores == 0 and cal.method == "gumbel_tail"
    again = Calibration.from_scores(torch.tensor(cal.scores, dtype=torch.float64), CONFIG.verdict.false_alarm_rate)
    assert again.threshold == cal.threshold  # the same stored scores, the same arithmetic: exact by construction
    assert detector.describe()["calibration"]["promised_false_alarm_rate"] == pytest.approx(
        cal.promised_false_alarm_rate
    )
    assert any("cannot promise 1.00% false alarms" in w and "99 normal images" in w for w in report.warnings)
    assert report.spool == len(images) * 2 * 16 * 16 * 100 * 4 and set(report.seconds) == {
        "measure",  # the training pictures' spread, for --trim-cover
        "quantise",  # the int8 scorer's backbone (--int8-scorer)
        "fit",
        "fit_waiting_for_pictures",
        "finish",
        "calibrate",
        "check",  # the int8 scorer's gate
        "write",
    }


def test_resume_equals_one_shot_statistics_and_folds(images, tmp_path):
    first, second = images[:18], images[18:]
    whole, whole_report = fit_detector(CONFIG, images, progress=False)
    part_report = train(CONFIG, first, tmp_path / "part.padim", progress=False)
    part = load_detector(tmp_path / "part.padim", device="cpu")
    resumed, resumed_report = fit_detector(CONFIG, second, resume=load_fit(tmp_path / "part.padim"), progress=False)
    assert {**part_report.folds, **resumed_report.folds} == whole_report.folds
    assert int(resumed.statistics.count) == int(whole.statistics.count) == len(images) * ROWS  # copies by name
    # the float32 backbone differs by ~1e-7 between batch compositions; the statistics
    # themselves agree to float64 round-off (tests/core)
    torch.testing.assert_close(resumed.statistics.mean, whole.statistics.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resumed.statistics.comoment, whole.statistics.comoment, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        resumed.model.precision_factor.float(), whole.model.precision_factor.float(), rtol=1e-3, atol=1e-3
    )  # float16 as stored
    # calibration: the earlier scores are kept as they were, and said to be earlier ones
    cal = resumed.calibration
    assert cal.count == len(images) and cal.earlier_scores == len(first)
    assert set(part.calibration.scores) <= set(cal.scores)  # read back from the file: exact
    assert any("kept from the resumed model" in w for w in resumed_report.warnings)
    # resuming with every image again adds only those the model has not seen (by content)
    again, again_report = fit_detector(CONFIG, images, resume=load_fit(tmp_path / "part.padim"), progress=False)
    assert len(again_report.already_fitted) == len(first) and int(again.statistics.count) == len(images) * ROWS
    torch.testing.assert_close(again.statistics.mean, whole.statistics.mean, rtol=1e-5, atol=1e-6)


def test_merge_equals_one_shot_and_calibrates_on_unseen_images(images, tmp_path):
    a, b, held = images[:11], images[11:24], images[24:]
    parts = []
    for name, chunk in (("a", a), ("b", b)):
        fit, _ = fit_partial(CONFIG, chunk, progress=False, scratch_dir=tmp_path)
        save_fit(fit, tmp_path / f"{name}.part")
        parts.append(tmp_path / f"{name}.part")
    merge_fits(parts, [i.path for i in held], CONFIG, tmp_path / "merged.padim", progress=False)
    merged = load_detector(tmp_path / "merged.padim", device="cpu", with_statistics=True)
    one_shot, _ = fit_partial(CONFIG, a + b, progress=False, scratch_dir=tmp_path)
    assert int(merged.statistics.count) == 24 * ROWS
    torch.testing.assert_close(merged.statistics.mean, one_shot.statistics.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.statistics.comoment, one_shot.statistics.comoment, rtol=1e-5, atol=1e-5)
    from PIL import Image

    from padim.models.data.changes import apply, seeded

    # the calibration images' changed copies (by name), scored by the merged model: unseen, so held out
    changed = [apply(Image.open(i.path).convert("RGB"), CONFIG.expected.draw(seeded(i.path.name))) for i in held]
    held_scores = merged.score(merged.preprocess(changed)).raw_scores
    expected = Calibration.from_scores(held_scores.double(), CONFIG.verdict.false_alarm_rate)
    assert merged.calibration.threshold == pytest.approx(
        expected.threshold, rel=1e-3
    )  # float16 factors score them here
    assert merged.provenance.calibration_source == "held_out"
    with pytest.raises(FitError, match="were fitted in the parts"):
        merge_fits(parts, [i.path for i in a[:2] + held], CONFIG, tmp_path / "x.padim", progress=False)


@pytest.mark.parametrize(
    "expect, fit_changes, shrinkage",
    [("", False, 0.0), ("brightness=0.1,shift=2", False, 0.0), ("brightness=0.1,shift=2", True, 0.0), ("", False, 0.5)],
)
def test_without_room_for_the_spool_the_calibration_embeds_again_and_agrees(
    images, tmp_path, monkeypatch, expect, fit_changes, shrinkage
):
    # shrunk: the pooled covariance from the spool's pass (pool) and from the statistics in memory agree
    config = CONFIG.replace(expect=expect, fit_changes=fit_changes, shrinkage=shrinkage)
    spooled, _ = fit_detector(config, images, progress=False)
    # room for the factors (a few MiB) and not for the spool beside them and its reserve (memory_plan.DISK_RESERVE)
    monkeypatch.setattr("padim.models.fit.memory_plan.free_disk", lambda directory: 64 * 2**20)
    again, report = fit_detector(config, images, progress=False)
    assert report.spool == 0 and any("embeds them again" in w for w in report.warnings)
    # the same batches of the same images in one process: the same float32 embeddings
    torch.testing.assert_close(again.statistics.comoment, spooled.statistics.comoment, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(again.calibration.scores, spooled.calibration.scores, rtol=1e-6)


def test_a_spool_in_the_devices_memory_fits_the_same_model_as_one_on_disk(images, tmp_path, monkeypatch):
    # on a GPU with room the spool waits in its memory; here the CPU stands in for it
    config = CONFIG.replace(shrinkage=0.1)  # the pool's pass reads the spool too
    on_disk = train(config, images, tmp_path / "disk.padim", progress=False, scratch_dir=tmp_path / "scratch")
    monkeypatch.setattr("padim.models.fit.training.spool_in_memory", lambda plan, free: True)
    held = train(config, images, tmp_path / "held.padim", progress=False, scratch_dir=tmp_path / "scratch")
    assert held.plan is not None and held.plan.spool_held and on_disk.plan is not None and not on_disk.plan.spool_held
    assert held.plan.total == on_disk.plan.total + on_disk.plan.spool and held.spool == on_disk.spool > 0
    first, _ = load_artifact(tmp_path / "disk.padim")
    second, _ = load_artifact(tmp_path / "held.padim")
    assert first.keys() == second.keys()
    for name in ("mean", "precision_factor", "statistics.comoment", "calibration.scores", "calibration.taken_scores"):
        assert torch.equal(first[name], second[name]), name  # the same rows, read from memory instead of the disk

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(EmbeddingSpool, "__init__", _failing_in_memory(EmbeddingSpool.__init__, out_of_memory))
    fallen = train(config, images, tmp_path / "fallen.padim", progress=False, scratch_dir=tmp_path / "scratch")
    assert fallen.plan is not None and not fallen.plan.spool_held and fallen.spool == on_disk.spool
    assert torch.equal(load_artifact(tmp_path / "fallen.padim")[0]["precision_factor"], first["precision_factor"])


def _failing_in_memory(init, fail):
    """``EmbeddingSpool.__init__`` that runs ``fail`` for a spool in memory: the GPU had less room than planned."""

    def patched(self, *args, device=None, **kwargs):
        if device is not None:
            fail()
        init(self, *args, **kwargs)

    return patched


def test_changed_copies_are_made_on_the_decoding_threads_as_the_fit_would_make_them(images):
    fit = Fit.start(CONFIG.replace(decode_workers=2))
    name_of = {image.path: image.name for image in images}
    batches = [[image.path for image in images[:5]], [image.path for image in images[5:9]]]
    seen = []
    for paths, pictures, copies in fit.reading.decoded(batches, [], name_of.__getitem__):
        assert copies is not None and len(copies) == len(pictures) == len(paths)
        names = [name_of[p] for p in paths]
        made = [
            apply(picture, fit.config.expected.draw(seeded(name)))
            for name, picture in zip(names, pictures, strict=True)
        ]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(copies, made, strict=True))
        # the embeddings of copies made there are those of copies made by embed itself
        assert torch.equal(fit.reading.embed(names, pictures, copies), fit.reading.embed(names, pictures))
        seen += paths
    assert seen == [p for batch in batches for p in batch]
    stable = Fit.start(AS_TAKEN)
    assert all(copies is None for _, _, copies in stable.reading.decoded(batches, [], name_of.__getitem__))


def test_a_fit_says_how_long_it_waited_for_pictures_and_names_more_workers_when_that_was_most(
    images, tmp_path, monkeypatch
):
    report = train(CONFIG, images, tmp_path / "model.padim", progress=False)
    assert 0 < report.seconds["fit_waiting_for_pictures"] <= report.seconds["fit"]  # workers=0: decoded in line
    assert not any("--decode-workers" in w for w in report.warnings)  # a fit of a second or two says nothing
    monkeypatch.setattr("padim.models.fit.training.WAITING_SECONDS", 0.0)
    monkeypatch.setattr("padim.models.fit.training.WAITING_SHARE", 0.0)
    monkeypatch.setattr("padim.models.fit.training.usable_cpus", lambda: 16)
    report = train(CONFIG, images, tmp_path / "model.padim", progress=False)
    (said,) = [w for w in report.warnings if "--decode-workers" in w]
    assert "waiting for pictures to be decoded and their changed copies made" in said and "--decode-workers 16" in said
    monkeypatch.setattr("padim.models.fit.training.usable_cpus", lambda: 1)  # no more cores to give it
    report = train(CONFIG.replace(decode_workers=1), images, tmp_path / "model.padim", progress=False)
    assert not any("--decode-workers" in w for w in report.warnings)


def padim_files_open() -> list[str]:
    """This process's open files that are padim scratch files (unlinked, so named ``... (deleted)``)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if ".padim-" in target:
            found.append(target)
    return found


def test_scratch_files_leave_nothing_behind_on_success_or_failure(images, tmp_path, monkeypatch):
    train(CONFIG, images[:12], tmp_path / "ok.padim", progress=False, scratch_dir=tmp_path / "scratch")
    assert list((tmp_path / "scratch").iterdir()) == [] and padim_files_open() == []

    def broken(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C in the middle of the finish

    monkeypatch.setattr("padim.models.fit.fold_scores.fold_base", broken)
    with pytest.raises(KeyboardInterrupt):
        train(CONFIG, images[:12], tmp_path / "never.padim", progress=False, scratch_dir=tmp_path / "scratch")
    assert list((tmp_path / "scratch").iterdir()) == [] and padim_files_open() == []
    assert not (tmp_path / "never.padim").exists()


def test_a_fit_that_would_not_fit_in_memory_is_refused_before_it_starts_naming_what_would(
    images, tmp_path, monkeypatch
):
    from padim.models.fit.memory_plan import FitFacts, plan_fit

    facts = FitFacts(len(images), spool=True, int8_scorer=True)  # the default fit makes its int8 scorer
    room = plan_fit(CONFIG.replace(image_size=128), facts, device="cpu").total
    monkeypatch.setattr("padim.models.fit.training.free_memory", lambda device: room)
    with pytest.raises(FitError) as info:
        train(CONFIG.replace(image_size=256), images, tmp_path / "big.padim", progress=False)
    message = str(info.value)
    assert "needs about" in message and "free" in message and "--image-size 128" in message
    # what the plan counts, by part (test_memory_plan.py checks the other options and --no-int8-scorer)
    assert "statistics " in message and "backbone " in message
    assert "\n" not in message and not (tmp_path / "big.padim").exists()


@pytest.mark.parametrize("phase", ["accumulate", "finish"])
def test_running_out_of_gpu_memory_mid_fit_is_an_error_with_the_plan_and_what_to_try(
    images, tmp_path, monkeypatch, phase
):
    """torch raises OutOfMemoryError on a GPU; the fit answers with its plan and smaller options, leaving nothing."""

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Fit, phase, out_of_memory)
    with pytest.raises(DoesNotFit) as info:
        train(
            CONFIG.replace(image_size=96),
            images[:12],
            tmp_path / "m.padim",
            progress=False,
            scratch_dir=tmp_path / "scratch",
        )
    message = str(info.value)
    assert message.startswith("the CPU ran out of memory during the fit (its plan: ")
    assert "--batch-size 4" in message and "\n" not in message
    assert isinstance(info.value, FitError)  # the CLI's one error family: exit 1 with this line, no traceback
    assert not (tmp_path / "m.padim").exists() and list((tmp_path / "scratch").iterdir()) == []


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
        fit_detector(AS_TAKEN, copies, progress=False)
    # with the line's changes declared and fitted, one picture under those changes is a model (of little use: said)
    _, report = fit_detector(CONFIG, copies, progress=False)
    assert any("11 image(s) are copies of others" in w for w in report.warnings)


def test_copies_are_named(images, tmp_path):
    copy = tmp_path / "copy-of-003.png"
    copy.write_bytes(images[3].path.read_bytes())
    _, report = fit_detector(CONFIG, images[:8] + [TrainingImage(copy, copy.name)], progress=False)
    assert report.copies == [["003.png", "copy-of-003.png"]]
    assert any(
        "1 image(s) are copies of others (same content: 003.png = copy-of-003.png)" in w for w in report.warnings
    )


def test_unreadable_images_are_left_out_and_named(images, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    detector, report = fit_detector(CONFIG, images[:10] + [TrainingImage(bad, "broken.png")], progress=False)
    assert int(detector.statistics.count) == 10 * ROWS and [n for n, _ in report.unreadable] == ["broken.png"]
    assert any("broken.png" in w for w in report.warnings)
    with pytest.raises(FitError, match=r"none of the 1 images could be read \(broken.png"):
        fit_detector(CONFIG, [TrainingImage(bad, "broken.png")], progress=False)
