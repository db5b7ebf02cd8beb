"""Load test of `padim serve`: requests/s and latency at 1, 8 and 32 concurrent clients.

Starts a real uvicorn process (`padim serve`) on 127.0.0.1, sends 224-px PNGs as raw bodies
from N concurrent keep-alive connections for a fixed time, and compares requests/s with the
library's own throughput with the same runtime (``score`` on ready tensors, at batch 8, the
service's CPU batch preference, and at batch 16; measured in this process while the server is
idle). Loopback only.

The load comes from ``wrk`` when it is installed (``apt-get install wrk``): it is written in C
and takes about 0.5 ms of CPU per request. The fallback client (asyncio + httpx) takes about
16 ms per request, which on a 2-core machine is CPU taken from the server being measured.

    python benchmarks/serve_load.py --clients 1 8 32 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image
from timing import median_seconds, wait_ready, work_folder

from padim.models import PadimConfig, fit_detector, list_images, training_images
from padim.models.data.synthetic import generate
from padim.models.fit.model_file import save_detector


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(url: str, bodies: list[bytes], clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    stop = time.perf_counter() + seconds

    async def worker(index: int) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            i = index
            while time.perf_counter() < stop:
                body = bodies[i % len(bodies)]
                i += clients
                started = time.perf_counter()
                try:
                    response = await client.post(url + "/score", content=body, headers={"content-type": "image/png"})
                    key = None if response.status_code == 200 else str(response.status_code)
                except httpx.TransportError as error:
                    key = type(error).__name__
                if key is None:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors[key] = errors.get(key, 0) + 1

    began = time.perf_counter()
    await asyncio.gather(*[worker(i) for i in range(clients)])
    elapsed = time.perf_counter() - began
    ms = np.array(latencies) * 1000
    return {
        "clients": clients,
        "requests": len(latencies),
        "requests_per_second": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "errors": errors,
    }


WRK_SCRIPT = """
local bodies = {}
for path in string.gmatch(os.getenv("PADIM_BENCH_IMAGES"), "[^;]+") do
  local f = io.open(path, "rb"); bodies[#bodies + 1] = f:read("*a"); f:close()
end
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", "/score", {["Content-Type"] = "image/png"}, bodies[i])
end
"""


def load_wrk(url: str, images: list[Path], clients: int, seconds: float, script: Path) -> dict:
    env = {**os.environ, "PADIM_BENCH_IMAGES": ";".join(map(str, images))}
    out = subprocess.run(
        ["wrk", "-t", "1", "-c", str(clients), "-d", f"{seconds:g}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout

    def field(prefix: str) -> str:
        return next(line.split()[1] for line in out.splitlines() if line.strip().startswith(prefix))

    def to_ms(value: str) -> float:
        for unit, factor in (("ms", 1.0), ("us", 1e-3), ("s", 1000.0), ("m", 60000.0)):
            if value.endswith(unit):
                return float(value[: -len(unit)]) * factor
        return float(value)

    errors = {}
    for line in out.splitlines():
        if "Non-2xx" in line:
            errors["non_2xx"] = int(line.split()[-1])
        if "Socket errors" in line:
            errors["socket"] = line.split(":", 1)[1].strip()
    total = int(next(line.split()[0] for line in out.splitlines() if "requests in" in line))
    return {
        "clients": clients,
        "requests": total,
        "requests_per_second": float(field("Requests/sec")),
        "p50_ms": to_ms(field("50%")),
        "p99_ms": to_ms(field("99%")),
        "errors": errors,
        "client": "wrk",
    }


def batch_totals(url: str) -> tuple[float, float]:
    """(images scored, batches run) so far, from the server's Prometheus metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        if f.name == "padim_batch_size"
        for s in f.samples
    }
    return samples.get("padim_batch_size_sum", 0.0), samples.get("padim_batch_size_count", 0.0)


def library_throughput(model: Path, images: list[Path], runtime: str, batch_size: int, repeats: int = 7) -> float:
    """img/s of the scorer the server runs (same runtime), on ready tensors, at ``batch_size``."""
    from padim.models.deploy.runtimes import load_scorer

    detector = load_scorer(model, runtime, "cpu")
    batch = detector.preprocess([Image.open(p).convert("RGB") for p in (images * batch_size)[:batch_size]])
    return batch_size / median_seconds(lambda: detector.score(batch), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--client", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument("--runtime", default="auto", help="the server's and the library's runtime (default auto)")
    args = parser.parse_args()
    use_wrk = args.client == "wrk" or (args.client == "auto" and shutil.which("wrk") is not None)

    work = work_folder(args.workdir, "padim-serve-bench-")
    category = work / "data" / "carpet"
    if not category.exists():
        generate(work / "data", ("carpet",), train=40, test_good=16, test_defect=4, size=args.image_size, seed=3)
    model = work / "carpet.padim"
    if not model.exists():
        config = PadimConfig(weights="random", image_size=args.image_size, device="cpu")
        save_detector(fit_detector(config, training_images(category / "train" / "good"), progress=False)[0], model)
    test_images = list_images(category / "test")
    bodies = [p.read_bytes() for p in test_images]

    library = library_throughput(model, test_images, args.runtime, 8)
    library16 = library_throughput(model, test_images, args.runtime, 16)
    print(
        f"library ({args.runtime} runtime): {library:.1f} img/s at batch 8, {library16:.1f} at batch 16 "
        f"({args.image_size} px, {torch.get_num_threads()} threads)"
    )

    port = free_port()
    env = {**os.environ, "PADIM_LOG_LEVEL": "warning"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "padim",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--runtime",
            args.runtime,
            "--max-batch-size",
            str(args.max_batch_size),
            "--max-delay-ms",
            str(args.max_delay_ms),
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 120, probe_s=1.0)
        rows = []
        script = work / "post.lua"
        script.write_text(WRK_SCRIPT)
        last_images, last_batches = batch_totals(url)
        print(f"load client: {'wrk' if use_wrk else 'python (httpx); install wrk for a lighter client'}")
        for clients in args.clients:
            asyncio.run(load(url, bodies, clients, 2.0))  # warm-up
            if use_wrk:
                row = load_wrk(url, test_images, clients, args.seconds, script)
            else:
                row = asyncio.run(load(url, bodies, clients, args.seconds))
            row["ratio_to_library"] = row["requests_per_second"] / library
            images, batches = batch_totals(url)
            row["mean_batch"] = (images - last_images) / max(batches - last_batches, 1)
            last_images, last_batches = images, batches
            rows.append(row)
            print(
                f"{clients:3d} clients: {row['requests_per_second']:6.1f} req/s, p50 {row['p50_ms']:7.1f} ms, "
                f"p99 {row['p99_ms']:7.1f} ms, {100 * row['ratio_to_library']:5.1f}% of library batch 8, "
                f"mean device batch {row['mean_batch']:.1f}, errors {row['errors']}"
            )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    print(
        json.dumps(
            {
                "runtime": args.runtime,
                "library_images_per_second_batch8": library,
                "library_images_per_second_batch16": library16,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
