"""What a fit will cost, said before it starts: memory by part, the device's free memory, the spool's disk.

``padim train`` prints a :class:`FitPlan` before pass 1 and refuses, with the options that would
fit, a fit that would not (:func:`check`), instead of dying in the middle. The parts:

- **statistics**: the packed float64 comoment ``P D (D + 1) / 2 * 8`` bytes and the means (``P``
  times the tiles with ``--tiles`` and a Gaussian per tile position: ``tile_statistics``). A
  fit with a spool forms the comoment slice by slice after pass 1 (and not at all for a
  ``--slim`` file); without a spool it is streamed during pass 1.
- **finish**: one slice's float64 buffers (comoment, Cholesky factor, inverse; see
  :data:`SLICE_BYTES`), a block of embeddings and the out-of-fold
  distances of every image (``N P`` float32; twice with ``expect``: its changed copy's too).
- **spool** (disk, or a GPU's memory where it fits there: :func:`spool_in_memory`): every picture's embeddings,
  and its changed copy's with ``expect``.
- **backbone**: its weights (kept, and folded for inference) and one batch's activations (every
  tile of every picture of the batch, and on a GPU of their changed copies with ``expect``: one call): the
  family's measured factor over the bytes of its stem's and stages' outputs
  (:attr:`~padim.models.families.BackboneSpec.activation_factor`: 162 B/px on resnet18, 710 on wide_resnet50_2).
  A fit that makes the int8 scorer runs ONNX Runtime sessions beside it, each with a batch's activations: the int8
  backbone's, and for a new fit on a CPU the float32 graph's that pass 1 runs (its weights too). Measured at 200
  pictures, resnet18, 224 px (2-core Zen 4 VM): peak RSS 1.64-1.66 GB with both, 1.51-1.53 GB with the int8 one
  alone.
- **process**: torch itself (673 MB resident after ``import torch, torchvision``, CUDA build) and
  what the process keeps besides (:data:`PROCESS_BYTES`).

Example:
    >>> from padim.models.config import PadimConfig
    >>> plan = plan_fit(PadimConfig(backbone="wide_resnet50_2", weights="random"), FitFacts(images=40, spool=True))
    >>> round(plan.statistics / 1e9, 2)                               # the packed comoment, float64 (GB)
    3.83
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from padim.core.packing import packed_length
from padim.core.spool import EmbeddingSpool, free_disk
from padim.models.config import PadimConfig
from padim.models.errors import DiskFull
from padim.models.errors import DoesNotFit as DoesNotFit  # re-exported: raised here
from padim.models.features.backbones import network
from padim.models.features.embedding import grid_shape

GB = 2**30

# What the finish works on at once (the fit in progress reads these; the plan counts them).
#: Bytes of one ``(c, D, D)`` float64 buffer of the finish: sets the pixels per slice. Three or
#: four such buffers are alive at once.
SLICE_BYTES = {"cpu": 32 * 2**20, "cuda": 256 * 2**20}
#: Bytes of float64 embeddings worked on at once within a slice (spool rows, fold blocks).
BLOCK_BYTES = 16 * 2**20
#: Bytes of embeddings held in memory per group when the calibration must embed images again.
REEMBED_GROUP_BYTES = 512 * 2**20
#: Bytes of held batches added to the in-memory statistics at once (no spool).
UPDATE_BLOCK_BYTES = 256 * 2**20
#: Resident memory besides the parts: the interpreter with torch and torchvision imported (CUDA
#: build: 673 MB measured), padim's modules, the decoding threads and what the allocator keeps after
#: pass 1 (resnet18 at 224 px: 873 MB resident after pass 1, of which 160 MB are backbone). On a GPU:
#: the CUDA context.
PROCESS_BYTES = {"cpu": 850 * 2**20, "cuda": 500 * 2**20}
#: Disk left free beside the spool and the factors.
DISK_RESERVE = GB
#: A spool waits in a GPU's memory when the plan, the spool and :data:`DEVICE_RESERVE` fit in this share of its free
#: memory: the plan's parts are estimates, and the caching allocator and cuDNN's workspaces take theirs.
DEVICE_SHARE = 0.85
DEVICE_RESERVE = GB


@dataclass(frozen=True)
class FitPlan:
    """Bytes a fit needs, by part, on its device, and the disk its spool takes.

    Attributes:
        device: ``cpu`` or ``cuda``.
        statistics, finish, backbone, process: memory (see the module docstring).
        spool: bytes of pass 1's embeddings (0 without a spool): on disk, or in the device's memory.
        factors: disk bytes of the float32 precision factors waiting for the file.
        spool_held: the spool waits in the device's memory (:func:`spool_in_memory`), counted in :attr:`total`.
    """

    device: str
    statistics: int
    finish: int
    backbone: int
    process: int
    spool: int
    factors: int
    spool_held: bool = False

    @property
    def total(self) -> int:
        return self.statistics + self.finish + self.backbone + self.process + (self.spool if self.spool_held else 0)

    def describe(self, free: int | None) -> str:
        """One line: the total, its parts and the free memory."""
        parts = (
            f"statistics {_gb(self.statistics)}, finish {_gb(self.finish)}, backbone {_gb(self.backbone)}, "
            f"process {_gb(self.process)}" + (f", embeddings {_gb(self.spool)}" if self.spool_held else "")
        )
        room = f" of {_gb(free)} free" if free is not None else ""
        return f"needs about {_gb(self.total)} on the {self.device.upper()}{room} ({parts})"


@dataclass(frozen=True)
class FitFacts:
    """What a fit does beyond its configuration: said once, and handed whole to its plan, its check and its errors.

    Attributes:
        images: pictures this run fits.
        spool: pass 1's embeddings wait on disk (else the statistics are streamed in memory).
        with_statistics: the file keeps the statistics (``False``: ``--slim``; no comoment is formed, given a spool).
        resume: statistics are read from a file (they are then held whatever ``with_statistics``).
        int8_scorer: the fit makes the model's int8 scorer (ONNX Runtime's sessions beside the backbone).
    """

    images: int
    spool: bool
    with_statistics: bool = True
    resume: bool = False
    int8_scorer: bool = False


def plan_fit(config: PadimConfig, facts: FitFacts, device: str | None = None) -> FitPlan:
    """The memory a fit will need (see the module docstring); ``device``: ``cpu`` or ``cuda`` (default: the
    config's, resolved)."""
    images, spool = facts.images, facts.spool
    device = device or (
        "cuda" if config.run.device == "cuda" or (config.run.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    spec = config.spec
    rows, cols = grid_shape(config)
    tiles, per_image = config.tile_count, config.rows_per_image  # a picture's tiles; its rows in the statistics
    pixels, dim = rows * cols * tiles // per_image, config.embedding_dim_or_default()
    spooled = config.spooled_rows_per_picture  # its rows in the spool: with its changed copy's (expect)
    held = facts.with_statistics or not spool or facts.resume
    statistics = (pixels * packed_length(dim) * 8 + 2 * pixels * dim * 8) if held else 2 * pixels * dim * 8
    slice_pixels = max(1, min(pixels, SLICE_BYTES[device] // (8 * dim * dim)))
    finish = 4 * slice_pixels * dim * dim * 8 + 4 * BLOCK_BYTES + images * spooled * pixels * 4
    deepest = max(spec.stages.index(layer) for layer in config.features.stages)
    outputs = [*spec.stem, *zip(spec.channels[: deepest + 1], spec.strides, strict=False)]  # (channels, stride)
    per_pixel = 4 * sum(c / s**2 for c, s in outputs)
    through = 2 if config.gaussian.expect and device == "cuda" else 1  # on a GPU, pictures and copies: one call
    activations = int(
        spec.activation_factor * per_pixel * config.features.image_size**2 * config.run.batch_size * tiles * through
    )
    # without a spool: float64 slices and held batches; with expect, a batch's copies beside it
    embedding = (
        config.run.batch_size
        * tiles
        * rows
        * cols
        * dim
        * 4
        * (1 if spool else 3)
        * (2 if config.gaussian.expect else 1)
    )
    update = 0 if spool else max(UPDATE_BLOCK_BYTES, REEMBED_GROUP_BYTES)  # held batches, or a group embedded again
    # the int8 scorer's sessions (on the CPU, whatever the fit's device: a batch of pictures, then one of their
    # copies): the int8 backbone's, and for a new fit on a CPU the float32 graph's (Fit.prepare_int8_scorer: a
    # resumed model's graph comes without it)
    batch = activations // through
    graph = device == "cpu" and not facts.resume
    sessions = (batch + (batch + _weights_bytes(config) if graph else 0)) * facts.int8_scorer
    backbone = 2 * _weights_bytes(config) + activations + embedding + update + sessions
    return FitPlan(
        device,
        statistics,
        finish,
        backbone,
        PROCESS_BYTES[device],
        EmbeddingSpool.size(images * spooled, pixels, dim) if spool else 0,
        factor_bytes(pixels, dim),
    )


def free_memory(device: str) -> int | None:
    """Bytes free for this process on ``device``: ``MemAvailable`` (and the cgroup's limit) or the GPU's free memory."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_room()
    if limit is not None:
        available = limit if available is None else min(available, limit)
    return available


def spool_in_memory(plan: FitPlan, free: int | None) -> bool:
    """Whether pass 1's spool (``plan`` with one) waits in the GPU's memory: on a GPU, when everything the plan
    counts, the spool and :data:`DEVICE_RESERVE` fit in :data:`DEVICE_SHARE` of ``free``. There the finish reads it
    back without the disk, and pass 1 appends a batch without waiting for its copy to the host. A CPU's spool stays
    on disk: a fit's memory on a CPU does not grow with its pictures."""
    if plan.device != "cuda" or free is None or not plan.spool:
        return False
    return plan.total + plan.spool + DEVICE_RESERVE <= free * DEVICE_SHARE


def factor_bytes(pixels: int, dim: int) -> int:
    """Bytes of the float32 precision factors a fit keeps in its scratch file: a packed triangle a pixel."""
    return pixels * packed_length(dim) * 4


def spool_fits(directory: Path, rows: int, pixels: int, dim: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``rows`` rows of embeddings (kept in ``dtype``) and the float32 factors fit in ``directory``'s free
    disk."""
    needed = EmbeddingSpool.size(rows, pixels, dim, dtype) + factor_bytes(pixels, dim) + DISK_RESERVE
    return free_disk(directory) >= needed


def check_disk(directory: Path, pixels: int, dim: int) -> None:
    """Before pass 1: the float32 factors wait in a scratch file in ``directory`` until the model file is written
    there. A disk without room for them fails the fit now (:class:`DiskFull`), not once its pictures are read."""
    needed, free = factor_bytes(pixels, dim), free_disk(directory)
    if free < needed:
        raise DiskFull(
            f"{directory}: {free / 2**20:.1f} MiB free, and the fit's precision factors need "
            f"{needed / 2**20:.1f} MiB there before the model file is written; free space, or write the output "
            "elsewhere"
        )


def check(config: PadimConfig, plan: FitPlan, free: int | None, facts: FitFacts) -> None:
    """Raise :class:`DoesNotFit` naming the options that would fit, when ``plan`` exceeds ``free``."""
    if free is None or plan.total <= free:
        return
    advice = "; ".join(_alternatives(config, plan, free, facts)) or "a machine with more memory"
    raise DoesNotFit(f"this fit {plan.describe(free)}, so it would run out of memory; what would fit: {advice}")


def ran_out(config: PadimConfig, plan: FitPlan, free: int | None, facts: FitFacts) -> DoesNotFit:
    """The error for a fit that ran out of GPU memory although its plan fitted: what to try, smallest change first.

    The plan's parts are estimates and other processes may hold the GPU's memory; the options
    named are those whose plan fits in three quarters of this one.
    """
    options = []
    if config.run.batch_size > 1:
        options.append(f"--batch-size {max(1, config.run.batch_size // 2)} (the backbone's activations)")
    options += _alternatives(config, plan, plan.total * 3 // 4, facts)
    room = f"; {_gb(free)} was free before it started" if free is not None else ""
    where = "GPU" if plan.device == "cuda" else "CPU"
    others = "; other processes on the GPU take from it too" if plan.device == "cuda" else ""
    return DoesNotFit(
        f"the {where} ran out of memory during the fit (its plan: {_gb(plan.total)}{room}{others}); "
        f"try: {'; '.join(options)}"
    )


def _alternatives(config: PadimConfig, plan: FitPlan, free: int, facts: FitFacts) -> list[str]:
    """Options (as flags, with their totals) whose plan fits in ``free``: smaller image, fewer dims, no int8 scorer,
    --slim, CPU."""

    def fits(changed: PadimConfig, changed_facts: FitFacts = facts) -> int | None:
        total = plan_fit(changed, changed_facts, plan.device).total
        return total if total <= free else None

    options = []
    spec = config.spec
    multiple = max(16, max(spec.stride_of(layer) for layer in config.features.stages))
    for size in range(config.features.image_size - multiple, 2 * multiple - 1, -multiple):
        try:
            total = fits(config.replace(image_size=size))
        except ValueError:
            continue
        if total is not None:
            options.append(f"--image-size {size} ({_gb(total)})")
            break
    dim = config.embedding_dim_or_default()
    for fewer in sorted({d for d in (dim * 3 // 4, dim // 2, dim // 4, 100, 50) if 1 <= d < dim}, reverse=True):
        total = fits(config.replace(embedding_dim=fewer))
        if total is not None:
            options.append(f"--embedding-dim {fewer} ({_gb(total)})")
            break
    if config.tile_count > 1 and config.framing.tile_statistics == "position" and not facts.resume:
        total = fits(config.replace(tile_statistics="shared"))
        if total is not None:  # the statistics of one tile instead of one per tile position
            options.append(
                f"--tile-statistics shared (one set of statistics for every tile: uniform surfaces; {_gb(total)})"
            )
    if facts.int8_scorer:
        total = fits(config.replace(int8_scorer=False), dataclasses.replace(facts, int8_scorer=False))
        if total is not None:
            options.append(f"--no-int8-scorer (no ONNX Runtime sessions beside the backbone; {_gb(total)})")
    if facts.with_statistics and facts.spool and not facts.resume:
        total = fits(config, dataclasses.replace(facts, with_statistics=False))
        if total is not None:
            options.append(f"--slim (no statistics in the file; {_gb(total)})")
    if plan.device == "cuda":
        cpu_free = free_memory("cpu")
        total = plan_fit(config, facts, device="cpu").total
        if cpu_free is not None and total <= cpu_free:
            options.append(f"--device cpu ({_gb(total)} of {_gb(cpu_free)} free)")
    return options


def _weights_bytes(config: PadimConfig) -> int:
    """Parameters of the backbone's used stages, counted on a meta-device model (nothing allocated)."""
    with torch.device("meta"):
        model = network(config.features.backbone)
    keys = set(config.spec.used_keys(model.state_dict().keys(), config.features.stages))
    return sum(t.numel() * 4 for k, t in model.state_dict().items() if k in keys)


def _cgroup_room() -> int | None:
    """Bytes left under a cgroup v2 memory limit (a container's), or ``None`` without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _gb(nbytes: int) -> str:
    """Decimal units, as disks and the docs count them: 1 GB = 10^9 bytes."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.0f} MB"
