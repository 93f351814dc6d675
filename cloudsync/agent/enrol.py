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
from edged.common.atomic import write_atomic

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
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"enrol-{rid}", protocol=mqtt.MQTTv5
    )
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
    client.suppress_exceptions = True  # a callback's failure is logged; paho's thread goes on
    client.enable_logger(logging.getLogger("cloudsync.paho"))
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
                    log.warning(
                        "request %s for %s waits for an operator: edgefleet enrol approve %s",
                        rid,
                        node,
                        rid,
                    )
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
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
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


class Renewal:
    """The node's next certificate, asked for on its own topic at ``renew_after`` of its
    certificate's lifetime (cloudsync.fleet.enrolment renews what the broker lets only this
    node ask): a new key, made here; the answer checked as an enrolment's; then both files
    replaced (the key's ``.next`` first, renamed over the old one, then the certificate) and
    the session resumed with them (``Agent`` makes a new MQTT client: one reconnect)."""

    def __init__(self, config: Config, node: str) -> None:
        self.config, self.node = config, node
        self.key: ec.EllipticCurvePrivateKey | None = None  # the next key, while asked
        self.asked_at = 0.0
        self.due_at: float | None = None  # time.time() to ask at (None: read the certificate)
        self.refused = ""

    def due(self, now: float) -> bool:
        """Whether to ask now (at ``renew_after`` of the certificate's life; asked again every
        RETRY_S until answered, and an hour after a refusal)."""
        mq = self.config.mqtt
        if mq.cert_file is None or mq.key_file is None or not self.config.enrol.renew_after:
            return False
        if self.key is not None:
            return now - self.asked_at >= RETRY_S
        if self.due_at is None:
            try:
                cert = x509.load_pem_x509_certificate(mq.cert_file.read_bytes())
            except (OSError, ValueError):
                self.due_at = time.time() + 3600.0
                return False
            start = cert.not_valid_before_utc.timestamp()
            lifetime = cert.not_valid_after_utc.timestamp() - start
            self.due_at = start + lifetime * self.config.enrol.renew_after
        return time.time() >= self.due_at

    def request(self, now: float) -> bytes:
        """The request's payload (a new key the first time)."""
        if self.key is None:
            self.key = new_key()
            log.info(
                "the certificate is %.0f%% through its life: asking for the next one",
                100 * self.config.enrol.renew_after,
            )
        self.asked_at = now
        return envelope.Envelope(self.node, 1, {"csr": make_csr(self.key, self.node)}).encode()

    def answered(self, payload: bytes) -> bool:
        """The fleet's answer: True once the new key and certificate are in place."""
        mq = self.config.mqtt
        if self.key is None or mq.cert_file is None or mq.key_file is None:
            return False
        trusted = x509.load_pem_x509_certificate(mq.ca_file.read_bytes()) if mq.ca_file else None
        try:
            answer = read_answer(envelope.decode(payload).body, self.key, self.node, trusted)
        except (EnrolError, envelope.EnvelopeError) as exc:
            log.error("an answer to the renewal was not the fleet's: %s", exc)
            return False
        if answer.state != "issued":
            if answer.error != self.refused:
                log.error("the fleet does not renew the certificate: %s", answer.error)
                self.refused = answer.error
            self.key, self.due_at = None, time.time() + 3600.0
            return False
        pem = self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # a power cut anywhere leaves a pair that goes together (settle() at the next start)
        nxt = Path(f"{mq.cert_file}.next")
        write_atomic(nxt, answer.cert, 0o644)
        write_atomic(mq.key_file, pem, 0o600)
        nxt.replace(mq.cert_file)
        log.info("renewed: the next certificate is in %s", mq.cert_file)
        self.key, self.due_at = None, None
        return True


def settle(config: Config) -> None:
    """A renewal cut short between its key and its certificate: ``{cert_file}.next`` is the
    certificate of the key in place, or of no key (a cut before the key): kept or dropped."""
    mq = config.mqtt
    if mq.cert_file is None or mq.key_file is None:
        return
    nxt = Path(f"{mq.cert_file}.next")
    if not nxt.exists():
        return
    try:
        cert = x509.load_pem_x509_certificate(nxt.read_bytes())
        key = serialization.load_pem_private_key(mq.key_file.read_bytes(), None)
        mine = public_der(cert.public_key()) == public_der(key.public_key())
    except (OSError, ValueError):
        mine = False
    if mine:
        nxt.replace(mq.cert_file)
        log.warning("a renewal was cut short: its certificate is in place now")
    else:
        nxt.unlink()
