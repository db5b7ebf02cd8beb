"""padim against AnomaVision's PaDiM, side by side in one run: each one's every runtime, interleaved.

The same seeded resnet18 state_dict is loaded into both, at 224 px, layers 1-3 (AnomaVision's
``layer_indices=[0, 1, 2]``; its default is layers 1-2), 100 channels, fitted on the same
generated images. Both score the same normalised tensor batch (the scorer alone: tensor in,
map and score out; decoding and resizing are the same PIL work for both and left out).
AnomaVision runs in its own virtual environment (``pip install anomavision``), as a worker
process that times its runtimes when told to, so that rounds alternate between the two:

    python -m venv /tmp/avenv && /tmp/avenv/bin/pip install anomavision
    python benchmarks/compare_anomavision.py --anomavision-python /tmp/avenv/bin/python [--rounds 9]

AnomaVision is exported with its own ``ModelExporter`` (ONNX, fp32) and run by its own
``ModelWrapper`` backends, with their default settings. Its ImageNet download is replaced by
the state_dict (no network here). Prints img/s (median, best) per runtime and batch size and
the ratio of padim's fastest to AnomaVision's fastest, and the CPU features the runtimes use (AVX2, AVX-512, VNNI, BF16,
AMX) that this machine has.

padim's side also runs what ``--runtime auto`` picks for the model file (fitted with no flag: its int8 scorer where
this CPU computes int8 faster, else float32; ``onnxruntime`` asked for is the float32 scorer), and its gated exports
(each with its own threshold, from ``--calibration-images`` more normal pictures, never the test ones): OpenVINO int8
everywhere, and
OpenVINO bf16 where this CPU runs bfloat16 (AVX512-BF16, AMX). Each export's gate reading is printed beside.
And the same pictures fitted at ``train --precision int8`` (the backbone quantised from the training pictures, no
other folder): what ``--runtime auto`` picks for it (its own graph on ONNX Runtime) and torch with the same int8
backbone. Every scorer's image AUROC on the whole test set is printed beside its speed, and each fit's time
(``--fit-rounds`` interleaved fits of each: the default, the float32 model alone, int8; median).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORKER_FLAG = "--worker"
#: Idle seconds before every timed call: the other process's (and runtime's) thread pools stop
#: spinning, so that each measurement starts on idle cores.
SETTLE_S = 0.3


# ---------------------------------------------------------------------- AnomaVision side (its venv)
def worker(work: Path, batch_size: int) -> None:
    """Fit, export and time AnomaVision's PaDiM; one timing round per ``run`` line on stdin."""
    import logging

    import torch
    import torchvision
    from torch.utils.data import DataLoader, TensorDataset

    logging.disable(logging.INFO)
    try:  # AnomaVision's OpenVINO backend imports openvino.runtime, which OpenVINO 2026 folded into openvino itself:
        import openvino.runtime  # noqa: F401 (the same classes under the old name, so that its default runs)
    except ImportError:
        try:
            import openvino

            sys.modules["openvino.runtime"] = openvino
        except ImportError:
            pass  # no OpenVINO: its backend says so below
    import anomavision.algorithm.common.feature_extraction as extraction
    from anomavision.algorithm.padim import Padim
    from anomavision.export import ModelExporter
    from anomavision.inference.model import ModelWrapper

    extraction.BACKBONES["resnet18"] = (torchvision.models.resnet18, None)  # no download; weights below
    # AnomaVision calls torch.onnx.export(..., dynamic_axes=...) without `dynamo`: written for the
    # TorchScript exporter (the default before torch 2.9). With torch's newer default its graph
    # fails at any batch but the example's (a Resize of rank-3 scales), so give it what it was
    # written for.
    export = torch.onnx.export
    torch.onnx.export = lambda *a, **k: export(*a, **{"dynamo": False, **k})
    model = Padim("resnet18", torch.device("cpu"), layer_indices=[0, 1, 2], feat_dim=100)
    model.embeddings_extractor.backbone.load_state_dict(torch.load(work / "resnet18-seed0.pth"))
    model.embeddings_extractor.backbone.eval()
    train = torch.from_numpy(np.load(work / "train.npy"))
    model.fit(DataLoader(TensorDataset(train), batch_size=16))
    torch.save(model, work / "anomavision.pt")
    exporter = ModelExporter(work / "anomavision.pt", work / "anomavision-export", logging.getLogger("export"), "cpu")
    onnx_path = exporter.export_onnx(
        input_shape=(1, 3, train.shape[-1], train.shape[-1]),
        output_name="model.onnx",
        dynamic_batch=True,
        force_precision="fp32",
    )
    runtimes = {"torch": lambda x: model.predict(torch.from_numpy(x))}
    wrapper = ModelWrapper(str(onnx_path), "cpu")
    runtimes["onnxruntime"] = wrapper.predict
    try:  # its own OpenVINO export needs openvino-dev's `mo` (gone since OpenVINO 2025): the same
        import openvino as ov  # conversion of its ONNX graph, in fp32, then its own OpenVINO backend

        xml = work / "anomavision-export" / "openvino" / "model.xml"
        ov.save_model(ov.convert_model(str(onnx_path)), str(xml), compress_to_fp16=False)
        runtimes["openvino"] = ModelWrapper(str(xml), "cpu").predict
    except Exception as error:  # noqa: BLE001 - reported, the others still run
        print(json.dumps({"note": f"openvino not measured: {error}"}), flush=True)
    test = np.load(work / "test.npy")
    batch = test[:batch_size]
    scores = {}
    with torch.no_grad():
        for name, run in runtimes.items():
            scores[name] = []
            for first in range(0, len(test), batch_size):
                out = run(test[first : first + batch_size])
                found = out[0] if not isinstance(out[0], torch.Tensor) else out[0].numpy()
                scores[name] += np.asarray(found).reshape(-1).tolist()
            run(batch[:1])
    print(json.dumps({"ready": list(runtimes), "scores": scores}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        times = {}
        with torch.no_grad():
            for name, run in runtimes.items():
                for b in sorted({1, batch_size}):
                    time.sleep(SETTLE_S)
                    started = time.perf_counter()
                    run(batch[:b])
                    times[f"{name} b{b}"] = time.perf_counter() - started
        print(json.dumps(times), flush=True)


# ---------------------------------------------------------------------- padim side
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anomavision-python", required=True, help="python of a venv with anomavision installed")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--train-images", type=int, default=60)
    parser.add_argument(
        "--calibration-images", type=int, default=40, help="normal pictures for the gated exports (0: none)"
    )
    parser.add_argument("--fit-rounds", type=int, default=1, help="fits a precision (fp32, int8), interleaved")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path, help="write the JSON report here too")
    args = parser.parse_args()

    import torch
    from PIL import Image
    from timing import machine_name, seeded_resnet18, work_folder

    from padim.models import PadimConfig, fit_detector, training_images
    from padim.models.data.synthetic import generate
    from padim.models.deploy.export import ExportError
    from padim.models.deploy.quantise import QuantiseOptions, export_quantised_detector
    from padim.models.deploy.runtimes import load_scorer, openvino_runs
    from padim.models.devices import cpu_features
    from padim.models.features.embedding import model_input
    from padim.models.fit.model_file import save_detector

    features = cpu_features()
    print(f"{machine_name()}: {', '.join(features) or 'no AVX2/AVX-512 flags'}", flush=True)
    work = work_folder(args.workdir, "padim-vs-anomavision-")
    work.mkdir(parents=True, exist_ok=True)
    category = work / "data" / "carpet"
    if not category.exists():
        generate(work / "data", ("carpet",), train=args.train_images, test_good=25, test_defect=10, size=224, seed=1)
    weights = seeded_resnet18(work / "resnet18-seed0.pth")
    # PaDiM as published on both sides: no neighbourhood average, the map smoothed with sigma 4
    config = PadimConfig(
        weights=str(weights),
        image_size=224,
        batch_size=16,
        device="cpu",
        embedding_dim=100,
        neighbourhood=1,
        blur_sigma=4.0,
    )
    # the default (a float32 model with its int8 scorer), the float32 model alone (the default before model format
    # 20), and a model fitted at int8
    fits = {
        "default": (config, "padim.padim"),
        "fp32": (config.replace(int8_scorer=False), "padim-fp32.padim"),
        "int8": (config.replace(precision="int8"), "padim-int8.padim"),
    }
    fit_seconds: dict[str, list[float]] = {name: [] for name in fits}
    for _ in range(args.fit_rounds):
        for name, (fitted_with, file) in fits.items():
            started = time.perf_counter()
            fitted, _ = fit_detector(fitted_with, training_images(category / "train" / "good"), progress=False)
            fit_seconds[name].append(time.perf_counter() - started)
            save_detector(fitted, work / file)
            if name == "default":
                detector = fitted
            print(f"padim fit, {name}: {fit_seconds[name][-1]:.1f} s", flush=True)
    train_paths = sorted((category / "train" / "good").glob("*.png"))
    test_paths = sorted((category / "test").rglob("*.png"))
    labels = np.array([p.parent.name != "good" for p in test_paths], dtype=int)
    pictures = detector.preprocess([Image.open(p).convert("RGB") for p in train_paths])
    np.save(work / "train.npy", model_input(pictures).numpy())  # AnomaVision reads normalised float32
    test = detector.preprocess([Image.open(p).convert("RGB") for p in test_paths])
    np.save(work / "test.npy", model_input(test).numpy())
    batch = test[: args.batch_size]

    scorers = {}
    for runtime in ("torch", "onnxruntime", "openvino", "auto"):  # a runtime asked for runs the float32 scorer
        try:
            scorers[runtime] = load_scorer(work / "padim.padim", runtime, "cpu")
        except ExportError as error:
            print(f"padim {runtime}: not measured ({error})")
    print(f"padim auto: the {scorers['auto'].file_scorer} scorer ({getattr(scorers['auto'], 'runtime_reason', '')})")
    if args.calibration_images:
        calibration = work / "calibration" / "carpet" / "train" / "good"
        if not calibration.exists():
            generate(work / "calibration", ("carpet",), train=args.calibration_images, test_good=0, test_defect=0,
                     size=224, seed=2)  # fmt: skip
        precisions = ["int8"]
        try:
            if openvino_runs("bf16") == "bf16":
                precisions.append("bf16")
            for precision in precisions:
                output = work / f"padim-openvino-{precision}"
                if not output.exists():
                    export_quantised_detector(
                        detector, output, "openvino", work / "padim.padim",
                        QuantiseOptions(precision, calibration, quantiser_images=16, force=True),
                    )  # fmt: skip
                gate = json.loads((output / "padim.json").read_text())["quantisation"]["agreement"]
                print(f"padim openvino-{precision} export: gate max score error {gate['max_score_error']:.2%}, "
                      f"passed {gate['passed']}")  # fmt: skip
                scorers[f"openvino-{precision}"] = load_scorer(output, "auto", "cpu")
        except ExportError as error:
            print(f"padim gated exports: not measured ({error})")
    for runtime in ("auto", "torch"):  # the model fitted at int8: its own graph (auto), and torch around it
        scorers[f"int8-trained {runtime}"] = load_scorer(work / "padim-int8.padim", runtime, "cpu")
    for scorer in scorers.values():
        scorer.score(batch)
        scorer.score(batch[:1])

    process = subprocess.Popen(
        [args.anomavision_python, __file__, WORKER_FLAG, str(work), str(args.batch_size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=work,
    )
    ready = None
    for line in process.stdout:
        if line.startswith("{"):
            message = json.loads(line)
            if "note" in message:
                print("anomavision:", message["note"])
            if "ready" in message:
                ready = message
                break
    if ready is None:
        print("the AnomaVision worker did not start", file=sys.stderr)
        return 1
    from sklearn.metrics import roc_auc_score

    auroc = {f"anomavision {name}": float(roc_auc_score(labels, found)) for name, found in ready["scores"].items()}
    for name, scorer in scorers.items():
        raw = [scorer.score(test[i : i + args.batch_size]).raw_scores for i in range(0, len(test), args.batch_size)]
        auroc[f"padim {name}"] = float(roc_auc_score(labels, torch.cat(raw).numpy()))
    times: dict[str, list[float]] = {}
    sizes = sorted({1, args.batch_size})
    for _ in range(args.rounds):
        process.stdin.write("run\n")
        process.stdin.flush()
        for key, seconds in json.loads(process.stdout.readline()).items():
            times.setdefault(f"anomavision {key}", []).append(seconds)
        for name, scorer in scorers.items():
            for b in sizes:
                time.sleep(SETTLE_S)
                started = time.perf_counter()
                scorer.score(batch[:b])
                times.setdefault(f"padim {name} b{b}", []).append(time.perf_counter() - started)
    process.stdin.close()
    process.wait(60)

    report = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "cpu": machine_name(),
        "cpu_features": list(features),
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "image_size": 224,
        "layers": list(config.features.stages),
        "embedding_dim": 100,
        "test_pictures": {"normal": int((labels == 0).sum()), "defect": int(labels.sum())},
        "image_auroc": {k: round(v, 4) for k, v in auroc.items()},
        "train_pictures": args.train_images,
        "fit_seconds": {k: round(float(np.median(v)), 2) for k, v in fit_seconds.items()},
        "fit_ratio_int8": round(float(np.median(fit_seconds["int8"]) / np.median(fit_seconds["fp32"])), 3),
        "fit_ratio_default": round(float(np.median(fit_seconds["default"]) / np.median(fit_seconds["fp32"])), 3),
        "default_int8_scorer": None if detector.int8_scorer is None else detector.int8_scorer.check,
        "img_per_s": {},
    }
    for name, value in auroc.items():
        print(f"  image AUROC {name:<30} {value:.4f}")
    print(f"fit of {args.train_images} pictures: float32 alone {report['fit_seconds']['fp32']} s, the default (with "
          f"its int8 scorer) {report['fit_seconds']['default']} s ({report['fit_ratio_default']}x), at int8 "
          f"{report['fit_seconds']['int8']} s ({report['fit_ratio_int8']}x)")  # fmt: skip
    print(f"scorer alone (tensor in, map + score out), {args.rounds} interleaved rounds; img/s median (best)")
    for key, seconds in times.items():
        b = int(key.rsplit("b", 1)[1])
        median, best = b / float(np.median(seconds)), b / min(seconds)
        report["img_per_s"][key] = {"median": round(median, 2), "best": round(best, 2)}
        print(f"  {key:<28} {median:7.1f} ({best:.1f})")
    for b in sizes:
        ours = max(
            (v["median"], k) for k, v in report["img_per_s"].items() if k.startswith("padim") and k.endswith(f"b{b}")
        )
        theirs = max(
            (v["median"], k)
            for k, v in report["img_per_s"].items()
            if k.startswith("anomavision") and k.endswith(f"b{b}")
        )
        report[f"fastest_ratio_b{b}"] = round(ours[0] / theirs[0], 3)
        print(
            f"batch {b}: fastest padim ({ours[1]}, {ours[0]:.1f}) / fastest AnomaVision ({theirs[1]}, {theirs[0]:.1f})"
            f" = {ours[0] / theirs[0]:.2f}x"
        )
        # float32 against float32: AnomaVision's OpenVINO runs at the CPU's default inference precision, bfloat16
        # where the CPU has AVX512-BF16 or AMX (padim's asks for f32), so the fastest pair may not be like for like
        same = (
            report["img_per_s"].get(f"padim onnxruntime b{b}"),
            report["img_per_s"].get(f"anomavision onnxruntime b{b}"),
        )
        if all(same):
            report[f"float32_onnxruntime_ratio_b{b}"] = round(same[0]["median"] / same[1]["median"], 3)
            print(
                f"batch {b}: float32 ONNX Runtime, padim / AnomaVision = {same[0]['median'] / same[1]['median']:.2f}x"
            )
    try:
        import openvino

        report["openvino_default_precision"] = str(openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))
        print(f"OpenVINO's default inference precision here (AnomaVision's): {report['openvino_default_precision']}")
    except Exception as error:  # OpenVINO not installed or no CPU plugin: nothing to say
        print(f"OpenVINO's default precision not read ({type(error).__name__})")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        worker(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(main())
