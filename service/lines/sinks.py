"""Where a line's verdicts go: an MQTT broker, a webhook, or a PLC's OPC UA server.

A sink :meth:`~Sink.send` s messages in order and returns how many its receiver confirmed; the rest stay in the
outbox (:mod:`.journal`) and are sent again after a back-off. Each message carries its key as ``id``: a receiver
that sees an id twice (a delivery confirmed by the receiver but not yet removed from the outbox when a crash came)
drops the repeat.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import ssl
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from .config import MqttConnection, MqttSink, OpcUaSink, WebhookSink

if TYPE_CHECKING:  # the extras, imported where a line uses them
    import httpx
    from asyncua import Client

log = logging.getLogger("padim.lines")


class SinkDown(Exception):
    """The sink cannot take messages now (not connected, refused, timed out); they wait in the outbox. The first
    ``done`` messages of the send were delivered before it went down."""

    def __init__(self, why: str, done: int = 0):
        super().__init__(why)
        self.done = done


class Sink(Protocol):
    name: str
    connected: bool
    last_error: str | None

    async def start(self) -> None: ...

    async def send(self, messages: list[dict]) -> int: ...

    async def close(self) -> None: ...

    def describe(self) -> dict: ...


def make_sink(config, name: str, line: str) -> Sink:
    if isinstance(config, MqttSink):
        return MqttPublisher(config, name, line)
    if isinstance(config, WebhookSink):
        return Webhook(config, name)
    return OpcUaWriter(config, name)


def body(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":"), sort_keys=True).encode()


# ---------------------------------------------------------------------- MQTT
def mqtt_client(config: MqttConnection, client_id: str):
    """A paho client with the connection's credentials and TLS, reconnecting by itself (1 to 30 s apart)."""
    import paho.mqtt.client as mqtt  # paho-mqtt: the `lines` extra, imported only where a line uses MQTT

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    if config.username is not None:
        client.username_pw_set(config.username, config.password())
    if config.tls or config.ca_file is not None:
        client.tls_set(
            ca_certs=str(config.ca_file) if config.ca_file else None,
            certfile=str(config.cert_file) if config.cert_file else None,
            keyfile=str(config.key_file) if config.key_file else None,
            tls_version=ssl.PROTOCOL_TLS_CLIENT,
        )
    client.reconnect_delay_set(1, 30)
    return client


class MqttPublisher:
    """QoS 1 (by default) messages on the line's topic; the latest also retained on ``TOPIC/last``, and the
    service's presence on ``TOPIC/status`` (``online``, or ``offline`` from the broker when the service dies)."""

    def __init__(self, config: MqttSink, name: str, line: str):
        self.config, self.name = config, name
        self.topic = config.topic or f"padim/{line}/verdicts"
        self.connected = False
        self.last_error: str | None = "connecting"
        self._client = mqtt_client(config, f"padim-{line}-{name}-{os.getpid()}")
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.will_set(f"{self.topic}/status", "offline", qos=1, retain=True)

    def _on_connect(self, client, userdata, flags, reason, properties) -> None:
        self.connected = not reason.is_failure
        if self.connected:
            self.last_error = None
            client.publish(f"{self.topic}/status", "online", qos=1, retain=True)
            log.info("MQTT connected", extra={"sink": self.name, "broker": f"{self.config.host}:{self.config.port}"})
        else:
            self.last_error = f"refused: {reason}"

    def _on_disconnect(self, client, userdata, flags, reason, properties) -> None:
        if self.connected:
            log.warning("MQTT disconnected", extra={"sink": self.name, "reason": str(reason)})
        self.connected = False
        self.last_error = f"disconnected: {reason}"

    async def start(self) -> None:
        # connect_async: a broker that is down now is not an error; paho keeps trying, messages wait in the outbox
        self._client.connect_async(self.config.host, self.config.port, self.config.keepalive_s)
        self._client.loop_start()

    async def send(self, messages: list[dict]) -> int:
        return await asyncio.to_thread(self._publish, messages)

    def _publish(self, messages: list[dict]) -> int:
        if not self._client.is_connected():
            raise SinkDown(self.last_error or "not connected")
        infos = [self._client.publish(self.topic, body(m), qos=self.config.qos) for m in messages]
        done = 0
        for info in infos:
            try:
                info.wait_for_publish(timeout=10)
            except (RuntimeError, ValueError) as error:  # not queued: the connection went meanwhile
                raise SinkDown(str(error), done) from None
            if not info.is_published():
                raise SinkDown("the broker did not acknowledge within 10 s", done)
            done += 1
        self._client.publish(f"{self.topic}/last", body(messages[-1]), qos=1, retain=True)
        return done

    async def close(self) -> None:
        self._client.publish(f"{self.topic}/status", "offline", qos=1, retain=True)
        self._client.disconnect()
        self._client.loop_stop()

    def describe(self) -> dict:
        return {"type": "mqtt", "topic": self.topic, "broker": f"{self.config.host}:{self.config.port}"}


class MqttTrigger:
    """Calls ``on_message(payload)`` for each message on a trigger topic (QoS 1)."""

    def __init__(self, config, line: str, on_message):
        self.config = config
        self._client = mqtt_client(config, f"padim-{line}-trigger-{os.getpid()}")
        self._client.on_connect = lambda client, *_: client.subscribe(config.topic, qos=1)
        self._client.on_message = lambda _client, _userdata, message: on_message(
            message.payload.decode("utf-8", "replace").strip() or None
        )

    def start(self) -> None:
        self._client.connect_async(self.config.host, self.config.port, self.config.keepalive_s)
        self._client.loop_start()

    def stop(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


# ---------------------------------------------------------------------- webhook
class Webhook:
    """Each message POSTed as JSON; a 2xx answer delivers it. Headers: ``X-Padim-Id`` (and ``Idempotency-Key``)
    with its key, and ``X-Padim-Signature: sha256=HEX``, the HMAC-SHA256 of the body with the line's secret."""

    def __init__(self, config: WebhookSink, name: str):
        self.config, self.name = config, name
        self.connected = True
        self.last_error: str | None = None
        self._secret = os.environ[config.secret_env].encode() if config.secret_env else None
        self._client: httpx.AsyncClient | None = None  # once started

    async def start(self) -> None:
        import httpx  # the `lines` extra, imported only where a line posts to a webhook

        logging.getLogger("httpx").setLevel(logging.WARNING)  # a webhook's every request is not news
        self._client = httpx.AsyncClient(timeout=self.config.timeout_s, follow_redirects=False)

    def headers(self, payload: bytes, key: str) -> dict[str, str]:
        headers = {"content-type": "application/json", "x-padim-id": key, "idempotency-key": key}
        if self._secret is not None:
            headers["x-padim-signature"] = "sha256=" + hmac.new(self._secret, payload, hashlib.sha256).hexdigest()
        return {**self.config.headers, **headers}

    async def send(self, messages: list[dict]) -> int:
        import httpx  # the `lines` extra

        assert self._client is not None
        for done, message in enumerate(messages):
            payload = body(message)
            try:
                answer = await self._client.post(
                    self.config.url, content=payload, headers=self.headers(payload, message["id"])
                )
            except httpx.HTTPError as error:
                self.connected, self.last_error = False, f"{type(error).__name__}: {error}"
                raise SinkDown(self.last_error, done) from None
            if not answer.is_success:
                self.connected, self.last_error = True, f"answered {answer.status_code}"
                raise SinkDown(self.last_error, done)
        self.connected, self.last_error = True, None
        return len(messages)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def describe(self) -> dict:
        return {"type": "webhook", "url": self.config.url.split("?", 1)[0]}


# ---------------------------------------------------------------------- OPC UA
class OpcUaWriter:
    """Writes each message's configured fields to a server's nodes, in one Write call a message (the PLC sees the
    latest verdict last). Each value is converted to its node's own data type, read once per connection."""

    def __init__(self, config: OpcUaSink, name: str):
        self.config, self.name = config, name
        self.connected = False
        self.last_error: str | None = "connecting"
        self._client: Client | None = None
        self._nodes: list = []
        self._types: list = []

    async def start(self) -> None:
        return None  # connects on the first send: a PLC that is off now is not an error

    async def _connect(self) -> None:
        from asyncua import Client  # asyncua: the `opcua` extra, imported only where a line writes to OPC UA

        client = Client(self.config.endpoint, timeout=self.config.timeout_s)
        if self.config.username is not None:
            client.set_user(self.config.username)
            if self.config.password_env:
                client.set_password(os.environ[self.config.password_env])
        await client.connect()
        try:
            nodes = [client.get_node(node) for node in self.config.nodes.values()]
            types = [await node.read_data_type_as_variant_type() for node in nodes]
        except Exception:
            await client.disconnect()
            raise
        self._client, self._nodes, self._types = client, nodes, types
        self.connected, self.last_error = True, None
        log.info("OPC UA connected", extra={"sink": self.name, "endpoint": self.config.endpoint})

    async def send(self, messages: list[dict]) -> int:
        from asyncua import ua  # the `opcua` extra

        for done, message in enumerate(messages):
            try:
                if self._client is None:
                    await self._connect()
                assert self._client is not None
                values = [
                    ua.DataValue(ua.Variant(_as(message.get(field), kind), kind))
                    for field, kind in zip(self.config.nodes, self._types, strict=True)
                ]
                await self._client.write_values(self._nodes, values)
            except Exception as error:  # any failure: drop the connection and try again later
                self.connected, self.last_error = False, f"{type(error).__name__}: {error}"
                await self._drop()
                raise SinkDown(self.last_error, done) from None
        return len(messages)

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.disconnect()
            except Exception:  # the connection is gone already
                pass

    async def close(self) -> None:
        await self._drop()

    def describe(self) -> dict:
        return {"type": "opcua", "endpoint": self.config.endpoint, "nodes": len(self.config.nodes)}


def _as(value, kind):
    """``value`` as the Python type a node of variant type ``kind`` takes (``None`` -> its zero)."""
    name = kind.name
    if name == "Boolean":
        return bool(value)
    if name in ("Float", "Double"):
        return float(value or 0.0)
    if "Int" in name or name == "Byte" or name == "SByte":
        return int(value or 0)
    if name == "String":
        return "" if value is None else str(value)
    if name == "DateTime":
        return datetime.fromisoformat(value) if isinstance(value, str) else datetime.now(UTC)
    return value
