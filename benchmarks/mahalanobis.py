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
  the triangle in :data:`~padim.models.deploy.export.FACTOR_BLOCKS` row blocks): the default runtime.
- ``onnxruntime float16 factors``: the factors stored float16 in the graph; ONNX Runtime folds their cast at load.
- ``onnxruntime int8 factors``: ``MatMulInteger`` with int8 factors (a scale per position and row) and the
  difference quantised per position and picture (a scale each): a quarter of the bytes.
- ``openvino f32 / bf16 / f16``: the float32 graph compiled with each ``INFERENCE_PRECISION_HINT`` (bf16 and f16
  where this CPU runs them: OpenVINO keeps the constant factors in that type and multiplies in it).

The factors come from a fitted Gaussian per position (correlated features, channel scales 0.2-3, as a backbone's;
``precision_factor`` with epsilon 0.01): the error of each variant is the largest relative error of ``d^2`` and of
the image score (``sqrt`` of the largest ``d^2`` of a picture) against float64, on 16 pictures near the mean.
Rounds interleave the variants, each timed call after an idle pause; the median is printed.

    python benchmarks/mahalanobis.py [--rounds 15] [--output benchmarks/results/DATE-MACHINE-mahalanobis.json]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pixels", type=int, default=3136, help="positions (56 x 56 at 224 px)")
    parser.add_argument("--dim", type=int, default=100, help="channels D")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=15)
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
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
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
    for note in notes:
        print(note)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
