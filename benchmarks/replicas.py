"""One and two replicas behind a real load balancer, sharing a repository folder and a real PostgreSQL record.

Starts a throwaway PostgreSQL cluster (tests/postgres.py), Debian's haproxy (tests/haproxy.py: health checks on
/health/ready, retries) and ``padim serve`` replicas (resnet18, seeded random weights, 224 px, the default
runtime: ONNX Runtime on a CPU, so each version is exported once into the repository's shared cache), then:

1. requests per second through the balancer with one replica, then with two, at the same closed-loop load;
2. an activation of version 2 through replica a under that load: how long until a answers with it (a loads it,
   exporting it first) and until b does (b reads the repository's pointer every ``--poll`` seconds, then
   loads the export a made), and how many requests failed meanwhile.

    python benchmarks/replicas.py [--seconds 15] [--clients 8] [--output benchmarks/results/replicas-MACHINE.json]

On a 2-core machine two replicas share the same two cores: expect no gain in throughput (the test is of
correctness); on a cluster each replica has its own GPU or cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from timing import machine_name, seeded_resnet18, wait_ready, work_folder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test harness (imported where used): PostgreSQL, haproxy, the load


def start(name: str, port: int, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "padim", "serve", "--port", str(port)],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, "PADIM_REPLICA": name},
        )
    if wait_ready(f"http://127.0.0.1:{port}", 600, process):
        return process
    if process.poll() is not None:
        raise SystemExit(f"replica {name} exited:\n{log.read_text()}")
    raise SystemExit(f"replica {name} not ready in time")


def throughput(url: str, pictures: list[bytes], clients: int, seconds: float) -> float:
    from helpers import closed_loop

    results: list = []
    for thread in closed_loop(url, pictures, clients, 2.0, results, threading.Event()):  # warm
        thread.join()
    results.clear()
    begun = time.monotonic()
    for thread in closed_loop(url, pictures, clients, seconds, results, threading.Event()):
        thread.join()
    return sum(status == 200 for _, status, _ in results) / (time.monotonic() - begun)


def version_of(url: str, data: bytes) -> int | None:
    try:
        response = httpx.post(url + "/score", content=data, headers={"content-type": "image/png"}, timeout=60)
        return response.json()["model"]["version"] if response.status_code == 200 else None
    except httpx.TransportError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds of load for each throughput")
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--poll", type=float, default=5.0, help="PADIM_REPOSITORY_POLL_S (the chart's default: 5)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the replicas and the cluster are stopped on the way out

    from haproxy import Balancer
    from helpers import closed_loop, free_port
    from postgres import Cluster

    from padim.models import PadimConfig, fit_detector, training_images
    from padim.models.data.synthetic import generate
    from padim.models.fit.model_file import save_detector
    from padim.models.repository import Repository

    work = work_folder(args.workdir, "padim-replicas-")
    category = work / "data" / "carpet"
    if not category.exists():
        generate(work / "data", ("carpet",), train=60, test_good=20, test_defect=5, size=224, seed=1)
    weights = seeded_resnet18(work / "resnet18-seed0.pth")
    models = []
    for seed in (0, 1):
        path = work / f"carpet-{seed}.padim"
        if not path.exists():
            config = PadimConfig(weights=str(weights), image_size=224, device="cpu", seed=seed)
            detector, _ = fit_detector(config, training_images(category / "train" / "good"), progress=False)
            save_detector(detector, path)
        models.append(path)
    pictures = [p.read_bytes() for p in sorted((category / "test").rglob("*.png"))]
    root = work / f"repository-{time.time_ns()}"
    repository = Repository(root)
    repository.activate("carpet", repository.add("carpet", models[0]).version)
    repository.add("carpet", models[1])

    cluster = Cluster()
    env = {
        "PADIM_REPOSITORY": str(root),
        "PADIM_REPOSITORY_POLL_S": str(args.poll),
        "PADIM_RECORD_DIR": str(work / f"record-{time.time_ns()}"),
        "PADIM_RECORD_URL": cluster.new_database(),
        "PADIM_ADMIN_KEY": "bench-admin",
        "PADIM_DEVICE": "cpu",
    }
    ports = {"a": free_port(), "b": free_port()}
    processes: list[subprocess.Popen] = []
    report: dict = {
        "machine": f"{machine_name()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "model": "resnet18 224 px, default options, seeded random weights; runtime auto (ONNX Runtime)",
        "clients": args.clients,
        "poll_s": args.poll,
    }
    try:
        started = time.monotonic()
        processes.append(start("a", ports["a"], env, work / "a.log"))
        report["first_start_s"] = round(time.monotonic() - started, 1)  # includes exporting version 1
        with Balancer(work, {"a": ports["a"]}) as one:
            report["one_replica_rps"] = round(throughput(one.url, pictures, args.clients, args.seconds), 1)
        print(f"one replica: {report['one_replica_rps']} requests/s")
        started = time.monotonic()
        processes.append(start("b", ports["b"], env, work / "b.log"))
        report["second_start_s"] = round(time.monotonic() - started, 1)  # the export is in the shared cache
        with Balancer(work, ports) as two:
            report["two_replicas_rps"] = round(throughput(two.url, pictures, args.clients, args.seconds), 1)
            print(f"two replicas: {report['two_replicas_rps']} requests/s")
            results: list = []
            stop = threading.Event()
            threads = closed_loop(two.url, pictures, args.clients, 600, results, stop)
            time.sleep(2.0)
            asked = time.monotonic()
            answer = httpx.post(
                f"http://127.0.0.1:{ports['a']}/models/carpet/versions/2/activate",
                headers={"x-api-key": "bench-admin"},
                timeout=600,
            )
            answer.raise_for_status()
            on_a = time.monotonic() - asked
            while version_of(f"http://127.0.0.1:{ports['b']}", pictures[0]) != 2:
                if time.monotonic() - asked > 600:
                    raise SystemExit("b did not serve version 2 within 600 s")
                time.sleep(0.1)
            on_b = time.monotonic() - asked
            time.sleep(1.0)
            stop.set()
            for thread in threads:
                thread.join()
        report["activation"] = {
            "served_by_a_s": round(on_a, 2),
            "served_by_every_replica_s": round(on_b, 2),
            "requests": len(results),
            "failed": sum(status != 200 for _, status, _ in results),
        }
        print(
            f"activation: a answered with version 2 after {on_a:.1f} s, every replica served it after {on_b:.1f} s; "
            f"{report['activation']['failed']} of {len(results)} requests failed meanwhile"
        )
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        cluster.remove()
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
