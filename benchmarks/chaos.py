"""Faults at once for half an hour or more: a soak, on 127.0.0.1 only, bounded, that stops by itself.

``padim serve --workers 2 --repository REPO`` with the record in PostgreSQL (``PADIM_RECORD_REQUIRED``: no answer
without its row; the record's journal and pictures and the line's journal on a small tmpfs) and one hot-folder line
to a real MQTT broker. Clients post known pictures at a steady rate, a writer drops a picture into the hot folder
every ``--line-every`` seconds, and every ``--every`` seconds (seeded) one fault, the kinds in a shuffled cycle:

    api         kill -9 of an API process
    scoring     kill -9 of the scoring process
    supervisor  kill -9 of the supervisor; restarted as systemd would (its children, told by Linux, stop first)
    postgres    PostgreSQL restarted
    broker      the MQTT broker down for 10 s
    swap        version 2 activated, then rolled back 5 s later
    disk        the small disk full for 20 s

It prints the answers given; the errors by kind with the seconds they took and the fault they followed; answers that
carry another picture's or another version's score (must be 0); records lost, answered rows the database lacks (must
be 0); line pictures whose verdict arrived twice or not at all (must be 0); and the service's memory and open files
at the start and the end (flat: within one model's size).

    python benchmarks/chaos.py [--minutes 40] [--every 20-30] [--seed 0] [--rate 4] [--output FILE]

The defaults cause 60-80 faults in 40 minutes (the next fault is drawn once the last one has ended).

Needs root (the tmpfs) and Debian's postgresql and mosquitto (``bash tests/setup-system.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil
from timing import machine_name, wait_ready, work_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import components  # noqa: E402
from helpers import SmallDisk, free_port, roles, small_disk  # noqa: E402

KINDS = ("api", "scoring", "supervisor", "postgres", "broker", "swap", "disk")
ADMIN = "chaos-admin-key"
PNG = {"content-type": "image/png"}
#: Two answers for one picture and version agree this closely (float32 on one CPU; a restarted process included).
SCORE_RTOL = 1e-3


def padim(*args: str | Path) -> None:
    subprocess.run([sys.executable, "-m", "padim", "-q", *map(str, args)], check=True)


class Service:
    """``padim serve`` as its own process group, started again after a kill of its supervisor."""

    def __init__(self, work: Path, repository: Path, env: dict):
        self.work, self.repository, self.env = work, repository, env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, wait: bool = True) -> None:
        self.starts += 1
        log = open(self.work / f"server-{self.starts}.log", "w")
        command = [sys.executable, "-m", "padim", "serve", "--repository", str(self.repository), "--workers", "2"]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port), "--device", "cpu"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        if wait:
            self.wait_ready(180)

    def wait_ready(self, timeout: float) -> None:
        if wait_ready(self.url, timeout):
            return
        raise SystemExit(f"the service was not ready in {timeout:.0f} s: see {self.work}/server-{self.starts}.log")

    def tree(self) -> list[psutil.Process]:
        assert self.process is not None
        try:
            top = psutil.Process(self.process.pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_supervisor(self) -> None:
        """kill -9 of the supervisor; its children stop on the SIGTERM Linux sends them, and what is left after
        30 s is killed (systemd's stop of the unit's control group), then the unit is started again."""
        assert self.process is not None
        children = self.tree()[1:]
        self.process.kill()
        self.process.wait(30)
        _, alive = psutil.wait_procs(children, timeout=30)
        for process in alive:
            process.kill()
        self.start(wait=False)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


class Clients:
    """``count`` threads posting ``pictures`` in turn, together ``rate`` a second, each answer kept."""

    def __init__(self, url: str, pictures: list[bytes], count: int, rate: float, until: float):
        self.url, self.pictures, self.until = url, pictures, until
        self.answers: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k, count / rate), daemon=True) for k in range(count)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _run(self, k: int, period: float) -> None:
        client = httpx.Client(timeout=30)
        n = k
        next_at = time.monotonic() + k * period / len(self.threads)
        while not self.stop.is_set() and time.time() < self.until:
            self.stop.wait(max(0.0, next_at - time.monotonic()))
            next_at += period
            index = n % len(self.pictures)
            n += len(self.threads)
            sent = time.time()
            answer = {"sent": sent, "picture": index}
            try:
                response = client.post(self.url + "/score", content=self.pictures[index], headers=PNG)
                answer["status"] = response.status_code
                body = response.json()
                if response.status_code == 200:
                    answer.update(raw=body["raw_score"], version=body["model"]["version"], record=body.get("record_id"))
                else:
                    answer["kind"] = f"{response.status_code} {body.get('error', {}).get('code', '?')}"
            except (httpx.HTTPError, ValueError) as error:
                answer.update(status=0, kind=type(error).__name__)
                client.close()
                client = httpx.Client(timeout=30)
            answer["answered"] = time.time()
            with self.lock:
                self.answers.append(answer)

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


class LineWriter:
    """A picture into the hot folder every ``every`` seconds, each under a name of its own."""

    def __init__(self, folder: Path, pictures: list[bytes], every: float, until: float):
        self.folder, self.pictures, self.every, self.until = folder, pictures, every, until
        self.written: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self.stop.wait(self.every) and time.time() < self.until:
            name = f"part-{n:06d}.png"
            temporary = self.folder / f".{name}.tmp"  # written whole, then renamed in: a camera PC's copy
            temporary.write_bytes(self.pictures[n % len(self.pictures)])
            os.replace(temporary, self.folder / name)
            self.written.append(name)
            n += 1


def sample(service: Service) -> dict:
    """The service's processes: resident memory and open files, summed."""
    rss = fds = 0
    for process in service.tree():
        try:
            rss += process.memory_info().rss
            fds += process.num_fds()
        except psutil.NoSuchProcess:
            continue
    return {"time": time.time(), "rss_mib": round(rss / 2**20, 1), "open_files": fds}


def settled(service: Service, seconds: float = 30.0) -> dict:
    """The service's memory and files once it has been quiet and ready a while (median of a few samples)."""
    service.wait_ready(180)
    time.sleep(seconds)
    samples = []
    for _ in range(5):
        samples.append(sample(service))
        time.sleep(1)
    samples.sort(key=lambda s: s["rss_mib"])
    return samples[len(samples) // 2]


def fault(kind: str, rng: random.Random, service: Service, cluster, broker, disk: SmallDisk) -> str:
    """Cause one fault of ``kind`` (and end it, for those that last); what was done."""
    admin = {"x-api-key": ADMIN}
    if kind in ("api", "scoring"):
        assert service.process is not None
        found = roles(service.process.pid)
        role = rng.choice(["api-1", "api-2"]) if kind == "api" else "scoring"
        if role not in found:
            return f"{role} not running (being started): skipped"
        os.kill(found[role], signal.SIGKILL)
        return f"kill -9 {role} (pid {found[role]})"
    if kind == "supervisor":
        service.kill_supervisor()
        return "kill -9 supervisor, started again"
    if kind == "postgres":
        cluster.stop()
        cluster.start()
        return "PostgreSQL restarted"
    if kind == "broker":
        broker.stop()
        time.sleep(10)
        broker.start()
        return "broker down 10 s"
    if kind == "swap":
        up = httpx.post(service.url + "/models/weave/versions/2/activate", headers=admin, timeout=120)
        time.sleep(5)
        back = httpx.post(service.url + "/models/weave/rollback", headers=admin, timeout=120)
        return f"activate 2: {up.status_code}, rollback: {back.status_code}"
    if kind == "disk":
        disk.fill()
        time.sleep(20)
        disk.free()
        return "disk full 20 s"
    raise ValueError(kind)


def references(url: str, pictures: list[bytes]) -> dict[int, float]:
    scores = {}
    for index, data in enumerate(pictures):
        response = httpx.post(url + "/score", content=data, headers=PNG, timeout=60)
        response.raise_for_status()
        scores[index] = response.json()["raw_score"]
    return scores


def report_errors(answers: list[dict], faults: list[dict]) -> dict:
    """Errors by kind: how many, over how many seconds (one-second buckets), and after which fault kind."""
    by_kind: dict[str, dict] = {}
    starts = [f["start"] for f in faults]
    for answer in answers:
        if answer["status"] == 200:
            continue
        entry = by_kind.setdefault(answer["kind"], {"count": 0, "seconds": set(), "after": Counter()})
        entry["count"] += 1
        entry["seconds"].add(int(answer["sent"]))
        before = [f for f, s in zip(faults, starts, strict=True) if s <= answer["sent"]]
        entry["after"][before[-1]["kind"] if before else "none"] += 1
    return {
        kind: {"count": e["count"], "seconds": len(e["seconds"]), "after_fault": dict(e["after"])}
        for kind, e in sorted(by_kind.items())
    }


def records_kept(database_url: str) -> set[str]:
    import psycopg

    with psycopg.connect(database_url) as db:
        return {str(row[0]) for row in db.execute("select id from records")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=40.0, help="how long faults are caused (default 40)")
    parser.add_argument("--every", default="20-30", help="seconds between faults, drawn in this range (20-30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=4.0, help="/score requests a second, all clients (4)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--line-every", type=float, default=2.0, help="seconds between hot-folder pictures (2)")
    parser.add_argument("--workdir", type=Path, default=None, help="kept when given (else a temporary folder)")
    parser.add_argument("--output", type=Path, default=None, help="write the report as JSON here too")
    args = parser.parse_args()
    low, high = (float(x) for x in args.every.split("-"))
    for marker in ("tmpfs", "postgres", "mosquitto"):
        missing = components.COMPONENTS[marker].missing()
        if missing:
            raise SystemExit(f"{marker}: {missing} (bash tests/setup-system.sh provides it)")
    import mosquitto
    import postgres

    from padim.models.data.synthetic import generate
    from padim.models.repository import Repository

    work = work_folder(args.workdir, "padim-chaos-")
    generate(work / "data", ("weave",), train=30, test_good=6, test_defect=4, size=96, seed=0)
    data = work / "data" / "weave"
    for name, seed in (("v1.padim", 0), ("v2.padim", 1)):
        if not (work / name).is_file():
            padim("train", data / "train" / "good", "--output", work / name, "--weights", "random", "--seed", seed)
    pictures = [p.read_bytes() for p in sorted((data / "test").rglob("*.png"))]
    repository_root = work / "repository"
    repository = Repository(repository_root)
    if not repository.versions("weave"):
        repository.activate("weave", repository.add("weave", work / "v1.padim").version)
        repository.add("weave", work / "v2.padim")
    model_mib = (work / "v1.padim").stat().st_size / 2**20

    cluster = postgres.Cluster()
    database = cluster.new_database()
    broker = mosquitto.Broker(work / "broker")
    broker.start()
    subscriber = mosquitto.Subscriber(broker.port, "padim/press/verdicts", client_id="chaos-subscriber")
    hot = work / "in"
    hot.mkdir(exist_ok=True)
    rng = random.Random(args.seed)
    with small_disk(work / "disk", 64 * 2**20) as disk:
        lines = work / "lines.yaml"
        lines.write_text(
            f"state_dir: {disk.path / 'lines'}\nlines:\n  - name: press\n"
            f"    source: {{type: folder, path: {hot}, settle_s: 0.2, poll_s: 0.2}}\n"
            f"    sinks:\n      - {{type: mqtt, host: 127.0.0.1, port: {broker.port}, topic: padim/press/verdicts}}\n"
        )
        env = {
            "PADIM_ADMIN_KEY": ADMIN,
            "PADIM_RECORD_DIR": str(disk.path / "record"),
            "PADIM_RECORD_URL": database,
            "PADIM_RECORD_REQUIRED": "true",
            "PADIM_LINES": str(lines),
        }
        service = Service(work, repository_root, env)
        service.start()
        try:
            reference = {1: references(service.url, pictures)}
            admin = {"x-api-key": ADMIN}
            httpx.post(service.url + "/models/weave/versions/2/activate", headers=admin, timeout=120).raise_for_status()
            reference[2] = references(service.url, pictures)
            httpx.post(service.url + "/models/weave/rollback", headers=admin, timeout=120).raise_for_status()
            start = settled(service, 10)
            began = time.time()
            until = began + args.minutes * 60
            clients = Clients(service.url, pictures, args.clients, args.rate, until)
            writer = LineWriter(hot, pictures, args.line_every, until)
            clients.start()
            writer.thread.start()
            samples, faults = [start], []
            cycle: list[str] = []
            next_fault = began + rng.uniform(low, high)
            print(f"soak: {args.minutes:g} min, a fault every {args.every} s, seed {args.seed}", flush=True)
            while time.time() < until:
                if time.time() >= next_fault:
                    if not cycle:
                        cycle = rng.sample(KINDS, len(KINDS))
                    kind = cycle.pop()
                    started = time.time()
                    try:
                        did = fault(kind, rng, service, cluster, broker, disk)
                    except (httpx.HTTPError, OSError) as error:  # e.g. a swap while the service is starting
                        did = f"not done: {type(error).__name__}: {error}"
                    faults.append({"kind": kind, "start": started, "end": time.time(), "what": did})
                    print(f"{started - began:7.1f} s  {kind:10s} {did}", flush=True)
                    next_fault = time.time() + rng.uniform(low, high)
                samples.append(sample(service))
                time.sleep(1.0)
            clients.join()
            writer.stop.set()
            writer.thread.join(30)
            end = settled(service, 30)
            # every row answered is in the database once the journals have been replayed; every line picture
            # delivered once the outbox has drained
            deadline = time.time() + 180
            while time.time() < deadline:
                storage = httpx.get(service.url + "/records/storage", headers=admin, timeout=10).json()
                delivered = {m["source"] for m in subscriber.messages}
                if storage.get("rows_waiting") == 0 and set(writer.written) <= delivered:
                    break
                time.sleep(1)
            time.sleep(5)  # a second delivery, were there one, would come now
            kept = records_kept(database)
            messages = list(subscriber.messages)
        finally:
            service.stop()
            subscriber.close()
            broker.stop()
            cluster.remove()

    answers = clients.answers
    answered = [a for a in answers if a["status"] == 200]
    expected = [reference[a["version"]][a["picture"]] for a in answered]
    wrong = [a for a, e in zip(answered, expected, strict=True) if abs(a["raw"] - e) > SCORE_RTOL * abs(e)]
    lost = [a for a in answered if a.get("record") not in kept]
    per_source = Counter(m["source"] for m in messages)
    per_id = Counter(m["id"] for m in messages)
    twice = sorted(s for s, n in per_source.items() if n > 1)
    missing = sorted(set(writer.written) - set(per_source))
    by_fault = defaultdict(int)
    for f in faults:
        by_fault[f["kind"]] += 1
    report = {
        "machine": machine_name(),
        "python": platform.python_version(),
        "minutes": args.minutes,
        "every_s": args.every,
        "seed": args.seed,
        "rate_per_s": args.rate,
        "faults": len(faults),
        "faults_by_kind": dict(by_fault),
        "service_starts": service.starts,
        "answers": len(answers),
        "answered_200": len(answered),
        "errors": report_errors(answers, faults),
        "wrong_answers": len(wrong),
        "records_lost": len(lost),
        "line_pictures": len(writer.written),
        "line_delivered_twice": len(twice),
        "line_ids_received_twice": sum(1 for n in per_id.values() if n > 1),
        "line_missing": len(missing),
        "memory_start_mib": start["rss_mib"],
        "memory_end_mib": end["rss_mib"],
        "memory_max_mib": max(s["rss_mib"] for s in samples),
        "open_files_start": start["open_files"],
        "open_files_end": end["open_files"],
        "model_mib": round(model_mib, 1),
        "fault_log": faults,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "fault_log"}, indent=1))
    verdict = (
        len(wrong) == 0
        and len(lost) == 0
        and not twice
        and not missing
        and end["rss_mib"] - start["rss_mib"] <= model_mib
    )
    print(
        f"{'PASS' if verdict else 'FAIL'}: {len(faults)} faults, {len(answered)}/{len(answers)} answered, "
        f"{len(wrong)} wrong, {len(lost)} records lost, {len(twice)} delivered twice, {len(missing)} missing, "
        f"memory {start['rss_mib']:.0f} -> {end['rss_mib']:.0f} MiB (a model: {model_mib:.1f} MiB), "
        f"open files {start['open_files']} -> {end['open_files']}"
    )
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
