"""``padim export``: the whole scorer as an ONNX graph, an OpenVINO IR or a Triton model repository."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from padim.models.choices import EXPORT_FORMATS
from padim.models.errors import UsageError

from ..options import quiet_option

TRITON_EXAMPLE = "tritonserver --model-repository DIR"


def register(commands) -> None:
    export = commands.add_parser(
        "export", parents=[quiet_option()], help="export the whole scorer to ONNX, OpenVINO IR or a Triton model repository",
        description="Write the whole scorer as one graph: normalised images (B, 3, S, S) in, anomaly_map (B, S, S) "
        "and raw_score (B,) out, with the backbone, channel reduction, Mahalanobis distance, upsampling, blur and "
        "maximum inside. Beside it, padim.json gives the input size and normalisation, the threshold and "
        "calibration, the model's identity and every file's sha256. `padim predict/evaluate/serve` run an export "
        "directory as they run the .padim file (--runtime onnxruntime|openvino), to 1e-4 of torch's scores. "
        f"--format triton writes DIR/NAME/config.pbtxt and DIR/NAME/1/model.onnx; serve it with `{TRITON_EXAMPLE}`. "
        "Needs the extras: pip install 'padim-inspect[onnx]' (and [openvino] for --format openvino).",
    )
    export.add_argument("model", type=Path, metavar="MODEL", help="model file (padim train)")
    export.add_argument("--format", "-f", choices=EXPORT_FORMATS, default="onnx", help="default onnx")
    export.add_argument("--output", "-o", type=Path, required=True, metavar="DIR",
                        help="directory to write (an earlier export there is replaced once the new one is complete)")
    export.add_argument("--name", help="Triton model name (default: the model file's stem)")
    export.add_argument("--triton-device", choices=("gpu", "cpu"), default="gpu",
                        help="--format triton: where Triton runs the model (default gpu: KIND_GPU, one instance on "
                        "each GPU; cpu: KIND_CPU)")
    export.add_argument("--external-data", choices=("auto", "always", "never"), default="auto",
                        help="ONNX weights in a separate model.onnx.data file (default auto: when over 1.5 GB, "
                        "as protobuf stops at 2 GB)")
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from padim.core.artifact import file_sha256
    from padim.models.deploy.export import export_detector
    from padim.models.model_file import load_detector

    if args.name is not None and args.format != "triton":
        raise UsageError("--name is the Triton model name; it needs --format triton")
    if args.triton_device != "gpu" and args.format != "triton":
        raise UsageError("--triton-device is for --format triton")
    started = time.perf_counter()
    detector = load_detector(args.model, device="cpu")
    external = {"auto": None, "always": True, "never": False}[args.external_data]
    directory = export_detector(detector, args.output, args.format, args.model, source_sha256=file_sha256(args.model),
                                name=args.name, external_data=external, triton_device=args.triton_device)
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    report = {"model": str(args.model), "format": args.format, "output": str(directory),
              "files": {str(p.relative_to(directory)): p.stat().st_size for p in files},
              "seconds": round(time.perf_counter() - started, 2)}
    if args.format == "triton":
        report["serve_with"] = TRITON_EXAMPLE.replace("DIR", str(args.output))
    print(json.dumps(report, indent=2))
    return 0
