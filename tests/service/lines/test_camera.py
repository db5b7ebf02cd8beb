"""Camera lines on a real `padim serve --lines`: a video file OpenCV wrote (every Nth frame, and triggered over HTTP
and MQTT, its verdicts written to a real OPC UA server's nodes), and an MJPEG stream that drops and comes back."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cv2
import httpx
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from asyncua import Server, ua
from helpers import assert_same_verdict, free_port, run_cli, running_server, wait_until
from mosquitto import Broker, Subscriber

pytestmark = pytest.mark.mosquitto

EVERY = 3
STREAM_FRAMES = 15  # frames the MJPEG server sends before it drops the connection


class Plc:
    """An OPC UA server (asyncua's own) on 127.0.0.1 with a PLC's variables for one line, on a thread of its own."""

    NODES = {"score": ("Score", 0.0), "is_anomaly": ("Reject", False), "part": ("Part", ""), "id": ("Id", "")}

    def __init__(self):
        self.port = free_port()
        self.endpoint = f"opc.tcp://127.0.0.1:{self.port}/plc/"
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.variables: dict = {}
        self._call(self._start())

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    async def _start(self) -> None:
        self.server = Server()
        await self.server.init()
        self.server.set_endpoint(self.endpoint)
        index = await self.server.register_namespace("urn:padim:test-plc")
        line = await self.server.nodes.objects.add_object(index, "Line3")
        for field, (name, initial) in self.NODES.items():
            variable = await line.add_variable(ua.NodeId(f"Line3.{name}", index), name, initial)
            await variable.set_writable()
            self.variables[field] = variable
        self.index = index
        await self.server.start()

    def node_ids(self) -> dict[str, str]:
        return {field: f"ns={self.index};s=Line3.{name}" for field, (name, _) in self.NODES.items()}

    def values(self) -> dict:
        return {field: self._call(v.read_value()) for field, v in self.variables.items()}

    def stop(self) -> None:
        self._call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


class Stream:
    """An MJPEG stream (multipart/x-mixed-replace) that drops its connection after STREAM_FRAMES frames."""

    def __init__(self, frames: list[np.ndarray]):
        encoded = [cv2.imencode(".jpg", f)[1].tobytes() for f in frames]
        self.connections = 0
        stream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stream.connections += 1
                self.send_response(200)
                self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
                self.end_headers()
                try:
                    for i in range(STREAM_FRAMES):
                        jpeg = encoded[i % len(encoded)]
                        head = f"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
                        self.wfile.write(head.encode() + jpeg + b"\r\n")
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:
                    pass
                self.close_connection = True  # the drop

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/stream.mjpg"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def write_video(path: Path, pictures: list[Path]) -> None:
    frames = [cv2.imread(str(p)) for p in pictures]
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (width, height))
    for frame in frames:
        writer.write(frame)
    writer.release()


def frames_of(path: Path) -> list[np.ndarray]:
    """The video's frames as OpenCV decodes them: the reference the line must agree with."""
    capture, frames = cv2.VideoCapture(str(path)), []
    while True:
        ok, frame = capture.read()
        if not ok:
            return frames
        frames.append(frame)


def test_video_stream_and_triggers_reach_mqtt_and_opc_ua(model_file, dataset, tmp_path):
    pictures = sorted((dataset / "test" / "good").glob("*.png")) + sorted((dataset / "test" / "hole").glob("*.png"))
    video = tmp_path / "video.avi"
    write_video(video, pictures)
    frames = frames_of(video)
    assert len(frames) == len(pictures)
    # the reference: padim predict on every Nth frame as OpenCV decodes it
    reference = tmp_path / "frames"
    reference.mkdir()
    for index in range(0, len(frames), EVERY):
        cv2.imwrite(str(reference / f"{index:03d}.png"), frames[index])
    run_cli("-q", "predict", model_file, reference, "--output", tmp_path / "predicted", "--no-maps", "--no-heatmaps")
    lines_ = (tmp_path / "predicted" / "results.jsonl").read_text().splitlines()
    predicted = {int(Path(r["path"]).stem): r for r in map(json.loads, lines_)}

    broker = Broker(tmp_path / "broker")
    broker.start()
    plc = Plc()
    stream = Stream(frames)
    nth = Subscriber(broker.port, "padim/video-nth/verdicts", client_id="nth")
    live = Subscriber(broker.port, "padim/stream/verdicts", client_id="stream")
    lines = tmp_path / "lines.yaml"
    lines.write_text(
        f"""
lines:
  - name: video-nth
    source: {{type: camera, device: video.avi, mode: every_nth, every: {EVERY}}}
    sinks: [{{type: mqtt, host: 127.0.0.1, port: {broker.port}}}]
  - name: video-trigger
    camera: top
    source:
      type: camera
      device: video.avi
      mode: trigger
      trigger: {{host: 127.0.0.1, port: {broker.port}, topic: plc/line3/trigger}}
    sinks: [{{type: opcua, endpoint: "{plc.endpoint}", nodes: {json.dumps(plc.node_ids())}}}]
  - name: stream
    source: {{type: camera, device: "{stream.url}", mode: rate, rate_hz: 10, reconnect_max_s: 1}}
    sinks: [{{type: mqtt, host: 127.0.0.1, port: {broker.port}}}]
"""
    )
    try:
        with running_server(tmp_path, [model_file], args=("--lines", str(lines))) as server:
            # every Nth frame of the video, each verdict as padim predict gives it for that frame
            expected = len(range(0, len(frames), EVERY))
            nth.wait_for(expected, 30)
            by_frame = {int(m["source"].rpartition("#")[2]): m for m in nth.messages}
            assert set(by_frame) == set(predicted)
            for index, message in by_frame.items():
                assert_same_verdict(message, predicted[index])
            # triggered: two over HTTP, one over MQTT; each scores the next frame; the PLC's nodes hold the last
            for part in ("A-1", "A-2"):
                answer = httpx.post(server.url + "/lines/video-trigger/trigger", json={"part": part})
                assert answer.status_code == 202, answer.text
            trigger = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
            trigger.connect("127.0.0.1", broker.port)
            trigger.loop_start()
            trigger.publish("plc/line3/trigger", "A-3", qos=1).wait_for_publish(5)
            trigger.loop_stop()

            def triggered() -> dict:
                return httpx.get(server.url + "/lines/video-trigger").json()

            wait_until(lambda: triggered()["sinks"][0]["outbox"] == 0 and triggered()["counts"]["scored"] == 3, 30, "3")
            last = triggered()["last"]
            assert last["source"].endswith("video.avi#2") and last["part"] == "A-3" and last["camera"] == "top"
            values = plc.values()
            assert values == {
                "score": pytest.approx(last["score"]),
                "is_anomaly": last["is_anomaly"],
                "part": "A-3",
                "id": last["id"],
            }
            # the stream drops after each STREAM_FRAMES frames; the source reopens it and goes on
            wait_until(lambda: stream.connections >= 2 and len(live.ids()) >= 8, 40, "frames after a drop")
            state = httpx.get(server.url + "/lines/stream").json()
            assert state["source"]["reconnects"] >= 1
            ready = httpx.get(server.url + "/health/ready").json()
            assert set(ready["lines"]) == {"video-nth", "video-trigger", "stream"}
            assert ready["lines"]["video-nth"]["source"] == "ended"
            wrong = httpx.post(server.url + "/lines/stream/trigger")
            assert wrong.status_code == 422 and wrong.json()["error"]["code"] == "invalid_parameter"
            assert httpx.post(server.url + "/lines/nope/trigger").json()["error"]["code"] == "line_not_found"
    finally:
        nth.close()
        live.close()
        broker.stop()
        plc.stop()
        stream.server.shutdown()
