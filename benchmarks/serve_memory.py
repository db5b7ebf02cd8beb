"""Memory of `padim serve` under a burst of large images: peak RSS growth over idle, and what stays.

Starts a real `padim serve` on 127.0.0.1 (a small random-weights model it trains itself unless
--model is given), warms it up, then sends N concurrent PNGs of SIDE x SIDE pixels (flat colour
with a little noise: a ~100 KB file that decodes to SIDE^2 x 4 bytes). The server's RSS is
sampled from /proc every 5 ms.

    python benchmarks/serve_memory.py --concurrent 16 --side 6300

Prints one JSON object: idle, peak and after-burst RSS (MB), the statuses, and the settings.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from timing import wait_ready, work_folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def large_png(side: int, seed: int) -> bytes:
    """A flat image with a sparse scatter of noisy pixels: compresses well, decodes to side^2 pixels."""
    rng = np.random.default_rng(seed)
    pixels = np.full((side, side, 3), (120, 110, 100), dtype=np.uint8)
    rows = rng.integers(0, side, 2000)
    pixels[rows, rng.integers(0, side, 2000)] = rng.integers(0, 255, (2000, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=9)
    return buffer.getvalue()


def train_model(work: Path) -> Path:
    run = [sys.executable, "-m", "padim", "-q"]
    subprocess.run(
        [*run, "synth", str(work / "data"), "--categories", "weave", "--train", "12", "--size", "128"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    model = work / "weave.padim"
    subprocess.run(
        [
            *run,
            "train",
            str(work / "data" / "weave" / "train" / "good"),
            "--weights",
            "random",
            "--image-size",
            "128",
            "--output",
            str(model),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model file (default: train a small random-weights one)")
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--side", type=int, default=6300)
    parser.add_argument("--heatmap", action="store_true", help="ask for heat maps too")
    args = parser.parse_args()

    work = work_folder(None, "padim-serve-memory-")
    model = args.model or train_model(work)
    bodies = [large_png(args.side, seed) for seed in range(args.concurrent)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PADIM_MAX_QUEUE": str(max(256, args.concurrent)), "PADIM_REQUEST_TIMEOUT_S": "300"}
    server = subprocess.Popen(
        [sys.executable, "-m", "padim", "serve", "--model", str(model), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(url, 120)
        small = io.BytesIO()
        Image.new("RGB", (128, 128), (120, 110, 100)).save(small, format="PNG")
        for _ in range(5):  # warm: thread pools, allocator, the first batches
            httpx.post(url + "/score", content=small.getvalue(), headers={"content-type": "image/png"}, timeout=60)
        time.sleep(1.0)
        idle = rss_mb(server.pid)

        peak, sampling = idle, True

        def sample() -> None:
            nonlocal peak
            while sampling:
                peak = max(peak, rss_mb(server.pid))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()

        def post(body: bytes) -> int:
            return httpx.post(
                url + "/score",
                content=body,
                headers={"content-type": "image/png"},
                params={"heatmap": str(args.heatmap).lower()},
                timeout=300,
            ).status_code

        with ThreadPoolExecutor(args.concurrent) as pool:
            statuses = list(pool.map(post, bodies))
        seconds = time.perf_counter() - started
        time.sleep(2.0)
        sampling = False
        sampler.join()
        after = rss_mb(server.pid)
        print(
            json.dumps(
                {
                    "concurrent": args.concurrent,
                    "side": args.side,
                    "png_kb": round(np.mean([len(b) for b in bodies]) / 1024, 1),
                    "heatmap": args.heatmap,
                    "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
                    "burst_seconds": round(seconds, 2),
                    "idle_rss_mb": round(idle),
                    "peak_rss_mb": round(peak),
                    "peak_growth_mb": round(peak - idle),
                    "after_rss_mb": round(after),
                    "kept_mb": round(after - idle),
                }
            )
        )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    main()
