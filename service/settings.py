"""Service settings, from ``PADIM_*`` environment variables (pydantic-settings) and CLI flags."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


#: Measured on 2-16 core x86 CPUs: throughput per image is flat from batch 8 upwards.
CPU_PREFERRED_BATCH = 8


class ServiceSettings(BaseSettings):
    """Everything ``padim serve`` can be told. Environment: ``PADIM_<NAME>`` (e.g. ``PADIM_API_KEY``)."""

    model_config = SettingsConfigDict(env_prefix="PADIM_", frozen=True, extra="forbid")

    models: list[Path] = Field(default_factory=list, description="model files; the first is the default")
    model_dir: Path | None = Field(None, description="serve every *.padim file in this directory (sorted)")
    default_model: str | None = Field(None, description="name (file stem) of the default model")
    api_key: SecretStr | None = Field(None, description="when set, every route but /health/* and /metrics needs it")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = Field(32, ge=1, le=1024, description="largest device batch")
    max_delay_ms: float = Field(5.0, ge=0, le=10_000, description="longest wait for a batch to fill")
    preferred_batch_size: int | None = Field(
        None, ge=1, le=1024,
        description="send a batch once it has this many images; default 8 on CPU (larger batches are no "
        "faster per image there), max_batch_size on CUDA")
    max_queue: int = Field(256, ge=1, description="queued images per model before 503")
    request_timeout_s: float = Field(30.0, gt=0, description="a request waiting longer gets 504")
    max_upload_bytes: int = Field(20_000_000, ge=1, description="larger bodies get 413, before being read")
    max_image_pixels: int = Field(40_000_000, ge=1, description="larger images get 413 (decompression bombs)")
    decode_workers: int = Field(2, ge=1, description="threads decoding and resizing images")
    heatmap_max_side: int = Field(1024, ge=16, description="heat maps and masks are at most this many pixels wide/high")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight requests may take")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    def batch_preference(self, device_type: str) -> int:
        """The preferred batch size on a device of this type (``cpu`` or ``cuda``)."""
        if self.preferred_batch_size is not None:
            return min(self.preferred_batch_size, self.max_batch_size)
        return min(CPU_PREFERRED_BATCH, self.max_batch_size) if device_type == "cpu" else self.max_batch_size

    def model_files(self) -> list[Path]:
        files = list(self.models)
        if self.model_dir is not None:
            files += sorted(self.model_dir.glob("*.padim"))
        return files


@functools.lru_cache
def get_settings() -> ServiceSettings:
    """Settings from the environment, read once (tests override the dependency or clear the cache)."""
    return ServiceSettings()
