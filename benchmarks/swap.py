"""Models that change while the line runs: upload-to-active time, latency during a swap, memory across swaps.

Trains two random-weights models per backbone (two seeds, so two different versions) on generated
pictures, puts the first in a repository and starts a real `padim serve --repository` on 127.0.0.1.
Then, per backbone:
- **upload to active**: `POST /models/NAME/versions?activate=true` with the second file, timed from
  the first byte sent to the 201 (streamed to disk, checked, loaded and warmed up beside the active
  version, swapped in; with runtime auto on a CPU that includes the ONNX export);
- **latency**: `--clients` threads post pictures without pause; p50/p99 of the requests that
  finished in a steady window, against those that were in flight while an upload-and-activate ran;
  every status is counted (a failed request is reported, never dropped);
- **memory**: the server's RSS (/proc) after each of ten activations, alternating the two versions.

    python benchmarks/swap.py --backbones resnet18 wide_resnet50_2 --runtime auto

Prints one JSON object per backbone; --output FILE also writes them all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from timing import wait_ready, work_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import free_port  # noqa: E402

ADMIN = "bench-admin"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def train(work: Path, backbone: str, seed: int, size: int, images: int) -> Path:
    data = work / "data" / "weave" / "train" / "good"
    if not data.is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "padim",
                "-q",
                "synth",
                str(work / "data"),
                "--categories",
                "weave",
                "--train",
                str(images),
                "--size",
                str(size),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    model = work / f"{backbone}-{size}-seed{seed}.padim"
    if not model.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "padim",
                "-q",
                "train",
                str(data),
                "--output",
                str(model),
                "--backbone",
                backbone,
                "--weights",
                "random",
                "--image-size",
                str(size),
                "--seed",
                str(seed),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return model


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def measure(work: Path, backbone: str, size: int, images: int, runtime: str, clients: int, steady_s: float) -> dict:
    first, second = (train(work, backbone, seed, size, images) for seed in (0, 1))
    repository = work / f"repo-{backbone}-{runtime}"
    shutil.rmtree(repository, ignore_errors=True)  # a fresh repository: version 1, then 2
    subprocess.run(
        [sys.executable, "-m", "padim", "-q", "repository", "add", str(repository), "weave", str(first), "--activate"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / f"server-{backbone}-{runtime}.log", "w")
    env = {**os.environ, "PADIM_ADMIN_KEY": ADMIN, "PADIM_RUNTIME": runtime, "PADIM_CACHE_DIR": str(work / "cache")}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "padim",
            "serve",
            "--repository",
            str(repository),
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        wait_ready(url, 600, every=0.5)
        picture = next((work / "data" / "weave" / "test" / "good").iterdir()).read_bytes()
        answers: list[tuple[float, float, int, int | None]] = []  # sent, answered, status, version
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(base_url=url, timeout=120) as http:
                while not stop.is_set():
                    sent = time.monotonic()
                    response = http.post("/score", content=picture, headers={"content-type": "image/png"})
                    version = response.json().get("model", {}).get("version") if response.status_code == 200 else None
                    answers.append((sent, time.monotonic(), response.status_code, version))

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(2.0)  # clients warm
        steady_from = time.monotonic()
        time.sleep(steady_s)
        steady_to = time.monotonic()
        admin = httpx.Client(base_url=url, timeout=3600, headers={"x-api-key": ADMIN})
        digest = hashlib.sha256()
        with open(second, "rb") as handle:  # streamed: a wide_resnet50_2 file is gigabytes
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
        swap_from = time.monotonic()
        with open(second, "rb") as body:
            uploaded = admin.post(
                "/models/weave/versions",
                params={"activate": "true"},
                content=body,
                headers={"content-type": "application/octet-stream", "x-content-sha256": digest.hexdigest()},
            )
        swap_to = time.monotonic()
        if uploaded.status_code != 201:
            raise SystemExit(f"upload failed: {uploaded.status_code} {uploaded.text}")
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(120)
        steady = [b - a for a, b, s, _ in answers if a >= steady_from and b <= steady_to]
        during = [b - a for a, b, s, _ in answers if b >= swap_from and a <= swap_to]  # in flight during the swap
        failed = sum(1 for _, _, s, _ in answers if s != 200)
        rss = [round(rss_mb(server.pid), 1)]
        activations = []
        for i in range(10):
            version = 1 if i % 2 == 0 else 2
            started = time.monotonic()
            response = admin.post(f"/models/weave/versions/{version}/activate")
            activations.append(round(time.monotonic() - started, 3))
            if response.status_code != 200:
                raise SystemExit(f"activate failed: {response.status_code} {response.text}")
            httpx.post(url + "/score", content=picture, headers={"content-type": "image/png"}, timeout=120)
            time.sleep(0.5)  # the retired version drains and is released
            rss.append(round(rss_mb(server.pid), 1))
        return {
            "backbone": backbone,
            "image_size": size,
            "runtime": runtime,
            "model_file_mb": round(second.stat().st_size / 2**20, 1),
            "upload_to_active_s": round(swap_to - swap_from, 3),
            "activate_s_median": round(float(np.median(activations)), 3),
            "clients": clients,
            "requests": len(answers),
            "failed": failed,
            "versions_seen": sorted({v for *_, v in answers if v is not None}),
            "steady_p50_ms": percentile(steady, 50),
            "steady_p99_ms": percentile(steady, 99),
            "steady_requests": len(steady),
            "swap_p50_ms": percentile(during, 50),
            "swap_p99_ms": percentile(during, 99),
            "swap_max_ms": percentile(during, 100),
            "swap_requests": len(during),
            "rss_mb_after_each_of_ten_swaps": rss,
            "rss_growth_mb": round(rss[-1] - rss[0], 1),
        }
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbones", nargs="+", default=["resnet18", "wide_resnet50_2"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--images", type=int, default=30, help="training pictures per model")
    parser.add_argument("--runtime", default="auto", choices=["auto", "torch", "onnxruntime"])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--steady-s", type=float, default=15.0)
    parser.add_argument("--workdir", type=Path, help="keep the models and data here (reused when there)")
    parser.add_argument("--output", type=Path, help="also write the results here (JSON)")
    args = parser.parse_args()
    work = work_folder(args.workdir, "padim-swap-")
    results = []
    for backbone in args.backbones:
        result = measure(work, backbone, args.image_size, args.images, args.runtime, args.clients, args.steady_s)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.output is not None:
        args.output.write_text(
            json.dumps(
                {
                    "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
                    "date": time.strftime("%Y-%m-%d"),
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
