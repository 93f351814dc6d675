"""The device in its fleet, as deployed: a second tree, the fleet's box, booted the same way on
the field's LAN (tests/field/rig.py ``Network``: its own namespace, a veth to the device's),
with Debian's Mosquitto (TLS 1.3, client certificates, the fleet's ACL) and PostgreSQL from
their packages and edgefleet.service from ours, on PostgreSQL through its socket as its own
user. The device tree's cloudsync.service, as edged's user, enrols with the fleet's claim
credential and a one-time token, connects as itself, and keeps the records a program on the
device hands it: none lost across the cable pulled, cloudsync killed by systemd (SIGKILL) and
the device's power cut (every process of the tree killed at once).

The fleet's consumer (tests/field/consume.py) is an operator's MQTT session in the fleet's box
that writes down every record the broker delivers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol.envelope import canonical
from cloudsync.protocol.manifest import file_entry, make, sign
from tests.asunit import proc_status
from tests.conftest import ROOT, skip_or_fail
from tests.field.rig import PYTHON, Field, Network
from tests.field.test_field import active, failed_units
from tests.fleetservice import TOKENS, tokens_toml
from tests.journal_files import KEYS, REQUEST_KEYS
from tests.mosquitto import ACL, CLAIM, OPERATOR, render_config
from tests.packaging.test_deb import package
from tests.pki import issue

FLEET_BASE = ROOT / "build" / "debian-fleet.tar"
FLEET = "field"
NODE = "field-dev-1"
HOST = "fleet.field"  # the broker's name, in both trees' /etc/hosts
LOG_FIELDS = KEYS | REQUEST_KEYS  # what of a journal entry leaves the device
PORT = 8883
BROKER_PKI = "/etc/mosquitto/fleet"  # in the fleet's box; the consumer's certificate too
RECEIVED = "/field/received.jsonl"
CDN_PORT = 8443
CDN_ROOT = "/field/cdn"  # in the fleet's box
CDN_LOG = "/field/cdn.jsonl"
KEY = Ed25519PrivateKey.generate()  # the fleet's signing key ("fleet-1"): both boxes trust it
DATABASE = "postgresql:///fleet?host=/var/run/postgresql"
EDGEFLEET_TOML = f"""\
[service]
fleet = "{FLEET}"
database = "{DATABASE}"
trust_dir = "/etc/edgefleet/trust"
[mqtt]
host = "{HOST}"
port = {PORT}
ca_file = "/etc/edgefleet/ca.pem"
cert_file = "/etc/edgefleet/edgefleet.pem"
key_file = "/etc/edgefleet/edgefleet.key"
[api]
port = 8480
{tokens_toml()}
[enrolment]
ca_cert = "/etc/edgefleet/issuing-ca.pem"
ca_key = "/etc/edgefleet/issuing-ca.key"
"""
CLOUDSYNC_TOML = f"""\
[node]
fleet = "{FLEET}"
name = "{NODE}"
[mqtt]
host = "{HOST}"
port = {PORT}
ca_file = "/etc/edged/fleet-ca.pem"
cert_file = "/var/lib/edged/device.pem"
key_file = "/var/lib/edged/device.key"
[enrol]
claim_cert = "/etc/edged/claim.pem"
claim_key = "/etc/edged/claim.key"
token_file = "/etc/edged/enrol.token"
[delivery]
ca_file = "/etc/edged/fleet-ca.pem"
"""


def put(
    tree: Field, path: str, data: bytes | str, owner: str = "root:root", mode: str = "0644"
) -> None:
    """A file into a tree, as an operator puts it there."""
    target = tree.root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data.encode() if isinstance(data, str) else data)
    tree.run("chown", owner, path)
    tree.run("chmod", mode, path)


def api(box: Field, method: str, path: str, body: Any = None) -> dict[str, Any]:
    args = [json.dumps(body)] if body is not None else []
    return box.probe("api", method, path, *args, user=None)


def node_state(box: Field) -> str | None:
    """The node's state in the fleet service; None while it does not know the node."""
    found = api(box, "GET", f"/v1/nodes/{NODE}")
    return found["body"]["state"] if found["status"] == 200 else None


def steps(box: Field) -> list[dict[str, Any]]:
    """The device's delivery reports at the fleet, in the order they came."""
    return [
        line["payload"]["body"]["delivery"]
        for line in received(box)
        if line.get("topic", "").endswith(f"/{NODE}/events")
        and "delivery" in line["payload"]["body"]
    ]


def edged_events(box: Field) -> list[dict[str, Any]]:
    """edged's events (its log at INFO and above) as they reached the fleet."""
    return [
        line["payload"]["body"]
        for line in received(box)
        if line.get("topic", "").endswith(f"/{NODE}/events")
        and line["payload"]["body"].get("from") == "edged"
    ]


def received(box: Field) -> list[dict[str, Any]]:
    path = box.root / RECEIVED.lstrip("/")
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def fleet(field: Field, network: Network) -> Iterator[Field]:
    """The fleet's box, booted, its broker, database, service and consumer running; the device
    tree's cloudsync enrolled through it and online."""
    if not FLEET_BASE.is_file():
        skip_or_fail(f"{FLEET_BASE.name} is missing: run `make field`")
    work = ROOT / "build" / "field"
    box = Field.unpack(FLEET_BASE, work / "fleet", work / "fleet-nspawn.log", Network.FLEET)
    try:
        box.boot()
        # the fleet's box serves no inference: the package's units are not started there
        put(box, "/usr/sbin/policy-rc.d", "#!/bin/sh\nexit 101\n", mode="0755")
        box.install(package())
        box.run("rm", "/usr/sbin/policy-rc.d")
        box.run(
            "systemctl", "disable", "--now", "edged.socket", "edged.service", "edged-updater.path"
        )
        hosts = f"{Network.FLEET_ADDRESS} {HOST}\n"
        for tree in (box, field):
            with (tree.root / "etc" / "hosts").open("a") as etc_hosts:
                etc_hosts.write(hosts)

        pki = work / "pki"
        shutil.rmtree(pki, ignore_errors=True)
        pki.mkdir(parents=True)
        ca = issue("field fleet CA", None, pki, "ca")
        issue(HOST, ca, pki, "broker", server=True, names=(HOST,))
        issue(OPERATOR, ca, pki, "operator")
        issue(CLAIM, ca, pki, "claim")
        files = {
            name: (pki / name).read_bytes()
            for name in (
                "ca.pem",
                "ca.key",
                "broker.pem",
                "broker.key",
                "operator.pem",
                "operator.key",
                "claim.pem",
                "claim.key",
            )
        }

        # the broker: Debian's mosquitto.service with the configuration docs/PROTOCOL.md gives
        for name in ("ca.pem", "broker.pem", "broker.key", "operator.pem", "operator.key"):
            put(box, f"{BROKER_PKI}/{name}", files[name], "root:mosquitto", "0640")
        put(box, f"{BROKER_PKI}/acl", ACL, "root:mosquitto", "0640")
        put(
            box,
            "/etc/mosquitto/mosquitto.conf",
            render_config(
                PORT,
                Path(BROKER_PKI),
                Path(f"{BROKER_PKI}/acl"),
                Path("/var/lib/mosquitto"),
                address=Network.FLEET_ADDRESS,
            ),
        )
        box.run("systemctl", "restart", "mosquitto.service")

        # the database: Debian's cluster, a role for the service's user, its database
        box.wait("PostgreSQL", lambda: not box.run("pg_isready", "-q", check=False).returncode, 120)
        box.run("runuser", "-u", "postgres", "--", "createuser", "edgefleet")
        box.run("runuser", "-u", "postgres", "--", "createdb", "-O", "edgefleet", "fleet")

        # the service, as docs/OPERATIONS.md sets it up
        for name, source in (
            ("ca.pem", "ca.pem"),
            ("edgefleet.pem", "operator.pem"),
            ("edgefleet.key", "operator.key"),
            ("issuing-ca.pem", "ca.pem"),
            ("issuing-ca.key", "ca.key"),
        ):
            put(box, f"/etc/edgefleet/{name}", files[source], "root:edgefleet", "0640")
        put(box, "/etc/edgefleet/edgefleet.toml", EDGEFLEET_TOML)
        public = KEY.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        put(box, "/etc/edgefleet/trust/fleet-1.pub", public, "root:edgefleet", "0640")
        put(field, "/etc/edged/trust/fleet-1.pub", public)
        put(box, "/field/admin.token", TOKENS["admin"], mode="0600")
        box.run("systemctl", "enable", "--now", "edgefleet.service")
        healthy = box.wait(
            "edgefleet healthy", lambda: api(box, "GET", "/healthz")["status"] == 200, 120
        )

        shutil.copy(Path(__file__).with_name("consume.py"), box.root / "field" / "consume.py")
        box.run(
            "systemd-run",
            "--unit=field-consumer",
            PYTHON,
            "/field/consume.py",
            FLEET,
            HOST,
            str(PORT),
            BROKER_PKI,
            RECEIVED,
        )
        shutil.copy(Path(__file__).with_name("cdn.py"), box.root / "field" / "cdn.py")
        (box.root / CDN_ROOT.lstrip("/")).mkdir(parents=True, exist_ok=True)
        box.run(
            "systemd-run",
            "--unit=field-cdn",
            PYTHON,
            "/field/cdn.py",
            Network.FLEET_ADDRESS,
            str(CDN_PORT),
            f"{BROKER_PKI}/broker.pem",
            f"{BROKER_PKI}/broker.key",
            CDN_ROOT,
            CDN_LOG,
        )
        box.wait(
            "the consumer subscribed",
            lambda: sum("subscribed" in line for line in received(box)) == 2,
            60,
        )

        # the device: what the operator places, then cloudsync enabled
        token = api(box, "POST", "/v1/enrolment-tokens", {"node": NODE})
        assert token["status"] == 201, token
        put(field, "/etc/edged/fleet-ca.pem", files["ca.pem"])
        put(field, "/etc/edged/claim.pem", files["claim.pem"], "root:edged", "0640")
        put(field, "/etc/edged/claim.key", files["claim.key"], "root:edged", "0640")
        put(field, "/etc/edged/enrol.token", token["body"]["token"], "root:edged", "0640")
        put(field, "/etc/edged/cloudsync.toml", CLOUDSYNC_TOML)
        field.run("systemctl", "enable", "--now", "cloudsync.service")
        online = box.wait(
            "the device online in the fleet service", lambda: node_state(box) == "online", 180
        )
        print(
            f"\nfleet box: edgefleet healthy {healthy:.1f} s after its start; the device "
            f"enrolled and online {online:.1f} s after cloudsync's"
        )
    except BaseException:
        print(box.logs())
        box.poweroff()
        raise
    try:
        yield box
    finally:
        field.run("systemctl", "disable", "--now", "cloudsync.service", check=False)
        box.poweroff()
        shutil.rmtree(work / "fleet", ignore_errors=True)


def test_the_device_enrols_and_reports_to_edgefleet_on_postgresql(
    field: Field, fleet: Field
) -> None:
    cert = x509.load_pem_x509_certificate((field.root / "var/lib/edged/device.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((field.root / "etc/edged/fleet-ca.pem").read_bytes())
    assert cert.subject.rfc4514_string() == f"CN={NODE}" and cert.issuer == ca.subject
    key = field.run("stat", "-c", "%U %a", "/var/lib/edged/device.key").stdout.split()
    assert key == ["edged", "600"]  # made on the device, never left it

    pid = field.host_pid("cloudsync.service")
    status = proc_status(pid)
    assert status["Uid"].split()[0] == field.run("id", "-u", "edged").stdout.strip()
    assert status["Umask"] == "0027"
    service = proc_status(fleet.host_pid("edgefleet.service"))
    assert service["Uid"].split()[0] == fleet.run("id", "-u", "edgefleet").stdout.strip()

    node = api(fleet, "GET", f"/v1/nodes/{NODE}")["body"]
    print(f"\nthe node in the fleet service: {json.dumps(node)[:600]}")
    assert (node["fleet"], node["state"]) == (FLEET, "online")
    assert "intent" in json.dumps(node["models"])  # the models its heartbeats say it serves
    rows = fleet.run(
        "runuser",
        "-u",
        "postgres",
        "--",
        "psql",
        "-d",
        "fleet",
        "-tAc",
        "SELECT node, state FROM nodes",
    ).stdout.split()
    assert rows == [f"{NODE}|online"]  # where the service keeps it: PostgreSQL
    assert failed_units(fleet) == [] and failed_units(field) == []


def test_records_survive_the_cable_a_sigkill_and_a_power_cut(
    field: Field, fleet: Field, network: Network
) -> None:
    """100 records online, 100 with the cable out, cloudsync SIGKILLed by systemd (it restarts
    it), 100 more, the device's power cut, the cable back, the boot: all 300 reach the fleet,
    a record twice only as the same record, and the stream numbered without a gap."""
    assert field.probe("records", "online", "100")["stored"] == 100
    network.link(up=False)
    try:
        assert field.probe("records", "cable-out", "100")["stored"] == 100
        before = field.main_pid("cloudsync.service")
        field.run("systemctl", "kill", "-s", "KILL", "cloudsync.service")
        field.wait(
            "cloudsync restarted",
            lambda: field.main_pid("cloudsync.service") not in (0, before),
            60,
        )
        after_kill = field.probe("records", "after-kill", "100")
        assert after_kill["stored"] == 100
        field.power_cut()
    finally:
        network.link(up=True)
    state = field.boot()
    ids = {f"{prefix}-{i}" for prefix in ("online", "cable-out", "after-kill") for i in range(100)}

    def ours() -> list[dict[str, Any]]:
        return [
            line["payload"]
            for line in received(fleet)
            if line.get("topic", "").endswith(f"/{NODE}/telemetry")
        ]

    took = field.wait("every record at the fleet", lambda: ids <= {r["id"] for r in ours()}, 180)
    records = ours()
    first: dict[str, dict[str, Any]] = {}
    for record in records:
        assert record["body"] == first.setdefault(record["id"], record)["body"]
    streams: dict[tuple[str, str], set[int]] = {}
    for record in first.values():
        streams.setdefault((record["epoch"], record["priority"]), set()).add(record["seq"])
    assert len(streams) == 1, streams.keys()  # one outbox file: one epoch, across the cut
    (numbers,) = streams.values()
    assert numbers == set(range(1, max(numbers) + 1))  # no gap: nothing stored was dropped
    print(
        f"\noutbox in the field: 300 records, {len(records) - len(first)} duplicates, "
        f"{after_kill['retries']} retries while systemd restarted cloudsync; all at the fleet "
        f"{took:.1f} s after the boot ({state})"
    )
    assert active(field, "cloudsync.service") and failed_units(field) == []


def test_a_model_file_damaged_on_disk_is_refused_and_fetched_again(
    field: Field, fleet: Field
) -> None:
    """The fleet deploys version 2 of intent-classifier through edgefleet (signed with the
    fleet's key, its files on the fleet box's HTTPS server), and it serves on the device. Its
    model.onnx is then cut short on the device's disk, as a power cut leaves a file being
    written, and the device's power is cut: after the boot edged refuses version 2 naming the
    file, version 1 serves; cloudsync reports version 2 damaged, fetches it again, and it
    serves. Each step is an event at the fleet."""
    model = "intent-classifier"
    source = field.root / "var/lib/edged/models" / model / "1"
    cdn = fleet.root / CDN_ROOT.lstrip("/") / model / "2"
    cdn.mkdir(parents=True)
    for path in source.iterdir():
        shutil.copy(path, cdn / path.name)
    files = sorted(cdn.iterdir())
    signed = make(model, 2, [file_entry(p) for p in files], 3600.0, {"fleet": FLEET})
    urls = {p.name: f"https://{HOST}:{CDN_PORT}/{model}/2/{p.name}" for p in files}
    entry = {"manifest": sign(signed, {"fleet-1": KEY}), "urls": urls}
    created = api(fleet, "POST", "/v1/deployments", {"id": "field-ic", "models": [entry]})
    assert created["status"] == 201, created

    def step(name: str, after: int = 0) -> dict[str, Any] | None:
        return next(
            (
                s
                for s in steps(fleet)[after:]
                if s["step"] == name and (s.get("model"), s.get("version")) == (model, 2)
            ),
            None,
        )

    delivered = fleet.wait("version 2 active on the device", lambda: step("active"), 180)
    onnx = field.root / "var/lib/edged/models" / model / "2" / "model.onnx"
    size = onnx.stat().st_size
    with onnx.open("r+b") as cut:  # what a power cut leaves of a file being written
        cut.truncate(size // 3)
    before = len(steps(fleet))
    field.power_cut()
    field.boot()
    repaired = fleet.wait("version 2 active again", lambda: step("active", before), 300)

    damaged = step("damaged", before)
    why = f"file 'model.onnx' has {size // 3} bytes, {size} listed"
    assert damaged is not None and damaged["why"] == f"on the node: {why}"
    refused = [e for e in edged_events(fleet) if e.get("reason") == "damaged"]
    assert refused and refused[-1]["model"] == model and why in refused[-1]["message"]
    fallback = [
        e
        for e in edged_events(fleet)
        if "serves until it is installed again" in e.get("message", "")
    ]
    assert (
        fallback
        and f"model {model}: version 2 damaged on disk; version 1" in (fallback[-1]["message"])
    )
    versions = field.probe("versions", model, user="carol")
    assert (versions["active"], versions["serving"], versions["damaged"]) == (2, [2], {})
    assert onnx.stat().st_size == size
    fetched = [
        json.loads(line)
        for line in (fleet.root / CDN_LOG.lstrip("/")).read_text().splitlines()
        if f"/{model}/2/model.onnx" in line
    ]
    assert [(f["status"], f["bytes"]) for f in fetched] == [(200, size)] * 2
    assert field.probe("infer")["answers"]["intent"]["intent"] == "image-report"
    print(
        f"\na damaged model in the field: version 2 delivered in {delivered:.1f} s; after the "
        f"power cut and the boot, fetched again and active in {repaired:.1f} s"
    )
    assert failed_units(field) == []


def test_edgefleet_logs_reads_the_journal_of_an_edged_that_will_not_start(
    field: Field, fleet: Field
) -> None:
    """Issue 48: edged's config broken, systemd restarting it in vain; from the fleet's box,
    ``edgefleet logs`` through the service, the broker and the device's cloudsync (its unit's
    user, in group systemd-journal) gets edged's own last words and systemd's lines about it
    from the device's journal, and nothing of the journal's entries but the fields it sends."""
    config = field.root / "etc" / "edged" / "edged.toml"
    before = config.read_bytes()
    put(
        fleet,
        "/field/fleet-1.key",
        KEY.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        mode="0600",
    )

    def logs(*more: str) -> dict[str, Any]:
        done = fleet.run(
            "edgefleet",
            "--service",
            "http://127.0.0.1:8480",
            "--token-file",
            "/field/admin.token",
            "logs",
            NODE,
            "--since",
            "10m",
            "--sign-key",
            "/field/fleet-1.key",
            "--kid",
            "fleet-1",
            "--timeout",
            "60",
            "--json",
            *more,
            check=False,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        answer: dict[str, Any] = json.loads(done.stdout)
        assert all(set(row) <= LOG_FIELDS for row in answer["lines"]), answer["lines"][:3]
        machine = (field.root / "etc" / "machine-id").read_text().strip()
        assert machine and machine not in done.stdout  # the journal's other fields stay
        return answer

    try:
        config.write_bytes(before + b"\n[bogus_section]\nkey = 1\n")
        field.run("systemctl", "restart", "edged.service", check=False)
        field.wait("edged failing", lambda: not active(field, "edged.service"), 60)
        answer = logs()
        lines = answer["lines"]
        print(f"\nedgefleet logs {NODE}, edged down: {json.dumps(lines[-4:])[:900]}")
        assert any(r["identifier"] == "edged" and "bogus_section" in r["message"] for r in lines)
        assert any(
            r["identifier"] == "systemd"
            and r["unit"] == "edged.service"
            and r["pid"] == 1
            and "edged.service" in r["message"]
            for r in lines
        ), lines[-6:]
        capped = logs("--max-bytes", "1024", "--level", "debug")
        assert len(canonical(capped["lines"])) <= 1024 and capped.get("left_out", 0) >= 1
    finally:
        config.write_bytes(before)
        field.run("systemctl", "reset-failed", "edged.service", check=False)
        field.run("systemctl", "restart", "edged.service", check=False)
        field.wait("edged back", lambda: active(field, "edged.service"), 180)
