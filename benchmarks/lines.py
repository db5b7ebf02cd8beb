"""A line end to end: a picture written into a hot folder to its verdict received from a real MQTT broker.

Starts Debian's ``mosquitto`` on a free port and a real ``padim serve --lines`` (resnet18, seeded random
weights, 224 px, the default options) with one hot-folder line and an MQTT sink, then writes pictures into the
folder at fixed rates. Each picture's latency is the time from just before its file is written to its message
arriving at a subscriber. Prints, per rate, p50/p99 latency and how many were over a 200 ms budget; the highest
rate (from a ladder) held with none late; and the service's CPU time per picture for the line against
``POST /score`` of the same pictures at the same rate (the source/sink machinery's own cost):

    python benchmarks/lines.py [--seconds 10] [--output benchmarks/results/lines-MACHINE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import paho.mqtt.client as mqtt
import psutil
from timing import machine_name, seeded_resnet18, wait_ready, work_folder

BUDGET_MS = 200.0
RATES = (1, 10, 30)
LADDER = (5, 10, 15, 20, 25, 30, 40, 50, 60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(work: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    config = work / "mosquitto.conf"
    config.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    program = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    process = subprocess.Popen([program, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return process, port


def start_server(work: Path, model: Path, lines: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(work / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "padim", "serve", str(model), "--port", str(port), "--lines", str(lines)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    if wait_ready(url, 180):
        return process, url
    raise SystemExit("the server did not become ready: " + (work / "server.log").read_text()[-2000:])


class Received:
    def __init__(self, port: int, topic: str):
        self.arrived: dict[str, float] = {}
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_connect = lambda client, *_: client.subscribe(topic, 1)
        self.client.on_message = self._message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _message(self, _client, _userdata, message) -> None:
        now = time.time()
        source = json.loads(message.payload)["source"]
        with self.lock:
            self.arrived.setdefault(source, now)


def run_rate(folder: Path, pictures: list[bytes], rate: float, seconds: float, received: Received, tag: str) -> dict:
    count = max(1, int(rate * seconds))
    written: dict[str, float] = {}
    start = time.perf_counter()
    for i in range(count):
        due = start + i / rate
        time.sleep(max(0.0, due - time.perf_counter()))
        name = f"{tag}-{i:05d}.png"
        written[name] = time.time()
        with open(folder / name, "wb") as file:  # written in one go and closed: taken on the close event
            file.write(pictures[i % len(pictures)])
    deadline = time.time() + 60
    while time.time() < deadline:
        with received.lock:
            if all(name in received.arrived for name in written):
                break
        time.sleep(0.05)
    with received.lock:
        latencies = sorted((received.arrived[n] - t) * 1000 for n, t in written.items() if n in received.arrived)
    lost = count - len(latencies)
    return {
        "rate": rate,
        "pictures": count,
        "received": len(latencies),
        "p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1) if latencies else None,
        "late": sum(1 for x in latencies if x > BUDGET_MS) + lost,
    }


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def http_rate(url: str, pictures: list[bytes], rate: float, count: int) -> None:
    """POST /score ``count`` times at ``rate`` (one client, as a line's camera PC would)."""
    with httpx.Client(timeout=30) as client:
        start = time.perf_counter()
        for i in range(count):
            time.sleep(max(0.0, start + i / rate - time.perf_counter()))
            data = pictures[i % len(pictures)]
            client.post(url + "/score", content=data, headers={"content-type": "image/png"}).raise_for_status()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of pictures at each rate")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    from padim.models import PadimConfig, fit_detector, training_images
    from padim.models.data.synthetic import generate
    from padim.models.fit.model_file import save_detector

    work = work_folder(args.workdir, "padim-lines-")
    category = work / "data" / "carpet"
    if not category.exists():
        generate(work / "data", ("carpet",), train=60, test_good=20, test_defect=5, size=224, seed=1)
    model = work / "carpet.padim"
    if not model.exists():
        config = PadimConfig(weights=str(seeded_resnet18(work / "resnet18-seed0.pth")), image_size=224, device="cpu")
        detector, _ = fit_detector(config, training_images(category / "train" / "good"), progress=False)
        save_detector(detector, model)
    pictures = [p.read_bytes() for p in sorted((category / "test").rglob("*.png"))]
    folder = work / "in"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(work / "padim-lines", ignore_errors=True)
    folder.mkdir()
    broker, port = start_broker(work)
    lines = work / "lines.yaml"
    lines.write_text(
        "lines:\n  - name: bench\n    latency_budget_ms: 200\n    source: {type: folder, path: in}\n"
        f"    sinks: [{{type: mqtt, host: 127.0.0.1, port: {port}}}]\n"
    )
    server, url = start_server(work, model, lines)
    received = Received(port, "padim/bench/verdicts")
    report: dict = {
        "machine": f"{machine_name()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "model": "resnet18 224 px, default options, seeded random weights",
        "budget_ms": BUDGET_MS,
    }
    try:
        run_rate(folder, pictures, 5, 2, received, "warm")
        report["rates"] = [run_rate(folder, pictures, r, args.seconds, received, f"r{r}") for r in RATES]
        for row in report["rates"]:
            print(f"{row['rate']:>4} pictures/s: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, late {row['late']}")
        held = None
        for rate in LADDER:
            row = run_rate(folder, pictures, rate, 5, received, f"ladder{rate}")
            print(f"  ladder {rate:>3}/s: p99 {row['p99_ms']} ms, late {row['late']} of {row['pictures']}")
            if row["late"]:
                break
            held = rate
        report["highest_rate_none_late"] = held
        print(f"highest rate with none late at {BUDGET_MS:.0f} ms: {held} pictures/s (ladder {LADDER})")
        # CPU per picture: the line against POST /score alone, same pictures, same rate, alternating (3 rounds)
        service = psutil.Process(server.pid)
        rate, count = 10.0, int(10 * args.seconds)
        line_cpu, http_cpu = [], []
        for round_ in range(3):
            before = cpu_seconds(service)
            run_rate(folder, pictures, rate, args.seconds, received, f"cpu{round_}")
            line_cpu.append((cpu_seconds(service) - before) / count)
            before = cpu_seconds(service)
            http_rate(url, pictures, rate, count)
            http_cpu.append((cpu_seconds(service) - before) / count)
        line_ms, http_ms = statistics.median(line_cpu) * 1000, statistics.median(http_cpu) * 1000
        report["cpu_ms_per_picture"] = {
            "line": round(line_ms, 2),
            "score_http": round(http_ms, 2),
            "ratio": round(line_ms / http_ms, 3),
            "rounds": {
                "line": [round(x * 1000, 1) for x in line_cpu],
                "score_http": [round(x * 1000, 1) for x in http_cpu],
            },
        }
        print(
            f"service CPU per picture at {rate:g}/s (median of 3 alternating rounds): line {line_ms:.1f} ms, "
            f"POST /score {http_ms:.1f} ms ({line_ms / http_ms:.2f}x)"
        )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        broker.terminate()
        received.client.loop_stop()
    print(json.dumps(report, indent=2))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
