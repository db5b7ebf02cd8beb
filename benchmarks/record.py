"""The inspection record and learning from it: what it costs scoring, what its writer sustains, what an update
costs and what it changes.

1. **scoring throughput** of a real `padim serve` (torch runtime, resnet18) with the record off, on SQLite and
   on PostgreSQL (a throwaway cluster, tests/postgres.py), at batch 16 (`/score/batch`) and batch 1 (`/score`),
   `--clients` threads posting without pause for `--seconds`; the three servers are measured in interleaved
   rounds and the median of the rounds is kept;
2. **rows per second the writer sustains**: the record's two writer threads (journal, then database) fed rows
   as fast as they take them, until the database has every one, on SQLite and PostgreSQL;
3. **an update with 40 reviewed pictures against a full refit** (resnet18, `--size` px, `--fit` normal pictures
   fitted): `update_model` (the service's update job) against `padim train` on all the pictures;
4. **what the update changes**: false alarms on normal pictures under another lamp (not among the 40), and
   recall on generated defects, before and after.

    python benchmarks/record.py --output benchmarks/results/DATE-MACHINE-record.json

Prints one JSON object; --output also writes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from timing import wait_ready, work_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import components  # noqa: E402
from helpers import free_port  # noqa: E402


def machine() -> str:
    name = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return f"{os.cpu_count()}-core {name}"


def generate(work: Path, size: int, train: int, shifted: int, defects: int) -> tuple[Path, list[Path], list[Path]]:
    from padim.models.data.synthetic import generate as synth

    (category,) = synth(
        work / "data", ("weave",), train=train + shifted, test_good=0, test_defect=defects // 4, size=size, seed=11
    )
    normal = sorted((category / "train" / "good").glob("*.png"))
    fit, extra = normal[:train], normal[train:]
    fitted = work / "fit"
    fitted.mkdir(exist_ok=True)
    for path in fit:
        os.replace(path, fitted / path.name)
    lamp = work / "lamp"
    lamp.mkdir(exist_ok=True)
    for path in extra:  # another lamp: dimmer contrast, brighter (the tests' shift)
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)
        Image.fromarray(np.clip(pixels * 0.5 + 100, 0, 255).astype(np.uint8)).save(lamp / path.name)
    found = sorted(p for p in (category / "test").glob("*/*.png") if p.parent.name != "good")
    return fitted, sorted(lamp.glob("*.png")), found


def train(data: Path, output: Path, size: int) -> float:
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "padim",
            "-q",
            "train",
            str(data),
            "--output",
            str(output),
            "--weights",
            "random",
            "--image-size",
            str(size),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - started


# ------------------------------------------------------------------------------ 1. scoring throughput
class Server:
    def __init__(self, model: Path, env: dict, work: Path, name: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(work / f"server-{name}.log", "w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "padim",
                "serve",
                str(model),
                "--port",
                str(self.port),
                "--runtime",
                "torch",
                "--device",
                "cpu",
                "--log-level",
                "warning",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        if wait_ready(self.url, 180, every=0.3):
            return
        raise RuntimeError(f"{name}: not ready")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)


def load(url: str, pictures: list[bytes], batch: int, clients: int, seconds: float) -> float:
    """Pictures scored per second by ``clients`` threads posting without pause for ``seconds``. Every picture sent
    is new content (8 bytes after the PNG's end, which decoders ignore), as on a line: the record stores each."""
    done = [0] * clients
    stop = time.perf_counter() + seconds

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = k
            while time.perf_counter() < stop:
                chunk = [pictures[(i + j) % len(pictures)] + os.urandom(8) for j in range(batch)]
                if batch == 1:
                    answer = http.post(url + "/score", content=chunk[0], headers={"content-type": "image/png"})
                else:
                    answer = http.post(
                        url + "/score/batch",
                        files=[("file", (f"{j}.png", d, "image/png")) for j, d in enumerate(chunk)],
                    )
                answer.raise_for_status()
                done[k] += batch
                i += batch

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - started)


def throughput(model: Path, pictures: list[Path], work: Path, cluster, args) -> dict:
    data = [p.read_bytes() for p in pictures]
    servers = {
        "off": Server(model, {}, work, "off"),
        "sqlite": Server(model, {"PADIM_RECORD_DIR": str(work / "record-sqlite")}, work, "sqlite"),
    }
    if cluster is not None:
        servers["postgresql"] = Server(
            model,
            {"PADIM_RECORD_DIR": str(work / "record-pg"), "PADIM_RECORD_URL": cluster.new_database()},
            work,
            "postgresql",
        )
    results: dict = {}
    try:
        for batch, clients in ((16, args.clients), (1, args.clients * 2)):
            rounds: dict[str, list[float]] = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, server in servers.items():  # interleaved: a slow minute hits every server alike
                    rounds[name].append(load(server.url, data, batch, clients, args.seconds))
            medians = {name: statistics.median(values) for name, values in rounds.items()}
            results[f"batch_{batch}"] = {
                name: {
                    "images_per_s": round(medians[name], 2),
                    "rounds": [round(v, 2) for v in rounds[name]],
                    "vs_off": round(medians[name] / medians["off"], 4),
                }
                for name in servers
            }
        for name, server in servers.items():
            if name != "off":
                results[f"rows_{name}"] = httpx.get(server.url + "/records/storage").json()["rows"]
    finally:
        for server in servers.values():
            server.stop()
    return results


# ------------------------------------------------------------------------------ 2. the writer
def writer_rate(url: str | None, folder: Path, rows: int) -> dict:
    from padim.service.record.recorder import Recorder
    from padim.service.record.rows import make_row
    from padim.service.record.store import RecordStore, database_url

    folder.mkdir(parents=True, exist_ok=True)
    store = RecordStore(database_url(url, folder))
    store.migrate()
    recorder = Recorder(folder, store, 10**10, 10**12, 30, 90)
    recorder.start()
    result = {
        "raw_score": 5.0,
        "score": 0.1,
        "threshold": 0.5,
        "raw_threshold": 12.0,
        "is_anomaly": False,
        "anomalous_area": 0.0,
    }
    pictures = [os.urandom(20_000) for _ in range(64)]  # 64 distinct contents, scored again and again
    digests = [hashlib.sha256(p).hexdigest() for p in pictures]
    started = time.perf_counter()
    for first in range(0, rows, 2000):  # in waves the journal writer's queue (10,000 rows) holds
        futures = [
            recorder.submit(
                make_row("weave", 1, result, 3.0, (224, 224), digests[i % 64], 20_000, {"part": str(i)}, 0.02),
                pictures[i % 64],
            )
            for i in range(first, min(rows, first + 2000))
        ]
        for future in futures:
            future.result(120)
    journaled = time.perf_counter() - started
    if not recorder.flushed(600):
        raise RuntimeError(f"the database did not take the rows: {recorder.last_error}")
    committed = time.perf_counter() - started
    recorder.close()
    return {"rows": rows, "journaled_per_s": round(rows / journaled), "committed_per_s": round(rows / committed)}


# ------------------------------------------------------------------------------ 3, 4. the update
def flag_share(model: Path, pictures: list[Path]) -> float:
    from padim.models.fit.learning import flagged

    verdicts = flagged(model, pictures)
    return sum(verdicts) / len(verdicts)


def update_cost(work: Path, fit: Path, lamp: list[Path], defects: list[Path], size: int, reviewed: int) -> dict:
    from padim.core.artifact import read_header
    from padim.models.fit.learning import picture_name, update_model
    from padim.models.fit.passes import TrainingImage

    base = work / "base.padim"
    base_seconds = train(fit, base, size)
    learn, others = lamp[:reviewed], lamp[reviewed:]
    images = [TrainingImage(p, picture_name(hashlib.sha256(p.read_bytes()).hexdigest())) for p in learn]
    started = time.perf_counter()
    update_model(base, images, [], work / "updated.padim")
    update_seconds = time.perf_counter() - started
    everything = work / "everything"
    everything.mkdir(exist_ok=True)
    for path in [*fit.glob("*.png"), *learn]:
        target = everything / path.name
        if not target.exists():
            target.write_bytes(path.read_bytes())
    refit_seconds = train(everything, work / "refit.padim", size)
    return {
        "fitted": len(list(fit.glob("*.png"))),
        "reviewed": reviewed,
        "size": size,
        "base_fit_s": round(base_seconds, 2),
        "update_s": round(update_seconds, 2),
        "full_refit_s": round(refit_seconds, 2),
        "update_vs_refit": round(update_seconds / refit_seconds, 3),
        "other_lamp_pictures": len(others),
        "defects": len(defects),
        "false_alarms_other_lamp_before": round(flag_share(base, others), 4),
        "false_alarms_other_lamp_after": round(flag_share(work / "updated.padim", others), 4),
        "false_alarms_other_lamp_refit": round(flag_share(work / "refit.padim", others), 4),
        "recall_before": round(flag_share(base, defects), 4),
        "recall_after": round(flag_share(work / "updated.padim", defects), 4),
        "recall_refit": round(flag_share(work / "refit.padim", defects), 4),
        # the earlier pictures' out-of-fold scores are kept from the base fit (models of fewer pictures)
        "raw_threshold_before": round(read_header(base)["calibration"]["threshold"], 4),
        "raw_threshold_after": round(read_header(work / "updated.padim")["calibration"]["threshold"], 4),
        "raw_threshold_refit": round(read_header(work / "refit.padim")["calibration"]["threshold"], 4),
        "promised_after": read_header(work / "updated.padim")["calibration"]["promised_false_alarm_rate"],
        "promised_refit": read_header(work / "refit.padim")["calibration"]["promised_false_alarm_rate"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--fit", type=int, default=200, help="normal pictures the base model fits")
    parser.add_argument("--reviewed", type=int, default=40)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writer-rows", type=int, default=20_000)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    work = work_folder(args.workdir, "padim-record-")
    fit, lamp, defects = generate(work, args.size, args.fit, args.reviewed + 100, 60)
    cluster = None
    if components._postgres() is None:
        import postgres

        cluster = postgres.Cluster()
    try:
        report = {
            "machine": machine(),
            "date": time.strftime("%Y-%m-%d"),
            "torch_threads": os.cpu_count(),
            "update": update_cost(work, fit, lamp, defects, args.size, args.reviewed),
        }
        print(json.dumps(report["update"]), flush=True)
        report["writer"] = {"sqlite": writer_rate(None, work / "writer-sqlite", args.writer_rows)}
        if cluster is not None:
            report["writer"]["postgresql"] = writer_rate(cluster.new_database(), work / "writer-pg", args.writer_rows)
        print(json.dumps(report["writer"]), flush=True)
        report["throughput"] = throughput(work / "base.padim", sorted(fit.glob("*.png"))[:64], work, cluster, args)
    finally:
        if cluster is not None:
            cluster.remove()
    print(json.dumps(report, indent=1))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
