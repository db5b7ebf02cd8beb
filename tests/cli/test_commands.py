"""The real ``padim`` command line, end to end, on generated images with random weights."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import IMAGE_SIZE, normal_and_shifted, older_format_of, run_cli
from PIL import Image

from padim.core import load_artifact

# Image-AUROC floor for the generated 'weave' category with random resnet18 weights at 64 px.
# With 6 good and 12 defective test images, AUROC under chance has a standard deviation of
# sqrt((6 + 12 + 1) / (12 * 6 * 12)) = 0.15, so 0.85 is 2.3 sigma above chance; with the defaults this
# set scores .89 (--standardise gain; .90 with none: one pair of 72 apart, 2-core Intel Xeon VM), its
# faint stains and scratches ranked among the good pictures and every hole above them, so the floor
# leaves a pair or two of room without letting a broken detector through.
IMAGE_AUROC_FLOOR = 0.85


def test_train_writes_a_labelled_self_contained_model(model_file):
    tensors, header = load_artifact(model_file)
    assert header["weights"]["source"] == "random"
    assert header["config"]["image_size"] == IMAGE_SIZE
    assert header["fit_image_count"] == 30 and header["verified"] is True
    assert header["calibration"]["scores"] == 30 and header["calibration_source"] == "out_of_fold"
    assert any(k.startswith("backbone.") for k in tensors)
    assert tensors["mean"].shape == ((IMAGE_SIZE // 4) ** 2, 100)
    assert header["precision_dtype"] in ("float16", "float32")
    info = json.loads(run_cli("info", model_file).stdout)
    assert info["backbone"] == "resnet18" and info["size_bytes"] == model_file.stat().st_size
    assert info["fit_image_count"] == 30 and info["verified"] == "every tensor"  # small files: checked by default
    assert info["calibration"]["scores"] == 30 and info["calibration"]["false_alarm_rate"] == 0.01
    assert info["calibration"]["folds"] == "loo" and info["calibration"]["false_alarm_bound"] > 0
    assert json.loads(run_cli("info", "--verify", model_file).stdout)["verified"] == "every tensor"


def test_info_finds_a_flipped_bit_without_being_asked_and_says_when_it_checked_the_header_only(
    model_file, tmp_path, monkeypatch, capsys
):
    from padim.cli import main
    from padim.commands import info

    broken = tmp_path / "flipped.padim"
    data = bytearray(model_file.read_bytes())
    data[-1000] ^= 0x01  # inside the last tensors: the statistics
    broken.write_bytes(bytes(data))
    result = run_cli("info", broken, check=False)
    assert result.returncode == 1 and "does not match its digest" in result.stderr
    monkeypatch.setattr(info, "VERIFY_BY_DEFAULT_BYTES", 1000)  # as if the file were a large one
    assert main(["info", str(broken)]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] == "header only (--verify checks every tensor)"


def test_train_says_what_the_threshold_promises(dataset, tmp_path):
    result = run_cli(
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "m.padim",
        "--weights",
        "random",
        "--image-size",
        IMAGE_SIZE,
        "--false-alarm-rate",
        "0.02",
    )
    summary = json.loads(result.stdout)
    calibration = summary["calibration"]
    assert summary["fitted"] == summary["fit_image_count"] == calibration["scores"] == 30
    assert calibration["false_alarm_rate"] == 0.02 and calibration["method"] == "gumbel_tail"
    assert calibration["promised_false_alarm_rate"] >= 1 / 31  # the best 30 scores can promise
    # so 2% is not promised wherever the threshold falls: said in one line, with the number needed
    (warning,) = [line for line in result.stderr.splitlines() if "warning:" in line]
    assert "cannot promise 2.00% false alarms" in warning and "49 normal images would" in warning
    # the model's int8 scorer (--int8-scorer, the default): its gate's figures, said and in the summary
    int8 = summary["int8_scorer"]
    (said,) = [line for line in result.stderr.splitlines() if "int8 scorer" in line]
    assert int8["check"]["images"] == 16 and int8["check"]["tolerance"] == 0.25
    assert ("kept" in said) == int8["check"]["passed"] == (int8["calibration"] is not None)
    info = json.loads(run_cli("info", tmp_path / "m.padim").stdout)
    assert info["int8_scorer"] == int8 and info["runtime"]["scorer"] in ("int8", "float32")
    assert (info["runtime"]["scorer"] == "int8") == ("int8 scorer on ONNX Runtime" in info["runtime"]["why"])
    assert "threshold" in result.stderr and "from 30 out-of-fold scores, aiming at 2.00%" in result.stderr
    # what it costs, said before pass 1: the memory plan and where the embeddings wait
    (plan,) = [line for line in result.stderr.splitlines() if "this fit needs about" in line]
    assert "GB free" in plan and "removed when the fit ends" in plan
    # each picture's embeddings and its changed copy's (the default expects the line's changes) wait on disk
    assert (
        "embeddings (and their changed copies', --expect brightness=0.2," in plan and f"spooled to {tmp_path}" in plan
    )
    assert summary["spooled_bytes"] == 30 * 2 * (IMAGE_SIZE // 4) ** 2 * 100 * 4
    assert summary["memory"]["planned_bytes"] < summary["memory"]["free_bytes"]
    assert summary["memory"]["embeddings_in_device_memory"] is False  # on a CPU the spool waits on disk
    phases = summary["phase_seconds"]
    # measure: the training pictures' spread, which --trim-cover reads; quantise and check: the int8 scorer's
    # backbone and gate (--int8-scorer)
    assert set(phases) == {
        "measure", "quantise", "fit", "fit_waiting_for_pictures", "finish", "calibrate", "check", "write"
    }  # fmt: skip
    assert 0 < phases["fit_waiting_for_pictures"] < phases["fit"]  # the part of pass 1 not in the backbone


def test_hashed_folds_slim_with_a_scratch_dir(dataset, tmp_path):
    scratch = tmp_path / "scratch"
    result = run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "m.padim",
        "--weights",
        "random",
        "--image-size",
        IMAGE_SIZE,
        "--calibration-folds",
        "7",
        "--slim",
        "--scratch-dir",
        scratch,
    )
    summary = json.loads(result.stdout)
    assert summary["calibration"]["folds"] == 7 and summary["calibration"]["scores"] == 30
    _, header = load_artifact(tmp_path / "m.padim")
    assert header["has_statistics"] is False and header["config"]["calibration_folds"] == 7
    assert list(scratch.iterdir()) == []  # the spool and the factors had no names, and are gone
    bad = run_cli(
        "train", dataset / "train" / "good", "--output", tmp_path / "x.padim", "--calibration-folds", "1", check=False
    )
    assert bad.returncode == 1 and "calibration_folds: 1 is not allowed" in bad.stderr and "loo" in bad.stderr


def test_predict_outputs(model_file, dataset, tmp_path):
    out = tmp_path / "pred"
    summary = json.loads(run_cli("-q", "predict", model_file, dataset / "test", "--output", out).stdout)
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 6 + 12
    header = load_artifact(model_file)[1]
    # the threshold of the scorer --runtime auto ran: the model's int8 one on a CPU that computes int8 faster
    calibration = header["int8_scorer"]["calibration"] if summary["scorer"] == "int8" else header["calibration"]
    for record in lines:
        # the service's keys (tests/service), and the score recomputed from the file's header
        assert set(record) == {
            "path",
            "score",
            "raw_score",
            "is_anomaly",
            "threshold",
            "raw_threshold",
            "anomalous_area",
            "weights",
            "map",
            "heatmap",
        }
        logistic = 1 / (1 + math.exp(-(record["raw_score"] - calibration["threshold"]) / calibration["scale"]))
        assert record["score"] == pytest.approx(logistic, rel=1e-12)
        assert record["threshold"] == 0.5 and record["raw_threshold"] == pytest.approx(calibration["threshold"])
        assert record["is_anomaly"] == (record["raw_score"] >= calibration["threshold"])
        assert "RANDOM" in record["weights"]
    first = lines[0]
    rel = os.path.relpath(first["path"], dataset / "test")
    heat = Image.open(out / "heatmaps" / (os.path.splitext(rel)[0] + ".png"))
    source = Image.open(first["path"])
    # band above, original | overlay, colour bar below (tests/models/scoring/test_heatmaps.py)
    assert heat.width >= 2 * source.width and heat.height > source.height
    anomaly_map = np.load(out / "maps" / (os.path.splitext(rel)[0] + ".npy"))
    assert anomaly_map.dtype == np.float32 and anomaly_map.shape == (source.height, source.width)
    # the map is at the image's resolution; its maximum is close to the raw score
    assert anomaly_map.max() == pytest.approx(first["raw_score"], rel=0.05)
    defective = [r["raw_score"] for r in lines if "/good/" not in r["path"]]
    good = [r["raw_score"] for r in lines if "/good/" in r["path"]]
    assert np.mean(defective) > np.mean(good)


def test_predict_single_file(model_file, dataset, tmp_path):
    image = dataset / "test" / "hole" / "000.png"
    run_cli("-q", "predict", model_file, image, "--output", tmp_path, "--no-heatmaps")
    (record,) = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert record["path"] == str(image) and (tmp_path / "maps" / "000.npy").exists()
    assert not (tmp_path / "heatmaps").exists()


def test_evaluate_reports_metrics_and_leaves_model_alone(model_file, dataset, tmp_path):
    from sklearn.metrics import f1_score

    before = model_file.read_bytes()
    out = tmp_path / "eval.json"
    result = run_cli("-q", "evaluate", model_file, dataset, "--output", out)
    printed = json.loads(result.stdout)
    saved = json.loads(out.read_text())
    assert printed == saved
    assert saved["image_auroc"] >= IMAGE_AUROC_FLOOR
    assert saved["pixel_auroc"] > 0.8
    # F1 at the model's threshold, from predict's verdicts on the same images (PRO: tests/models)
    run_cli("-q", "predict", model_file, dataset / "test", "--output", tmp_path / "p", "--no-maps", "--no-heatmaps")
    records = [json.loads(line) for line in (tmp_path / "p" / "results.jsonl").read_text().splitlines()]
    labels = ["/good/" not in r["path"] for r in records]
    assert saved["f1_at_threshold"] == pytest.approx(f1_score(labels, [r["is_anomaly"] for r in records]))
    assert "RANDOM" in saved["weights"]
    assert model_file.read_bytes() == before


def test_evaluate_says_which_defect_pictures_have_no_mask_or_refuses_with_require_masks(model_file, dataset, tmp_path):
    category = tmp_path / "weave"
    shutil.copytree(dataset, category)
    (category / "ground_truth" / "hole" / "000_mask.png").unlink()
    result = run_cli("-q", "evaluate", model_file, category, "--report", tmp_path / "report")
    assert "1 defect picture(s) have no mask" in result.stderr and "1 in test/hole" in result.stderr
    assert "Pixel ROC: normal pixels" in (tmp_path / "report" / "report.html").read_text()  # from the masked ones
    assert result.stderr.count("no mask") == 1  # said once
    assert json.loads(result.stdout)["unmasked_defect_images"] == 1
    refused = run_cli("-q", "evaluate", model_file, category, "--require-masks", check=False)
    assert refused.returncode != 0 and "--require-masks" in refused.stderr and "1 in test/hole" in refused.stderr
    assert refused.stdout == ""


def test_evaluate_calibrate_stores_f1_threshold(model_file, dataset, tmp_path):
    copy = tmp_path / "m.padim"
    copy.write_bytes(model_file.read_bytes())
    result = json.loads(run_cli("-q", "evaluate", copy, dataset, "--calibrate", "--output", tmp_path / "e.json").stdout)
    _, header = load_artifact(copy)
    # the threshold of the scorer that scored the pictures (--runtime auto: the int8 one on a CPU with int8)
    stored = header["int8_scorer"]["calibration"] if result["scorer"] == "int8" else header["calibration"]
    assert stored["threshold"] == pytest.approx(result["f1_optimal_raw_threshold"])
    assert stored["method"] == "manual" and stored["false_alarm_rate"] is None
    assert header["has_statistics"] is True  # re-saving keeps what --resume and merge need
    float32 = run_cli("-q", "evaluate", copy, dataset, "--calibrate", "--runtime", "onnxruntime")  # float32's own
    assert json.loads(float32.stdout)["scorer"] == "float32"
    _, header = load_artifact(copy)
    assert header["calibration"]["method"] == "manual" and header["int8_scorer"] is None  # its threshold replaced


def test_resume_through_the_cli_matches_one_shot(dataset, tmp_path):
    images = sorted((dataset / "train" / "good").glob("*.png"))
    part_a, part_b, both = tmp_path / "a", tmp_path / "b", tmp_path / "ab"
    for folder, chunk in ((part_a, images[:20]), (part_b, images[20:]), (both, images)):
        folder.mkdir()
        for p in chunk:
            (folder / p.name).write_bytes(p.read_bytes())
    common = ["--weights", "random", "--image-size", IMAGE_SIZE]
    run_cli("-q", "train", part_a, "--output", tmp_path / "a.padim", *common)
    run_cli("-q", "train", part_b, "--output", tmp_path / "ab-resumed.padim", "--resume", tmp_path / "a.padim")
    run_cli("-q", "train", both, "--output", tmp_path / "ab.padim", *common)
    resumed, h1 = load_artifact(tmp_path / "ab-resumed.padim")
    whole, h2 = load_artifact(tmp_path / "ab.padim")
    assert h1["fit_image_count"] == h2["fit_image_count"] == 30
    assert h1["calibration"]["scores"] == 30 and h1["calibration"]["earlier_scores"] == 20
    torch.testing.assert_close(resumed["statistics.mean"], whole["statistics.mean"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resumed["statistics.comoment"], whole["statistics.comoment"], rtol=1e-5, atol=1e-5)
    # changing an architectural option on resume is refused
    clash = run_cli(
        "-q",
        "train",
        part_b,
        "--output",
        tmp_path / "x.padim",
        "--resume",
        tmp_path / "a.padim",
        "--image-size",
        "128",
        check=False,
    )
    assert clash.returncode == 1 and "image_size=64" in clash.stderr
    config = tmp_path / "c.yaml"
    config.write_text("image_size: 128\n")  # a value from YAML is checked as a flag is
    clash = run_cli(
        "-q",
        "train",
        part_b,
        "--output",
        tmp_path / "x.padim",
        "--resume",
        tmp_path / "a.padim",
        "--config",
        config,
        check=False,
    )
    assert clash.returncode == 1 and "image_size=64" in clash.stderr and "--config" in clash.stderr
    # the earlier out-of-fold scores were read from their maps one way: another image score would mix two scales
    clash = run_cli(
        "-q",
        "train",
        part_b,
        "--output",
        tmp_path / "x.padim",
        "--resume",
        tmp_path / "a.padim",
        "--image-score",
        "patch_max",
        check=False,
    )
    assert clash.returncode == 1 and "image_score='map_max'" in clash.stderr
    clash = run_cli(
        "-q",
        "train",
        part_b,
        "--output",
        tmp_path / "x.padim",
        "--resume",
        tmp_path / "a.padim",
        "--neighbourhood",
        "1",
        check=False,
    )
    assert clash.returncode == 1 and "neighbourhood=3" in clash.stderr
    # the earlier scores were computed with (or without) the declared changes: so must the new ones be
    clash = run_cli(
        "-q",
        "train",
        part_b,
        "--output",
        tmp_path / "x.padim",
        "--resume",
        tmp_path / "a.padim",
        "--expect",
        "typical",
        check=False,
    )
    assert clash.returncode == 1 and "--resume" in clash.stderr and "expect=" in clash.stderr
    assert not (tmp_path / "x.padim").exists()


def test_train_with_expected_changes_says_what_the_promise_covers(dataset, tmp_path, model_file):
    common = ["--weights", "random", "--image-size", IMAGE_SIZE, "--batch-size", 8]
    done = run_cli(
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "line.padim",
        *common,
        "--expect",
        "brightness=0.1,shift=2",
        "--fit-changes",
    )
    # the generated textures' crops share no position: they already show every shift, which --trim-cover (the
    # default) leaves to their own out-of-fold scores; train, the file and padim info say so
    summary = json.loads(done.stdout)
    assert summary["calibration"]["expect"] == "brightness=0.1" and summary["calibration"]["fit_changes"]
    assert "padim train: --expect brightness=0.1,shift=2: 30 training pictures measured: light within" in done.stderr
    assert "they already show shift at least as far as declared" in done.stderr
    assert (
        "on pictures within the declared changes brightness=0.1,shift=2: shift already as far among the 30 "
        "training pictures measured" in done.stderr
    )  # the verdict line
    assert "embeddings (and their changed copies', --expect brightness=0.1)" in done.stderr  # the plan line
    info = json.loads(run_cli("info", tmp_path / "line.padim").stdout)
    assert info["calibration"]["expect"] == "brightness=0.1" and info["calibration"]["fit_changes"] is True
    measured = info["calibration"]["measured"]
    assert measured["declared"] == "brightness=0.1,shift=2" and measured["left_out"] == ["shift"]
    assert measured["shift"] is None and measured["pictures"] == 30  # placement not measurable: a texture
    assert "within the declared changes brightness=0.1,shift=2" in info["calibration"]["covers"]
    # --no-trim-cover draws every declared change
    whole = run_cli("-q", "train", dataset / "train" / "good", "--output", tmp_path / "whole.padim", *common,
                    "--expect", "brightness=0.1,shift=2", "--no-trim-cover")  # fmt: skip
    assert json.loads(whole.stdout)["calibration"]["expect"] == "brightness=0.1,shift=2"
    assert "measured" not in json.loads(run_cli("info", tmp_path / "whole.padim").stdout)["calibration"]
    _, header = load_artifact(tmp_path / "line.padim")
    assert header["fit_image_count"] == 30 and header["calibration"]["scores"] == 30  # one score a picture
    # a preset is stored as its bounds; fitting copies without saying which changes is refused
    preset = run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "p.padim",
        *common,
        "--expect",
        "typical",
        "--no-fit-changes",
    )
    assert json.loads(preset.stdout)["calibration"]["expect"] == "brightness=0.1,contrast=0.1,rotate=1,blur=1,jpeg=80"
    refused = run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "x.padim",
        *common,
        "--expect",
        "stable",
        "--fit-changes",
        check=False,
    )
    assert refused.returncode == 1 and "--fit-changes fits each picture's changed copy" in refused.stderr
    wrong = run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "x.padim",
        *common,
        "--expect",
        "brightness=2",
        check=False,
    )
    assert wrong.returncode == 1 and "brightness=2.0 is not allowed; use a number from 0 to 0.5" in wrong.stderr
    assert not (tmp_path / "x.padim").exists()


def test_train_and_info_say_the_shrinkage_the_statistics_asked_for(dataset, tmp_path):
    """``--shrinkage auto`` (the default) estimates the weight when the factors are formed: train says it (stderr and
    its JSON line), the file keeps it (format 18) and ``padim info`` shows it; a weight given is shown as given."""
    common = ["--weights", "random", "--image-size", IMAGE_SIZE, "--batch-size", 8]
    done = run_cli("train", dataset / "train" / "good", "--output", tmp_path / "auto.padim", *common)
    chosen = json.loads(done.stdout)["shrinkage"]
    assert chosen["chosen"] == "estimated" and 0 < chosen["weight"] <= 0.95
    assert f"padim train: shrinkage {chosen['weight']:.3f}, estimated from the statistics (--shrinkage auto)" in (
        done.stderr
    )
    _, header = load_artifact(tmp_path / "auto.padim")
    assert header["config"]["shrinkage"] == "auto" and header["shrinkage_estimated"]["weight"] == chosen["weight"]
    assert json.loads(run_cli("info", tmp_path / "auto.padim").stdout)["shrinkage"] == chosen
    given = run_cli(
        "train", dataset / "train" / "good", "--output", tmp_path / "given.padim", *common, "--shrinkage", 0.3
    )
    assert json.loads(given.stdout)["shrinkage"] == {
        "weight": 0.3,
        "chosen": "given",
        "why": "given (--shrinkage WEIGHT)",
    }
    assert "estimated from the statistics" not in given.stderr
    wrong = run_cli("train", dataset / "train" / "good", "--output", tmp_path / "x.padim", *common, "--shrinkage",
                    "lots", check=False)  # fmt: skip
    assert wrong.returncode == 2 and "'lots' is not a number or auto" in wrong.stderr


def test_expect_auto_measures_the_training_pictures_and_the_model_keeps_what_it_measured(dataset, tmp_path):
    """``--expect auto`` measures the training pictures when the fit starts (the same numbers
    :func:`~padim.models.data.spread.measure` gives on them), fits with the bounds they set, says so, and keeps both in
    the file (format 14); a resume keeps that cover; a partial fit refuses; a format-13 file reads without one."""
    from padim.models.data.spread import Spread, measure
    from padim.models.fit.model_file import load_detector

    common = ["--weights", "random", "--image-size", IMAGE_SIZE, "--batch-size", 8]
    pictures = sorted((dataset / "train" / "good").glob("*.png"))
    training = tmp_path / "train"
    training.mkdir()
    for path in pictures[:16]:
        (training / path.name).write_bytes(path.read_bytes())
    done = run_cli("train", training, "--output", tmp_path / "auto.padim", *common, "--expect", "auto")
    spread = measure(Image.open(p) for p in sorted(training.glob("*.png")))
    cover = str(spread.cover())
    summary = json.loads(done.stdout)
    assert summary["calibration"]["expect"] == cover and summary["calibration"]["fit_changes"]
    assert f"--expect auto: 16 training pictures measured: light within {spread.brightness:.1%}" in done.stderr
    assert "how far the 16 training pictures measured wander (--expect auto;" in done.stderr  # the verdict line
    _, header = load_artifact(tmp_path / "auto.padim")
    assert header["format_version"] >= 14 and header["config"]["expect"] == cover
    assert Spread.from_dict(header["expect_measured"]) == spread
    info = json.loads(run_cli("info", tmp_path / "auto.padim").stdout)
    assert (
        info["calibration"]["measured"] == spread.to_dict()
        and "16 training pictures measured" in (info["calibration"]["covers"])
    )
    described = load_detector(tmp_path / "auto.padim", "cpu").describe()["calibration"]
    assert described["measured"] == spread.to_dict() and described["expect"] == cover
    # a resume (auto given again or not) keeps the cover it measured and what it measured
    extra = tmp_path / "more"
    extra.mkdir()
    for path in pictures[16:20]:
        (extra / path.name).write_bytes(path.read_bytes())
    run_cli(
        "-q",
        "train",
        extra,
        "--resume",
        tmp_path / "auto.padim",
        "--output",
        tmp_path / "more.padim",
        "--expect",
        "auto",
    )
    _, resumed = load_artifact(tmp_path / "more.padim")
    assert resumed["config"]["expect"] == cover and resumed["expect_measured"] == header["expect_measured"]
    assert resumed["fit_image_count"] == 20
    from padim.models.fit.learning import update_model
    from padim.models.fit.passes import TrainingImage

    taken_out = sorted(extra.glob("*.png"))[0]
    update_model(tmp_path / "more.padim", [], [TrainingImage(taken_out, taken_out.name)], tmp_path / "less.padim")
    _, less = load_artifact(tmp_path / "less.padim")
    assert less["fit_image_count"] == 19 and less["expect_measured"] == header["expect_measured"]
    partial = run_cli(
        "-q",
        "train",
        training,
        "--output",
        tmp_path / "p.padim",
        *common,
        "--expect",
        "auto",
        "--partial",
        check=False,
    )
    assert partial.returncode == 1 and "--partial with --expect auto" in partial.stderr
    assert not (tmp_path / "p.padim").exists()
    # format 13 had no measurement: read as a declared cover
    tensors, current = load_artifact(tmp_path / "auto.padim")
    del current["expect_measured"]
    older_format_of(tensors, current, tmp_path / "thirteen.padim", 13)
    older = load_detector(tmp_path / "thirteen.padim", "cpu").describe()["calibration"]
    assert "measured" not in older and older["expect"] == cover and "declared changes" in older["covers"]


def test_train_at_int8_quantises_its_backbone_from_the_training_pictures_and_every_step_keeps_it(dataset, tmp_path):
    """``train --precision int8``: the backbone quantised once from the training pictures, kept in the file (format
    15) with the gate's figures and what made it; ``predict`` (runtime auto) runs the model's own graph on ONNX
    Runtime, scoring as torch with the same int8 backbone does; ``export`` writes that graph with the model's
    threshold, no calibration folder; a resume keeps the very graph; ``--partial`` refuses it; a format 14 file
    still reads."""
    import shutil

    from padim.models.fit.model_file import load_detector

    good = dataset / "train" / "good"
    common = ["--weights", "random", "--image-size", str(IMAGE_SIZE), "--quiet"]
    model = tmp_path / "int8.padim"
    summary = json.loads(run_cli("train", good, "-o", model, "--precision", "int8", *common).stdout)
    assert summary["precision"] == "int8" and summary["precision_check"]["passed"]
    assert summary["precision_check"]["tolerance"] == 0.25 and summary["phase_seconds"]["quantise"] > 0
    tensors, header = load_artifact(model)
    graph = tensors["backbone.int8.onnx"]
    assert graph.dtype == torch.uint8 and header["format_version"] >= 15
    quantiser = header["precision_check"]["quantiser"]
    assert (
        quantiser["format"] == "QDQ"
        and quantiser["images"] == 30
        and quantiser["layers"] == ["layer1", "layer2", "layer3"]
    )
    info = json.loads(run_cli("info", model).stdout)
    assert info["precision"] == "int8" and info["calibration"]["threshold_of"] == "int8 scorer"
    assert info["runtime"]["auto"] == "onnxruntime" and "int8 backbone" in info["runtime"]["why"]
    out = tmp_path / "predicted"
    result = json.loads(run_cli("predict", model, dataset / "test", "-o", out).stdout)
    assert result["runtime"] == "onnxruntime"
    by_torch = json.loads(
        run_cli("predict", model, dataset / "test", "-o", tmp_path / "t", "--runtime", "torch").stdout
    )
    assert by_torch["runtime"] == "torch"
    scores = {r["path"]: r["raw_score"] for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    torch_scores = [json.loads(x) for x in (tmp_path / "t" / "results.jsonl").read_text().splitlines()]
    assert len(torch_scores) == len(scores) == 18
    for row in torch_scores:  # one int8 backbone, the statistics in ONNX Runtime or in torch
        assert scores[row["path"]] == pytest.approx(row["raw_score"], rel=1e-4)
    detector = load_detector(model, "cpu")
    assert detector.describe()["precision"] == "int8" and detector.device.type == "cpu"
    exported = json.loads(run_cli("export", model, "-o", tmp_path / "e", "--format", "onnx", "-q").stdout)
    assert exported["precision"] == "int8" and exported["threshold_of"] == "int8 scorer"
    metadata = json.loads((tmp_path / "e" / "padim.json").read_text())
    assert metadata["calibration"]["threshold"] == pytest.approx(header["calibration"]["threshold"], rel=1e-12)
    refused = run_cli("export", model, "-o", tmp_path / "f", "--precision", "float32", check=False)
    assert refused.returncode == 1 and "trained at int8" in refused.stderr
    extra = tmp_path / "extra"
    shutil.copytree(dataset / "test" / "good", extra)
    run_cli("train", extra, "-o", tmp_path / "more.padim", "--resume", model, *common)
    more, resumed = load_artifact(tmp_path / "more.padim")
    assert torch.equal(more["backbone.int8.onnx"], graph) and resumed["fit_image_count"] == 36
    partial = run_cli(
        "train", good, "-o", tmp_path / "p.padim", "--precision", "int8", "--partial", *common, check=False
    )
    assert partial.returncode == 1 and "--partial with --precision int8" in partial.stderr
    del tensors["backbone.int8.onnx"]
    header["config"]["precision"] = "fp32"
    del header["precision_check"]
    older_format_of(tensors, header, tmp_path / "fourteen.padim", 14)
    assert load_detector(tmp_path / "fourteen.padim", "cpu").describe()["precision"] == "float32"
    header["config"]["precision"] = "int8"  # an int8 model whose graph is missing: damaged
    older_format_of(tensors, header, tmp_path / "broken.padim", 15)
    broken = run_cli("predict", tmp_path / "broken.padim", dataset / "test", "-o", tmp_path / "b", check=False)
    assert broken.returncode != 0 and "no backbone.int8.onnx" in broken.stderr and "Traceback" not in broken.stderr


def test_precision_auto_chooses_for_the_machine_and_says_why(dataset, tmp_path):
    from padim.models.devices import choose_precision

    chosen, why = choose_precision(torch.device("cpu"))
    model = tmp_path / "auto.padim"
    result = run_cli(
        "train",
        dataset / "train" / "good",
        "-o",
        model,
        "--weights",
        "random",
        "--image-size",
        32,
        "--precision",
        "auto",
    )
    (line,) = [x for x in result.stderr.splitlines() if "--precision auto:" in x]
    assert line.endswith(f"--precision auto: {chosen}, for {why}")
    assert load_artifact(model)[1]["config"]["precision"] == chosen
    # auto's reduced precision is a choice: where its gate refuses it, the model is fitted at fp32 instead
    strict = tmp_path / "strict.padim"
    args = ["--weights", "random", "--image-size", 32, "--precision", "auto", "--max-score-error", "1e-9"]
    result = run_cli("train", dataset / "train" / "good", "-o", strict, *args)
    assert load_artifact(strict)[1]["config"]["precision"] == "fp32"
    if chosen != "fp32":
        (line,) = [x for x in result.stderr.splitlines() if "fitting at fp32 instead" in x]
        assert f"{chosen}'s gate refused it ({chosen} against fp32 on 16 training pictures" in line


def test_train_with_a_state_dict_file(dataset, tmp_path, weights_file):
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "f.padim",
        "--weights",
        weights_file,
        "--image-size",
        IMAGE_SIZE,
    )
    _, header = load_artifact(tmp_path / "f.padim")
    assert header["weights"]["source"] == "file"


def test_config_file_and_flag_precedence(dataset, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("weights: random\nimage_size: 32\nembedding_dim: 20\n")
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "c.padim",
        "--config",
        config,
        "--image-size",
        IMAGE_SIZE,
    )
    _, header = load_artifact(tmp_path / "c.padim")
    assert header["config"]["image_size"] == IMAGE_SIZE and header["embedding_dim"] == 20
    config.write_text("backbone: resnet19\n")
    bad = run_cli(
        "train", dataset / "train" / "good", "--output", tmp_path / "d.padim", "--config", config, check=False
    )
    assert bad.returncode == 1 and "choose one of: resnet18" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("cut", [0.3, 0.99])
def test_truncated_model_is_a_one_line_error(model_file, dataset, tmp_path, cut):
    broken = tmp_path / "broken.padim"
    data = model_file.read_bytes()
    broken.write_bytes(data[: int(len(data) * cut)])
    result = run_cli("predict", broken, dataset / "test" / "good", "--output", tmp_path / "o", check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "broken.padim" in result.stderr


def _train_folder(folder, output, *extra):
    return run_cli(
        "train", folder, "--output", output, "--weights", "random", "--image-size", "32", *extra, check=False
    )


def error_lines(stderr: str) -> list[str]:
    """The lines of an error message (progress bars aside)."""
    return [line for line in stderr.splitlines() if "error:" in line]


def test_bad_training_inputs_leave_no_file(tmp_path, dataset):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _train_folder(empty, tmp_path / "m.padim")
    assert result.returncode == 1 and "no images found" in result.stderr
    (empty / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    result = _train_folder(empty, tmp_path / "m.padim")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "none of the 1 images could be read (a.png: not a readable image" in result.stderr
    assert "at least 3" in result.stderr and len(error_lines(result.stderr)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_tiny_training_sets(dataset, tmp_path, count):
    folder = tmp_path / "few"
    folder.mkdir()
    for p in sorted((dataset / "train" / "good").glob("*.png"))[:count]:
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "zz-broken.png").write_bytes(b"not an image")
    result = _train_folder(folder, tmp_path / "m.padim")
    assert "Traceback" not in result.stderr
    if count < 3:
        assert result.returncode == 1 and "needs at least 3 normal images" in result.stderr
        assert "zz-broken.png" in result.stderr and not (tmp_path / "m.padim").exists()
        assert len(error_lines(result.stderr)) == 1
    else:  # a working model, with the unreadable image named and what it cannot promise said
        assert result.returncode == 0, result.stderr
        assert "left out 1 unreadable image(s): zz-broken.png" in result.stderr and "cannot promise" in result.stderr
        assert json.loads(result.stdout)["fitted"] == 3


def test_identical_images_are_a_clear_refusal(dataset, tmp_path):
    folder = tmp_path / "same"
    folder.mkdir()
    image = (dataset / "train" / "good" / "000.png").read_bytes()
    for i in range(12):
        (folder / f"{i:03d}.png").write_bytes(image)
    result = _train_folder(folder, tmp_path / "m.padim", "--expect", "stable")
    assert result.returncode == 1 and "do not vary" in result.stderr and "Traceback" not in result.stderr
    assert len(error_lines(result.stderr)) == 1 and not (tmp_path / "m.padim").exists()
    # with the line's changes declared and fitted (the default) one picture under those changes is a model, and
    # train says that all but one are copies
    result = _train_folder(folder, tmp_path / "m.padim")
    assert result.returncode == 0 and "11 image(s) are copies of others" in result.stderr


def test_predict_fails_closed_on_non_finite_scores(model_file, dataset, tmp_path, monkeypatch, capsys):
    from padim.cli import main
    from padim.models.deploy import runtimes

    load = runtimes.load_detector

    def poisoned(*args, **kwargs):
        detector = load(*args, **kwargs)
        detector.model.mean[0, 0] = float("nan")
        return detector

    monkeypatch.setattr(runtimes, "load_detector", poisoned)
    code = main(
        [
            "-q",
            "predict",
            str(model_file),
            str(dataset / "test" / "hole"),
            "--output",
            str(tmp_path / "o"),
            "--runtime",
            "torch",
        ]
    )  # the poisoned torch model itself
    captured = capsys.readouterr()
    assert code == 1 and "4 of 4 image(s) got a NaN or infinite score and no verdict" in captured.err
    records = [json.loads(line) for line in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(
        r["error"]["code"] == "non_finite_score" and "is_anomaly" not in r for r in records
    )


def test_offline_imagenet_is_a_clear_error(dataset, tmp_path):
    # an unreachable proxy makes any download fail fast, as on an offline node
    env = {
        "TORCH_HOME": str(tmp_path / "cache"),
        "https_proxy": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
    }
    result = run_cli("train", dataset / "train" / "good", "--output", tmp_path / "m.padim", check=False, env=env)
    assert result.returncode == 1
    assert "resnet18-f37072fd.pth" in result.stderr and "--weights" in result.stderr
    assert not (tmp_path / "m.padim").exists()


def test_interrupted_training_leaves_no_file(tmp_path):
    from padim.models.data.synthetic import generate

    (category,) = generate(tmp_path / "data", ("carpet",), train=300, test_good=0, test_defect=0, size=64)
    output = tmp_path / "m.padim"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "padim",
            "train",
            category / "train" / "good",
            "--output",
            output,
            "--weights",
            "random",
            "--image-size",
            "64",
            "--batch-size",
            "4",
        ],
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal: a test run started in the background (`pytest &`) ignores SIGINT,
        # and a child would inherit that and never see the signal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    seen = ""
    while "fit:" not in seen and time.time() < deadline:  # wait for the progress bar
        seen += process.stderr.read(1)
    process.send_signal(signal.SIGINT)
    rest = process.communicate(timeout=60)[1]
    assert process.returncode == 130, seen + rest
    assert "interrupted" in rest
    assert not output.exists() and not list(tmp_path.glob(".m.padim*")) and not list(tmp_path.glob(".padim-*"))


def test_padim_alone_lists_the_commands_and_every_argument_is_explained():
    from padim.cli import build_parser

    result = run_cli(check=False)
    assert result.returncode == 0
    for command in ("train", "predict", "evaluate", "merge", "export", "serve", "info", "synth"):
        assert f"    {command}" in result.stdout
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    for name, sub in commands.choices.items():
        text = sub.format_help()
        assert "%%" not in text, name
        for action in sub._actions:
            assert action.help, f"padim {name} {action.dest} has no help"
        assert "-q, --quiet" in text, name  # -q after the command too
    assert "(default 16)" in commands.choices["predict"].format_help()


def test_predict_mirrors_input_folders_under_output(model_file, dataset, tmp_path):
    test = dataset / "test"
    run_cli("-q", "predict", model_file, test / "hole", test / "scratch", "--output", tmp_path / "a", "--no-maps")
    assert sorted(p.relative_to(tmp_path / "a" / "heatmaps").as_posix() for p in (tmp_path / "a").rglob("*.png")) == [
        f"{d}/{i:03d}.png" for d in ("hole", "scratch") for i in range(4)
    ]
    run_cli(
        "-q",
        "predict",
        model_file,
        test / "hole" / "000.png",
        test / "good" / "000.png",
        "--output",
        tmp_path / "b",
        "--no-heatmaps",
    )
    assert sorted(p.relative_to(tmp_path / "b" / "maps").as_posix() for p in (tmp_path / "b").rglob("*.npy")) == [
        "good/000.npy",
        "hole/000.npy",
    ]


def test_predict_reports_unreadable_images_and_scores_the_rest(model_file, dataset, tmp_path):
    images = tmp_path / "in"
    images.mkdir()
    (images / "a.png").write_bytes((dataset / "test" / "good" / "000.png").read_bytes())
    (images / "b.png").write_bytes(b"not a png")
    result = run_cli("-q", "predict", model_file, images, "--output", tmp_path / "o", check=False)
    assert result.returncode == 1 and "1 of 2 image(s) could not be read" in result.stderr
    assert "BufferedReader" not in result.stderr
    records = {
        Path(r["path"]).name: r for r in map(json.loads, (tmp_path / "o" / "results.jsonl").read_text().splitlines())
    }
    assert "score" in records["a.png"] and records["b.png"]["error"]["code"] == "unreadable_image"
    # a predict that fails before scoring anything leaves nothing behind
    failed = run_cli("-q", "predict", tmp_path / "missing.padim", images, "--output", tmp_path / "none", check=False)
    assert failed.returncode == 1 and not (tmp_path / "none").exists()


def test_evaluate_writes_no_file_unless_asked_and_a_report_when_asked(model_file, dataset, tmp_path):
    result = run_cli(
        "-q", "evaluate", model_file, dataset, "--report", tmp_path / "report", "--gallery", "2", cwd=tmp_path
    )
    printed = json.loads(result.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no evaluation.json left in the cwd
    saved = json.loads((tmp_path / "report" / "evaluation.json").read_text())
    assert len(saved["per_image"]) == printed["images"] == 18
    assert {k: v for k, v in saved.items() if k != "per_image"} == {k: v for k, v in printed.items() if k != "report"}
    assert printed["report"] == str(tmp_path / "report" / "report.html")
    confusion = printed["confusion_at_threshold"]
    assert sum(confusion.values()) == 18 and confusion["true_positives"] + confusion["false_negatives"] == 12
    page = (tmp_path / "report" / "report.html").read_text()
    for heading in (
        "Image ROC",
        "Pixel ROC",
        "PRO",
        "Score histograms",
        "Worst false alarms",
        "Worst misses",
        "By defect type",
        "RANDOM WEIGHTS",
    ):
        assert heading in page, heading
    assert page.count('src="data:image/png;base64,') == 4 + 2 + 2  # three curves and histograms, two cards each
    assert "http://" not in page and "https://" not in page  # self-contained: opens offline


def test_drift_exits_0_on_normal_images_and_3_on_shifted_ones_with_a_report(model_file, tmp_path):
    normal, shifted = normal_and_shifted(tmp_path / "line", 40)
    calm = run_cli("-q", "drift", model_file, normal[0].parent, "--report", tmp_path / "calm")
    reading = json.loads(calm.stdout)
    assert (
        calm.returncode == 0 and reading["status"] == "normal" and reading["alarms"] == [] and reading["images"] == 40
    )
    assert reading["input_drift"] is not None and reading["flag_rate"]["basis"] == "promised"
    drift = run_cli("-q", "drift", model_file, shifted[0].parent, "--report", tmp_path / "drift", check=False)
    reading = json.loads(drift.stdout)
    assert drift.returncode == 3, drift.stderr
    assert reading["status"] == "alarm" and set(reading["alarms"]) == {"flag_rate", "score_drift", "input_drift"}
    saved = json.loads((tmp_path / "drift" / "drift.json").read_text())
    assert saved["alarms"] == reading["alarms"] and len(saved["highest"]) == 20 and saved["images"] == 40
    page = (tmp_path / "drift" / "drift.html").read_text()
    for text in (
        "ALARM",
        "flag rate (one-sided binomial)",
        "input drift (one-sided KS)",
        "Highest scores",
        "RANDOM WEIGHTS",
    ):
        assert text in page, text
    assert page.count('src="data:image/png;base64,') == 1 and "https://" not in page
    # too few images, or a bad level: a one-line error (exit 1), not a verdict
    few = run_cli("-q", "drift", model_file, normal[0].parent, "--min-images", "41", check=False)
    assert few.returncode == 1 and "40 readable image(s); the tests need at least 41" in few.stderr
    bad = run_cli("-q", "drift", model_file, normal[0].parent, "--level", "1.5", check=False)
    assert bad.returncode == 1 and "--level must be between 0 and 1" in bad.stderr


def test_help_and_health_load_no_torch():
    """``padim --help``, every ``padim COMMAND --help`` and ``padim health`` (Docker runs it every few seconds)
    import no torch: the commands import the library inside ``run``."""
    script = (
        "import sys, contextlib, io\n"
        "from padim.cli import main\n"
        "from padim.commands import COMMANDS\n"
        "names = [c.__name__.rpartition('.')[2].replace('_', '-') for c in COMMANDS]\n"
        "for argv in [['--help'], *[[n, '--help'] for n in names]]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    status = main(['health', '--url', 'http://127.0.0.1:9/health/ready', '--timeout', '1'])\n"
        "heavy = sorted(m for m in ('torch', 'torchvision', 'numpy', 'PIL', 'fastapi') if m in sys.modules)\n"
        "print(status, len(names), heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "14", "[]"], result.stdout


def test_a_gpu_out_of_memory_outside_the_fit_is_one_line_with_what_to_do(monkeypatch, capsys, model_file, tmp_path):
    """predict/evaluate on a GPU that runs out: torch.OutOfMemoryError becomes one line and exit 1, not a traceback."""
    import torch

    from padim.cli import main
    from padim.commands import predict

    def out_of_memory(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB\nmore detail")

    monkeypatch.setattr(predict, "run", out_of_memory)
    assert main(["-q", "predict", str(model_file), str(tmp_path), "--output", str(tmp_path / "o")]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert "padim predict: error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 1.50 GiB)" in error
    assert "--batch-size" in error and "--device cpu" in error


def test_a_region_of_interest_through_train_predict_and_evaluate(dataset, tmp_path):
    import shutil

    train = tmp_path / "train"
    shutil.copytree(dataset / "train" / "good", train)
    Image.new("RGB", (40, 40), (90, 90, 90)).save(train / "small.png")  # cannot hold the region
    model = tmp_path / "roi.padim"
    result = run_cli(
        "train",
        train,
        "--output",
        model,
        "--weights",
        "random",
        "--image-size",
        64,
        "--roi",
        "8,16,80,64",
        "--resize",
        "crop",
        "--calibration-folds",
        2,
    )
    assert "small.png" in result.stderr and "does not lie inside this 40x40 picture" in result.stderr
    summary = json.loads(result.stdout)
    assert summary["unreadable"] == 1 and summary["fitted"] == 30
    info = json.loads(run_cli("-q", "info", model).stdout)
    assert info["header"]["config"]["roi"] == [8, 16, 80, 64] and info["header"]["config"]["resize"] == "crop"
    # maps at the picture's size (96 px), 0 outside the scored square: 64 x 64 centred in the 80 x 64 region
    run_cli("-q", "predict", model, dataset / "test", "--output", tmp_path / "p")
    anomaly_map = np.load(tmp_path / "p" / "maps" / "hole" / "000.npy")
    assert anomaly_map.shape == (96, 96)
    inside = np.zeros_like(anomaly_map, dtype=bool)
    inside[16:80, 16:80] = True
    assert not anomaly_map[~inside].any() and anomaly_map[inside].min() > 0
    # evaluate compares maps with the masks framed as the pictures were
    saved = json.loads(run_cli("-q", "evaluate", model, dataset, "--output", tmp_path / "e.json").stdout)
    assert 0.5 < saved["pixel_auroc"] <= 1 and 0 <= saved["image_auroc"] <= 1


def test_a_tiled_model_trains_predicts_and_evaluates_through_the_cli(dataset, tmp_path):
    model = tmp_path / "tiled.padim"
    result = run_cli(
        "train",
        dataset / "train" / "good",
        "--output",
        model,
        "--weights",
        "random",
        "--image-size",
        64,
        "--tiles",
        "2x2",
        "--tile-overlap",
        "0.25",
        "--calibration-folds",
        2,
        "--embedding-dim",
        32,
    )
    assert "this fit (2x2 tiles of 64 px, a Gaussian per tile position: statistics x4) needs about" in result.stderr
    info = json.loads(run_cli("-q", "info", model).stdout)
    assert info["header"]["config"]["tiles"] == [2, 2] and info["tiles"] == [2, 2]
    run_cli("-q", "predict", model, dataset / "test", "--output", tmp_path / "p", "--runtime", "torch")
    assert np.load(tmp_path / "p" / "maps" / "hole" / "000.npy").shape == (96, 96)  # the picture's size
    saved = json.loads(run_cli("-q", "evaluate", model, dataset, "--runtime", "torch").stdout)
    assert 0.5 < saved["pixel_auroc"] <= 1 and 0 <= saved["image_auroc"] <= 1


@pytest.mark.parametrize("value, message", [("2by2", "is not ROWSxCOLS"), ("9x1", "tiles: (9, 1) is not allowed")])
def test_bad_tiles_are_a_one_line_error(dataset, tmp_path, value, message):
    result = run_cli(
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "m.padim",
        "--weights",
        "random",
        "--tiles",
        value,
        check=False,
    )
    assert result.returncode in (1, 2) and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "m.padim").exists()


@pytest.mark.parametrize(
    "value, message", [("1,2,3", "is not x,y,width,height"), ("0,0,8,8", "roi: (0, 0, 8, 8) is not allowed")]
)
def test_a_bad_region_of_interest_is_a_one_line_error(dataset, tmp_path, value, message):
    result = run_cli(
        "train",
        dataset / "train" / "good",
        "--output",
        tmp_path / "m.padim",
        "--weights",
        "random",
        "--roi",
        value,
        check=False,
    )
    assert result.returncode in (1, 2) and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "m.padim").exists()


def test_train_at_a_reduced_precision_gates_it_and_predict_scores_at_it(dataset, tmp_path):
    """``train --precision``: the check's figures on stderr and in the summary, refused past --max-score-error
    (nothing written), written with --force; ``predict`` (runtime auto) scores it with torch; the gate's flags
    without a reduced precision, and the option's old spelling, are answered as a user would expect."""
    good = dataset / "train" / "good"
    common = ["--weights", "random", "--image-size", str(IMAGE_SIZE), "--expect", "stable", "--quiet"]
    model = tmp_path / "fp16.padim"
    refused = run_cli(
        "train", good, "-o", model, "--precision", "fp16", "--max-score-error", "1e-9", *common, check=False
    )
    assert refused.returncode != 0 and not model.exists()
    (line,) = [x for x in refused.stderr.splitlines() if "not accurate enough" in x]
    assert "fp16 against fp32 on 16 training pictures" in line and "nothing was written" in line
    summary = json.loads(run_cli("train", good, "-o", model, "--precision", "fp16", *common).stdout)
    assert summary["precision"] == "fp16" and summary["precision_check"]["passed"]
    assert 0 < summary["precision_check"]["max_score_error"] <= 0.02
    info = json.loads(run_cli("info", model).stdout)
    assert info["precision"] == "fp16" and info["calibration"]["threshold_of"] == "fp16 scorer"
    out = tmp_path / "predicted"
    result = json.loads(run_cli("predict", model, dataset / "test" / "good", "-o", out).stdout)
    assert result["runtime"] == "torch" and result["images"] == 6
    export = run_cli("export", model, "-o", tmp_path / "e", check=False)
    assert export.returncode != 0 and "scores at fp16 and its threshold is fp16's" in export.stderr
    wrong = run_cli("train", good, "-o", tmp_path / "x.padim", "--force", "--no-int8-scorer", *common, check=False)
    assert wrong.returncode == 1 and "gate a model fitted at --precision bf16, fp16, int8" in wrong.stderr
    old = tmp_path / "old.padim"
    run_cli("train", good, "-o", old, "--precision-dtype", "float32", *common)
    assert load_artifact(old)[1]["config"]["factor_dtype"] == "float32"
