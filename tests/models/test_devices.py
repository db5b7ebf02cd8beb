"""Which device runs what: the decisions, with the machine's state (GPU, ONNX Runtime providers) patched.

These run on any machine; tests/cuda checks the same paths on a real GPU.
"""

from __future__ import annotations

import pytest
import torch

from padim.models import devices
from padim.models.deploy.runtimes import TENSORRT_MAX_BATCH, onnxruntime_providers
from padim.models.devices import float64_is_slow, is_cuda_error, resolve_device, runtime_device
from padim.models.errors import ExportError, UsageError


@pytest.fixture
def machine(monkeypatch):
    """Set what this machine seems to have: ``machine(gpu=..., ort_cuda=...)``; CUDA settings are not touched."""
    configured = []
    monkeypatch.setattr(devices, "configure_cuda", lambda: configured.append(True))

    def set_up(gpu: bool, ort_cuda: bool = False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setattr(devices, "onnxruntime_has_cuda", lambda: ort_cuda)
        return configured

    return set_up


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_is_the_gpu_when_torch_sees_one(machine, gpu):
    configured = machine(gpu)
    assert resolve_device("auto") == torch.device("cuda" if gpu else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert configured == ([True] if gpu else [])  # TF32 off and cudnn tuning, on the GPU only


def test_cuda_without_a_gpu_is_a_usage_error_that_says_what_to_check(machine):
    machine(gpu=False)
    with pytest.raises(UsageError, match=r"torch sees no CUDA device.*nvidia-smi.*--gpus all.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(UsageError, match="choose one of auto, cpu, cuda"):
        resolve_device("gpu")


@pytest.mark.parametrize(
    ("gpu", "ort_cuda", "expected"),
    [(False, False, "cpu"), (True, False, "cpu"), (True, True, "cuda"), (False, True, "cpu")],
)
def test_onnxruntime_auto_takes_the_gpu_only_with_its_cuda_provider(machine, gpu, ort_cuda, expected):
    machine(gpu, ort_cuda)
    assert runtime_device("onnxruntime", "auto").type == expected
    assert runtime_device("onnxruntime", "cpu").type == "cpu"


def test_onnxruntime_on_cuda_without_onnxruntime_gpu_is_refused(machine):
    machine(gpu=True, ort_cuda=False)
    with pytest.raises(UsageError, match="needs the onnxruntime-gpu wheel"):
        runtime_device("onnxruntime", "cuda")


@pytest.mark.parametrize("gpu", [False, True])
def test_openvino_runs_on_the_cpu_and_refuses_cuda(machine, gpu):
    machine(gpu, ort_cuda=True)
    assert runtime_device("openvino", "auto").type == "cpu"
    with pytest.raises(UsageError, match="--runtime openvino runs on the CPU"):
        runtime_device("openvino", "cuda")


def test_torch_follows_torch(machine):
    machine(gpu=True, ort_cuda=False)
    assert runtime_device("torch", "auto").type == "cuda"
    machine(gpu=False)
    assert runtime_device("torch", "auto").type == "cpu"


def test_onnxruntime_providers_cuda_first_and_tensorrt_only_when_asked(tmp_path):
    available = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert onnxruntime_providers(available, torch.device("cpu"), 224, None) == ["CPUExecutionProvider"]
    plain = onnxruntime_providers(available, torch.device("cuda", 1), 224, None)
    assert [p if isinstance(p, str) else p[0] for p in plain] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert plain[0][1]["device_id"] == 1 and plain[0][1]["use_tf32"] == 0
    cache = tmp_path / "engines"
    with_trt = onnxruntime_providers(available, torch.device("cuda"), 224, str(cache))
    name, options = with_trt[0]
    assert name == "TensorrtExecutionProvider" and options["trt_engine_cache_path"] == str(cache) and cache.is_dir()
    assert options["trt_profile_min_shapes"] == "images:1x3x224x224"
    assert options["trt_profile_max_shapes"] == f"images:{TENSORRT_MAX_BATCH}x3x224x224"
    with pytest.raises(ExportError, match="needs onnxruntime-gpu"):
        onnxruntime_providers(["CPUExecutionProvider"], torch.device("cuda"), 224, None)


@pytest.mark.parametrize(
    ("capability", "slow"),
    [
        ((7, 5), True),
        ((8, 6), True),
        ((8, 9), True),
        ((12, 0), True),
        ((7, 0), False),
        ((8, 0), False),
        ((9, 0), False),
    ],
)
def test_float64_rate_by_compute_capability(capability, slow):
    """T4 7.5, A10 8.6, L4 8.9, RTX 50 12.0 are slow at float64; V100 7.0, A100 8.0, H100 9.0 are not."""
    assert float64_is_slow(torch.device("cuda"), capability) is slow
    assert float64_is_slow(torch.device("cpu")) is False


def test_what_counts_as_a_cuda_error():
    assert is_cuda_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_cuda_error(RuntimeError("shape mismatch"))
    assert not is_cuda_error(ValueError("CUDA"))


def test_configure_cuda_turns_tf32_off_and_cudnn_tuning_on():
    flags = torch.backends.cudnn
    before = (flags.allow_tf32, torch.backends.cuda.matmul.allow_tf32, flags.benchmark)
    try:
        flags.allow_tf32 = True  # cuDNN's default for convolutions
        devices.configure_cuda()
        assert flags.allow_tf32 is False and torch.backends.cuda.matmul.allow_tf32 is False
        assert flags.conv.fp32_precision != "tf32" and torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert flags.benchmark is True
        with torch.backends.cudnn.flags(enabled=True):  # torch's own readers of the flags still work
            pass
    finally:
        flags.allow_tf32, torch.backends.cuda.matmul.allow_tf32, flags.benchmark = before


def test_the_probe_is_nothing_on_a_cpu_and_refuses_a_wrong_sum_on_a_gpu(monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the probe ran an operation on a CPU")

    with monkeypatch.context() as patched:
        patched.setattr(torch, "ones", no_work)
        patched.setattr(torch.cuda, "synchronize", no_work)
        assert devices.probe(torch.device("cpu")) is None
    # a GPU in an error state that computes a wrong sum (its tensor and its wait stood in for on the CPU)
    monkeypatch.setattr(torch, "ones", lambda n, device: torch.full((n,), 7.0 / 8))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    with pytest.raises(RuntimeError, match="gave 7.0 for 8.0"):
        devices.probe(torch.device("cuda"))


def test_cpu_features_names_the_runtime_flags_in_order_from_the_cpuinfo_flags(monkeypatch):
    zen4 = frozenset("fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 avx512vl".split())
    assert devices.cpu_features(zen4) == ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
    sapphire = frozenset("avx2 avx512f avx512_vnni avx_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8".split())
    assert devices.cpu_features(sapphire) == devices.RUNTIME_CPU_FLAGS
    assert devices.cpu_features(frozenset({"fp", "asimd", "asimddp"})) == ()  # an ARM CPU: none of them
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert devices.cpu_features() == ("avx2",)  # read from this machine by default
