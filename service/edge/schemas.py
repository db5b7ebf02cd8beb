"""What the service answers: one pydantic model per response shape (and the OpenAPI document's schemas)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from padim.core import FALSE_ALARM_RATE_RANGE
from padim.models.options import shown_fields

#: The highest version number a request may name: what the record's Integer column holds (PostgreSQL's int4).
MAX_VERSION = 2**31 - 1


class ModelInfo(BaseModel):
    """Which model answered: returned with every score."""

    name: str = Field(description="the model's name (a repository's folder, or the model file's stem)")
    version: int = Field(
        default=1,
        description="the version that scored and judged the image (a repository's "
        "numbered version; 1 for models served from PADIM_MODELS / PADIM_MODEL_DIR)",
    )
    backbone: str
    created: str | None = Field(description="when the model's statistics were last extended (ISO 8601, UTC)")
    sha256: str = Field(description="sha256 of the model file")
    weights: str = Field(description="origin of the backbone weights; RANDOM weights are demo-only")


class ScoreResult(BaseModel):
    """The verdict on one image (the same keys as `padim predict`'s results.jsonl)."""

    score: float = Field(description="0..1; the image is anomalous at or above `threshold`")
    raw_score: float = Field(
        description="the image score, Mahalanobis distance units (by default the maximum of the map)"
    )
    is_anomaly: bool
    threshold: float = Field(description="threshold used, on the 0..1 score scale (0.5 unless the request set one)")
    raw_threshold: float | None = Field(
        description="the same threshold in raw units; null when the threshold is 0 or 1, which have no finite raw value"
    )
    anomalous_area: float = Field(description="share of map pixels at or above the threshold")
    heatmap: str | None = Field(
        None,
        description="PNG, base64 (heatmap=true): the image, tinted only where the map "
        "nears or passes the threshold, with the outline of the area at or above it; at the "
        "image's size (at most PADIM_HEATMAP_MAX_SIDE a side)",
    )
    mask: str | None = Field(None, description="PNG, base64: white where at or above the threshold (mask=true)")
    record_id: str | None = Field(
        None,
        description="the picture's row in the inspection record (when the record is on: "
        "GET /records/{id}; a review refers to it)",
    )


class ScoreResponse(ScoreResult):
    model: ModelInfo
    latency_ms: float


class BatchResponse(BaseModel):
    results: list[ScoreResult] = Field(description="one per `file` part, in order")
    model: ModelInfo
    latency_ms: float


class SpreadInfo(BaseModel):
    """What ``train --expect auto`` measured on the training pictures (padim.models.data.spread)."""

    pictures: int = Field(description="how many were measured (at most 200)")
    brightness: float = Field(description="95th percentile of |mean grey / median - 1|")
    contrast: float = Field(description="95th percentile of |relative spread / median - 1|")
    shift: float | None = Field(
        description="offset from the median picture, pixels (null: the pictures share no "
        "position, placement covered as rough's)"
    )
    rotate: float | None = Field(description="turn from the median picture, degrees (null: as shift)")
    blur: float = Field(description="the Gaussian sigma, pixels, that softens the median picture to the softest")
    jpeg: int | None = Field(description="the lowest JPEG quality (null: stored losslessly)")
    registered: float = Field(description="the share of pictures that registered to their median picture")


class CalibrationInfo(BaseModel):
    """How the threshold was set and what it promises (see docs/calibration.md)."""

    method: str = Field(description="gumbel_tail, empirical, maximum, manual or quantile (format 1)")
    threshold: float = Field(description="raw threshold (score 0.5)")
    scale: float = Field(description="raw-score width of the logistic score")
    scores: int = Field(description="out-of-fold (or held-out) normal scores it was set from")
    earlier_scores: int = Field(description="how many of them were kept from an earlier fit (--resume)")
    false_alarm_rate: float | None = Field(description="the rate asked for (none for a manual threshold)")
    promised_false_alarm_rate: float = Field(description="distribution-free rate: (N + 1 - j) / (N + 1)")
    false_alarm_bound: float = Field(description="upper bound of the rate at `confidence`")
    confidence: float
    source: str | None = Field(description="out_of_fold (the fit's images) or held_out (images no part fitted)")
    folds: int | Literal["loo"] = Field(
        description="calibration folds: `loo` (leave-one-out, each image its own fold) or the number of folds K"
    )
    expect: str = Field(
        default="",
        description="the changes of the line the threshold covers, as bounds (train --expect; empty: none declared)",
    )
    fit_changes: bool = Field(default=False, description="whether each training picture's changed copy was fitted too")
    measured: SpreadInfo | None = Field(
        default=None,
        description="train --expect auto: how far the training pictures wander, which sized `expect` (1.5x each)",
    )
    covers: str = Field(default="", description="which normal pictures the false-alarm promise is about, in words")
    threshold_of: str = Field(
        default="float32 scorer",
        description="whose scores set the threshold: `float32 scorer` "
        "(the model file's), or a quantised scorer's own on held-out normal images (padim export "
        "--precision)",
    )


class QuantisationAgreement(BaseModel):
    """The quantised scorer against the float32 one on held-out normal (and check) images, at export."""

    images: int = Field(description="held-out normal images compared")
    check_images: int = Field(description="--check-images (defect) images compared")
    rank_correlation: float | None = Field(description="Spearman's of the image scores")
    max_score_error: float = Field(description="largest relative raw-score difference (the gate's statistic)")
    median_score_error: float
    max_map_error: float = Field(description="largest map difference relative to the map's own largest value")
    verdict_changes: int = Field(description="verdicts that differ at the float32 threshold")
    verdict_changes_normal: int
    verdict_changes_check: int
    tolerance: float = Field(description="the gate's tolerance on max_score_error")
    passed: bool
    forced: bool = Field(description="written with --force although the gate failed")
    auroc_float32: float | None
    auroc_quantised: float | None
    threshold: float = Field(description="the float32 raw threshold the verdicts were compared at")


class QuantisationInfo(BaseModel):
    agreement: QuantisationAgreement
    float32_calibration: dict = Field(description="the model file's calibration, which the scorer's own replaced")
    promise: str = Field(description="what the quantised scorer's threshold promises, in words")
    verified: str
    tool: str


#: The options a served model's description shows, with their help as the description: from their declaration.
#: Built at import from that table, so its fields are known at run time only: mypy checks it as a BaseModel.
ShownOptions: type[BaseModel] = create_model(  # type: ignore[call-overload]  # fields from a table, not literals
    "ShownOptions", **{name: (kind, Field(description=what)) for name, (kind, what) in shown_fields().items()}
)


class StageInfo(BaseModel):
    """A stage of the backbone that the model reads."""

    name: str = Field(description="the torchvision node (layer2, features.22)")
    channels: int
    stride: int = Field(description="input pixels per feature-grid cell")


class ShrinkageChoice(BaseModel):
    """The weight of the pooled covariance a model was fitted with, and why (model format 18)."""

    weight: float | None = Field(description="the weight; null for a partial fit, whose merge estimates it")
    chosen: Literal["given", "estimated"] = Field(
        description="given (train --shrinkage WEIGHT) or estimated from the statistics (--shrinkage auto)"
    )
    why: str = Field(description="in words: what it was estimated from, or that it was given")


class ModelDescription(ModelInfo, ShownOptions):  # type: ignore[misc,valid-type]  # ShownOptions: made at import
    """A served model in full (``GET /models``)."""

    backbone_family: str = Field(description="resnet, vgg, efficientnet, mobilenet_v3 or convnext")
    stages: list[StageInfo] = Field(description="the backbone's stages the model reads, shallowest first")
    weights_source: str
    shrinkage_chosen: ShrinkageChoice | None = Field(
        default=None, description="the shrinkage weight the fit used and why (the option `shrinkage` may say auto)"
    )
    grid: list[int]
    input_shape: list[int] = Field(description="height, width of the model input in pixels (the tiles together)")
    fit_image_count: int
    calibration: CalibrationInfo
    verified: bool = Field(description="whether the file's digests were checked at load (model format 2)")
    runtime: str = Field(description="what runs the scorer: torch, onnxruntime or openvino")
    runtime_reason: str | None = Field(
        default=None,
        description="why PADIM_RUNTIME=auto chose that runtime for a model file: the fastest scorer whose scores "
        "the model's threshold was computed from (asked for: the runtime was named)",
    )
    precision: Literal["float32", "bf16", "fp16", "int8"] = Field(
        default="float32",
        description="the backbone's arithmetic: a model file's train --precision (float32, bf16, fp16, int8), or an "
        "export's padim export --precision (float32, int8, fp16, bf16); the threshold is that arithmetic's",
    )
    cuda_graphs: list[int] = Field(
        default=[],
        description="the batch sizes scored through captured CUDA graphs (torch on a GPU, PADIM_CUDA_GRAPHS); "
        "empty: every batch is scored eagerly",
    )
    runs_at: Literal["float32", "bf16"] | None = Field(
        default=None,
        description="what the arithmetic is on this machine where it is not `precision`: a bf16 OpenVINO export "
        "on a CPU without bfloat16 runs at float32 (correct scores, slower than where it was made)",
    )
    precision_check: dict | None = Field(
        default=None,
        description="a model fitted at bf16, fp16 or int8: its image scores against fp32's on training pictures "
        "(images, max_score_error, median_score_error, verdict_changes, tolerance, passed, forced; int8: quantiser, "
        "what made its backbone)",
    )
    quantisation: QuantisationInfo | None = Field(
        default=None,
        description="a quantised export: its accuracy gate and the float32 calibration its own threshold replaced",
    )
    int8_scorer: dict | None = Field(
        default=None,
        description="served by a float32 model's int8 scorer (model format 20, chosen by PADIM_RUNTIME=auto on a CPU "
        "that computes int8 faster): its gate against float32 at fit time (check: images, max_score_error, "
        "median_score_error, tolerance, passed), what made its backbone (quantiser), the float32 calibration beside "
        "its own, its promise; the calibration above is its own",
    )
    padim_version: str
    threshold: float = Field(description="the threshold on the score scale: 0.5")
    load_seconds: float
    versions: list[VersionInfo] = Field(default=[], description="every version of the model, the active one marked")


class VersionInfo(BaseModel):
    """One version of a model (``GET /models/{name}/versions``)."""

    version: int = Field(description="monotonic; never reused, also after a version is removed")
    sha256: str = Field(description="sha256 of the model file (of the file an export was made from)")
    created: str = Field(description="when the version was added (ISO 8601, UTC)")
    source: str = Field(
        description="`upload`, the file name given to `padim repository add`, `copied in`, or "
        "`model set` (a model of PADIM_MODELS / PADIM_MODEL_DIR)"
    )
    kind: Literal["model", "export"] = Field(description="a .padim file or an export directory")
    active: bool = Field(description="new requests go to this version")
    loaded: bool = Field(description="in memory now (the active version, and replaced ones still answering)")
    calibration: dict | None = Field(
        description="the calibration summary its file records: method, threshold, "
        "false_alarm_rate, promised_false_alarm_rate, false_alarm_bound, scores, ..."
    )
    update: dict | None = Field(
        None,
        description="a version made by an update from reviews (POST "
        "/models/{name}/update): base_version, learned_from and removed (record ids), the "
        "gate (recall and false alarms, old against new), job, forced activations",
    )


class VersionsResponse(BaseModel):
    model: str
    versions: list[VersionInfo] = Field(description="oldest first")


class VersionChange(BaseModel):
    """What an upload, activation or rollback did."""

    model: str
    version: int = Field(description="the version uploaded or now active")
    sha256: str
    created: str
    source: str
    kind: Literal["model", "export"]
    active: bool = Field(description="whether it is the active version now")
    update: dict | None = None


class ModelsResponse(BaseModel):
    default: str | None = Field(description="the model POST /score uses (null: none served yet, an empty repository)")
    models: list[ModelDescription] = Field(description="the default first")
    record: bool = Field(
        default=False,
        description="whether the inspection record is on (GET /records, the review queue; docs/record.md)",
    )


class FlagRateReading(BaseModel):
    """The window's flags against what normal images alone would give (a one-sided binomial test)."""

    flags: int = Field(description="images at or above the model's own threshold (whatever a request asked for)")
    rate: float = Field(description="flags / images")
    normal_rate: float = Field(description="the most normal images would give: the calibration's false-alarm bound")
    basis: Literal["promised", "manual"] = Field(
        description="promised: a requested rate's bound; manual: a threshold set "
        "by hand, its bound on the same normal scores (no promise)"
    )
    p_value: float = Field(description="P(X >= flags), X ~ Binomial(images, normal_rate)")
    alarm: bool = Field(
        description="p_value < level: more flags than normal images alone would give (drift or a defect wave)"
    )


class ShiftReading(BaseModel):
    """A one-sided Kolmogorov-Smirnov test: do the window's values run higher than the calibration's?"""

    statistic: float = Field(description="KS D+, 0..1")
    p_value: float
    alarm: bool = Field(description="p_value < level")
    median_ratio: float = Field(description="the window's median over the calibration's (1: unchanged)")
    psi: float | None = Field(None, description="population stability index on the calibration's deciles (scores only)")


class ScoreHistogram(BaseModel):
    edges: list[float] = Field(description="bin edges on the 0..1 score scale; the threshold is 0.5")
    recent: list[int] = Field(description="the window's images per bin")
    calibration: list[int] = Field(description="the calibration's normal images per bin")


class MonitorResponse(BaseModel):
    """``GET /models/{name}/monitor``: the last images a model answered, read against its calibration.

    Per server process and lost on restart (Prometheus' padim_verdicts_total and padim_score are the
    durable record); see docs/monitoring.md.
    """

    model: str
    version: int = Field(
        default=1,
        description="the version whose answers the window holds: a new version starts a "
        "new window, since its threshold makes older flags incomparable",
    )
    images: int = Field(description="images in the window")
    status: Literal["collecting", "normal", "alarm"] = Field(
        description="collecting: fewer than min_images; alarm: a test fired"
    )
    alarms: list[str] = Field(description="the tests that fired: flag_rate, score_drift, input_drift")
    verdict: str = Field(description="what the reading says, in words")
    level: float = Field(description="each test's level (PADIM_MONITOR_LEVEL)")
    min_images: int
    flag_rate: FlagRateReading | None
    score_drift: ShiftReading | None = Field(description="raw scores against the calibration's out-of-fold scores")
    input_drift: ShiftReading | None = Field(
        description="input distances (mean squared distance over every pixel) "
        "against the training images' out-of-fold ones; null for models "
        "older than format 7 and exports older than version 4"
    )
    window: int = Field(description="images the window holds at most (PADIM_MONITOR_WINDOW)")
    recorded: int = Field(description="images scored since the window was started or reset")
    threshold_overrides: int = Field(description="of them, scored for requests that set their own threshold")
    since: str = Field(description="when the window was started or reset (ISO 8601, UTC)")
    bytes: int = Field(description="memory the window holds")
    threshold: float = Field(description="the model's threshold on the score scale: 0.5")
    raw_threshold: float
    histogram: ScoreHistogram


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable reason, e.g. `invalid_image`, `overloaded`")
    message: str = Field(description="what went wrong and what to do, for people")


class ErrorResponse(BaseModel):
    """Every error the service answers, whatever its status."""

    error: ErrorDetail


class LiveResponse(BaseModel):
    status: str = Field(description="always `alive`")


class ReadyResponse(BaseModel):
    status: str = Field(description="`ready`, or `not_ready` (with status 503)")
    models: list[str] | None = Field(None, description="the served models, when ready")
    reason: str | None = Field(None, description="`loading`, `draining` or `failed: ...`, when not ready")
    lines: dict[str, dict] | None = Field(
        None,
        description="with PADIM_LINES, each line's source state and each sink's connection and outbox: detail only, "
        "a camera or broker that is down never makes the service unready",
    )
    replica: str | None = Field(None, description="this replica's name (PADIM_REPLICA), where it has one")


class LineSource(BaseModel):
    type: Literal["folder", "camera"]
    state: str = Field(description="folder: watching, unreachable; camera: connected, reconnecting, ended, stopped")
    error: str | None = None
    path: str | None = None
    device: str | None = Field(None, description="the camera, stream (without credentials) or video file")
    mode: str | None = None
    frames_read: int | None = None
    reconnects: int | None = None
    dropped: int | None = Field(None, description="frames chosen and dropped because the line was behind")
    triggers_waiting: int | None = None


class LineSink(BaseModel):
    name: str
    type: Literal["mqtt", "webhook", "opcua"]
    connected: bool
    error: str | None = None
    outbox: int = Field(description="verdicts waiting for this sink")
    oldest_s: float | None = Field(None, description="age of the oldest verdict waiting")
    full: bool = Field(description="the outbox is at outbox.max_messages")
    dropped: int = Field(description="verdicts dropped from the full outbox since the start (drop_oldest)")
    topic: str | None = None
    broker: str | None = None
    url: str | None = None
    endpoint: str | None = None
    nodes: int | None = None


class LineState(BaseModel):
    name: str
    model: str | None
    station: str | None
    camera: str | None
    source: LineSource
    paused: str | None = Field(
        None, description="why the line takes no picture now (a full outbox under block, a journal it cannot write)"
    )
    rate: float = Field(description="pictures a second over the last minute")
    in_flight: int
    latency_budget_ms: float
    counts: dict[str, int] = Field(description="since the start: received, scored, flagged, late, rejected, deferred")
    last: dict | None = Field(None, description="the latest verdict message, as the sinks got it")
    sinks: list[LineSink]


class LinesResponse(BaseModel):
    lines: list[LineState]


class TriggerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    part: str | None = Field(None, max_length=256, description="the part id of the frame the trigger scores")


class TriggerResponse(BaseModel):
    line: str
    triggers_waiting: int = Field(description="triggers not yet served, this one included")


class LastPicture(BaseModel):
    message: dict = Field(description="its verdict message")
    heatmap: str = Field(description="the picture with its heat map (PNG, base64), drawn again on request")


class ReviewInfo(BaseModel):
    """One review of a recorded picture (every one is kept; the latest is the record's label)."""

    id: int
    time: str = Field(description="ISO 8601, UTC")
    label: Literal["normal", "defect"]
    defect_type: str | None
    note: str | None
    reviewer: str | None


class RecordRow(BaseModel):
    """One scored picture, as the inspection record keeps it."""

    id: str = Field(description="32 hex digits; ids sort by time")
    time: str = Field(description="when it was scored (ISO 8601, UTC)")
    model: str
    version: int = Field(description="the version that scored and judged it")
    raw_score: float
    score: float
    threshold: float = Field(description="the threshold the request used, on the 0..1 scale")
    raw_threshold: float | None
    is_anomaly: bool
    anomalous_area: float
    input_distance: float | None
    width: int = Field(description="the picture's width as sent (EXIF orientation applied)")
    height: int
    sha256: str = Field(description="sha256 of the picture's bytes as sent (the stored picture's name)")
    picture_bytes: int
    fields: dict[str, str] = Field(description="the client's own fields (part, line, station, camera, ...)")
    part: str | None
    source: str = Field(description="http, or a line source")
    sampled: bool = Field(description="a passed picture drawn into the review queue (PADIM_REVIEW_SAMPLE)")
    label: Literal["normal", "defect"] | None = Field(description="the latest review's label; null: not reviewed")
    reviewed_at: str | None


class RecordDetail(RecordRow):
    reviews: list[ReviewInfo] = Field(description="every review, oldest first")
    picture_kept: bool = Field(description="the picture is stored (false once evicted; the row stays)")
    picture_pinned: bool = Field(description="reviewed or learned from: never evicted")


class RecordsPage(BaseModel):
    records: list[RecordRow] = Field(description="newest first")
    next: str | None = Field(description="the cursor of the next (older) page: pass it as cursor=; null at the end")


class ReviewRequest(BaseModel):
    """What an operator says of a recorded picture."""

    model_config = {"extra": "forbid"}

    label: Literal["normal", "defect"] = Field(
        description="normal: a false alarm (or a right pass), which an update "
        "may learn from; defect: a real defect (or a miss)"
    )
    defect_type: str | None = Field(None, max_length=64, description="scratch, stain, hole, ... (free text)")
    note: str | None = Field(None, max_length=2000)
    reviewer: str | None = Field(None, max_length=128, description="who reviewed it")


class RecordStorage(BaseModel):
    """What the record holds on disk, against its budget (``GET /records/storage``)."""

    database: Literal["sqlite", "postgresql"]
    database_up: bool | None = Field(description="whether the last write to the database succeeded (null: none yet)")
    required: bool = Field(description="PADIM_RECORD_REQUIRED")
    rows: int = Field(description="rows in the database")
    rows_waiting: int = Field(description="rows in the journal the database does not have yet")
    journal_bytes: int
    journal_max_bytes: int
    max_bytes: int = Field(description="PADIM_RECORD_MAX_BYTES: the pictures' budget")
    retention_days: float
    flagged_retention_days: float
    pictures: int = Field(description="pictures stored")
    bytes: int = Field(description="their bytes")
    pinned_pictures: int = Field(description="reviewed or learned from: never evicted, whatever the budget says")
    pinned_bytes: int
    flagged_pictures: int
    flagged_bytes: int
    passed_pictures: int
    passed_bytes: int
    evicted_pictures: int = Field(description="pictures removed by retention or the budget (their rows stay)")


class UpdateRequest(BaseModel):
    """``POST /models/{name}/update``: which pictures the new version learns from."""

    model_config = {"extra": "forbid"}

    records: list[str] | None = Field(
        None,
        max_length=10_000,
        description="record ids to add (each reviewed as "
        "normal); default: every picture of the model reviewed as normal that the "
        "version has not fitted",
    )
    version: int | None = Field(None, ge=1, le=MAX_VERSION, description="the version to update; default the active one")


class LineThresholdRequest(BaseModel):
    """``POST /models/{name}/threshold``: which version's Gaussians, for which rate, from which line pictures."""

    model_config = {"extra": "forbid"}

    version: int | None = Field(
        None, ge=1, le=MAX_VERSION, description="the version whose Gaussians keep scoring; default the active one"
    )
    false_alarm_rate: float | None = Field(
        None,
        ge=FALSE_ALARM_RATE_RANGE[0],
        le=FALSE_ALARM_RATE_RANGE[1],
        description="the rate to promise on the line; default the version's own",
    )
    since: str | None = Field(
        None,
        description="only pictures scored at or after this moment (ISO 8601, UTC unless it says): after a change "
        "on the line, the pictures of the line as it is now",
    )


class LineThreshold(BaseModel):
    """A new version (not active) whose threshold the line's normal pictures set: what it replaces and buys."""

    model: str
    version: int = Field(description="the new version: the same Gaussians, another threshold; not active")
    base_version: int = Field(description="the version whose Gaussians it keeps (and whose pictures set it)")
    proposed: str = Field(description="when (ISO 8601, UTC); what the line scores after it is read at activation")
    line: dict = Field(
        description="the pictures that set it: how many (once each, none reviewed as defect; unreviewed flagged "
        "ones count as normal), how many reviewed normal, the versions that scored them, first and last (epoch s)"
    )
    threshold: dict = Field(description="raw thresholds, `old` and `new`")
    replaces: dict = Field(
        description="the threshold it replaces: method, raw threshold, promised rate, and the cover of changes it "
        "was sized by (expect, fit_changes)"
    )
    calibration: dict = Field(
        description="the rate asked, the rate promised on the line's pictures and its upper bound at `confidence`"
    )
    gate: dict = Field(
        description="recorded scores of reviewed pictures at the old and the new threshold: defects caught (recall), "
        "reviewed normals flagged; `passed` as an update's gate (PADIM_UPDATE_MAX_RECALL_DROP)"
    )


class JobInfo(BaseModel):
    """A model update and how far it got (``GET /jobs/{id}``)."""

    id: str
    model: str
    base_version: int = Field(description="the version it updates")
    state: Literal["queued", "running", "succeeded", "failed"]
    phase: str = Field(description="queued, remove, add, gate, commit, activate, done")
    progress: float = Field(description="0..1")
    created: str
    started: str | None
    finished: str | None
    request: dict
    result: dict | None = Field(
        description="once succeeded: the new version, what it learned (record ids), the "
        "gate (recall on reviewed defects and false alarms, old against new) and whether it "
        "was activated"
    )
    error: str | None
