"""The Mahalanobis step alone, in every runtime and arithmetic it could run in: time at batch 1 and 16, bytes of
factors it reads, and its error against float64.

The step is ``||W_p (x_p - mu_p)||^2`` for each of ``P`` positions (56 x 56 = 3,136 at 224 px) with its own
lower-triangular ``D x D`` factor ``W_p`` (D = 100): at batch 1 a matrix-vector product a position, which reads every
factor once (125 MB in float32, four times a 32 MB L3) for 31 M multiply-adds. It is bound by memory, so what it
costs is what its factors weigh in the arithmetic the runtime computes in. Variants:

- ``torch float32``: :func:`padim.core.scoring.squared_mahalanobis` (``--runtime torch``).
- ``torch float16 factors``: the same with the factors as ``train --factor-dtype auto`` stores them, upcast 128
  positions at a time inside the product.
- ``onnxruntime float32``: the export's graph of the step (:func:`padim.models.deploy.export.triangular_squared_norm`,
  the triangle in :data:`~padim.models.deploy.export.FACTOR_BLOCKS` row blocks) with float32 factors: the default
  runtime's graph of a model whose factors ``train`` kept in float32. The ratios printed are against it.
- ``onnxruntime float16 factors``: the factors stored float16 in the graph; ONNX Runtime folds their cast at load:
  the default's graph where ``train --factor-dtype auto`` stored float16 factors (as it does for resnet18).
- ``onnxruntime int8 factors``: ``MatMulInteger`` with int8 factors (a scale per position and row) and the
  difference quantised per position and picture (a scale each): a quarter of the bytes.
- ``openvino f32 / bf16 / f16``: the float32 graph compiled with each ``INFERENCE_PRECISION_HINT`` (bf16 and f16
  where this CPU runs them: OpenVINO keeps the constant factors in that type and multiplies in it).
- ``torch inductor float16 factors`` (``--inductor``: needs a C++ compiler): the same row blocks, the factors kept
  float16 and upcast inside the kernel ``torch.compile`` generates (the product as a multiply and a sum, fused).

- ``native float16 factors, AVX-512 / AVX2`` (``--native``: needs a C compiler): ``benchmarks/kernels/mahalanobis.c``,
  a hand-written kernel (not part of padim) that reads each position's float16 factor in blocks of rows below the
  diagonal once for up to four pictures and keeps the products in registers: what a kernel made for this step
  gives where no runtime's does.

Bounds (``--bounds``), timed as the variants are but not the step (no error is printed):

- ``read the factors' bytes once``: torch summing a float32 tensor of the bytes the default graph's row blocks
  hold: what reading them costs on this machine's memory at full speed, the floor of any float32 kernel.
- ``onnxruntime one 2-D product, same bytes``: a single ``(1, D) @ (D, bytes / 4 D)`` MatMul, the same factor
  bytes read by one matrix-vector product instead of one a position: what ONNX Runtime's per-product overhead
  costs the step.

The factors come from a fitted Gaussian per position (correlated features, channel scales 0.2-3, as a backbone's;
``precision_factor`` with epsilon 0.01): the error of each variant is the largest relative error of ``d^2`` and of
the image score (``sqrt`` of the largest ``d^2`` of a picture) against float64, on 16 pictures near the mean.
Rounds interleave the variants, each timed call after an idle pause; the median is printed.

    python benchmarks/mahalanobis.py [--rounds 15] [--bounds] [--inductor] [--native]
        [--output benchmarks/results/DATE-MACHINE-mahalanobis.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from timing import machine_name

from padim.core.scoring import squared_mahalanobis
from padim.core.statistics import precision_factor
from padim.models.deploy.export import FACTOR_BLOCKS, triangular_squared_norm
from padim.models.devices import cpu_features
from padim.models.features.quantised import export_module

#: Idle seconds before each timed call (thread pools stop spinning).
SETTLE_S = 0.05


class Step(torch.nn.Module):
    """``(N, D, P)`` embeddings (channels first, as the embedding gives them) -> ``(N, P)`` squared distances, as the
    export's graph computes them."""

    def __init__(self, mean: torch.Tensor, factor: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("factor", factor)

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        delta = embedding.permute(2, 0, 1) - self.mean.unsqueeze(1)  # (P, N, D)
        return triangular_squared_norm(delta, self.factor.to(torch.float32)).transpose(0, 1)


def gaussians(pixels: int, dim: int, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, D)`` means and ``(P, D, D)`` float32 precision factors of a fitted Gaussian per position."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(pixels, dim, dim, generator=generator) * 0.1 + torch.eye(dim)
    scales = torch.linspace(0.2, 3.0, dim)
    features = torch.randn(pixels, samples, dim, generator=generator) @ mixing * scales
    mean = features.mean(1)
    centred = features - mean.unsqueeze(1)
    covariance = centred.transpose(1, 2) @ centred / (samples - 1)
    return mean, precision_factor(covariance, epsilon=0.01).contiguous()


def int8_graph(mean: torch.Tensor, factor: torch.Tensor, path: Path) -> Path:
    """The step with int8 factors and ``MatMulInteger`` (opset 18), row blocks as the float32 graph's."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    pixels, dim = mean.shape
    inits = [
        numpy_helper.from_array(mean.numpy()[:, None, :], "mean"),
        numpy_helper.from_array(np.array([2], np.int64), "last"),
        numpy_helper.from_array(np.array(1 / 127, np.float32), "step"),
        numpy_helper.from_array(np.array(1e-30, np.float32), "tiny"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
    ]
    nodes = [
        helper.make_node("Transpose", ["x"], ["rows"], perm=[2, 0, 1]),
        helper.make_node("Sub", ["rows", "mean"], ["delta"]),
        helper.make_node("Abs", ["delta"], ["magnitude"]),
        helper.make_node("ReduceMax", ["magnitude", "last"], ["largest"], keepdims=1),
        helper.make_node("Mul", ["largest", "step"], ["scale0"]),
        helper.make_node("Max", ["scale0", "tiny"], ["scale"]),
        helper.make_node("Div", ["delta", "scale"], ["scaled"]),
        helper.make_node("Round", ["scaled"], ["rounded"]),
        helper.make_node("Cast", ["rounded"], ["quantised"], to=TensorProto.INT8),
    ]
    bounds = [round(dim * (i + 1) / FACTOR_BLOCKS) for i in range(FACTOR_BLOCKS)]
    terms, start = [], 0
    for i, stop in enumerate(bounds):
        block = factor[:, start:stop, :stop]  # rows start..stop, columns 0..stop
        row_scale = block.abs().amax(-1).clamp_min(1e-30) / 127  # (P, rows)
        codes = torch.round(block / row_scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        inits += [
            numpy_helper.from_array(codes.transpose(1, 2).contiguous().numpy(), f"w{i}"),
            numpy_helper.from_array(row_scale.unsqueeze(1).numpy(), f"s{i}"),
            numpy_helper.from_array(np.array([stop], np.int64), f"stop{i}"),
        ]
        nodes += [
            helper.make_node("Slice", ["quantised", "zero", f"stop{i}", "last"], [f"q{i}"]),
            helper.make_node("MatMulInteger", [f"q{i}", f"w{i}"], [f"i{i}"]),
            helper.make_node("Cast", [f"i{i}"], [f"f{i}"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"f{i}", f"s{i}"], [f"g{i}"]),
            helper.make_node("Mul", [f"g{i}", "scale"], [f"h{i}"]),
            helper.make_node("Mul", [f"h{i}", f"h{i}"], [f"sq{i}"]),
            helper.make_node("ReduceSum", [f"sq{i}", "last"], [f"t{i}"], keepdims=0),
        ]
        terms.append(f"t{i}")
        start = stop
    nodes += [helper.make_node("Sum", terms, ["sum"]), helper.make_node("Transpose", ["sum"], ["y"], perm=[1, 0])]
    graph = helper.make_graph(
        nodes,
        "mahalanobis_int8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dim, pixels])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", pixels])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def inductor_step(mean: torch.Tensor, factor16: torch.Tensor) -> Callable[[np.ndarray], np.ndarray]:
    """The step as ``torch.compile`` (Inductor) makes it: float16 factors in the graph's row blocks, upcast inside the
    generated kernel, the product a multiply and a sum over the block's columns (compiled on the first call). The
    difference is made contiguous first and the blocks are arguments: Inductor's kernel was 3-4x slower with a
    strided difference or the blocks as constants (measured)."""
    dim = factor16.shape[-1]
    stops = [round(dim * (i + 1) / FACTOR_BLOCKS) for i in range(FACTOR_BLOCKS)]
    starts = [0, *stops[:-1]]
    blocks = [factor16[:, start:stop, :stop].contiguous() for start, stop in zip(starts, stops, strict=True)]

    def step(delta: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
        total = None
        for block in blocks:
            part = (block.unsqueeze(0).float() * delta[..., : block.shape[-1]].unsqueeze(2)).sum(-1)  # (N, P, rows)
            term = part.square().sum(-1)
            total = term if total is None else total + term
        return total

    compiled = torch.compile(step, dynamic=False)
    return lambda x: compiled((torch.from_numpy(x).transpose(1, 2) - mean).contiguous(), *blocks).numpy()


def pack_blocks(factor: torch.Tensor, rows: int) -> np.ndarray:
    """``(P, D, D)`` lower-triangular factors -> ``(P, entries)`` float16 bits in the native kernel's layout: for each
    column ``k``, the ``rows``-row blocks from the one holding the diagonal down (zeros above it and past ``D``)."""
    pixels, dim = factor.shape[0], factor.shape[-1]
    blocks = -(-dim // rows)
    padded = torch.zeros(pixels, blocks * rows, dim)
    padded[:, :dim] = factor.tril()
    row_index = [b * rows + r for k in range(dim) for b in range(k // rows, blocks) for r in range(rows)]
    col_index = [k for k in range(dim) for b in range(k // rows, blocks) for _ in range(rows)]
    packed = padded[:, row_index, col_index].to(torch.float16)
    return np.ascontiguousarray(packed.numpy()).view(np.uint16)


def native_steps(mean: torch.Tensor, factor: torch.Tensor, work: Path) -> dict[str, Callable[[np.ndarray], object]]:
    """The hand-written kernel (``benchmarks/kernels/mahalanobis.c``) for each instruction set this CPU has, built
    with the system C compiler; empty where there is none or the CPU has neither."""
    import ctypes
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    flags = set(cpu_features())
    if compiler is None:
        return {}
    library = work / "mahalanobis.so"
    source = Path(__file__).resolve().parent / "kernels" / "mahalanobis.c"
    subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-pthread", "-o", str(library), str(source)], check=True)
    kernel = ctypes.CDLL(str(library)).mahalanobis_f16
    kernel.restype = ctypes.c_int
    kernel.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4 + [ctypes.c_int]
    pixels, dim = mean.shape
    means = np.ascontiguousarray(mean.numpy())
    threads = torch.get_num_threads()
    steps = {}
    for isa, rows, needs in ((512, 16, "avx512f"), (256, 8, "avx2")):
        if needs not in flags:
            continue
        packed = pack_blocks(factor, rows)

        def step(x: np.ndarray, isa=isa, packed=packed) -> np.ndarray:
            x = np.ascontiguousarray(x)
            out = np.empty((x.shape[0], pixels), np.float32)
            code = kernel(isa, x.ctypes.data, means.ctypes.data, packed.ctypes.data, out.ctypes.data, x.shape[0],
                          pixels, dim, packed.shape[1], threads)  # fmt: skip
            if code != 0:
                raise ValueError(f"the native kernel refused D = {dim} or {threads} threads")
            return out

        steps[f"native float16 factors, {needs} ({packed.nbytes / 1e6:.0f} MB)"] = step
    return steps


def bounds(factor: torch.Tensor) -> dict[str, Callable[[np.ndarray], object]]:
    """The floors the step is measured against: reading the default graph's factor bytes at full speed (torch), and
    the same bytes in one ONNX Runtime matrix-vector product (``N`` rows at once)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    pixels, dim = factor.shape[0], factor.shape[-1]
    stops = [round(dim * (i + 1) / FACTOR_BLOCKS) for i in range(FACTOR_BLOCKS)]
    starts = [0, *stops[:-1]]
    entries = pixels * sum((stop - start) * stop for start, stop in zip(starts, stops, strict=True))
    held = torch.randn(entries)  # as many float32 values as the graph's blocks hold
    wide = np.random.default_rng(0).standard_normal((dim, entries // dim), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "one_product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", entries // dim])],
        [numpy_helper.from_array(wide, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return {
        f"read the factors' bytes once ({entries * 4 / 1e6:.0f} MB)": lambda x: held.sum(),
        "onnxruntime one 2-D product, same bytes": lambda x: session.run(None, {"x": np.ascontiguousarray(x[:, :, 0])}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pixels", type=int, default=3136, help="positions (56 x 56 at 224 px)")
    parser.add_argument("--dim", type=int, default=100, help="channels D")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--bounds", action="store_true", help="time the floors too (reading the bytes, one product)")
    parser.add_argument("--inductor", action="store_true", help="the torch.compile variant too (a C++ compiler)")
    parser.add_argument("--native", action="store_true", help="the hand-written C kernel too (a C compiler)")
    parser.add_argument("--output", type=Path, help="write the JSON report here too")
    args = parser.parse_args()

    import onnxruntime as ort

    torch.set_grad_enabled(False)
    mean, factor = gaussians(args.pixels, args.dim, samples=3 * args.dim, seed=0)
    generator = torch.Generator().manual_seed(1)
    largest = max(args.batches)
    spread = torch.linspace(0.2, 3.0, args.dim)
    embedding = mean + torch.randn(largest, *mean.shape, generator=generator) * spread  # (N, P, D)
    channels_first = embedding.transpose(1, 2).contiguous()  # (N, D, P): what the step is given
    reference = squared_mahalanobis(embedding.double(), mean.double(), factor.double())  # (N, P) float64

    work = Path(tempfile.mkdtemp(prefix="padim-mahalanobis-"))
    runs: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
    factor16 = factor.half()
    runs["torch float32"] = lambda x: squared_mahalanobis(torch.from_numpy(x).transpose(1, 2), mean, factor).numpy()
    runs["torch float16 factors"] = lambda x: squared_mahalanobis(
        torch.from_numpy(x).transpose(1, 2), mean, factor16
    ).numpy()
    example = (channels_first[:2].contiguous(),)
    float_graph = export_module(Step(mean, factor), example, ["x"], ["y"], work / "float32.onnx")
    half_graph = export_module(Step(mean, factor16), example, ["x"], ["y"], work / "float16.onnx")
    options = ort.SessionOptions()
    for name, graph in (
        ("onnxruntime float32", float_graph),
        ("onnxruntime float16 factors", half_graph),
        ("onnxruntime int8 factors", int8_graph(mean, factor, work / "int8.onnx")),
    ):
        session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        runs[name] = lambda x, s=session: s.run(None, {"x": x})[0]
    notes = []
    try:
        import openvino as ov

        core = ov.Core()
        for hint in ("f32", "bf16", "f16"):
            compiled = core.compile_model(
                str(float_graph), "CPU", {"INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": "LATENCY"}
            )
            runs_at = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
            request = compiled.create_infer_request()
            runs[f"openvino {hint} (runs {runs_at})"] = lambda x, r=request: np.array(r.infer({0: x})[0])
    except ImportError:
        notes.append("OpenVINO is not installed: not measured")

    if args.inductor:
        runs["torch inductor float16 factors"] = inductor_step(mean, factor16)
    if args.native:
        # the factors as the model keeps them (float16), so the kernel's error is that of its own arithmetic
        runs.update(native_steps(mean, factor16.float(), work))
    floors = bounds(factor) if args.bounds else {}

    report = {
        "machine": machine_name(),
        "platform": platform.machine(),
        "cpu_features": list(cpu_features()),
        "threads": torch.get_num_threads(),
        "pixels": args.pixels,
        "dim": args.dim,
        "factor_blocks": FACTOR_BLOCKS,
        "rounds": args.rounds,
        "notes": notes,
        "variants": {},
        "bounds": {name: {"ms": {}} for name in floors},
    }
    print(f"{report['machine']}: {', '.join(report['cpu_features']) or 'no AVX2/AVX-512 flags'}")
    x = channels_first.numpy()
    for name, run in runs.items():
        found = torch.from_numpy(np.asarray(run(x))).double()
        score, score_ref = found.amax(1).sqrt(), reference.amax(1).sqrt()
        report["variants"][name] = {
            "d2_max_rel_error": float(((found - reference).abs() / reference).max()),
            "image_score_max_rel_error": float(((score - score_ref).abs() / score_ref).max()),
            "ms": {},
        }
        for b in args.batches:
            run(x[:b])  # warm: kernels chosen, buffers allocated
    for run in floors.values():
        for b in args.batches:
            run(x[:b])
    timed = {**runs, **floors}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, run in timed.items():
            for b in args.batches:
                time.sleep(SETTLE_S)
                started = time.perf_counter()
                run(x[:b])
                times.setdefault((name, b), []).append(time.perf_counter() - started)
    base = {b: statistics.median(times[("onnxruntime float32", b)]) for b in args.batches}
    print(f"{'variant':<36} " + " ".join(f"{'batch ' + str(b):>18}" for b in args.batches) + "  d2 / score error")
    for name, entry in report["variants"].items():
        cells = []
        for b in args.batches:
            median = statistics.median(times[(name, b)])
            entry["ms"][str(b)] = round(median * 1e3, 3)
            entry.setdefault("speedup_vs_onnxruntime_float32", {})[str(b)] = round(base[b] / median, 3)
            cells.append(f"{median * 1e3:8.2f} ms ({base[b] / median:4.2f}x)")
        print(
            f"{name:<36} " + " ".join(f"{c:>18}" for c in cells) + f"  {entry['d2_max_rel_error']:.1e} / "
            f"{entry['image_score_max_rel_error']:.1e}"
        )
    for name, entry in report["bounds"].items():
        cells = []
        for b in args.batches:
            median = statistics.median(times[(name, b)])
            entry["ms"][str(b)] = round(median * 1e3, 3)
            cells.append(f"{median * 1e3:8.2f} ms ({base[b] / median:4.2f}x)")
        print(f"{'bound: ' + name:<36} " + " ".join(f"{c:>18}" for c in cells))
    for note in notes:
        print(note)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
