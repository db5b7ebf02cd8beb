"""`padim serve` against its own scorer: requests/s, latency, batches and CPU per request of each process kind.

For each backbone, on generated pictures with seeded random weights:

1. **the scorer alone**: ``load_scorer(...).score`` on host tensors (the model as served: ``--runtime``, torch by
   default), img/s at batch 1, 16 and 64 (``--batches``);
2. **the service**: a real ``padim serve`` process on 127.0.0.1 for each ``--workers`` value, loaded by clients in
   several processes (``--client-processes``; a client in one Python process cannot load a fast server), each
   holding keep-alive connections in a closed loop (every connection sends its next request when it has its answer),
   at each number of ``--connections``, with ``--bodies`` (``png``: PNGs at the model's own size, 224 px by default;
   ``jpeg1080``: a 1920x1080 JPEG, a camera frame). Per row: req/s, p50 and p99 latency, req/s over the scorer's
   img/s at its largest batch, the mean batch the batcher formed (from /metrics), errors, and the CPU milliseconds
   per request of each process kind (from /proc: the service's one process, or its supervisor, scoring process and
   API processes).

Rows print as they come (one JSON object each); ``--save`` writes them with the machine's name to
``benchmarks/results/<date>-<machine>-serve-gpu.json``. ``--device cpu`` runs it all on the CPU (the 2-core machine
of this project: ``--image-size 64`` makes a model small enough that scoring costs little, so that the service's own
cost shows).

    python benchmarks/serve_gpu.py                                  # on a GPU machine: the issue's table
    python benchmarks/serve_gpu.py --device cpu --backbones resnet18 --image-size 64 --workers 1 2 \\
        --connections 1 32 --bodies png --seconds 10              # the 2-core CPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import machine_name, median_seconds, wait_ready, work_folder  # noqa: E402 (the benchmarks' own helpers)

from padim.models import PadimConfig, fit_detector, training_images  # noqa: E402
from padim.models.data.synthetic import generate  # noqa: E402
from padim.models.deploy.runtimes import load_scorer  # noqa: E402
from padim.models.features.embedding import stacked  # noqa: E402
from padim.models.fit.model_file import save_detector  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- data and model
def prepare(folder: Path, backbone: str, size: int, device: str) -> tuple[Path, dict[str, list[bytes]]]:
    """A model of generated pictures (seeded random weights) and the request bodies: the test pictures as PNGs at
    the model's size, and as 1920x1080 JPEGs."""
    (category,) = generate(folder / "data", ("weave",), train=40, test_good=12, test_defect=4, size=size, seed=0)
    model = folder / f"{backbone}-{size}.padim"
    if not model.exists():
        config = PadimConfig(backbone=backbone, weights="random", image_size=size, device=device)
        save_detector(fit_detector(config, training_images(category / "train" / "good"), progress=False)[0], model)
    pictures = sorted((category / "test").rglob("*.png"))
    bodies: dict[str, list[bytes]] = {"png": [], "jpeg1080": []}
    for path in pictures:
        image = Image.open(path).convert("RGB")
        png = io.BytesIO()
        image.save(png, format="PNG")
        bodies["png"].append(png.getvalue())
        jpeg = io.BytesIO()
        image.resize((1920, 1080), Image.BICUBIC).save(jpeg, format="JPEG", quality=90)
        bodies["jpeg1080"].append(jpeg.getvalue())
    return model, bodies


def scorer_alone(
    model: Path, device: str, runtime: str, size: int, batches: list[int], repeats: int
) -> dict[int, float]:
    """img/s of the scorer the service runs (``load_scorer``: the same runtime), on ready host batches of 8-bit pixels
    as the service forms them (page-locked for a GPU)."""
    detector = load_scorer(model, runtime, device)
    rates = {}
    for batch in batches:
        generator = torch.Generator().manual_seed(batch)
        pixels = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=generator)
        images = stacked(list(pixels), detector.device)
        rates[batch] = batch / median_seconds(lambda images=images: detector.score(images), repeats)
    return rates


# --------------------------------------------------------------------------- the clients
def _request(body: bytes, content_type: str) -> bytes:
    return (
        f"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _connection(
    port: int, requests: list[bytes], start: float, stop: float, out: list, index: int, total: list[int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = index
    try:
        while time.perf_counter() < stop:
            sent = time.perf_counter()
            writer.write(requests[i % len(requests)])
            i += 1
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            total[0] += 1
            if sent >= start:
                out.append((status, time.perf_counter() - sent))
            if b"connection: close" in head.lower():
                break
    except (ConnectionError, asyncio.IncompleteReadError):
        out.append((0, 0.0))
    finally:
        writer.close()


def _client_process(
    port: int, bodies: list[bytes], content_type: str, connections: int, warm: float, seconds: float, index: int, queue
) -> None:
    """One client process: ``connections`` keep-alive connections in a closed loop; its (status, seconds) back."""
    requests = [_request(body, content_type) for body in bodies]
    out: list = []
    total = [0]  # every answer, the warm-up's too (the CPU per request is read over all of them)

    async def main() -> None:
        start = time.perf_counter() + warm
        stop = start + seconds
        await asyncio.gather(
            *[_connection(port, requests, start, stop, out, index * 1000 + c, total) for c in range(connections)]
        )

    asyncio.run(main())
    queue.put((out, total[0]))


def load(
    port: int, bodies: list[bytes], content_type: str, connections: int, processes: int, warm: float, seconds: float
) -> dict:
    """Closed-loop load from ``processes`` client processes holding ``connections`` connections in all."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = max(1, min(processes, connections))
    shares = [connections // processes + (1 if i < connections % processes else 0) for i in range(processes)]
    workers = [
        context.Process(target=_client_process, args=(port, bodies, content_type, n, warm, seconds, i, queue))
        for i, n in enumerate(shares)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=warm + seconds + 120) for _ in workers]
    for worker in workers:
        worker.join(30)
    answers = [a for r, _ in results for a in r]
    ok = np.array([t for s, t in answers if s == 200]) * 1000
    errors: dict[str, int] = {}
    for status, _ in answers:
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
    return {
        "connections": connections,
        "requests": int(ok.size),
        "requests_per_second": ok.size / seconds,
        "p50_ms": float(np.percentile(ok, 50)) if ok.size else None,
        "p99_ms": float(np.percentile(ok, 99)) if ok.size else None,
        "errors": errors,
        "answered": sum(n for _, n in results),
    }


WRK_SCRIPT = """
local bodies = {}
for path in string.gmatch(os.getenv("PADIM_BENCH_BODIES"), "[^;]+") do
  local f = io.open(path, "rb"); bodies[#bodies + 1] = f:read("*a"); f:close()
end
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", "/score", {["Content-Type"] = os.getenv("PADIM_BENCH_TYPE")}, bodies[i])
end
"""


def load_wrk(
    port: int, files: list[Path], content_type: str, connections: int, threads: int, seconds: float, script: Path
) -> dict:
    """The same closed loop from wrk (C; about half a millisecond of CPU a request): its own latency figures."""
    env = {**os.environ, "PADIM_BENCH_BODIES": ";".join(map(str, files)), "PADIM_BENCH_TYPE": content_type}
    threads = max(1, min(threads, connections))
    command = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds:g}s", "--latency", "-s",
               str(script), f"http://127.0.0.1:{port}"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout

    def field(prefix: str) -> str:
        return next(line.split()[1] for line in out.splitlines() if line.strip().startswith(prefix))

    def ms(value: str) -> float:
        for unit, factor in (("ms", 1.0), ("us", 1e-3), ("s", 1000.0), ("m", 60000.0)):
            if value.endswith(unit):
                return float(value[: -len(unit)]) * factor
        return float(value)

    total = int(next(line.split()[0] for line in out.splitlines() if "requests in" in line))
    errors = {}
    for line in out.splitlines():
        if "Non-2xx" in line:
            errors["non_2xx"] = int(line.split()[-1])
        if "Socket errors" in line:
            errors["socket"] = line.split(":", 1)[1].strip()
    good = total - errors.get("non_2xx", 0)
    return {
        "connections": connections,
        "requests": good,
        "requests_per_second": good / seconds,
        "p50_ms": ms(field("50%")),
        "p99_ms": ms(field("99%")),
        "errors": errors,
        "answered": total,
    }


# --------------------------------------------------------------------------- the server
def processes_of(pid: int) -> dict[int, str]:
    """The service's processes by pid: its one process, or the supervisor and its children by role."""
    found = {pid: "service"}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            # forked children name themselves (padim-scoring); an earlier version's ran `-m ...processes.scoring`
            scoring = Path(f"/proc/{child}/comm").read_text().strip() == "padim-scoring"
            scoring = scoring or b"processes.scoring" in Path(f"/proc/{child}/cmdline").read_bytes()
            found[pid] = "supervisor"
            found[int(child)] = "scoring" if scoring else "api"
    return found


def cpu_seconds(pids: dict[int, str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for pid, role in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        totals[role] = totals.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / HZ
    return totals


def batch_totals(port: int) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    samples = {
        s.name: s.value for f in text_string_to_metric_families(text) if f.name == "padim_batch_size" for s in f.samples
    }
    return samples.get("padim_batch_size_sum", 0.0), samples.get("padim_batch_size_count", 0.0)


def start(
    model: Path, port: int, device: str, runtime: str, workers: int, folder: Path, code: str | None
) -> subprocess.Popen:
    """``padim serve`` of this tree, or of the tree at ``code`` (a PYTHONPATH: an earlier version, for "before")."""

    # the workers as a variable, not a flag: a version from before it ignores it
    env = {**os.environ, "PADIM_LOG_LEVEL": "warning", "PADIM_WORKERS": str(workers)}
    if code is not None:
        env["PYTHONPATH"] = code
    log = open(folder / f"server-{port}.log", "w")  # noqa: SIM115 - the server's, kept for a failure
    command = [sys.executable, "-m", "padim", "serve", str(model), "--port", str(port), "--device", device,
               "--runtime", runtime]  # fmt: skip
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if wait_ready(f"http://127.0.0.1:{port}", 600, server, every=0.5):
        return server
    if server.poll() is not None:
        raise SystemExit(f"the server exited: {(folder / f'server-{port}.log').read_text()[-3000:]}")
    raise SystemExit("the server did not become ready within 10 minutes")


def say(record: dict, results: list[dict]) -> None:
    results.append(record)
    print(json.dumps(record), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbones", nargs="+", default=["resnet18", "wide_resnet50_2"])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="the scorer alone's batches")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8], help="padim serve --workers values")
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--bodies", nargs="+", choices=("png", "jpeg1080"), default=["png", "jpeg1080"])
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument(
        "--client",
        choices=("python", "wrk"),
        default="python",
        help="python: asyncio clients in several processes"
        " (what a GPU machine without wrk has); wrk: one wrk with --client-processes threads (less CPU a request)",
    )
    parser.add_argument("--runtime", default="torch", help="the service's runtime (default torch, as on a GPU)")
    parser.add_argument(
        "--before",
        metavar="PYTHONPATH",
        help="also measure the service of the padim found at this PYTHONPATH (an earlier version: a folder whose "
        "padim/ is that tree's cli/ with core, models and service beside), at each --workers value",
    )
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds a row (after 2 s warm-up)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument(
        "--save",
        nargs="?",
        const="",
        metavar="SUFFIX",
        help="write benchmarks/results/<date>-<machine>-serve-gpu[-SUFFIX].json",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/serve_gpu.py: torch sees no GPU here; use --device cpu", file=sys.stderr)
        return 2
    folder = work_folder(args.workdir, "padim-serve-gpu-")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results: list[dict] = []
    layouts = [("this", workers, None) for workers in args.workers]
    if args.before is not None:  # the earlier version beside this one, at each --workers value
        layouts = [("before", workers, args.before) for workers in args.workers] + layouts
    for backbone in args.backbones:
        model, bodies = prepare(folder, backbone, args.image_size, args.device)
        rates = scorer_alone(model, args.device, args.runtime, args.image_size, args.batches, args.repeats)
        best = max(rates.values())
        say(
            {
                "backbone": backbone,
                "step": "scorer",
                "images_per_second": {str(k): round(v, 1) for k, v in rates.items()},
            },
            results,
        )  # noqa: E501
        files = {}
        for kind, payloads in bodies.items():
            files[kind] = [folder / f"{kind}-{i}.bin" for i in range(len(payloads))]
            for path, payload in zip(files[kind], payloads, strict=True):
                path.write_bytes(payload)
        script = folder / "post.lua"
        script.write_text(WRK_SCRIPT)
        for code, workers, path in layouts:
            port = free_port()
            server = start(model, port, args.device, args.runtime, workers, folder, path)
            try:
                pids = processes_of(server.pid)
                counts = {role: list(pids.values()).count(role) for role in set(pids.values())}
                for kind in args.bodies:
                    content_type = "image/png" if kind == "png" else "image/jpeg"
                    for connections in args.connections:
                        if args.client == "wrk":
                            load_wrk(port, files[kind], content_type, connections, args.client_processes, 2.0, script)
                        before_cpu, (images0, batches0) = cpu_seconds(pids), batch_totals(port)
                        if args.client == "wrk":
                            row = load_wrk(
                                port,
                                files[kind],
                                content_type,
                                connections,
                                args.client_processes,
                                args.seconds,
                                script,
                            )
                        else:
                            row = load(
                                port, bodies[kind], content_type, connections, args.client_processes, 2.0, args.seconds
                            )
                        after_cpu, (images1, batches1) = cpu_seconds(pids), batch_totals(port)
                        answered = max(row.pop("answered"), 1)
                        say(
                            {
                                "backbone": backbone,
                                "step": "service",
                                "code": code,
                                "runtime": args.runtime,
                                "workers": workers,
                                "processes": counts,
                                "body": kind,
                                **row,
                                "service_over_scorer": round(row["requests_per_second"] / best, 3),
                                "mean_batch": round((images1 - images0) / max(batches1 - batches0, 1), 2),
                                # each process kind's CPU over every answer of the row (with the python client, its
                                # warm-up's too)
                                "cpu_ms_per_request": {
                                    role: round(1000 * (after_cpu.get(role, 0) - before_cpu.get(role, 0)) / answered, 3)
                                    for role in after_cpu
                                },
                            },
                            results,
                        )
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(120)
    if args.save is not None:
        name = f"{datetime.date.today()}-{machine_name()}-serve-gpu{'-' + args.save if args.save else ''}.json"
        target = Path(__file__).resolve().parent / "results" / name
        meta = {"device": device_name, "torch": torch.__version__, "cpus": os.cpu_count(), "args": vars(args)}
        target.write_text(json.dumps({**meta, "results": results}, indent=2, default=str) + "\n")
        print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
