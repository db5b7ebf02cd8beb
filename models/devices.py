"""Which device runs what, and the CUDA settings every padim process uses there.

Every ``--device`` / ``PADIM_DEVICE`` goes through here:

- :func:`resolve_device`: ``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda``
  without one is a :class:`~padim.models.errors.UsageError` that says what to check.
- :func:`runtime_device`: the same, per inference runtime. ``auto`` becomes ``cuda`` only where
  that runtime can run on the GPU here: torch when torch sees one, ONNX Runtime when its
  ``CUDAExecutionProvider`` is installed (the ``onnxruntime-gpu`` wheel) as well, OpenVINO never
  (padim runs it on the CPU). An explicit ``cuda`` that the runtime cannot honour is an error,
  never a silent CPU run.
- :func:`configure_cuda`: TF32 off for convolutions and matrix products, so that scores on a GPU
  are within :data:`CROSS_DEVICE_RTOL` of the CPU's and a threshold calibrated on one holds on
  the other; ``cudnn.benchmark`` on (image size fixed, so each batch size is tuned once).

This module reads the state of the machine (``torch.cuda``, the installed ONNX Runtime); the
decisions are pure functions of what it read, tested with that state patched.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from padim.models.choices import DEVICES
from padim.models.errors import UsageError

log = logging.getLogger(__name__)

#: Largest relative difference allowed between image scores of one model on a CPU and on a GPU
#: (TF32 off; float32 sums in another order). The CUDA suite (tests/cuda) checks it wherever a
#: GPU is; a threshold is moved by at most this much, so only images within this distance of it
#: can change verdict.
CROSS_DEVICE_RTOL = 1e-4

#: Compute capabilities whose float64 rate is half of float32 or better (P100, V100, A100/A30,
#: H100/H200, B200): there the fit's float64 finish belongs on the GPU. Others (T4 7.5, A10/A40/
#: RTX 30 8.6, L4/L40/RTX 40 8.9, RTX 50 12.0) run float64 at 1/32-1/64 of float32.
FULL_FLOAT64 = frozenset({(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)})


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without a GPU is an error.

    A CUDA device chosen here gets :func:`configure_cuda` (TF32 off, cudnn autotuning on).

    Raises:
        UsageError: an unknown device, or ``cuda`` where torch sees no GPU.
    """
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "check the NVIDIA driver (nvidia-smi) and, in Docker, --gpus all; or use --device cpu"
        )
    if device == "cuda":
        configure_cuda()
    return torch.device(device)


def precision_device(device: str, precision: str) -> torch.device:
    """:func:`resolve_device` for a backbone at ``precision``: an int8 backbone's ``auto`` is the CPU (ONNX Runtime's
    int8 kernels), whatever GPU there is."""
    return resolve_device("cpu" if precision == "int8" and device == "auto" else device)


def onnxruntime_has_cuda() -> bool:
    """Whether the installed ONNX Runtime has its CUDA provider (``onnxruntime-gpu``)."""
    try:
        import onnxruntime  # optional extra: is it installed, and which wheel?
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def runtime_device(runtime: str, device: str) -> torch.device:
    """The device ``runtime`` (``torch``, ``onnxruntime`` or ``openvino``) runs on for ``--device device``.

    ``auto``: CUDA only where this runtime can use the GPU here (module docstring); the choice
    is logged with its reason.

    Raises:
        UsageError: ``cuda`` asked for a runtime that cannot run on it here.
    """
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if runtime == "torch":
        return resolve_device(device)
    if runtime == "openvino":
        if device == "cuda":
            raise UsageError(
                "--runtime openvino runs on the CPU in padim; use --device cpu, or --runtime torch for the GPU"
            )
        return torch.device("cpu")
    if runtime != "onnxruntime":
        raise UsageError(f"no device rule for runtime {runtime!r}")
    gpu = torch.cuda.is_available()
    provider = onnxruntime_has_cuda()
    if device == "cuda":
        if not provider:
            raise UsageError(
                "--device cuda with --runtime onnxruntime needs the onnxruntime-gpu wheel (the installed "
                "onnxruntime has no CUDAExecutionProvider); or use --runtime torch on the GPU"
            )
        return resolve_device("cuda")
    if device == "auto" and gpu and provider:
        log.debug("device auto: cuda for onnxruntime (CUDAExecutionProvider installed)")
        return resolve_device("cuda")
    if device == "auto" and gpu:
        log.info(
            "device auto: cpu for onnxruntime: this onnxruntime has no CUDAExecutionProvider "
            "(install onnxruntime-gpu, or serve the .padim file with --runtime torch to use the GPU)"
        )
    return torch.device("cpu")


def configure_cuda() -> None:
    """TF32 off (convolutions and matrix products in true float32) and cudnn autotuning on.

    TF32 convolutions (cuDNN's default) move features by about 1e-3 relative, more than
    :data:`CROSS_DEVICE_RTOL`: a model calibrated on a CPU would lose its threshold's promise on a
    GPU and the reverse. It costs convolution speed on Ampere and newer (see docs/gpu.md).
    """
    # The flags every torch reads: torch 2.14's newer fp32_precision = "ieee" would make any later
    # read of cudnn.allow_tf32 (torch.backends.cudnn.flags() does one) raise, as a mix of the two APIs.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True


def float64_is_slow(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Whether ``device`` is a GPU that runs float64 at 1/32-1/64 of its float32 rate (not in :data:`FULL_FLOAT64`).

    The fit's finish (comoment, Cholesky, triangular inverse, out-of-fold corrections) is float64
    and stays where the statistics are; on such a GPU it runs about as fast as a 16-core host
    would (docs/gpu.md has the calculation), and ``padim train`` says so before pass 1.
    """
    if device.type != "cuda":
        return False
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return tuple(capability) not in FULL_FLOAT64


def is_cuda_error(error: BaseException) -> bool:
    """Whether ``error`` comes from the CUDA device (out of memory, a launch failure, a lost GPU)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(error, accelerator):
        return True
    return isinstance(error, RuntimeError) and ("CUDA" in str(error) or "cuDNN" in str(error) or "CUBLAS" in str(error))


def probe(device: torch.device) -> None:
    """A tiny operation on ``device``, waited for: raises when the GPU is in an error state."""
    if device.type != "cuda":
        return
    value = torch.ones(8, device=device).sum()
    torch.cuda.synchronize(device)
    if float(value) != 8.0:
        raise RuntimeError(f"CUDA probe on {device} gave {float(value)} for 8.0")


#: CPU flags (``/proc/cpuinfo``) of native arithmetic at each reduced precision.
CPU_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
#: Lowest CUDA compute capability with bfloat16 arithmetic (Ampere).
BF16_CAPABILITY = (8, 0)
_told_slow: set[str] = set()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` cannot be read), read once a process: every model load
    asks (``--runtime auto``'s reason), and they do not change."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


#: CPU features the runtimes' fast paths use, in the order :func:`cpu_features` names them: 256- and 512-bit
#: vectors, int8 dot products (VNNI), bfloat16 and float16 vector arithmetic, and AMX's bfloat16 and int8 tiles.
RUNTIME_CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx_vnni",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
)


def cpu_features(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """Which of :data:`RUNTIME_CPU_FLAGS` this CPU has (``flags``: :func:`cpu_flags` by default); empty where
    ``/proc/cpuinfo`` cannot be read or none is there (an ARM CPU, an old x86 one)."""
    found = cpu_flags() if flags is None else flags
    return tuple(flag for flag in RUNTIME_CPU_FLAGS if flag in found)


def check_precision(precision: str, device: torch.device, capability: tuple[int, int] | None = None) -> None:
    """Whether ``device`` runs the backbone at ``precision`` (``train --precision``).

    A GPU older than Ampere has no bfloat16: an error that names what it runs. A CPU without native arithmetic at
    ``precision`` computes it correctly, emulated and slower than float32: said once a process (a warning).

    Raises:
        UsageError: bf16 on a GPU older than Ampere.
    """
    if precision == "fp32":
        return
    if precision == "int8":
        if device.type == "cuda":
            raise UsageError(
                "an int8 backbone runs on the CPU (ONNX Runtime's int8 kernels): use --device cpu; for a GPU fit "
                "and score at --precision bf16 or fp16"
            )
        return  # faster than float32 wherever ONNX Runtime has int8 kernels (AVX2 and up, ARM's dot products)
    if device.type == "cuda":
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        if precision == "bf16" and tuple(capability) < BF16_CAPABILITY:
            raise UsageError(
                f"this GPU (compute capability {capability[0]}.{capability[1]}) has no bfloat16: it runs fp16 and "
                "fp32; fit with --precision fp16 or fp32, or score this bf16 model with --device cpu"
            )
        return
    if not set(CPU_FLAGS[precision]) & cpu_flags():  # /proc/cpuinfo read once
        if precision not in _told_slow:
            _told_slow.add(precision)
            log.warning(
                "this CPU has no native %s arithmetic (%s): the %s backbone scores correctly, emulated, slower than "
                "fp32 here",
                precision,
                " or ".join(CPU_FLAGS[precision]),
                precision,
            )


#: CPU flags of int8 dot products (VNNI) and of the matrix units (AMX) that ``--precision auto`` looks for.
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: x86 CPUs where ONNX Runtime's int8 kernels beat its float32 ones (measured on AVX2 alone, docs/quantisation.md).
INT8_BASE_FLAGS = ("avx2",)


def choose_precision(device: torch.device, capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """``train --precision auto``: the backbone's arithmetic for a fit on ``device``, and why in a few words.

    bf16 on a GPU with bfloat16 (Ampere and newer) and on a CPU with AMX; int8 on a CPU with AVX2 or VNNI where ONNX
    Runtime is installed; fp32 otherwise (the one precision whose scores agree on a CPU and a GPU within 1e-4).
    """
    if device.type == "cuda":
        capability = capability or torch.cuda.get_device_capability(device)
        if tuple(capability) >= BF16_CAPABILITY:
            return "bf16", f"a GPU with bfloat16 (compute capability {capability[0]}.{capability[1]})"
        return "fp32", f"a GPU without bfloat16 (compute capability {capability[0]}.{capability[1]})"
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "bf16", "a CPU with AMX (bfloat16 matrix units)"
    fast = int8_flag(flags)
    if fast is None:
        return "fp32", "a CPU without int8 dot products (no AVX2, VNNI or AMX)"
    if not onnxruntime_installed():
        return "fp32", f"a CPU with {fast}, but ONNX Runtime (the int8 kernels) is not installed"
    return "int8", f"a CPU with {fast} and ONNX Runtime installed"


def int8_flag(flags: frozenset[str] | None = None) -> str | None:
    """The first flag of this CPU's (``flags``: :func:`cpu_flags` by default) whose int8 kernels ONNX Runtime runs
    faster than float32 (VNNI, AMX, or AVX2 alone: measured, docs/quantisation.md); ``None``: none (an ARM CPU, an
    old x86 one)."""
    found = cpu_flags() if flags is None else flags
    return next((f for f in (*INT8_FLAGS, *INT8_BASE_FLAGS) if f in found), None)


def onnxruntime_installed() -> bool:
    """Whether ONNX Runtime can be imported and the ONNX exporter (the ``onnxruntime`` extra) is installed: found, not
    imported (0.1-0.25 s, which a fit whose float graph is kept, or a scorer, never needs)."""
    try:
        import onnxruntime  # noqa: F401 (an optional extra: is it installed?)
    except ImportError:
        return False
    return importlib.util.find_spec("onnxscript") is not None


def usable_cpus() -> int:
    """Cores this process may use: its affinity, bounded by a cgroup's CPU quota (a container's CPU limit)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        limit, every = open("/sys/fs/cgroup/cpu.max").read().split()  # cgroup v2
        if limit != "max":
            cpus = min(cpus, max(1, int(int(limit) / int(every))))
    except (OSError, ValueError):
        try:  # cgroup v1
            quota = int(open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read())
            period = int(open("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read())
            if quota > 0:
                cpus = min(cpus, max(1, quota // period))
        except (OSError, ValueError):
            pass
    return cpus
