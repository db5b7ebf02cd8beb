"""Training runs: a new fit, a resumed one, partial fits and their merge, with what happened to each image.

These are what ``padim train`` and ``padim merge`` run (and the Python API). Each turns a list of
:class:`~padim.models.fit.passes.TrainingImage` into a model file through a
:class:`~padim.models.fit.in_progress.Fit`, and says in a :class:`FitReport` which images were left
out and why, what the threshold can promise, and what the fit cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from tqdm.auto import tqdm

from padim.core.calibration import Calibration, CalibrationError, fold_of
from padim.core.spool import EmbeddingSpool
from padim.core.statistics import NotPositiveDefiniteError, merge_states_
from padim.models.choices import EXPECT_AUTO, PRECISION_AUTO, install_extra
from padim.models.config import CALIBRATION, PadimConfig
from padim.models.data.changes import Expected
from padim.models.data.framing import Framing
from padim.models.data.images import list_images
from padim.models.data.spread import SAMPLE, Spread, measure, sampled, trim_sentence
from padim.models.devices import choose_precision, float64_is_slow, onnxruntime_installed, resolve_device, usable_cpus
from padim.models.errors import FitError as FitError  # re-exported: raised here
from padim.models.errors import ImageError, PrecisionGateFailed
from padim.models.features.quantised import GRAPH_KEY, QUANTISER_IMAGES, graph_settings
from padim.models.fit.distributed import Shard, gather
from padim.models.fit.in_progress import Fit
from padim.models.fit.memory_plan import (
    DoesNotFit,
    FitFacts,
    FitPlan,
    check,
    check_disk,
    free_memory,
    plan_fit,
    ran_out,
    spool_in_memory,
)
from padim.models.fit.model_file import load_detector, load_fit, save_fitted
from padim.models.fit.passes import (
    Accumulated,
    Finished,
    HeldRows,
    Scored,
    ScoringPass,
    SpooledRows,
    TrainingImage,
    batches_of,
    file_digest,
    split_rows,
)
from padim.models.fit.precision import CHECK_IMAGES, PrecisionCheck, PrecisionGate, measure_precision
from padim.models.scoring.detector import PadimDetector, Provenance, now
from padim.models.scoring.reduced import Int8Scorer

log = logging.getLogger(__name__)

#: Fewest readable images a new detector is fitted on: two for a covariance, and more to calibrate.
MIN_IMAGES = 3
#: How pass 1's int8 rows wait for their out-of-fold scores: float16 (half the bytes written and read back). They
#: are the int8 backbone's, already within a quantisation step of float32's; float16 moves a value by at most 1/2048
#: of itself (an eighth of a step at the top of a stage's uint8 range), and the scores the int8 threshold is read
#: from by at most 5.7e-4 of themselves on 200 pictures (docs/runtimes.md).
QUERY_ROWS_DTYPE = torch.float16


def training_images(root: str | Path) -> list[TrainingImage]:
    """Every image under ``root`` (recursively, sorted), named by its path relative to ``root``."""
    root = Path(root)
    return [TrainingImage(p, p.relative_to(root).as_posix() if root.is_dir() else p.name) for p in list_images(root)]


@contextlib.contextmanager
def timed_into(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Add the seconds the block takes to ``seconds[phase]`` (to the millisecond): a report's phases."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = round(seconds.get(phase, 0.0) + time.perf_counter() - started, 3)


@dataclass
class FitReport:
    """What happened to the images of one run (shown by ``padim train``).

    Attributes:
        listed: images given.
        unreadable: ``(name, reason)`` of images that could not be decoded (left out).
        already_fitted: names of images whose content the resumed model had fitted (left out).
        copies: groups of names of images with the same content (each fitted, in any folds).
        folds: fold of every image given, by name (``None``: leave-one-out, its own fold).
        unscored: names of fitted images without an out-of-fold score (their fold held all
            but fewer than two of the images).
        warnings: one line each.
        seconds: wall time of each phase on this rank: ``fit`` (pass 1), ``finish`` (statistics
            and factors), ``calibrate`` (out-of-fold distances and the threshold), ``check`` (a reduced precision's
            gate), ``write``; and ``fit_waiting_for_pictures``, the part of ``fit`` spent waiting for decoded
            pictures and their changed copies (``--decode-workers``), not in the backbone.
        plan: the memory the fit was sized for, and the free memory then.
        spool: bytes of embeddings spooled to disk (0 when the calibration embedded them again).
        precision_dtype: storage dtype of the precision factors written.
        float16_change: the float16 check's largest relative change of image scores.
        precision_check: a reduced precision's gate (``train --precision``; ``None`` at fp32).
        cuda_peak: ``torch.cuda.max_memory_allocated`` of the fit on a GPU (``None`` on a CPU).
        spread: what ``--expect auto`` or ``--trim-cover`` measured on the training pictures (``None`` without
            them, and on a resume, which keeps the cover it was fitted with).
        precision_choice: why ``--precision auto`` chose what it chose (``None`` without it).
        quantisation: what made a new int8 fit's backbone (``seconds["quantise"]`` its time).
        shrinkage: what ``--shrinkage auto`` estimated (:attr:`Finished.shrinkage`; ``None`` for a weight given).
        trimmed: with ``--trim-cover``, the changes declared and those left out of the cover (``declared``,
            ``left_out``), beside the ``spread`` they were read from; ``None`` otherwise.
        int8_scorer: the int8 scorer made beside a float32 model (kept or refused by its gate:
            :mod:`padim.models.scoring.reduced`; ``seconds["quantise"]`` its backbone's time); ``None`` where none was
            made, and ``no_int8_scorer`` then says why.
    """

    listed: int = 0
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    already_fitted: list[str] = field(default_factory=list)
    copies: list[list[str]] = field(default_factory=list)
    folds: dict[str, int | None] = field(default_factory=dict)
    unscored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    plan: FitPlan | None = None
    free_memory: int | None = None
    spool: int = 0
    precision_dtype: str | None = None
    float16_change: float | None = None
    precision_check: PrecisionCheck | None = None
    cuda_peak: int | None = None
    spread: Spread | None = None
    precision_choice: str | None = None
    quantisation: dict | None = None
    shrinkage: dict | None = None
    trimmed: dict | None = None
    int8_scorer: Int8Scorer | None = None
    no_int8_scorer: str | None = None

    @property
    def fitted(self) -> int:
        return self.listed - len(self.unreadable) - len(self.already_fitted)

    def timed(self, phase: str) -> contextlib.AbstractContextManager[None]:
        return timed_into(self.seconds, phase)


def train(
    config: PadimConfig,
    images: Sequence[TrainingImage],
    output: str | Path,
    resume: Fit | None = None,
    progress: bool = True,
    shard: Shard | None = None,
    with_statistics: bool = True,
    scratch_dir: str | Path | None = None,
    announce=None,
    gate: PrecisionGate | None = None,
) -> FitReport:
    """Fit (or go on fitting) a detector on normal images, with cross-fitted calibration, into ``output``.

    Args:
        config: the configuration (ignored for ``resume``, which keeps its own).
        images: every rank's images, each with its name (path relative to the data directory).
        output: the model file to write (atomically; rank 0 only).
        resume: a fit loaded from a model file: the images are added to its statistics, and
            their out-of-fold scores to its calibration scores. Images it already fitted (same
            content) are left out.
        progress: progress bars on stderr.
        shard: this process's place under ``torch.distributed`` (see :mod:`padim.models.fit.distributed`).
        with_statistics: keep the statistics in the file (``False``: ``--slim``).
        scratch_dir: where pass 1's embeddings and the factors wait (default: ``output``'s folder).
        announce: called with one line before pass 1 (the memory plan, where the spool goes).
        gate: the tolerance of a reduced precision's scores against fp32's, and whether to write the model past it
            (:mod:`padim.models.fit.precision`; default :class:`PrecisionGate`).

    Raises:
        FitError: too few readable images, none that could be scored out-of-fold, images that
            do not vary, or a fit that would not fit in memory (naming what would).
        PrecisionGateFailed: a reduced precision's scores past the gate's tolerance (and no ``force``): nothing
            written.
    """
    started = time.perf_counter()
    report = FitReport()
    if resume is None and config.gaussian.expect == EXPECT_AUTO:
        with report.timed("measure"):
            config, report.spread = measured_cover(config, images, shard)
        if announce is not None and (shard is None or shard.main):
            announce(f"--expect auto: {report.spread.describe()}")
    elif resume is None and config.gaussian.expect and config.gaussian.trim_cover:
        declared = config.gaussian.expect
        with report.timed("measure"):
            config, report.spread, report.trimmed = trimmed_cover(config, images, shard)
        if announce is not None and (shard is None or shard.main):
            announce(f"--expect {declared}: {trim_sentence(report.spread, report.trimmed, config.gaussian.expect)}")
    if resume is None and config.features.precision == PRECISION_AUTO:
        config, report.precision_choice = chosen_precision(config)
        if announce is not None and (shard is None or shard.main):
            announce(f"--precision auto: {report.precision_choice}")
        reduced = config.features.precision != "fp32"
        if reduced and shard is None and not (gate is not None and gate.force):
            # auto's reduced precision is a choice, not a demand: where its gate refuses it, fp32 is fitted instead
            try:
                done = train(config, images, output, None, progress, None, with_statistics, scratch_dir, announce, gate)
            except PrecisionGateFailed as refused:
                tried = config.features.precision
                said = refused.check.sentence() if refused.check is not None else str(refused)
                config = config.replace(precision="fp32")
                report.precision_choice = f"fp32: {tried}'s gate refused it ({said})"
                log.warning("--precision auto: %s's gate refused it (%s); fitting at fp32 instead", tried, said)
            else:
                done.precision_choice = report.precision_choice
                return done
    with _out_of_memory_as_error(None, report, None):
        fit = resume if resume is not None else Fit.start(config)
    config = fit.config
    if config.features.precision == "int8" and not fit.embedder.quantised:
        with report.timed("quantise"):
            chosen = [images[i].path for i in sampled([image.name for image in images], QUANTISER_IMAGES)]
            report.quantisation = fit.quantise(chosen, shard)
    images = _leave_out_fitted(fit, images, report)
    report.no_int8_scorer = _no_int8_scorer(config, resume, shard)
    if report.no_int8_scorer is None:
        with report.timed("quantise"):
            chosen = [images[i].path for i in sampled([image.name for image in images], QUANTISER_IMAGES)]
            try:
                report.quantisation = fit.prepare_int8_scorer(chosen, shard)
            except FitError as error:  # the fit itself says what it can make of pictures it cannot read
                report.no_int8_scorer = str(error)
    groups = fit.groups(images)
    earlier_count = fit.count
    scratch = Path(scratch_dir or Path(output).parent)
    check_disk(scratch, fit.pixels, fit.embedder.embedding_dim)
    facts = FitFacts(
        len(images),
        spool=False,
        with_statistics=with_statistics,
        resume=resume is not None,
        int8_scorer=fit.int8_embedder is not None,
    )
    spool, facts = _prepare(fit, report, facts, scratch, shard, announce)
    queries = _query_spool(fit, report, spool, scratch, len(images))
    try:
        with _out_of_memory_as_error(fit, report, facts):
            with report.timed("fit"):
                found = fit.accumulate(groups, progress, shard, spool, queries)
            _record(report, found)
            _check_enough(fit, report, earlier_count)
            _waited_for_pictures(fit, report)
            unreadable = {name for name, _ in report.unreadable}
            readable = [[i for i in group if i.name not in unreadable] for group in groups]
            asked = None if queries is None else SpooledRows(queries)  # the int8 rows, scored beside the pictures'
            scored = [_spooled_scores(fit, asked)] if spool is not None else fit.embed_again(readable, progress, shard)
            finished = _finish(fit, report, scored, scratch, facts, progress, shard)
            checked = None if finished.queried is None or spool is None else _checked_rows(fit, spool, queries)
    finally:
        for opened in (spool, queries):
            if opened is not None:
                opened.close()
    try:
        if shard is not None and not shard.main:
            return report
        with report.timed("calibrate"):
            calibration = _out_of_fold_calibration(
                fit,
                finished.scores,
                finished.input_distances,
                finished.taken_scores,
                _linked(finished, dict(found.digests)),
            )
        _warn(report, calibration, fit)
        provenance = _next_provenance(fit, report, started, shard, resumed=resume is not None, source="out_of_fold")
        if config.features.precision != "fp32":
            with report.timed("check"):
                report.precision_check = _gated(fit, finished, readable, calibration, gate or PrecisionGate())
            provenance.precision_check = report.precision_check.to_dict()
            if GRAPH_KEY in fit.backbone_weights:  # what made the int8 backbone, beside its gate
                provenance.precision_check["quantiser"] = graph_settings(fit.backbone_weights[GRAPH_KEY])
        elif finished.queried is not None:
            assert checked is not None, "the int8 rows were spooled beside the float32 ones"
            with report.timed("check"):
                report.int8_scorer = _int8_scorer(
                    fit, finished, checked, gate or PrecisionGate(), report, dict(found.digests)
                )
        with report.timed("write"):
            save_fitted(output, fit, finished, calibration, provenance, with_statistics, report.int8_scorer)
        return report
    finally:
        if finished.factors is not None:
            finished.factors.close()


def fit_detector(
    config: PadimConfig,
    images: Sequence[TrainingImage],
    resume: Fit | None = None,
    progress: bool = True,
    shard: Shard | None = None,
    scratch_dir: str | Path | None = None,
) -> tuple[PadimDetector | None, FitReport]:
    """:func:`train` into a temporary file, then that file's detector with its statistics (rank 0; ``None`` elsewhere).

    The detector is the one ``padim predict`` would load: float16 factors where the fit chose them.
    """
    with tempfile.TemporaryDirectory(prefix="padim-fit-", dir=scratch_dir) as folder:
        path = Path(folder) / "model.padim"
        report = train(config, images, path, resume, progress, shard, scratch_dir=folder)
        if shard is not None and not shard.main:
            return None, report
        return load_detector(
            path, "cpu" if config.run.device == "cpu" else config.run.device, with_statistics=True
        ), report


def fit_partial(
    config: PadimConfig,
    images: Sequence[TrainingImage],
    progress: bool = True,
    shard: Shard | None = None,
    scratch_dir: str | Path | None = None,
    announce=None,
) -> tuple[Fit, FitReport]:
    """Pass 1 and the statistics alone, for ``train --partial``: every image fitted, no factors, no calibration."""
    started = time.perf_counter()
    report = FitReport()
    if config.features.precision in ("int8", PRECISION_AUTO):
        raise FitError(
            f"--partial with --precision {config.features.precision}: each part would quantise its backbone from its "
            "own pictures, and parts with other backbones do not merge; fit the parts at --precision fp32 (or bf16, "
            "fp16), or fit one model at int8 on every picture (--resume adds pictures to it later)"
        )
    if config.gaussian.expect == EXPECT_AUTO:
        raise FitError(
            "--partial with --expect auto: each part would measure only its own pictures, and parts fitted with "
            "other covers do not merge; measure once (padim train --expect auto on a sample of the pictures shows "
            "the bounds, padim info keeps them) and give every part those bounds, or a preset (--expect rough)"
        )
    with _out_of_memory_as_error(None, report, None):
        fit = Fit.start(config)
    report.listed = len(images)
    report.folds = {i.name: _fold(i.name, config) for i in images}
    scratch = Path(scratch_dir or tempfile.gettempdir())
    spool, facts = _prepare(fit, report, FitFacts(len(images), spool=False), scratch, shard, announce)
    try:
        with _out_of_memory_as_error(fit, report, facts):
            with report.timed("fit"):
                found = fit.accumulate(fit.groups(images), progress, shard, spool)
            _record(report, found)
            if not fit.count:
                raise FitError(f"none of the {report.listed} images could be read ({_some(report.unreadable)})")
            with report.timed("finish"):
                fit.finish([], None, with_statistics=True, progress=progress, shard=shard)
    finally:
        if spool is not None:
            spool.close()
    fit.provenance = _next_provenance(fit, report, started, shard, resumed=False, source=None)
    return fit, report


def merge_fits(
    parts: Sequence[str | Path],
    calibration_images: Sequence[Path],
    run_options: PadimConfig,
    output: str | Path,
    false_alarm_rate: float | None = None,
    progress: bool = True,
    with_statistics: bool = True,
    scratch_dir: str | Path | None = None,
    gate: PrecisionGate | None = None,
) -> FitReport:
    """Combine fits of disjoint images (``train --partial`` files), calibrate on images none fitted, write ``output``.

    The merged statistics equal a one-shot fit of every part's images. The parts are read one
    at a time and added to the first, so that two parts' statistics at most are in memory. The
    threshold comes from the scores of ``calibration_images`` under the merged model: images it
    has not seen, so their scores are held out as out-of-fold ones are (no fold needs removing).
    Parts fitted at a reduced precision are gated as ``train`` gates them (``gate``), on the
    calibration images.

    Raises:
        FitError: parts whose settings or weights differ (naming the first two), calibration
            images that a part fitted, or none readable; ``PrecisionGateFailed`` past the gate.
        ArtifactError: a part that cannot be read, or has no statistics.
    """
    if not parts:
        raise FitError("nothing to merge")
    started = time.perf_counter()
    merged, provenances = _merged_parts(parts, run_options)
    config = merged.config = merged.config.replace(false_alarm_rate=false_alarm_rate)
    _unseen(merged, calibration_images)
    report = FitReport(listed=len(calibration_images))
    scratch = Path(scratch_dir or Path(output).parent)
    held = [TrainingImage(p, p.name) for p in calibration_images]
    finished = _merged_finished(merged, held, report, scratch, with_statistics, progress)
    try:
        calibration = _held_out_calibration(finished, config.verdict.false_alarm_rate)
        provenance = _merged_provenance(merged, parts, provenances, time.perf_counter() - started, report)
        if config.features.precision != "fp32":  # gated on the pictures it calibrated on
            readable = [image for image in held if str(image.path) not in {name for name, _ in report.unreadable}]
            with report.timed("check"):
                report.precision_check = _gated(merged, finished, [readable], calibration, gate or PrecisionGate())
            provenance.precision_check = report.precision_check.to_dict()
        with report.timed("write"):
            save_fitted(output, merged, finished, calibration, provenance, with_statistics)
        if shortfall := calibration.shortfall():
            report.warnings.append(shortfall)
        return report
    finally:
        if finished.factors is not None:
            finished.factors.close()


def _merged_finished(
    merged: Fit, held: list[TrainingImage], report: FitReport, scratch: Path, with_statistics: bool, progress: bool
) -> Finished:
    """The merged fit finished, with ``held``'s scores as its calibration's (pictures no part fitted)."""
    spool = merged.spool_or_none(scratch, len(held))
    try:
        with report.timed("fit"):
            scored = _held_out(merged, held, spool, progress, report)
        if not scored.names:
            raise FitError(f"none of the {len(held)} calibration images could be read ({_some(report.unreadable)})")
        facts = FitFacts(len(held), spool is not None, with_statistics, resume=True)
        return _finish(merged, report, [scored], scratch, facts, progress, None)
    finally:
        if spool is not None:
            spool.close()


def _merged_provenance(
    merged: Fit, parts: Sequence[str | Path], provenances: list, seconds: float, report: FitReport
) -> Provenance:
    """What a merged model file says of where it came from: the parts, their fits, the unreadable pictures."""
    return Provenance(
        fit_image_count=merged.count,
        calibration_source="held_out",
        unreadable_image_count=sum(p.unreadable_image_count for p in provenances),
        fit_seconds=round(seconds, 3),
        merged_from=[str(p) for p in parts],
        fits=[f for p in provenances for f in p.fits],
        shrinkage_estimated=report.shrinkage,
    )


# ---------------------------------------------------------------------- helpers
def _unseen(merged: Fit, calibration_images: Sequence[Path]) -> None:
    """Refuse calibration images that a part fitted: a merge calibrates on images none of them has seen."""
    fitted = set(merged.image_digests.tolist())
    seen = [p for p in calibration_images if file_digest(p) in fitted]
    if seen:
        raise FitError(
            f"{len(seen)} calibration image(s) were fitted in the parts ({_some([(str(p), '') for p in seen])}); "
            "calibration needs normal images that no part has seen"
        )


def _held_out_calibration(finished: Finished, false_alarm_rate: float) -> Calibration:
    """The threshold from the held-out images' scores; a :class:`FitError` saying why when they cannot set one."""
    try:
        return Calibration.from_scores(
            finished.scores,
            false_alarm_rate,
            input_distances=finished.input_distances,
            taken_scores=finished.taken_scores,
        )
    except CalibrationError as error:
        raise FitError(f"the calibration images cannot set a threshold: {error}") from None


def _merged_parts(parts: Sequence[str | Path], run_options: PadimConfig) -> tuple[Fit, list[Provenance]]:
    """The parts' statistics added into the first one's, read one at a time; refused unless they match."""
    merged = load_fit(parts[0], run_options=run_options)
    provenances = [merged.provenance]
    for source in parts[1:]:
        part = load_fit(source, run_options=run_options)
        clash = merged.config.differences(part.config, CALIBRATION)
        if clash:
            key = clash[0]
            raise FitError(
                f"{source}: {key}={part.config.to_dict()[key]!r} but {parts[0]} has "
                f"{merged.config.to_dict()[key]!r}; parts must come from the same configuration"
            )
        if part.weights.sha256 != merged.weights.sha256:
            raise FitError(
                f"{source}: other backbone weights than {parts[0]} (sha256 {part.weights.sha256[:12]} vs "
                f"{merged.weights.sha256[:12]})"
            )
        graphs = [fit.backbone_weights.get(GRAPH_KEY) for fit in (merged, part)]
        int8 = merged.config.features.precision == "int8"  # a float32 part's graph is its int8 scorer's: not merged
        if int8 and graphs[0] is not None and (graphs[1] is None or not torch.equal(graphs[0], graphs[1])):
            raise FitError(f"{source}: another int8 backbone than {parts[0]} (each fit quantised its own)")
        if not merged.embedding.same_reduction(part.embedding):
            raise FitError(f"{source}: another channel selection than {parts[0]} (different --seed or --embedding-dim)")
        assert merged.statistics is not None and part.statistics is not None, "a partial fit holds its statistics"
        merge_states_(merged.statistics, part.statistics)
        merged.image_digests = torch.cat([merged.image_digests, part.image_digests]).sort().values
        provenances.append(part.provenance)
        del part
    return merged, provenances


def _prepare(
    fit: Fit, report: FitReport, facts: FitFacts, scratch: Path, shard: Shard | None, announce
) -> tuple[EmbeddingSpool | None, FitFacts]:
    """The memory plan (refused when it does not fit), and the spool when it fits on the disk; ``facts`` with
    whether it does."""
    images, device = facts.images, fit.device.type
    free = free_memory(device)
    spooled = plan_fit(fit.config, dataclasses.replace(facts, spool=True), device)
    spool = _spool(fit, scratch, images, spooled, free)
    facts = dataclasses.replace(facts, spool=spool is not None)
    plan = plan_fit(fit.config, facts, device) if spool is None else spooled
    if spool is not None and spool.held is not None:
        plan = dataclasses.replace(plan, spool_held=True)
    report.plan, report.free_memory = plan, free
    try:
        check(fit.config, plan, free, facts)
    except DoesNotFit as error:
        if spool is not None:
            spool.close()
        raise FitError(str(error)) from None
    copies = (
        f" (and their changed copies', --expect {fit.config.gaussian.expect})" if fit.config.gaussian.expect else ""
    )
    spooled_bytes = EmbeddingSpool.size(images * fit.spooled_rows, fit.pixels, fit.embedder.embedding_dim)
    where = (
        f"embeddings{copies} kept in GPU memory ({_size(plan.spool)})"
        if spool is not None and spool.held is not None
        else f"embeddings{copies} spooled to {scratch} ({_size(plan.spool)}, removed when the fit ends)"
        if spool is not None
        else f"the embeddings of {images} images{copies} ({_size(spooled_bytes)}) "
        f"do not fit on the disk in {scratch}: the calibration embeds them again; --scratch-dir elsewhere avoids it"
    )
    if spool is None:
        report.warnings.append(where)
    if announce is not None and (shard is None or shard.main):
        config = fit.config
        tiles = (
            ""
            if config.tile_count == 1
            else (
                f" ({config.framing.tiles[0]}x{config.framing.tiles[1]} tiles of {config.features.image_size} px, "
                + (
                    "a Gaussian per tile position: statistics x" + str(config.tile_count)
                    if config.framing.tile_statistics == "position"
                    else "one set of statistics every tile shares"
                )
                + ")"
            )
        )
        announce(f"this fit{tiles} {plan.describe(free)}; {where}")
        if float64_is_slow(fit.device):
            announce(
                f"{torch.cuda.get_device_name(fit.device)} runs float64 at 1/32-1/64 of its float32 rate: the "
                "finish (float64) takes about as long as on a 16-core CPU; see docs/gpu.md"
            )
    return spool, facts


def _spool(fit: Fit, scratch: Path, images: int, plan: FitPlan, free: int | None) -> EmbeddingSpool | None:
    """Pass 1's spool: in the GPU's memory where ``plan`` (a fit with a spool) and the spool fit there
    (:func:`~padim.models.fit.memory_plan.spool_in_memory`), else on the disk in ``scratch``, else none."""
    if spool_in_memory(plan, free):
        try:
            return fit.spool_or_none(scratch, images, in_memory=True)
        except torch.OutOfMemoryError:  # the estimate was short, or another process took memory meanwhile
            torch.cuda.empty_cache()
            log.info("the embeddings did not fit in GPU memory after all: spooled to %s", scratch)
    return fit.spool_or_none(scratch, images)


@contextlib.contextmanager
def _out_of_memory_as_error(fit: Fit | None, report: FitReport, facts: FitFacts | None) -> Iterator[None]:
    """A GPU out of memory in the fit becomes :class:`DoesNotFit` with its plan and what to try (not a traceback)."""
    try:
        yield
    except torch.OutOfMemoryError:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if report.plan is None or fit is None or facts is None:
            raise DoesNotFit(
                "the GPU ran out of memory before the fit started (putting the backbone on it): other "
                "processes hold its memory (nvidia-smi shows them); free it, or use --device cpu"
            ) from None
        raise ran_out(fit.config, report.plan, report.free_memory, facts) from None


def _spooled_scores(fit: Fit, queries: SpooledRows | None = None) -> ScoringPass:
    """The spooled pictures' scoring pass (with ``queries``: their query rows', :mod:`padim.models.scoring.reduced`)."""
    spooled = fit.spooled
    assert spooled is not None, "scored from the spool only where the fit spooled"
    return ScoringPass(SpooledRows(spooled.spool), spooled.names, spooled.folds, queries)


def _no_int8_scorer(config: PadimConfig, resume: Fit | None, shard: Shard | None) -> str | None:
    """Why a fit makes no int8 scorer beside its float32 model (:mod:`padim.models.scoring.reduced`); ``None``: it
    does."""
    if not config.storage.int8_scorer:
        return "not asked for (--no-int8-scorer)"
    if config.features.precision != "fp32":
        return f"the model itself scores at {config.features.precision}"
    if shard is not None:
        return "a fit on several processes (torchrun) makes none: fit on one to have one"
    if resume is not None and resume.earlier_int8 is None:
        return "the resumed model has none (a new fit on every picture makes one)"
    if not onnxruntime_installed():
        return f"ONNX Runtime, which runs it, is not installed ({install_extra('onnxruntime')})"
    return None


def _query_spool(
    fit: Fit, report: FitReport, spool: EmbeddingSpool | None, scratch: Path, images: int
) -> EmbeddingSpool | None:
    """Where pass 1's int8 rows wait for the finish, beside its spool (on the disk); ``None`` where the fit makes no
    int8 scorer, or they do not fit there (said in ``report.no_int8_scorer``)."""
    if fit.int8_embedder is None:
        return None
    queries = fit.spool_or_none(scratch, images, dtype=QUERY_ROWS_DTYPE) if spool is not None else None
    if queries is None:
        fit.reading.queries = None
        report.no_int8_scorer = (
            f"its pictures' int8 embeddings do not fit on the disk in {scratch} beside the float32 ones "
            "(--scratch-dir elsewhere makes room)"
        )
    return queries


def _checked_rows(
    fit: Fit, spool: EmbeddingSpool, queries: EmbeddingSpool | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The embeddings the int8 scorer's gate compares: the first :data:`CHECK_IMAGES` pictures' own rows (not their
    changed copies') as pass 1 spooled them, by the float32 backbone and by the int8 one, ``(N, p, D)`` each on the
    CPU; ``None`` without int8 rows. Pass 1 spooled the readable pictures in the order the gate takes them, so the
    gate reads them back instead of decoding and embedding those pictures twice more."""
    if queries is None:
        return None
    count = min(CHECK_IMAGES, spool.rows // fit.spooled_rows) * fit.spooled_rows

    def first_rows(rows: EmbeddingSpool) -> torch.Tensor:
        read = torch.cat([rows.read(index, 0, count).cpu() for index in range(len(rows.slices))], dim=1)
        return split_rows(read, fit.rows_per_image)[0] if fit.config.gaussian.expect else read

    return first_rows(spool), first_rows(queries)


def _int8_scorer(
    fit: Fit,
    finished: Finished,
    checked: tuple[torch.Tensor, torch.Tensor],
    gate: PrecisionGate,
    report: FitReport,
    digest_of: dict[str, int],
) -> Int8Scorer | None:
    """The int8 scorer from its pictures' out-of-fold int8 scores (and a resumed model's), gated against float32 on
    training pictures under the fitted model (``checked``: their float32 and int8 rows, :func:`_checked_rows`);
    refused past the gate's tolerance (the writer then leaves its graph out of the file). ``None`` (said in
    ``report.no_int8_scorer``) where its scores set no threshold."""
    queried = finished.queried
    earlier = fit.earlier_int8.calibration if fit.earlier_int8 is not None else None
    assert queried is not None and fit.int8_embedder is not None, "the finish scored the int8 rows"
    assert queried.input_distances is not None, "a pass of query rows gives their input distances"

    def joined(before: tuple[float, ...], now: torch.Tensor) -> torch.Tensor:  # a resumed model's values first
        return torch.cat([torch.tensor(before, dtype=torch.float64), now])

    kept = earlier.scores if earlier is not None else ()
    try:
        calibration = Calibration.from_scores(
            joined(kept, queried.scores),
            fit.config.verdict.false_alarm_rate,
            earlier_scores=len(kept),
            input_distances=joined(earlier.input_distances if earlier else (), queried.input_distances),
            taken_scores=None
            if queried.taken_scores is None
            else joined((earlier.taken_scores or earlier.scores) if earlier else (), queried.taken_scores),
            pictures=(*(earlier.pictures if earlier else ()), *_linked_values(queried, digest_of)),
        )
    except CalibrationError as error:
        report.no_int8_scorer = f"its out-of-fold scores set no threshold ({error})"
        return None  # its graph is left out of the file by the writer (model_file._write), as a refused one's
    check = measure_precision(
        fit, finished.mean, finished.factors, [], calibration.threshold, gate, fit.int8_embedder, checked
    )
    quantiser = graph_settings(fit.backbone_weights[GRAPH_KEY])
    if not check.passed and gate.force:  # kept past its tolerance, marked so (--force)
        log.warning("the int8 scorer's gate failed, kept anyway (--force): %s", check.sentence())
        check = dataclasses.replace(check, forced=True)
    elif not check.passed:
        log.warning("the int8 scorer's gate refused it (%s): --runtime auto scores at float32", check.sentence())
        return Int8Scorer(check.to_dict(), quantiser, None)
    return Int8Scorer(check.to_dict(), quantiser, calibration)


def _held_out(
    fit: Fit, images: Sequence[TrainingImage], spool: EmbeddingSpool | None, progress: bool, report: FitReport
) -> ScoringPass:
    """Embed the images scored by the fitted model (merge's calibration images): into a spool, or memory."""

    names, parts = [], []
    unreadable: list[tuple[Path, str]] = []
    with tqdm(total=len(images), desc="embed calibration images", unit="img", disable=not progress, leave=False) as bar:
        name_of = {image.path: image.name for image in images}
        for paths, pictures, copies in fit.reading.decoded(
            batches_of([images], fit.config.run.batch_size), unreadable, name_of.__getitem__
        ):
            # the pictures' rows and their changed copies' (expect)
            embedded = fit.reading.embed([name_of[p] for p in paths], pictures, copies)
            if spool is not None:
                spool.append(embedded)
            else:
                parts.append(embedded.cpu())
            names += fit.reading.per_row(p.name for p in paths)
            bar.update(len(paths))
    report.unreadable = [(str(p), reason) for p, reason in unreadable]
    if spool is not None:
        report.spool = spool.nbytes
        return ScoringPass(SpooledRows(spool), names, None)
    return ScoringPass(HeldRows(torch.cat(parts) if parts else torch.zeros(0)), names, None)


def _finish(
    fit: Fit, report: FitReport, passes, scratch: Path, facts: FitFacts, progress: bool, shard: Shard | None
) -> Finished:
    if fit.spooled is not None:
        report.spool = fit.spooled.spool.nbytes
    timing: dict[str, float] = {}
    try:
        finished = fit.finish(
            passes, scratch, with_statistics=facts.with_statistics, progress=progress, shard=shard, timing=timing
        )
    except NotPositiveDefiniteError as error:
        raise FitError(str(error)) from None
    for phase, seconds in timing.items():
        report.seconds[phase] = round(report.seconds.get(phase, 0.0) + seconds, 3)
    report.unscored = finished.unscored
    report.precision_dtype = str(finished.precision_dtype).removeprefix("torch.")
    report.float16_change = finished.float16_change
    report.shrinkage = finished.shrinkage
    if fit.device.type == "cuda":
        report.cuda_peak = torch.cuda.max_memory_allocated(fit.device)
    return finished


def _gated(
    fit: Fit, finished: Finished, readable: list[list[TrainingImage]], calibration: Calibration, gate: PrecisionGate
) -> PrecisionCheck:
    """A reduced precision's scores against fp32's (:mod:`padim.models.fit.precision`), refused past the tolerance."""
    paths = [image.path for group in readable for image in group][:CHECK_IMAGES]
    check = measure_precision(fit, finished.mean, finished.factors, paths, calibration.threshold, gate)
    if check.passed:
        return check
    if not gate.force:
        refused = PrecisionGateFailed(
            f"the {check.precision} model is not accurate enough: {check.sentence()}; nothing was written. Raise "
            "--max-score-error if this is acceptable for your line, --force to write it anyway, or fit at "
            "--precision fp32"
        )
        refused.check = check
        raise refused
    log.warning("precision gate failed, written anyway (--force): %s", check.sentence())
    return dataclasses.replace(check, forced=True)


def _linked(finished: Finished, digest_of: dict[str, int]) -> tuple[tuple[int, float, float, float], ...]:
    """Each scored picture's digest with its score, input distance and taken score (NaN: none), in score order."""
    scored = Scored(finished.scored, finished.scores, finished.input_distances, finished.taken_scores)
    return _linked_values(scored, digest_of)


def _linked_values(scored: Scored, digest_of: dict[str, int]) -> tuple[tuple[int, float, float, float], ...]:
    """:func:`_linked` of what a pass scored (the pictures' own, or their query rows')."""
    nan = float("nan")
    inputs = scored.input_distances.tolist() if scored.input_distances is not None else []
    taken = scored.taken_scores.tolist() if scored.taken_scores is not None else []
    return tuple(
        (digest_of[name], float(score), inputs[i] if i < len(inputs) else nan, taken[i] if i < len(taken) else nan)
        for i, (name, score) in enumerate(zip(scored.names, scored.scores.tolist(), strict=True))
        if name in digest_of
    )


def _out_of_fold_calibration(
    fit: Fit,
    scores: torch.Tensor,
    input_distances: torch.Tensor | None = None,
    taken_scores: torch.Tensor | None = None,
    pictures: tuple[tuple[int, float, float, float], ...] = (),
) -> Calibration:
    """The threshold from the new images' out-of-fold ``scores`` ``(N,)`` and those of earlier fits (``--resume``);
    the input distances of both kept beside them (an earlier file older than format 7 has none), and the images' own
    scores where ``scores`` are their changed copies' (``expect``, which a resume keeps)."""
    earlier = fit.earlier.scores if fit.earlier is not None else ()
    earlier_inputs = fit.earlier.input_distances if fit.earlier is not None else ()
    if input_distances is not None:
        input_distances = torch.cat([torch.tensor(earlier_inputs, dtype=torch.float64), input_distances])
    if taken_scores is not None:
        # an earlier calibration without its images' own scores (a file older than format 8) gives its scores
        earlier_taken = (fit.earlier.taken_scores or fit.earlier.scores) if fit.earlier is not None else ()
        taken_scores = torch.cat([torch.tensor(earlier_taken, dtype=torch.float64), taken_scores])
    if not len(scores) and not earlier:
        raise FitError(
            f"no image could be scored out-of-fold: the {fit.count} readable images all fall in one of "
            f"the {fit.config.gaussian.calibration_folds} calibration folds (folds come from file names); add images"
        )
    earlier_pictures = fit.earlier.pictures if fit.earlier is not None else ()
    try:
        return Calibration.from_scores(
            torch.cat([torch.tensor(earlier, dtype=torch.float64), scores]),
            fit.config.verdict.false_alarm_rate,
            earlier_scores=len(earlier),
            input_distances=input_distances,
            taken_scores=taken_scores,
            pictures=(*earlier_pictures, *pictures),
        )
    except CalibrationError as error:
        raise FitError(
            f"the {fit.count} fitted images cannot be calibrated: {error}. "
            "Train on images of different parts or shots, as the line will see them"
        ) from None


def _fold(name: str, config: PadimConfig) -> int | None:
    folds = config.gaussian.calibration_folds
    return None if isinstance(folds, str) else fold_of(name, folds)  # "loo": no folds


def _leave_out_fitted(fit: Fit, images: Sequence[TrainingImage], report: FitReport) -> list[TrainingImage]:
    """Record every image's fold, and drop those whose content ``fit`` has fitted already."""
    report.listed = len(images)
    report.folds = {i.name: _fold(i.name, fit.config) for i in images}
    if not fit.image_digests.numel():
        return list(images)
    known = set(fit.image_digests.tolist())
    fresh = []
    for image in images:
        if file_digest(image.path) in known:
            report.already_fitted.append(image.name)
        else:
            fresh.append(image)
    return fresh


def _record(report: FitReport, found: Accumulated) -> None:
    report.unreadable = found.unreadable
    report.seconds["fit_waiting_for_pictures"] = found.waited
    same: dict[int, list[str]] = {}
    for name, digest in found.digests:
        same.setdefault(digest, []).append(name)
    report.copies = sorted(sorted(names) for names in same.values() if len(names) > 1)


#: Pass 1 names ``--decode-workers`` when it spent more than this share of its seconds waiting for pictures ...
WAITING_SHARE = 0.3
#: ... and took at least these seconds (a short fit says nothing).
WAITING_SECONDS = 5.0


def _waited_for_pictures(fit: Fit, report: FitReport) -> None:
    """A warning naming ``--decode-workers`` when pass 1 waited mostly for its pictures (decoded, and their changed
    copies made, on that many threads) and this machine has more cores: on a GPU the backbone outruns two threads."""
    waited, spent = report.seconds.get("fit_waiting_for_pictures", 0.0), report.seconds.get("fit", 0.0)
    workers, cores = fit.config.run.decode_workers, usable_cpus()
    if spent < WAITING_SECONDS or waited <= WAITING_SHARE * spent or workers >= cores:
        return
    copies = " and their changed copies made (--expect)" if fit.config.gaussian.expect else ""
    report.warnings.append(
        f"pass 1 spent {waited:.1f} of its {spent:.1f} s waiting for pictures to be decoded{copies} on "
        f"{workers} thread(s): --decode-workers {cores} (this machine's cores) makes them on more"
    )


def _check_enough(fit: Fit, report: FitReport, earlier_count: int) -> None:
    if report.listed and report.fitted == 0 and not report.already_fitted:
        raise FitError(
            f"none of the {report.listed} images could be read ({_some(report.unreadable)}); "
            f"a detector needs at least {MIN_IMAGES} readable normal images"
        )
    if fit.count < MIN_IMAGES:
        unread = f", {len(report.unreadable)} unreadable ({_some(report.unreadable)})" if report.unreadable else ""
        raise FitError(
            f"{fit.count} readable image(s){unread}: a detector needs at least {MIN_IMAGES} normal "
            "images (2 to fit, and more to calibrate its threshold); a few dozen give a useful one"
        )
    if report.listed and report.fitted == 0 and earlier_count:
        raise FitError(f"all {report.listed} images were already fitted in the resumed model; nothing to add")


def _warn(report: FitReport, calibration: Calibration, fit: Fit) -> None:
    if report.unreadable:
        report.warnings.append(f"left out {len(report.unreadable)} unreadable image(s): {_some(report.unreadable)}")
    if report.already_fitted:
        report.warnings.append(
            f"left out {len(report.already_fitted)} image(s) the resumed model had already fitted "
            f"(same content): {_some([(n, '') for n in report.already_fitted])}"
        )
    if report.copies:
        shown = "; ".join(" = ".join(group) for group in report.copies[:3])
        more = f" and {len(report.copies) - 3} more" if len(report.copies) > 3 else ""
        report.warnings.append(
            f"{sum(len(g) - 1 for g in report.copies)} image(s) are copies of others (same content: "
            f"{shown}{more}): a copy in another fold pulls the threshold down; remove copies"
        )
    if report.unscored:
        report.warnings.append(
            f"{len(report.unscored)} image(s) have no out-of-fold score: their calibration fold "
            f"holds all but {fit.count - len(report.unscored)} of the images"
        )
    if calibration.earlier_scores:
        report.warnings.append(
            f"{calibration.earlier_scores} of the {calibration.count} calibration scores are kept from the resumed "
            "model: its fits scored them with fewer images, so they run slightly high and the threshold errs "
            "towards fewer false alarms; a one-shot fit on all images recalibrates them all"
        )
    shortfall = calibration.shortfall()
    if shortfall:
        report.warnings.append(shortfall)


def _next_provenance(
    fit: Fit, report: FitReport, started: float, shard: Shard | None, resumed: bool, source: str | None
) -> Provenance:
    earlier = fit.provenance
    run = {
        "created": now(),
        "images": report.fitted,
        "unreadable": len(report.unreadable),
        "already_fitted": len(report.already_fitted),
        "resumed": resumed,
        "world_size": shard.world if shard else 1,
    }
    return Provenance(
        fit_image_count=fit.count,
        calibration_source=source,
        unreadable_image_count=earlier.unreadable_image_count + len(report.unreadable),
        fit_seconds=round(time.perf_counter() - started, 3),
        fits=[*earlier.fits, run],
        merged_from=list(earlier.merged_from),
        expect_measured={**report.spread.to_dict(), **(report.trimmed or {})}
        if report.spread is not None
        else earlier.expect_measured,
        shrinkage_estimated=report.shrinkage,
    )


def chosen_precision(config: PadimConfig) -> tuple[PadimConfig, str]:
    """``config`` with ``--precision auto`` replaced by the precision chosen for the device it fits on, and why."""
    precision, reason = choose_precision(resolve_device(config.run.device))
    return config.replace(precision=precision), f"{precision}, for {reason}"


def measured_cover(
    config: PadimConfig, images: Sequence[TrainingImage], shard: Shard | None = None
) -> tuple[PadimConfig, Spread]:
    """``config`` with ``expect auto`` replaced by the bounds the training pictures' own spread sets
    (:mod:`padim.models.data.spread`), and that spread.

    Raises:
        FitError: fewer than two of the pictures measured could be read.
    """
    spread = _spread(config, images, shard)
    if spread is None:
        raise FitError(
            f"--expect auto measures the training pictures, and fewer than two of the {min(len(images), SAMPLE)} it "
            "read could be decoded; declare the changes instead (e.g. --expect rough)"
        )
    return config.replace(expect=str(spread.cover())), spread


def trimmed_cover(
    config: PadimConfig, images: Sequence[TrainingImage], shard: Shard | None = None
) -> tuple[PadimConfig, Spread | None, dict | None]:
    """``config`` with the declared changes the training pictures already show at least as far left out of its
    cover (``--trim-cover``: :meth:`Spread.shown`), the spread measured, and what was declared and left out
    (``declared``, ``left_out``; ``None`` where fewer than two pictures could be read: the cover is kept whole)."""
    spread = _spread(config, images, shard)
    if spread is None:
        return config, None, None
    declared = Expected.parse(config.gaussian.expect)
    shown = spread.shown(declared)
    trimmed = config.replace(expect=str(spread.trimmed(declared))) if shown else config
    return trimmed, spread, {"declared": str(declared), "left_out": shown}


def _spread(config: PadimConfig, images: Sequence[TrainingImage], shard: Shard | None) -> Spread | None:
    """The training pictures' spread (:func:`~padim.models.data.spread.measure` on at most ``SAMPLE`` of them, in
    the region of interest); ``None`` where fewer than two could be read. Every rank measures the same pictures (so
    that a picture none can read fails every rank alike) and uses rank 0's numbers; an unreadable picture is left
    out of it (the fit says why)."""
    chosen = [images[i] for i in sampled([image.name for image in images])]

    def readable() -> Iterator[Image.Image]:
        for image in chosen:
            try:
                with Image.open(image.path) as opened:
                    opened.load()
                    yield opened
            except (OSError, ValueError, Image.DecompressionBombError):
                continue  # the fit says why

    try:
        spread = measure(readable(), None if config.framing.roi is None else _region_of(Framing.of(config)))
    except ValueError:
        spread = None
    return gather(spread, shard)[0]


def _region_of(framing: Framing):
    """The region of interest of a picture, or the whole picture where it does not hold it (the fit says so)."""

    def region(width: int, height: int) -> tuple[int, int, int, int]:
        try:
            return framing.region(width, height)
        except ImageError:
            return 0, 0, width, height

    return region


def _some(items: Sequence[tuple[str, str]], shown: int = 3) -> str:
    """``a.png: reason; b.png: reason and 5 more``."""
    text = "; ".join(f"{name}: {reason}" if reason else name for name, reason in items[:shown])
    return text + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.0f} MB"
