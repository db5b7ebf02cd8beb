"""The run folder: where the processes of one service meet (in ``/dev/shm``, memory that is shared).

Its name says whose it is: ``padim-NS-PID-START-RANDOM``, the supervisor's pid namespace, pid and start time. A new
supervisor removes the folders of supervisors that are gone (:func:`sweep`: a kill -9 or the OOM killer leaves its
folder behind), never one whose supervisor runs: a pid is only taken for the same process with its start time.

- ``settings.json`` (the supervisor): the service's settings but the keys (mode 0600): the keys
  (:data:`SECRETS`) never go into a file; each child reads them once, when it starts, from a pipe of its own
  (:meth:`RunFolder.secrets_pipe`);
- ``status`` (each process its row): state and pid of the scoring process (row 0) and of each API process, and the
  table's generation;
- ``places``, ``places.lock`` (each process its row): the queue bound's counts
  (:class:`padim.service.device.admission.SharedPlaces`);
- ``table.json`` (the scoring process): the served versions (model -> serial, version), the default model,
  readiness;
- ``views/SERIAL.json`` (the scoring process): what an API process needs of a version: configuration, calibration,
  identity;
- ``slots/ROW-N`` (API process ROW): a picture's model input (8-bit pixels) on its way to the device, then its map
  on the way back;
- ``metrics/`` (every process): Prometheus' multiprocess files (``PROMETHEUS_MULTIPROC_DIR``);
- ``engine.sock``, ``score.sock`` (the scoring process): its HTTP API (the routes API processes pass on), and
  pictures to score.

Every JSON file is replaced atomically (a temporary file renamed), so a reader sees the old one or the new one.
"""

from __future__ import annotations

import collections
import contextlib
import json
import mmap
import os
import shutil
import struct
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from padim.core.calibration import Calibration
from padim.models.config import PadimConfig
from padim.models.data.framing import Framing
from padim.models.data.images import to_pixels
from padim.models.features.backbones import WeightsInfo
from padim.models.options import json_value
from padim.models.scoring.detector import Provenance

from ..device.admission import SharedPlaces
from ..device.device_decoding import DeviceDecode
from ..edge.errors import ApiError
from ..settings import ServiceSettings
from ..state import model_info

#: Process states in ``status``.
STARTING, READY, DRAINING, STOPPED = 0, 1, 2, 3
_WORD = struct.Struct("<q")
#: ``status``: generation of the table, then (state, pid, starts) for each row.
_HEADER_WORDS = 1
_ROW_WORDS = 3


#: Settings that are never written into the run folder: each child reads them from a pipe when it starts.
SECRETS = ("api_key", "admin_key", "review_key", "record_url")


def shared_memory_root() -> Path:
    """Where run folders go: ``/dev/shm`` (a tmpfs: files there are memory) when it can be written, else the
    temporary folder."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot: /proc/PID/stat's 22nd field); ``None`` if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # fields from the 3rd on follow the name's ")"


def pid_namespace() -> int:
    """This process's pid namespace (its inode): pids are compared only within it."""
    return os.stat("/proc/self/ns/pid").st_ino


def sweep(root: Path) -> list[Path]:
    """Remove the run folders in ``root`` of this user's supervisors, in this pid namespace, that are gone (no process
    with that pid and start time); what was removed. Another namespace's folders (a container sharing the host's
    /dev/shm) and folders named otherwise are left alone."""
    removed, mine, uid = [], pid_namespace(), os.getuid()
    for folder in sorted(root.glob("padim-*")):
        parts = folder.name.split("-")
        if len(parts) != 5 or not all(p.isdigit() for p in parts[1:4]) or folder.is_symlink():
            continue
        namespace, pid, start = (int(p) for p in parts[1:4])
        with contextlib.suppress(OSError):
            if namespace == mine and folder.stat().st_uid == uid and process_start(pid) != start:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


class RunFolder:
    """The run folder ``root`` of a service with ``workers`` API processes (rows 1..workers; row 0 scores).

    The supervisor's holds the keys (``secrets``) in memory, for :meth:`secrets_pipe`; a child's holds none."""

    def __init__(self, root: Path, secrets: dict[str, str] | None = None):
        self.root = Path(root)
        self.workers = int((self.root / "workers").read_text()) if (self.root / "workers").exists() else 0
        self._status: mmap.mmap | None = None
        self._secrets = secrets or {}

    # ----------------------------------------------------------------- made by the supervisor
    @classmethod
    def create(cls, settings: ServiceSettings, workers: int) -> RunFolder:
        pid = os.getpid()
        root = shared_memory_root() / f"padim-{pid_namespace()}-{pid}-{process_start(pid)}-{uuid.uuid4().hex[:8]}"
        root.mkdir(mode=0o700)
        for name in ("views", "slots", "metrics"):
            (root / name).mkdir()
        (root / "workers").write_text(str(workers))
        secrets = {
            name: getattr(settings, name).get_secret_value() for name in SECRETS if getattr(settings, name) is not None
        }
        values = settings.model_dump(mode="json", exclude=set(SECRETS))
        descriptor = os.open(root / "settings.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(values, handle)
        with open(root / "status", "wb") as handle:
            handle.truncate((_HEADER_WORDS + (workers + 1) * _ROW_WORDS) * _WORD.size)
        SharedPlaces.create(root / "places", workers + 1)
        return cls(root, secrets)

    def secrets_pipe(self) -> int:
        """The read end of a new pipe that holds the keys, its write end closed: for one child to read once, when it
        starts (:meth:`settings`). The caller closes its copy once the child has one."""
        read, write = os.pipe()
        try:
            os.write(write, json.dumps(self._secrets).encode())  # a few hundred bytes: a pipe holds 64 KB
        finally:
            os.close(write)
        return read

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # ----------------------------------------------------------------- paths
    @property
    def engine_socket(self) -> Path:
        return self.root / "engine.sock"

    @property
    def score_socket(self) -> Path:
        return self.root / "score.sock"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def places(self) -> Path:
        return self.root / "places"

    def settings(self, secrets: int) -> ServiceSettings:
        """The service's settings: the run folder's, with the keys read from the pipe ``secrets`` (then closed)."""
        values = json.loads((self.root / "settings.json").read_text())
        with os.fdopen(secrets, "rb") as pipe:
            keys = json.loads(pipe.read() or b"{}")
        return ServiceSettings.model_validate(values | keys)

    # ----------------------------------------------------------------- status
    def _words(self) -> mmap.mmap:
        if self._status is None:
            with open(self.root / "status", "r+b") as handle:
                self._status = mmap.mmap(handle.fileno(), 0)
        return self._status

    def _offset(self, row: int, word: int) -> int:
        return (_HEADER_WORDS + row * _ROW_WORDS + word) * _WORD.size

    def set_state(self, row: int, state: int, pid: int | None = None) -> None:
        """A process's state (its own row; the supervisor writes STARTING and STOPPED)."""
        words = self._words()
        _WORD.pack_into(words, self._offset(row, 0), state)
        if pid is not None:
            _WORD.pack_into(words, self._offset(row, 1), pid)

    def started(self, row: int) -> int:
        """Count one more start of ``row`` (the supervisor's); returns the count."""
        words = self._words()
        count = _WORD.unpack_from(words, self._offset(row, 2))[0] + 1
        _WORD.pack_into(words, self._offset(row, 2), count)
        return count

    def state(self, row: int) -> tuple[int, int]:
        """``(state, pid)`` of ``row``."""
        words = self._words()
        return _WORD.unpack_from(words, self._offset(row, 0))[0], _WORD.unpack_from(words, self._offset(row, 1))[0]

    def generation(self) -> int:
        return _WORD.unpack_from(self._words(), 0)[0]

    def close(self) -> None:
        if self._status is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._status.close()
            self._status = None

    # ----------------------------------------------------------------- the table (the scoring process writes)
    def publish(self, table: dict, views: dict[int, dict]) -> None:
        """Write the views not written yet, then the table, then count a generation: an API process that reads
        the new generation finds every view the table names."""
        for serial, view in views.items():
            path = self.root / "views" / f"{serial}.json"
            if not path.exists():
                _write_json(path, view)
        _write_json(self.root / "table.json", table)
        words = self._words()
        _WORD.pack_into(words, 0, _WORD.unpack_from(words, 0)[0] + 1)

    def forget_views(self, keep: set[int]) -> None:
        """Remove the views of versions no longer loaded."""
        for path in (self.root / "views").glob("*.json"):
            if path.stem.isdigit() and int(path.stem) not in keep:
                path.unlink(missing_ok=True)

    def table(self) -> dict:
        try:
            return json.loads((self.root / "table.json").read_text())
        except (OSError, ValueError):
            return {}

    def view(self, serial: int) -> dict:
        return json.loads((self.root / "views" / f"{serial}.json").read_text())

    def slot_path(self, row: int, number: int) -> Path:
        return self.root / "slots" / f"{row}-{number}"


def journal_name(replica: str | None, row: int) -> str:
    """The record's journal of API process ``row`` (of replica ``replica``): ``journal/[REPLICA.]apiROW``."""
    return f"{replica}.api{row}" if replica else f"api{row}"


def _write_json(path: Path, value: dict) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


# --------------------------------------------------------------------------- views of versions
def view_of(name: str, version: int, serial: int, sha256: str, scorer, device_decode: bool = False) -> dict:
    """What an API process needs of a served version: to decode for it (or leave its JPEGs to the scoring device),
    judge its scores, and name it."""
    calibration = scorer.calibration
    return {
        "name": name,
        "version": version,
        "serial": serial,
        "sha256": sha256,
        "device_decode": device_decode,
        "config": {name: json_value(value) for name, value in scorer.config.to_dict().items()},
        "weights": scorer.weights.to_header(),
        "provenance": scorer.provenance.to_header(),
        "calibration": {
            "header": calibration.to_header(),
            "scores": list(calibration.scores),
            "input_distances": list(calibration.input_distances),
            "taken_scores": list(calibration.taken_scores),
        },
    }


class ScorerView:
    """A served version as an API process sees it: what decoding and verdicts read of a scorer (``config``,
    ``calibration``, ``framing``, ``preprocess``, ``weights``, ``provenance``), without its tensors."""

    def __init__(self, view: dict):
        self.config = PadimConfig.from_mapping(view["config"], source="the scoring process")
        self.weights = WeightsInfo(**view["weights"])
        self.provenance = Provenance.from_header(view["provenance"])
        saved = view["calibration"]

        def floats(key: str) -> torch.Tensor | None:
            return torch.tensor(saved[key], dtype=torch.float64) if saved[key] else None

        self.calibration = Calibration.from_header(
            saved["header"],
            torch.tensor(saved["scores"], dtype=torch.float64),
            floats("input_distances"),
            floats("taken_scores"),
        )
        self.framing = Framing.of(self.config)
        # the scoring device decodes this version's JPEGs: the API process only reads their headers
        self.device_decode = DeviceDecode(torch.device("cpu"), self.framing) if view.get("device_decode") else None

    def preprocess(self, images) -> torch.Tensor:
        """As every scorer's: the framed pixels (:func:`to_pixels`), normalised by the scorer on its device."""
        return to_pixels(images, self.framing)


@dataclass(eq=False)
class ServedView:
    """One served version in an API process: identity, its view, and its model's row in the queue bound."""

    name: str
    version: int
    serial: int
    sha256: str
    scorer: ScorerView

    def info(self):
        return model_info(self.name, self.version, self.sha256, self.scorer)

    def identity(self) -> dict:
        """:meth:`info` as the JSON every answer carries, made once."""
        cached = self.__dict__.get("_identity")
        if cached is None:
            cached = self.__dict__["_identity"] = self.info().model_dump()
        return cached


class Table:
    """An API process's reading of the table: re-read when its generation changes (one shared word per request)."""

    def __init__(self, run: RunFolder):
        self.run = run
        self._generation = -1
        self._table: dict = {}
        self._views: dict[int, ServedView] = {}
        self._engine: int | None = None
        self._lock = threading.Lock()

    def current(self) -> dict:
        generation = self.run.generation()
        if generation != self._generation:
            with self._lock:
                table = self.run.table()
                if table.get("engine") != self._engine:  # a restarted scoring process numbers versions anew
                    self._views.clear()
                    self._engine = table.get("engine")
                self._table, self._generation = table, generation
        return self._table

    def index(self, model: str) -> int:
        """The model's cell in the queue bound (numbered by the scoring process)."""
        index = self.current().get("indices", {}).get(model)
        if index is None:
            raise ApiError("model_not_found", f"no model named {model!r}")
        return int(index)

    def served(self, name: str | None) -> ServedView:
        """The version new requests of ``name`` (the default model when ``None``) go to.

        Raises:
            ApiError: 503 ``not_ready`` while loading or failed; 404 ``model_not_found``.
        """
        table = self.current()
        if not table.get("ready"):
            if table.get("failure"):
                raise ApiError("not_ready", f"the service failed: {table['failure']}", headers={"Retry-After": "30"})
            raise ApiError("not_ready", "models are still loading; retry shortly", headers={"Retry-After": "2"})
        models = table.get("models", {})
        key = name or table.get("default")
        if key is None:
            raise ApiError("model_not_found", "no model is served yet: upload one (POST /models/{name}/versions)")
        if key not in models:
            raise ApiError("model_not_found", f"no model named {key!r}; served: {', '.join(models) or 'none'}")
        return self.of(models[key]["serial"])

    def of(self, serial: int) -> ServedView:
        view = self._views.get(serial)
        if view is None:
            saved = self.run.view(serial)
            view = ServedView(saved["name"], saved["version"], serial, saved["sha256"], ScorerView(saved))
            self._views[serial] = view
        return view


# --------------------------------------------------------------------------- slots
class Slot:
    """A file in the run folder mapped in memory: a picture's model input (uint8 pixels), then its map."""

    def __init__(self, path: Path, number: int, nbytes: int, create: bool):
        self.path, self.number, self.nbytes = path, number, nbytes
        if create:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # memory is taken now: a full /dev/shm is an error here, not a SIGBUS at the first write
                os.posix_fallocate(descriptor, 0, nbytes)
            except OSError:
                os.close(descriptor)
                path.unlink(missing_ok=True)
                raise
        else:
            descriptor = os.open(path, os.O_RDWR)
        try:
            self.memory = mmap.mmap(descriptor, nbytes)
        finally:
            os.close(descriptor)

    def bytes(self, count: int) -> torch.Tensor:
        """The first ``count`` bytes as a uint8 tensor (the memory is shared, not copied): a JPEG for the device."""
        return torch.frombuffer(self.memory, dtype=torch.uint8, count=count)

    def tensor(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first ``prod(shape)`` values of ``dtype``, shaped (the memory is shared, not copied): a picture's
        uint8 pixels, then its float32 map."""
        count = 1
        for side in shape:
            count *= side
        return torch.frombuffer(self.memory, dtype=dtype, count=count).view(*shape)


#: A slot's model input: 8-bit pixels (:func:`to_pixels`), a quarter of float32's bytes; the scorer normalises them.
PIXELS = torch.uint8

#: Slot sizes are rounded up to this (a model's pictures then share one size, and slots are reused).
SLOT_GRAIN = 64 * 1024


class SlotPool:
    """An API process's slots, reused: taken for a picture, given back once the scoring process has answered. At most
    ``keep`` free slots of a size are kept (a burst's extra ones are removed, and their memory given back once the
    scoring process lets go of them too)."""

    def __init__(self, run: RunFolder, row: int, keep: int = 64):
        self.run, self.row, self.keep = run, row, keep
        self._free: dict[int, list[Slot]] = {}
        self._count = 0
        self._lock = threading.Lock()
        for stale in (run.root / "slots").glob(f"{row}-*"):  # a previous process of this row's
            stale.unlink(missing_ok=True)

    def take(self, nbytes: int) -> Slot:
        size = -(-max(nbytes, 1) // SLOT_GRAIN) * SLOT_GRAIN
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            self._count += 1
            number = self._count
        try:
            return Slot(self.run.slot_path(self.row, number), number, size, create=True)
        except OSError as error:
            raise ApiError(
                "overloaded",
                f"no shared memory for another picture ({error.strerror}): give the service a larger /dev/shm "
                "(docker run --shm-size, the chart's sharedMemory)",
                headers={"Retry-After": "1"},
            ) from None

    def give(self, slots: list[Slot]) -> None:
        with self._lock:
            for slot in slots:
                free = self._free.setdefault(slot.nbytes, [])
                if len(free) < self.keep:
                    free.append(slot)
                else:  # unmapped when the last view of it goes
                    slot.path.unlink(missing_ok=True)


class SlotMaps:
    """The scoring process's mappings of API processes' slots, by (row, number), the ``most`` used last; dropped when
    a row's process is replaced (its successor makes its slots anew). A mapping let go stays open while a picture in
    the queue still reads it."""

    def __init__(self, run: RunFolder, most: int = 4096):
        self.run, self.most = run, most
        self._maps: collections.OrderedDict[tuple[int, int], Slot] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, row: int, number: int, nbytes: int) -> Slot:
        key = (row, number)
        with self._lock:
            slot = self._maps.get(key)
            if slot is not None and slot.nbytes == nbytes:
                self._maps.move_to_end(key)
                return slot
        slot = Slot(self.run.slot_path(row, number), number, nbytes, create=False)
        with self._lock:
            self._maps[key] = slot
            while len(self._maps) > self.most:
                self._maps.popitem(last=False)
        return slot

    def drop(self, row: int) -> None:
        with self._lock:
            for key in [k for k in self._maps if k[0] == row]:
                del self._maps[key]
