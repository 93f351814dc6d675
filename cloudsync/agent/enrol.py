"""A new device's enrolment (cloudsync.protocol.enrol), before the agent starts: with the
claim credential of ``[enrol]`` and no certificate at ``[mqtt] cert_file`` yet.

The key is made here, at ``[mqtt] key_file`` (0600), and never leaves the device; the request
(its id and CSR) is kept beside it (``{key_file}.request``), so a cloudsync restarted while it
waits asks again with the same request and gets the same answer. The claim connection is a
clean session with the client id ``enrol-{rid}``; the request goes again every RETRY_S until
the fleet answers; a pending answer (an operator has to approve) is logged once and waited
on. The certificate is checked (this key, this name, signed by ``[mqtt] ca_file``) and written
to ``cert_file`` (0644) atomically: only then does cloudsync connect as itself.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from paho.mqtt.enums import CallbackAPIVersion

from cloudsync.agent.config import Config
from cloudsync.protocol import envelope
from cloudsync.protocol.enrol import (
    RETRY_S,
    Answer,
    EnrolError,
    make_csr,
    new_key,
    new_request_id,
    public_der,
    read_answer,
)
from cloudsync.protocol.mqtt import tls_context
from cloudsync.protocol.topics import enrol_answer, enrol_request
from edged.atomic import write_atomic

log = logging.getLogger("cloudsync.enrol")


def needed(config: Config) -> bool:
    """Whether this start must enrol first: a claim credential, and no certificate yet."""
    mq, claim = config.mqtt, config.enrol
    return claim.claim_cert is not None and mq.cert_file is not None and not mq.cert_file.exists()


def enrol(config: Config, node: str, stopping: threading.Event) -> bool:
    """Until the certificate is in place (True), ``stopping`` is set (False), or the fleet
    refuses or ``[enrol] timeout_s`` passes (EnrolError)."""
    mq, claim = config.mqtt, config.enrol
    if mq.key_file is None or mq.cert_file is None or mq.ca_file is None:
        raise EnrolError("[mqtt] cert_file, key_file and ca_file are needed to enrol")
    key = _key(mq.key_file)
    rid, csr = _request(mq.key_file, key, node)
    body: dict[str, Any] = {"csr": csr}
    if claim.token_file is not None:
        body["token"] = claim.token_file.read_text().strip()
    trusted = x509.load_pem_x509_certificate(mq.ca_file.read_bytes())
    fleet = config.node.fleet
    answers: queue.Queue[bytes] = queue.Queue()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"enrol-{rid}",
                         protocol=mqtt.MQTTv5)  # fmt: skip
    client.tls_set_context(tls_context(mq.ca_file, claim.claim_cert, claim.claim_key))
    client.reconnect_delay_set(1, 30)

    def on_connect(client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        if rc.is_failure:
            log.error("the broker refused the claim credential: %s", rc)
            return
        client.subscribe(enrol_answer(fleet, rid), 1)

    def on_subscribe(client: Any, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        send()  # the answer topic first, then the request: no answer can be missed

    def send() -> None:
        payload = envelope.Envelope(node, 1, body).encode()
        client.publish(enrol_request(fleet, rid), payload, 1)

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = lambda c, u, message: answers.put(bytes(message.payload))
    client.connect_async(mq.host, mq.port, mq.keepalive_s, clean_start=True)
    client.loop_start()
    deadline = time.monotonic() + claim.timeout_s if claim.timeout_s else None
    said_pending = False
    log.info("enrolling as %s (request %s) at %s:%s", node, rid, mq.host, mq.port)
    try:
        while not stopping.is_set():
            if deadline is not None and time.monotonic() > deadline:
                raise EnrolError(f"no certificate after {claim.timeout_s:g} s")
            try:
                payload = answers.get(timeout=RETRY_S)
            except queue.Empty:
                if client.is_connected():
                    send()
                continue
            try:
                answer = read_answer(envelope.decode(payload).body, key, node, trusted)
            except (EnrolError, envelope.EnvelopeError) as exc:
                log.error("an answer to the request was not the fleet's: %s", exc)
                continue
            if answer.state == "refused":
                raise EnrolError(f"the fleet refused the request: {answer.error}")
            if answer.state == "pending":
                if not said_pending:
                    log.warning("request %s for %s waits for an operator: edgefleet enrol"
                                " approve %s", rid, node, rid)  # fmt: skip
                    said_pending = True
                continue
            _keep(mq.cert_file, mq.key_file, answer)
            log.info("enrolled as %s: certificate in %s", node, mq.cert_file)
            return True
        return False
    finally:
        client.disconnect()
        client.loop_stop()


def _key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The device's key: made once, here, 0600 (kept across restarts of the enrolment)."""
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise EnrolError(f"{path}: not an EC private key")
        return key
    key = new_key()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())  # fmt: skip
    write_atomic(path, pem, 0o600)
    return key


def _request(key_file: Path, key: ec.EllipticCurvePrivateKey, node: str) -> tuple[str, str]:
    """The request's id and CSR: the ones kept beside the key (for this key and name), else
    new ones, kept."""
    kept = Path(f"{key_file}.request")
    if kept.exists():
        try:
            doc = json.loads(kept.read_text())
            if doc.get("node") == node and isinstance(doc.get("csr"), str):
                kept_csr = x509.load_pem_x509_csr(doc["csr"].encode())
                if public_der(kept_csr.public_key()) == public_der(key.public_key()):
                    return str(doc["rid"]), str(doc["csr"])
        except (ValueError, KeyError, TypeError):
            log.warning("%s cannot be read: a new request", kept)
    rid, csr = new_request_id(), make_csr(key, node)
    write_atomic(kept, json.dumps({"rid": rid, "node": node, "csr": csr}), 0o600)
    return rid, csr


def _keep(cert_file: Path, key_file: Path, answer: Answer) -> None:
    write_atomic(cert_file, answer.cert, 0o644)
    Path(f"{key_file}.request").unlink(missing_ok=True)
