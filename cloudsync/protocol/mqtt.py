"""A small synchronous MQTT 5 client (paho-mqtt 2.x underneath) for edgefleet and the tests:
connect over TLS with a certificate, publish and wait for the PUBACK's reason, subscribe and
collect what arrives. ``pki`` is a directory holding ``ca.pem`` and ``{stem}.pem/.key``."""

from __future__ import annotations

import ssl
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


def tls_context(
    ca_file: Path | None,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    max_version: ssl.TLSVersion | None = None,
) -> ssl.SSLContext:
    """A client context for the fleet's broker: TLS 1.3 only (``max_version`` lowers the ceiling
    instead: a test that the broker refuses older versions), the fleet CA (or the system's),
    and the client's certificate."""
    context = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=str(ca_file) if ca_file else None
    )
    if max_version is None:
        context.minimum_version = ssl.TLSVersion.TLSv1_3
    else:
        context.maximum_version = max_version
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


@dataclass
class SyncClient:
    port: int
    pki: Path
    stem: str | None
    host: str = "127.0.0.1"
    max_version: ssl.TLSVersion | None = None
    client_id: str = ""  # with one, a persistent session (the broker queues while it is away)
    received: list[tuple[str, bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id or f"test-{self.stem}-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )
        cert, key = (self.pki / f"{self.stem}.pem", self.pki / f"{self.stem}.key")
        context = tls_context(
            self.pki / "ca.pem",
            cert if self.stem else None,
            key if self.stem else None,
            self.max_version,
        )
        self.client.tls_set_context(context)
        self.client.reconnect_delay_set(1, 2)  # back soon after a broker restart
        self.connected = threading.Event()
        self.acks: dict[int, Any] = {}
        self.changed = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_ack
        self.client.on_subscribe = self._on_ack
        self.client.on_message = self._on_message

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        if not rc.is_failure:
            self.connected.set()

    def _on_ack(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        with self.changed:
            self.acks[mid] = rc
            self.changed.notify_all()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self.changed:
            self.received.append((message.topic, message.payload))
            self.changed.notify_all()

    def connect(self, timeout: float = 5.0) -> bool:
        """True once the broker accepted the connection; False if it did not (TLS refused,
        no CONNACK) within ``timeout``."""
        properties = None
        if self.client_id:
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = 3600
        try:
            self.client.connect(
                self.host, self.port, clean_start=not self.client_id, properties=properties
            )
        except (OSError, ssl.SSLError):
            return False
        self.client.loop_start()
        return self.connected.wait(timeout)

    def _wait_ack(self, mid: int, timeout: float) -> Any:
        with self.changed:
            self.changed.wait_for(lambda: mid in self.acks, timeout)
            return self.acks.get(mid)

    def publish(
        self, topic: str, payload: bytes, timeout: float = 5.0, retain: bool = False
    ) -> Any:
        """The PUBACK's reason code (QoS 1)."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        return self._wait_ack(info.mid, timeout)

    def subscribe(self, topic: str, timeout: float = 5.0) -> Any:
        """The SUBACK's reason codes."""
        rc, mid = self.client.subscribe(topic, qos=1)
        if mid is None:
            raise ConnectionError(f"cannot subscribe: {rc}")
        return self._wait_ack(mid, timeout)

    def wait_messages(self, count: int, timeout: float) -> list[tuple[str, bytes]]:
        with self.changed:
            self.changed.wait_for(lambda: len(self.received) >= count, timeout)
            return list(self.received)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
