"""A throwaway MQTT broker (Debian's ``mosquitto``) on a free port on 127.0.0.1, and a subscriber that keeps
what it receives. The broker keeps sessions across its own restarts (persistence on), as a plant's broker does:
a subscriber with a session of its own then misses nothing while the broker was down."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from components import mosquitto_path
from helpers import free_port


class Broker:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.config = self.folder / "mosquitto.conf"
        self.config.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {self.folder}/\nautosave_interval 1\n"
        )
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.folder / "mosquitto.log", "a")
        assert (program := mosquitto_path()) is not None
        self.process = subprocess.Popen([program, "-c", str(self.config)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 10
        while time.time() < deadline:
            probe = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
            try:
                probe.connect("127.0.0.1", self.port)
                probe.disconnect()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("mosquitto did not start: " + (self.folder / "mosquitto.log").read_text())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # saves its sessions and their queued messages
            self.process.wait(10)
        self.process = None


class Subscriber:
    """Keeps every message on ``topic`` (QoS 1, a session that outlives disconnections)."""

    def __init__(self, port: int, topic: str, client_id: str = "test-subscriber"):
        self.messages: list[dict] = []
        self.retained: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
        self.client.on_connect = lambda client, *_: client.subscribe([(topic, 1), (topic + "/+", 1)])
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.2, 1)
        self.topic = topic
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, _client, _userdata, message) -> None:
        with self._lock:
            if message.topic == self.topic:
                self.messages.append(json.loads(message.payload))
            else:
                self.retained[message.topic] = message.payload

    def ids(self) -> set[str]:
        with self._lock:
            return {m["id"] for m in self.messages}

    def wait_for(self, count: int, timeout: float) -> set[str]:
        deadline = time.time() + timeout
        while time.time() < deadline and len(self.ids()) < count:
            time.sleep(0.1)
        return self.ids()

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
