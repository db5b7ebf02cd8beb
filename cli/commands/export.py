"""``padim export``: the whole scorer as an ONNX graph, an OpenVINO IR or a Triton model repository."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from padim.models.choices import EXPORT_FORMATS, EXPORT_PRECISION_FLAGS, install_extra
from padim.models.errors import UsageError

from ..options import quiet_option

if TYPE_CHECKING:  # torch: not for --help
    from padim.models.deploy.quantise import QuantiseOptions

TRITON_EXAMPLE = "tritonserver --model-repository DIR"


def precision_value(text: str) -> str:
    """``--precision``: train's spelling (``fp32``); the export's own older one (``float32``) still read."""
    return "fp32" if text == "float32" else text


DESCRIPTION = (
    "Write the whole scorer as one graph: normalised images (B, 3, S, S) in, anomaly_map (B, S, S) "
    "and raw_score (B,) out, with the backbone, channel reduction, Mahalanobis distance, upsampling, blur and "
    "maximum inside. Beside it, padim.json gives the input size and normalisation, the threshold and "
    "calibration, the model's identity and every file's sha256. `padim predict/evaluate/serve` run an export "
    "directory as they run the .padim file (--runtime onnxruntime|openvino), to 1e-4 of torch's scores. "
    f"--format triton writes DIR/NAME/config.pbtxt and DIR/NAME/1/model.onnx; serve it with `{TRITON_EXAMPLE}`. "
    f"Needs an extra: {install_extra('onnx')} ('.[openvino]' for --format openvino). "
    "--precision int8 quantises the backbone (ONNX Runtime: static QDQ; OpenVINO: NNCF) on part of "
    "--calibration-images, compares it with float32 on the rest (and --check-images), refuses to write it when "
    "raw scores move more than --max-score-error (exit 4), and sets its own threshold from its scores of the "
    "images the quantiser did not see. --precision fp16 is the same for CUDA (ONNX Runtime, TensorRT, Triton); "
    "--precision bf16 for OpenVINO's bfloat16 on CPUs that have it (AVX512-BF16, AMX; made on that CPU). "
    "See docs/quantisation.md."
)


def register(commands) -> None:
    export = commands.add_parser(
        "export",
        parents=[quiet_option()],
        help="export the whole scorer to ONNX, OpenVINO IR or a Triton model repository",
        description=DESCRIPTION,
    )
    export.add_argument("model", type=Path, metavar="MODEL", help="model file (padim train)")
    export.add_argument("--format", "-f", choices=EXPORT_FORMATS, default="onnx", help="default onnx")
    export.add_argument(
        "--output",
        "-o",
        type=Path,
        required=True,
        metavar="DIR",
        help="directory to write (an earlier export there is replaced once the new one is complete)",
    )
    export.add_argument("--name", help="Triton model name (default: the model file's stem)")
    export.add_argument(
        "--triton-device",
        choices=("gpu", "cpu"),
        default="gpu",
        help="--format triton: where Triton runs the model (default gpu: KIND_GPU, one instance on "
        "each GPU; cpu: KIND_CPU)",
    )
    export.add_argument(
        "--external-data",
        choices=("auto", "always", "never"),
        default="auto",
        help="ONNX weights in a separate model.onnx.data file (default auto: when over 1.5 GB, "
        "as protobuf stops at 2 GB)",
    )
    _quantised_options(export.add_argument_group("quantised scorers (--precision int8|fp16|bf16)"))
    export.set_defaults(handler=run)


def _quantised_options(quantised) -> None:
    quantised.add_argument(
        "--precision",
        choices=tuple(EXPORT_PRECISION_FLAGS),
        type=precision_value,
        help="the backbone's precision, spelled as train's (default: the model's own, fp32, or for a model trained "
        "at --precision "
        "int8 its int8 backbone and threshold, no --calibration-images needed). int8: CPUs (--format onnx or "
        "openvino; triton with --triton-device cpu); fp16: CUDA (--format onnx or triton); bf16: OpenVINO on a CPU "
        "with bfloat16 (--format openvino)",
    )
    quantised.add_argument(
        "--calibration-images",
        type=Path,
        metavar="DIR",
        help="normal images, never the test set (needed with --precision): the first "
        "--quantiser-images of a seeded shuffle calibrate the quantiser, the rest (at least 20; "
        "about 99 to promise 1%% false alarms, 1,000 for the empirical quantile) the threshold "
        "and the accuracy gate",
    )
    quantised.add_argument(
        "--check-images",
        type=Path,
        metavar="DIR",
        help="defect images the accuracy gate also compares (verdict changes, AUROC)",
    )
    quantised.add_argument(
        "--quantiser-images",
        type=int,
        default=32,
        metavar="N",
        help="images that calibrate the int8 quantiser's ranges (default 32)",
    )
    quantised.add_argument(
        "--max-score-error",
        type=float,
        default=0.25,
        metavar="R",
        help="the gate: largest relative raw-score difference allowed (default 0.25, see docs/quantisation.md)",
    )
    quantised.add_argument("--force", action="store_true", help="write the export even when the gate fails (recorded)")
    quantised.add_argument(
        "--false-alarm-rate",
        type=float,
        metavar="A",
        help="the quantised scorer's threshold rate (default: the model's)",
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    quantise = _quantise_options(args)
    directory = _exported(args, quantise)
    print(json.dumps(_report(args, directory, quantise is not None, time.perf_counter() - started), indent=2))
    return 0


def _quantise_options(args: argparse.Namespace) -> QuantiseOptions | None:
    """The quantised export's options (``None`` for float32), once the flags are checked against each other."""
    if args.name is not None and args.format != "triton":
        raise UsageError("--name is the Triton model name; it needs --format triton")
    if args.triton_device != "gpu" and args.format != "triton":
        raise UsageError("--triton-device is for --format triton")
    from padim.core.artifact import read_header  # torch: not for --help

    if args.precision is not None:  # the flag's spelling (fp32) as the export's metadata writes it (float32)
        args.precision = EXPORT_PRECISION_FLAGS[args.precision]
    fitted_at = read_header(args.model).get("config", {}).get("precision", "fp32")
    if fitted_at == "int8" and args.precision == "float32":
        raise UsageError(
            "this model was trained at int8 and its threshold is its int8 scores': leave --precision out (or give "
            "int8) for its own graph, or retrain at --precision fp32 for a float32 one"
        )
    if fitted_at == "int8" and args.precision in (None, "int8") and args.calibration_images is None:
        args.precision = "int8"
        _float32_only(args, "an int8 model's own graph (its threshold is the model's)")
        return None  # the model's own int8 graph
    if args.precision in (None, "float32"):
        args.precision = "float32"
        _float32_only(args, "a quantised export: add --precision int8, fp16 or bf16")
        return None
    from padim.models.deploy.quantise import QuantiseOptions  # torch: not for --help

    if args.calibration_images is None:
        raise UsageError(
            f"--precision {args.precision} needs --calibration-images DIR: normal images (never the "
            "test set) to calibrate the quantiser and its threshold"
        )
    return QuantiseOptions(
        args.precision,
        args.calibration_images,
        args.check_images,
        args.quantiser_images,
        args.max_score_error,
        args.force,
        args.false_alarm_rate,
    )


def _float32_only(args: argparse.Namespace, what: str) -> None:
    """Refuse the quantiser's flags where no quantiser runs."""
    flags = (
        ("--calibration-images", args.calibration_images),
        ("--check-images", args.check_images),
        ("--force", args.force),
        ("--false-alarm-rate", args.false_alarm_rate),
    )
    given = [flag for flag, value in flags if value]
    if given:
        raise UsageError(f"{', '.join(given)} are for {what}")


def _exported(args: argparse.Namespace, quantise: QuantiseOptions | None) -> Path:
    """The export's directory, written (float32, or quantised and gated with ``quantise``)."""
    # imported here: `padim --help` and `padim health` load no torch
    from padim.core.artifact import file_sha256
    from padim.models.deploy.export import export_detector
    from padim.models.fit.model_file import load_detector

    detector = load_detector(args.model, device="cpu")
    shared = {
        "source_sha256": file_sha256(args.model),
        "name": args.name,
        "external_data": {"auto": None, "always": True, "never": False}[args.external_data],
        "triton_device": args.triton_device,
    }
    if quantise is None:
        return export_detector(detector, args.output, args.format, args.model, **shared)
    from padim.models.deploy.quantise import export_quantised_detector  # as above

    return export_quantised_detector(
        detector, args.output, args.format, args.model, quantise, progress=not args.quiet, **shared
    )


def _report(args: argparse.Namespace, directory: Path, quantised: bool, seconds: float) -> dict:
    """What the command prints: the files written and, for a quantised export, its gate and threshold."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    report = {
        "model": str(args.model),
        "format": args.format,
        "output": str(directory),
        "files": {str(p.relative_to(directory)): p.stat().st_size for p in files},
        "seconds": round(seconds, 2),
    }
    if quantised:
        metadata = json.loads((directory / "padim.json").read_text())
        report.update(
            {
                "precision": args.precision,
                "calibration": metadata["calibration"],
                "threshold_of": metadata["threshold_of"],
                "quantisation": metadata["quantisation"],
            }
        )
    elif args.precision == "int8":  # a model trained at int8: its own graph and threshold
        metadata = json.loads((directory / "padim.json").read_text())
        report.update({"precision": "int8", "threshold_of": metadata["threshold_of"]})
    if args.format == "triton":
        report["serve_with"] = TRITON_EXAMPLE.replace("DIR", str(args.output))
    return report
