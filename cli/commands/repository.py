"""``padim repository``: a model repository's versions, offline (list, add, activate, rollback, remove)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..options import quiet_option
from .records import moment, open_record, record_options

LAYOUT = (
    "DIR/NAME/N/ holds version N of model NAME (a model.padim file, or an export directory's files), "
    "DIR/NAME/ACTIVE the active version's number, DIR/NAME/HISTORY the activations (a rollback goes back one). "
    "`padim serve --repository DIR` serves each model's active version; with PADIM_ADMIN_KEY the same changes "
    "are made over HTTP while it runs (docs/deployment.md). Every change is atomic."
)


def register(commands) -> None:
    repository = commands.add_parser(
        "repository",
        parents=[quiet_option()],
        help="list, add, activate, roll back and remove model versions in a repository (offline)",
        description="Change a model repository on disk, with the checks the service's admin "
        "routes make (a version is loaded and scored once before it is added). " + LAYOUT,
    )
    actions = repository.add_subparsers(
        dest="action", metavar="ACTION", required=True, help="what to do (padim repository ACTION --help for each)"
    )
    listing = actions.add_parser("list", help="every model and version, the active one marked (JSON lines)")
    listing.add_argument("root", type=Path, metavar="DIR")
    listing.add_argument("name", nargs="?", metavar="NAME", help="only this model")
    add = actions.add_parser("add", help="add a model file or export directory as the next version of NAME")
    add.add_argument("root", type=Path, metavar="DIR")
    add.add_argument("name", metavar="NAME", help="the model's name (created when new)")
    add.add_argument(
        "model", type=Path, metavar="MODEL", help="a .padim file (padim train) or an export directory (padim export)"
    )
    add.add_argument("--activate", action="store_true", help="make it the active version")
    activate = actions.add_parser("activate", help="make VERSION the active version of NAME")
    activate.add_argument("root", type=Path, metavar="DIR")
    activate.add_argument("name", metavar="NAME")
    activate.add_argument("version", type=int, metavar="VERSION")
    rollback = actions.add_parser("rollback", help="make the version active before the current one active again")
    rollback.add_argument("root", type=Path, metavar="DIR")
    rollback.add_argument("name", metavar="NAME")
    remove = actions.add_parser("remove", help="delete a version that is not active (its number is never reused)")
    remove.add_argument("root", type=Path, metavar="DIR")
    remove.add_argument("name", metavar="NAME")
    remove.add_argument("version", type=int, metavar="VERSION")
    threshold = _threshold_action(actions)
    activate.add_argument(
        "--force",
        action="store_true",
        help="activate past a failed update gate, or a line threshold whose line has changed since",
    )
    for parser in (threshold, activate):
        record_options(parser)
    for parser in (listing, add, activate, rollback, remove, threshold):
        parser.set_defaults(handler=run)


def _threshold_action(actions) -> argparse.ArgumentParser:
    """``padim repository threshold``: a version whose threshold the line set."""
    threshold = actions.add_parser(
        "threshold",
        help="add a version whose threshold the line's normal pictures set (the record's scores; not active)",
        description="Write the next version of NAME with VERSION's Gaussians (the active one's by default) and the "
        "threshold the line set: the conformal quantile of the raw scores the record holds of every picture those "
        "Gaussians scored that no review called a defect (unreviewed flagged pictures count as normal). Nothing is "
        "scored again. It prints the threshold it replaces, the cover that threshold was sized by and the recall on "
        "reviewed defects at each; `padim repository activate` then serves it, unless the line has changed since "
        "(docs/calibration.md).",
    )
    threshold.add_argument("root", type=Path, metavar="DIR")
    threshold.add_argument("name", metavar="NAME")
    threshold.add_argument("--version", type=int, help="the version whose Gaussians keep scoring (default: the active)")
    threshold.add_argument(
        "--false-alarm-rate",
        type=float,
        metavar="RATE",
        help="the rate to promise on the line (default: the version's)",
    )
    threshold.add_argument(
        "--since", type=moment, metavar="TIME", help="only pictures scored at or after (ISO 8601, UTC unless it says)"
    )
    threshold.add_argument(
        "--max-recall-drop",
        type=float,
        default=float(os.environ.get("PADIM_UPDATE_MAX_RECALL_DROP", "0.0")),
        help="the gate's allowed share of reviewed defects lost (default PADIM_UPDATE_MAX_RECALL_DROP, else 0)",
    )
    return threshold


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` loads no torch
    from padim.models.errors import UsageError, VersionNotFound
    from padim.models.repository import Repository, check_name

    if args.action != "add" and not args.root.is_dir():
        raise UsageError(f"{args.root}: no such repository folder")
    repository = Repository(args.root)
    name = getattr(args, "name", None)
    if name is not None:
        check_name(name)
    if args.action == "list":
        names = [name] if name else repository.names()
        if name and not repository.versions(name):
            raise VersionNotFound(f"the repository has no model named {name!r}")
        for model in names:
            active = repository.active(model)
            for version in repository.versions(model):
                print(
                    json.dumps(
                        {
                            "model": model,
                            **version.to_dict(),
                            "active": version.version == active,
                            "calibration": version.calibration(),
                        }
                    )
                )
        return 0
    assert name is not None, "every action but list names a model"
    if args.action == "add":
        _check_servable(args.model)
        version = repository.add(name, args.model)
        if args.activate:
            repository.activate(name, version.version)
        print(json.dumps({"model": name, **version.to_dict(), "active": args.activate}))
        return 0
    if args.action == "threshold":
        print(json.dumps({"model": name, **_line_threshold(repository, args)}))
        return 0
    if args.action == "activate":
        _check_activation(repository, repository.version(name, args.version), args)
        repository.activate(name, args.version)
        number = args.version
    elif args.action == "rollback":
        number = repository.rollback(name)
    else:
        repository.remove(name, args.version)
        print(json.dumps({"model": name, "removed": args.version}))
        return 0
    print(json.dumps({"model": name, **repository.version(name, number).to_dict(), "active": True}))
    return 0


def _check_servable(path: Path) -> None:
    """Load the model as the service would (every tensor's digest) and score one blank picture."""
    # imported here: `padim --help` loads no torch
    import torch

    from padim.core.errors import ArtifactError
    from padim.models.deploy.runtimes import load_scorer
    from padim.models.errors import ExportError, UnservableModel, UsageError
    from padim.models.repository import check_model

    if not path.exists():
        raise UsageError(f"{path}: no such file or export directory")
    check_model(path)
    try:
        scorer = load_scorer(path, "auto" if path.is_dir() else "torch", "cpu")
        scorer.score(torch.zeros(1, 3, *scorer.config.input_shape, dtype=torch.uint8))
    except (ArtifactError, ExportError) as error:
        raise UnservableModel(f"{path}: cannot be served: {error}") from None


def _line_threshold(repository, args: argparse.Namespace) -> dict:
    # imported here: `padim --help` loads no torch
    from padim.service.updates import propose_line_threshold

    store = open_record(args)
    try:
        return propose_line_threshold(
            repository, store, args.name, args.version, args.false_alarm_rate, args.since, args.max_recall_drop
        )
    finally:
        store.close()


def _check_activation(repository, version, args: argparse.Namespace) -> None:
    """What the service checks before it activates: an update's gate, and a line threshold's line since."""
    # imported here: `padim --help` loads no torch
    from padim.core.drift import LEVEL, MIN_IMAGES
    from padim.models.errors import UsageError
    from padim.service.updates import LINE, activation_refused, line_changed

    if args.force:
        return
    stale = None
    if (version.update or {}).get("kind") == LINE:
        if args.record is None and args.url is None:
            raise UsageError(
                f"version {version.version} of {version.name!r} has a threshold the line set: pass --record (or set "
                "PADIM_RECORD_DIR) so that what the line scored since can be read, or --force"
            )
        store = open_record(args)
        try:
            stale = line_changed(store, version, LEVEL, MIN_IMAGES, repository)
        finally:
            store.close()
    refused = activation_refused(version, stale)
    if refused is not None:
        raise refused
