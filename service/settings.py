"""Service settings, from ``PADIM_*`` environment variables (pydantic-settings) and CLI flags."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from padim.models.choices import DEFAULT_WORKERS

#: Measured on 2-16 core x86 CPUs: throughput per image is flat from batch 8 upwards.
CPU_PREFERRED_BATCH = 8


class ServiceSettings(BaseSettings):
    """Everything ``padim serve`` can be told. Environment: ``PADIM_<NAME>`` (e.g. ``PADIM_API_KEY``)."""

    model_config = SettingsConfigDict(env_prefix="PADIM_", frozen=True, extra="forbid")

    models: list[Path] = Field(
        default_factory=list, description="model files or export directories; the first is the default"
    )
    model_dir: Path | None = Field(
        None, description="serve every *.padim file and export directory (padim export) in this directory (sorted)"
    )
    repository: Path | None = Field(
        None,
        description="a model repository (DIR/NAME/N/...; docs/deployment.md): each "
        "model's active version is served, and versions are uploaded, activated and rolled "
        "back while the service runs (the admin routes, with PADIM_ADMIN_KEY); not with "
        "PADIM_MODELS / PADIM_MODEL_DIR, which serve a fixed set",
    )
    repository_poll_s: float | None = Field(
        None,
        gt=0,
        description="read the repository again every this many seconds "
        "and serve what it says is active (a version copied in, ACTIVE edited); "
        "off by default",
    )
    default_model: str | None = Field(None, description="name (file stem) of the default model")
    api_key: SecretStr | None = Field(None, description="when set, every route but /health/* and /metrics needs it")
    admin_key: SecretStr | None = Field(
        None,
        description="opens the admin routes (upload, activate, roll back, remove, "
        "unload versions) and every other route; without it those routes do not "
        "exist. Must differ from PADIM_API_KEY, which cannot change models",
    )
    max_model_upload_bytes: int = Field(
        8_000_000_000,
        ge=1,
        description="largest model file an upload may carry "
        "(POST /models/{name}/versions; streamed to disk, never held in memory)",
    )
    model_upload_timeout_s: float = Field(3600.0, gt=0, description="a model upload's body must arrive within this")
    workers: int | None = Field(
        None,
        ge=1,
        le=64,
        description="API processes (HTTP, decoding, verdicts) beside one scoring process that owns the device, "
        "sharing the port; 1 runs everything in one process. Default from the CPUs this process may use (its "
        "affinity and a container's CPU limit): 1 on a CPU or with fewer than 4 cores, else one a core but two, "
        "at most 16 (docs/sizing.md)",
    )
    host: str = Field("127.0.0.1", description="address to bind (0.0.0.0 in the Docker image)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where models score; auto: cuda when torch sees a GPU"
    )
    runtime: Literal["auto", "torch", "onnxruntime", "openvino"] = Field(
        "auto",
        description="what runs the scorer; auto: onnxruntime on a CPU when installed (1.2-1.45x torch "
        "there), torch otherwise. .padim files are exported once and cached (PADIM_CACHE_DIR, else beside them)",
    )
    max_batch_size: int = Field(
        32,
        ge=1,
        le=1024,
        description="largest device batch, in backbone inputs: images, or "
        "tiles of a tiled model, whose batches then hold max_batch_size / tiles pictures (each "
        "model is warmed up with the largest batch it will form, so a batch that does not fit "
        "fails at start, not under load)",
    )
    max_device_errors: int = Field(
        3,
        ge=1,
        description="scoring batches failing in a row on the GPU (an error that "
        "splitting the batch did not cure) after which the service reports itself unready "
        "(/health/ready 503), so that an orchestrator restarts it",
    )
    cuda_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="most of the GPU's memory this process "
        "may take (torch.cuda.set_per_process_memory_fraction), to share a GPU",
    )
    max_delay_ms: float = Field(5.0, ge=0, le=10_000, description="longest wait for a batch to fill")
    preferred_batch_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="send a batch once it has this many images; default 8 on CPU (larger batches are no "
        "faster per image there), max_batch_size on CUDA",
    )
    max_queue: int = Field(
        256,
        ge=1,
        description="images per model admitted and waiting for a batch; a request "
        "that would go over gets 503 before its images are decoded, and a batch request with "
        "more images than this (or than max_batch_size) gets 422 batch_too_large",
    )
    request_timeout_s: float = Field(30.0, gt=0, description="a request waiting longer gets 504")
    max_upload_bytes: int = Field(
        20_000_000,
        ge=1,
        description="larger bodies get 413 (the body is read and "
        "discarded up to max_discard_bytes so the client can read the answer)",
    )
    max_discard_bytes: int = Field(
        64_000_000,
        ge=0,
        description="how much of a refused body (or headers) is read and thrown away before the connection is closed",
    )
    max_image_pixels: int = Field(40_000_000, ge=1, description="larger images get 413 (decompression bombs)")
    decode_workers: int = Field(DEFAULT_WORKERS, ge=1, description="threads decoding and resizing images")
    device_decode: Literal["off", "auto", "on"] = Field(
        "off",
        description="JPEGs decoded where the model scores them (nvJPEG on a GPU, batched) when the answer needs no "
        "heat map or mask and the model sees the whole picture: off (the default: a JPEG's raw score then moves "
        "by up to 0.3% against the CPU's decode, measured, and the GPU's speed is not measured yet), auto on a GPU, "
        "on also on a CPU (to check it there)",
    )
    cuda_graphs: bool = Field(
        True,
        description="torch on a GPU: capture the scorer as a CUDA graph for each batch size the batcher forms "
        "(1, 2, 4, 8, every multiple of 8 up to the largest) at warm-up, and replay them (a batch pads to the next "
        "size); checked against eager scoring at capture and dropped, with a warning, if they differ. Nothing on "
        "a CPU or another runtime",
    )
    decode_pixel_budget: int | None = Field(
        None,
        ge=1,
        description="decoded pixels in flight at once across all requests, which bounds decode "
        "memory (Pillow holds 4 bytes a pixel); default twice max_image_pixels: two images at the limit",
    )
    max_header_bytes: int = Field(32_768, ge=1024, description="request line and headers over this get 431")
    max_headers: int = Field(100, ge=1, description="requests with more headers get 431")
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the request line and headers must arrive within this "
        "(else 408, or a silent close if nothing was sent)",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="the body must arrive within this after the headers, else 408"
    )
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")
    max_connections: int = Field(512, ge=1, description="open connections beyond this get 503 too_many_connections")
    heatmap_max_side: int = Field(1024, ge=16, description="heat maps and masks are at most this many pixels wide/high")
    monitor_window: int = Field(
        2000,
        ge=1,
        le=1_000_000,
        description="recent images per model whose raw score and "
        "input distance the monitor keeps (16 bytes each; no image is kept) for GET "
        "/models/{name}/monitor and the padim_monitor_* gauges; per process, lost on restart",
    )
    monitor_level: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="level of each monitor test (flag rate, score drift, "
        "input drift): an alarm when its p-value is below this",
    )
    monitor_min_images: int = Field(30, ge=1, description="images in the window before the monitor's tests are read")
    record_dir: Path | None = Field(
        None,
        description="keep the inspection record here: a row for every scored picture "
        "and the picture's bytes as sent (docs/record.md); SQLite in this folder unless "
        "PADIM_RECORD_URL names a database. Off when neither is set",
    )
    record_url: SecretStr | None = Field(
        None,
        description="the record's database for several replicas: "
        "postgresql://user:password@host/db (pictures and the journal stay in "
        "PADIM_RECORD_DIR, by default $XDG_DATA_HOME/padim/record)",
    )
    replica: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="this process's name among replicas that share one PADIM_RECORD_DIR (a volume) and one "
        "PADIM_RECORD_URL: its journal is then RECORD_DIR/journal/NAME, and a replica adopts the journal of one "
        "that stopped (docs/kubernetes.md); the Helm chart sets it to the pod's name",
    )
    record_max_bytes: int = Field(
        10_000_000_000,
        ge=0,
        description="bytes of stored pictures; past it the oldest "
        "passed pictures are evicted first, then flagged ones (rows stay; reviewed and "
        "learned-from pictures are never evicted)",
    )
    record_retention_days: float = Field(30.0, gt=0, description="passed pictures are evicted after this many days")
    record_flagged_retention_days: float = Field(
        90.0, gt=0, description="flagged pictures are evicted after this many days"
    )
    record_required: bool = Field(
        False,
        description="a score fails with 503 record_unavailable instead of answering "
        "when its row cannot be made durable (the journal is full, or its disk failed): "
        "for lines that must trace every part",
    )
    record_journal_max_bytes: int = Field(
        1_000_000_000,
        ge=1,
        description="rows waiting for the database (down or "
        "slow) are kept in an on-disk journal of at most this many bytes (about "
        "600 bytes a row)",
    )
    record_timeout_s: float = Field(
        10.0,
        gt=0,
        description="with PADIM_RECORD_REQUIRED, how long a score waits for "
        "its row to be durable before it answers 503",
    )
    review_sample: float = Field(
        0.02,
        ge=0,
        le=1,
        description="share of passed pictures put in the review queue "
        "beside the flagged ones (misses are found only there)",
    )
    review_key: SecretStr | None = Field(
        None,
        description="reviews recorded pictures (POST /records/{id}/review) and "
        "reads the record, without the admin key's power over models",
    )
    update_max_recall_drop: float = Field(
        0.02,
        ge=0,
        le=1,
        description="an updated version (POST "
        "/models/{name}/update) whose recall on reviewed defects falls by more "
        "than this share (and by more than one defect) is not activated without "
        "force=true",
    )
    lines: Path | None = Field(
        None,
        description="a lines.yaml (docs/lines.md): hot folders and cameras whose pictures are scored as they "
        "arrive, their verdicts delivered to MQTT, webhooks or OPC UA through on-disk outboxes",
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight requests may take")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="debug, info, warning or error; logs are JSON lines on stderr"
    )

    @model_validator(mode="after")
    def _consistent(self) -> ServiceSettings:
        if (
            self.admin_key is not None
            and self.api_key is not None
            and self.admin_key.get_secret_value() == self.api_key.get_secret_value()
        ):
            raise ValueError("PADIM_ADMIN_KEY must differ from PADIM_API_KEY: the scoring key must not change models")
        if self.repository is not None and (self.models or self.model_dir is not None):
            raise ValueError(
                "serve either a repository (PADIM_REPOSITORY) or a fixed set of models (PADIM_MODELS, "
                "PADIM_MODEL_DIR), not both"
            )
        keys = {
            name: key.get_secret_value()
            for name, key in (
                ("PADIM_API_KEY", self.api_key),
                ("PADIM_ADMIN_KEY", self.admin_key),
                ("PADIM_REVIEW_KEY", self.review_key),
            )
            if key is not None
        }
        if self.review_key is not None and list(keys.values()).count(keys["PADIM_REVIEW_KEY"]) > 1:
            raise ValueError("PADIM_REVIEW_KEY must differ from PADIM_API_KEY and PADIM_ADMIN_KEY")
        if self.replica is not None and not self.record_on:
            raise ValueError("PADIM_REPLICA names a replica's journal in the record: it needs PADIM_RECORD_DIR or _URL")
        if self.repository_poll_s is not None and self.repository is None:
            raise ValueError("PADIM_REPOSITORY_POLL_S needs PADIM_REPOSITORY")
        return self

    @property
    def record_on(self) -> bool:
        return self.record_dir is not None or self.record_url is not None

    def record_folder(self) -> Path:
        """The record's folder: PADIM_RECORD_DIR, or with a database URL alone $XDG_DATA_HOME/padim/record."""
        if self.record_dir is not None:
            return self.record_dir
        return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "padim" / "record"

    def pixel_budget(self) -> int:
        return self.decode_pixel_budget or 2 * self.max_image_pixels

    def batch_limit(self) -> int:
        """Most images one /score/batch request may carry."""
        return min(self.max_batch_size, self.max_queue)

    def batch_preference(self, device_type: str) -> int:
        """The preferred batch size on a device of this type (``cpu`` or ``cuda``)."""
        if self.preferred_batch_size is not None:
            return min(self.preferred_batch_size, self.max_batch_size)
        return min(CPU_PREFERRED_BATCH, self.max_batch_size) if device_type == "cpu" else self.max_batch_size

    def picture_batches(self, device_type: str, tiles: int = 1) -> tuple[int, int]:
        """``(largest, preferred)`` batch of pictures of a model with ``tiles`` tiles a picture: the batch sizes
        count backbone inputs, so a tiled model's batches hold ``1 / tiles`` as many pictures (at least one)."""
        return max(1, self.max_batch_size // tiles), max(1, self.batch_preference(device_type) // tiles)

    def model_files(self) -> list[Path]:
        files = list(self.models)
        if self.model_dir is not None:
            files += sorted(
                p
                for p in self.model_dir.iterdir()
                if (p.suffix == ".padim" and p.is_file()) or (p / "padim.json").is_file()
            )
        return files


@functools.lru_cache
def get_settings() -> ServiceSettings:
    """Settings from the environment, read once (tests override the dependency or clear the cache)."""
    return ServiceSettings()
