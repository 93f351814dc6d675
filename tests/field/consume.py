"""The fleet's consumer in the field's fleet tree, run there by the package's Python as a
transient unit: an operator's MQTT session (the operators' certificate, a persistent session)
that takes every telemetry and events record of the fleet at QoS 1 and appends each, as the
broker delivered it, to a file, one JSON line each ({"topic", "payload"}), flushed before the
acknowledgement; a line {"subscribed": mid} for each subscription the broker granted.

    consume.py FLEET HOST PORT PKI OUT
"""

from __future__ import annotations

import json
import sys
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


def main() -> None:
    fleet, host, port, pki, out = sys.argv[1:6]
    received = open(out, "a", encoding="utf-8")  # noqa: SIM115 (open while the loop runs)
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id="field-consumer", protocol=mqtt.MQTTv5
    )
    client.tls_set(f"{pki}/ca.pem", f"{pki}/operator.pem", f"{pki}/operator.key")

    def on_connect(client: mqtt.Client, *_: Any) -> None:
        for leaf in ("telemetry", "events"):
            client.subscribe(f"edge/v1/{fleet}/+/{leaf}", qos=1)

    def on_message(_client: mqtt.Client, _data: Any, message: mqtt.MQTTMessage) -> None:
        line = {"topic": message.topic, "payload": json.loads(message.payload)}
        received.write(json.dumps(line) + "\n")
        received.flush()

    def on_subscribe(_client: mqtt.Client, _data: Any, mid: int, *_: Any) -> None:
        received.write(json.dumps({"subscribed": mid}) + "\n")
        received.flush()

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    properties = Properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = 3600
    client.connect(host, int(port), keepalive=10, clean_start=False, properties=properties)
    client.loop_forever(retry_first_connection=True)


if __name__ == "__main__":
    main()
