"""``padim info``: a model file's metadata as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from padim.models.choices import spelled_precision
from padim.models.families import BACKBONES

from ..options import quiet_option

#: Files up to this size have every tensor checked by default (hashing runs at about 1 GB/s).
VERIFY_BY_DEFAULT_BYTES = 2**30


def register(commands) -> None:
    info = commands.add_parser(
        "info",
        parents=[quiet_option()],
        help="print a model file's metadata as JSON",
        description="What a model file holds: images fitted, calibration (scores used, threshold, requested and "
        "promised false-alarm rates), backbone, and its full header. The header's digest is always checked; every "
        "tensor too for files up to 1 GiB (larger ones: --verify), and the output says which was checked.",
    )
    info.add_argument(
        "model",
        type=Path,
        metavar="MODEL",
        help="model file, or an export directory (padim export: its "
        "precision, the threshold it uses and why, and a quantised scorer's accuracy gate)",
    )
    info.add_argument(
        "--verify",
        action="store_true",
        help="check every tensor against its digest even in a file over "
        "1 GiB (reads the whole file; smaller files are always checked)",
    )
    info.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from padim.core.artifact import load_artifact, read_header
    from padim.models.deploy.runtimes import is_export
    from padim.models.features.backbones import WeightsInfo
    from padim.models.scoring.detector import promise_covers, shrinkage_chosen

    if is_export(args.model):
        print(json.dumps(export_summary(args.model), indent=2))
        return 0
    size = args.model.stat().st_size if args.model.is_file() else 0
    whole = args.verify or size <= VERIFY_BY_DEFAULT_BYTES
    header = load_artifact(args.model)[1] if whole else read_header(args.model)
    config = header.get("config", {})
    calibration = header.get("calibration") or {}
    summary = {
        "file": str(args.model),
        "size_bytes": size,
        "kind": header.get("kind"),
        "verified": ("every tensor" if whole else "header only (--verify checks every tensor)")
        if header["verified"]
        else False,
        "backbone": config.get("backbone"),
        **_backbone(config, header.get("backbone")),
        "image_size": config.get("image_size"),
        "tiles": config.get("tiles", [1, 1]),
        "precision": spelled_precision(config.get("precision", "fp32")),
        "precision_check": header.get("precision_check"),
        "int8_scorer": header.get("int8_scorer"),
        "runtime": _runtime(config.get("precision", "fp32"), header.get("int8_scorer")),
        "weights": WeightsInfo(**header["weights"]).label if "weights" in header else None,
        "shrinkage": shrinkage_chosen(config.get("shrinkage", 0.0), header.get("shrinkage_estimated")),
        "fit_image_count": header.get("fit_image_count"),
        "unreadable_image_count": header.get("unreadable_image_count"),
        "calibration": {
            **calibration,
            "source": header.get("calibration_source"),
            "folds": config.get("calibration_folds"),
            "expect": config.get("expect", ""),
            "fit_changes": bool(config.get("expect")) and config.get("fit_changes", False),
            **({"measured": header["expect_measured"]} if header.get("expect_measured") else {}),
            "threshold_of": f"{spelled_precision(config.get('precision', 'fp32'))} scorer",
            "covers": promise_covers(
                config.get("expect", ""),
                bool(config.get("expect")) and config.get("fit_changes", False),
                calibration.get("line_scores", 0),
                header.get("expect_measured"),
            ),
        }
        if calibration
        else None,
        "header": header,
    }
    print(json.dumps(summary, indent=2))
    return 0


def _runtime(precision: str, int8_scorer: dict | None) -> dict:
    """What ``--runtime auto`` runs here, the scorer (``float32``, or the model's ``int8`` one), and why."""
    from padim.models.deploy.runtimes import runs_int8_scorer, runtime_choice  # torch: not for --help

    runtime, why = runtime_choice("auto", "auto", precision, int8_scorer)
    scorer = "int8" if runs_int8_scorer("auto", precision, int8_scorer) else None
    return {"auto": runtime, "scorer": scorer or spelled_precision(precision), "why": why}


def _backbone(config: dict, stored: dict | None) -> dict:
    """The family and the stages a model reads: as ``stored`` (a model file's header ``backbone``, format 17; an
    export's description, version 13), else this padim's table's for its stored ``config``."""
    if stored is not None:
        return {"backbone_family": stored.get("family", stored.get("backbone_family")), "stages": stored["stages"]}
    spec = BACKBONES.get(str(config.get("backbone")))
    if spec is None or not config.get("layers"):
        return {}
    return {"backbone_family": spec.family, "stages": spec.described(tuple(config["layers"]))}


def _runs_at(precision: str) -> dict:
    """``runs_at`` where this machine runs an export at another precision than its own (bf16 without bfloat16)."""
    from padim.models.deploy.runtimes import ExportError, openvino_runs  # torch: not for --help

    try:
        ran = openvino_runs(precision)
    except ExportError:  # OpenVINO not installed: nothing runs it here
        return {}
    return {"runs_at": ran} if ran != precision else {}


def export_summary(directory: Path) -> dict:
    """What ``padim info`` shows of an export directory (every file's digest checked)."""
    from padim.models.deploy.export import read_export  # torch: not for --help

    metadata = read_export(directory)
    description = metadata["description"]
    quantisation = metadata.get("quantisation")
    return {
        "export": str(directory),
        "kind": metadata["kind"],
        "export_version": metadata["export_version"],
        "format": metadata["format"],
        "verified": "every file",
        "precision": metadata.get("precision", "float32"),
        **_runs_at(metadata.get("precision", "float32")),
        "backbone": description.get("backbone"),
        **_backbone(description, description if "stages" in description else None),
        "image_size": description.get("image_size"),
        "weights": description.get("weights"),
        "model": metadata["model"],
        "calibration": {**metadata["calibration"], "threshold_of": metadata.get("threshold_of", "float32 scorer")},
        "quantisation": quantisation,
        "files": metadata["files_sha256"],
    }
