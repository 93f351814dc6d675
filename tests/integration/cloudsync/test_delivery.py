"""Model delivery end to end with real parts: the desired state on a real Mosquitto (TLS, ACLs),
the files on nginx behind signed expiring URLs (its secure_link module checks them), cloudsync
downloading, resuming and verifying them, and a real edged installing, smoke-testing and
switching. The model is a real ONNX graph whose answers say which version gave them."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench.peer import free_port
from cloudsync.fleet.common import secure_link_url
from cloudsync.protocol import envelope
from cloudsync.protocol.manifest import file_entry, make, sign
from cloudsync.protocol.mqtt import SyncClient
from edged.client import ClientError
from edged.models.files import RECORD
from tests.asunit import owned_like
from tests.cloudsync_agent import NODE, Agent, bodies, operator
from tests.conftest import Daemon, skip_or_fail, wait_for
from tests.integration.edged.test_model_install import answer, rows, smoke
from tests.modelfiles import CONFIG, add_model, scale_model
from tests.mosquitto import OPERATOR, Broker, make_pki
from tests.nginx import SECRET, Cdn

MODEL = "scale"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for why in (Broker.available(), Cdn.available()):
        if why:
            skip_or_fail(why)
    return make_pki(tmp_path_factory.mktemp("pki"), ["n1"])


@dataclass
class Fleet:
    """One node (edged + cloudsync), the broker, the CDN, the operator's key and consumer."""

    broker: Broker
    cdn: Cdn
    edged: Daemon
    agent: Agent
    consumer: SyncClient
    key: Ed25519PrivateKey
    files: Path  # where the test builds versions before they go to the CDN

    def version(
        self, version: int, factor: float, lifetime_s: float = 3600.0, **model: Any
    ) -> tuple[dict[str, Any], dict[str, str], Path]:
        """A version on the CDN: (the signed manifest, its signed URLs, the file)."""
        path = self.files / f"{version}" / "model.onnx"
        scale_model(path, factor, **model)
        uri = self.cdn.put(f"{MODEL}/{version}/model.onnx", path.read_bytes())
        signed = make(
            MODEL, version, [file_entry(path)], lifetime_s, {"fleet": "f1"}, smoke(factor)
        )
        urls = {"model.onnx": secure_link_url(self.cdn.base, uri, SECRET, 600)}
        return sign(signed, {"fleet-1": self.key}), urls, path

    def configured(
        self, model: str, version: int, factor: float, config: str, smoke_factor: float = 0.0
    ) -> dict[str, Any]:
        """A desired-state entry of a version that carries its own config.pbtxt (on the CDN)."""
        entries, urls = [], {}
        for name in ("model.onnx", "config.pbtxt"):
            path = self.files / model / str(version) / name
            if name == "model.onnx":
                scale_model(path, factor)
            else:
                path.write_text(config)
            uri = self.cdn.put(f"{model}/{version}/{name}", path.read_bytes())
            urls[name] = secure_link_url(self.cdn.base, uri, SECRET, 600)
            entries.append(file_entry(path))
        signed = make(
            model, version, entries, 3600.0, {"fleet": "f1"}, smoke(smoke_factor or factor)
        )
        return {"manifest": sign(signed, {"fleet-1": self.key}), "urls": urls}

    def removal(self, model: str, version: int) -> dict[str, Any]:
        signed = make(model, version, [], 3600.0, {"fleet": "f1"}, remove=True)
        return {"manifest": sign(signed, {"fleet-1": self.key}), "urls": {}}

    def deliver(self, manifest: dict[str, Any], urls: dict[str, str]) -> None:
        self.deliver_body({"models": [{"manifest": manifest, "urls": urls}]})

    def deliver_body(self, body: dict[str, Any]) -> None:
        """A desired state, retained."""
        payload = envelope.Envelope(OPERATOR, int(time.time() * 1000), body).encode()
        assert not self.consumer.publish(NODE.desired_models, payload, retain=True).is_failure

    def steps(self) -> list[dict[str, Any]]:
        return [
            e.body["delivery"]
            for e in bodies(list(self.consumer.received), "events")
            if "delivery" in e.body
        ]

    def wait_step(
        self, step: str, version: int | None, timeout: float = 30, model: str = MODEL
    ) -> dict[str, Any]:
        return self._first(
            f"delivery step {step} of {model} version {version}",
            lambda row: (
                row["step"] == step
                and row.get("version") == version
                and row.get("model", model) == model
            ),
            timeout,
        )

    def outcome(self, version: int, after: int, timeout: float = 30) -> dict[str, Any]:
        """The first step of ``version`` after the first ``after`` steps that ends a try:
        refused, failed or active."""
        return self._first(
            f"the outcome of version {version}",
            lambda row: row.get("version") == version and row["step"] in ENDS,
            timeout,
            after,
        )

    def _first(
        self, what: str, matches: Callable[[dict[str, Any]], bool], timeout: float, after: int = 0
    ) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((row for row in self.steps()[after:] if matches(row)), None)

        wait_for(found, timeout, f"{what}: {self.steps()[after:]}")
        row = found()
        assert row is not None
        return row

    def restart(self, change: tuple[str, str] = ("", ""), remove: tuple[str, ...] = ()) -> None:
        """cloudsync stopped, ``change`` made to its config (old text, new text), the files
        ``remove`` names removed from its directory, started."""
        assert self.agent.signal(signal.SIGTERM) == 0
        if change[0]:
            text = self.agent.config.read_text()
            assert change[0] in text
            self.agent.config.write_text(text.replace(change[0], change[1]))
        for name in remove:
            (self.agent.workdir / name).unlink(missing_ok=True)
        self.agent.start()


ENDS = ("refused", "failed", "active")


def whole(version: Path) -> None:
    """A version directory holds its file, and an installed one the list edged keeps of it (the
    first version was placed by hand)."""
    names = sorted(p.name for p in version.iterdir())
    assert names == (["model.onnx"] if version.name == "1" else [RECORD, "model.onnx"]), version


def staging_of(fleet: Fleet) -> Path:
    """edged's staging directory, where cloudsync downloads to (the only place edged installs
    from)."""
    return fleet.edged.workdir / "state" / "staging"


@pytest.fixture
def fleet(tmp_path: Path, pki: Path, make_daemon: type[Daemon]) -> Iterator[Fleet]:
    repository = tmp_path / "models"
    add_model(repository, MODEL, {1: 1.0})
    edged = make_daemon(repository).start()  # and the agent: both as edged's user
    broker = Broker(tmp_path / "mosquitto", pki).start()
    cdn = Cdn(tmp_path / "cdn", pki).start()
    agent = Agent(tmp_path / "agent", broker)
    staging = edged.workdir / "state" / "staging"  # edged installs only from its own
    config = agent.config.read_text().replace(
        str(agent.workdir / "no-edged.sock"), str(edged.socket)
    )
    agent.config.write_text(
        config + f'[delivery]\nstaging_dir = "{staging}"\nca_file = "{pki}/ca.pem"\n'
        "retry_s = 2\nattempts = 2\nhealth_window_s = 4\nhealth_min_requests = 10\n"
    )
    key = agent.trust()
    consumer = operator(broker)
    files = tmp_path / "versions"
    try:
        yield Fleet(broker, cdn, edged, agent.start(), consumer, key, files)
    finally:
        consumer.close()
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
        cdn.stop()
        broker.kill()


def test_a_signed_version_is_downloaded_installed_and_serves(fleet: Fleet) -> None:
    # an older staging of this model (cut short) goes; another model's, named alike, stays
    staging = staging_of(fleet)
    for name in (f"{MODEL}-1", f"{MODEL}-det-3", f"{MODEL}-1x", f"{MODEL}-3-1"):
        (staging / name).mkdir()
        (staging / name / "model.onnx.part").write_bytes(b"partial")
        owned_like(staging, staging / name)  # left by cloudsync, as edged's user
    manifest, urls, path = fleet.version(2, 2.0)
    fleet.deliver(manifest, urls)
    active = fleet.wait_step("active", 2)
    assert active["previous"] == 1
    assert answer(fleet.edged.client) == ("2", 2.0)
    accepted = fleet.wait_step("accepted", 2)
    assert accepted["signed_by"] == ["fleet-1"] and accepted["bytes"] == path.stat().st_size
    served = [row for row in fleet.cdn.served() if row[0].endswith("/2/model.onnx")]
    assert served == [(f"/models/{MODEL}/2/model.onnx", 200, path.stat().st_size, "-")]
    # the staging directory was moved in, nothing of this model is left behind
    assert sorted(p.name for p in staging.iterdir()) == [
        f"{MODEL}-1x",
        f"{MODEL}-3-1",
        f"{MODEL}-det-3",
    ]
    assert (staging / f"{MODEL}-det-3" / "model.onnx.part").read_bytes() == b"partial"


def test_every_bad_manifest_and_file_is_refused_and_the_old_version_keeps_serving(
    fleet: Fleet,
) -> None:
    manifest, urls, _ = fleet.version(2, 2.0)
    fleet.deliver(manifest, urls)
    fleet.wait_step("active", 2)
    client = fleet.edged.client

    def refused(
        manifest: dict[str, Any], urls: dict[str, str], says: str, step: str
    ) -> dict[str, Any]:
        before = len(fleet.steps())
        fleet.deliver(manifest, urls)

        def found() -> list[dict[str, Any]]:
            return [
                r for r in fleet.steps()[before:] if says in str(r.get("why")) and r["step"] == step
            ]

        wait_for(found, 30, f"'{says}' in {fleet.steps()[before:]}")
        assert answer(client) == ("2", 2.0)
        return found()[0]

    stranger = Ed25519PrivateKey.generate()
    forged, urls3, _ = fleet.version(3, 3.0)
    forged = sign(forged["signed"], {"fleet-1": stranger})  # claims fleet-1, is not
    row = refused(forged, urls3, "fleet-1's signature does not verify", "refused")
    # what it claims to be, said as unverified: a rollout that sent it stops at once
    assert (row["model"], row["version"], row["unverified"]) == (MODEL, 3, True)
    expired, urls4, _ = fleet.version(4, 4.0, lifetime_s=-1)
    refused(expired, urls4, "(freeze)", "refused")
    old, urls1, _ = fleet.version(1, 1.0)
    refused(old, urls1, "version 1 is below 2", "refused")

    corrupt, urls5, path5 = fleet.version(5, 5.0)
    data = bytearray(path5.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same length, other bytes: on the CDN, not what was signed
    fleet.cdn.put(f"{MODEL}/5/model.onnx", bytes(data))
    refused(corrupt, urls5, "SHA-256 is not the manifest's", "failed")
    endless, urls6, path6 = fleet.version(6, 6.0)
    fleet.cdn.put(f"{MODEL}/6/model.onnx", path6.read_bytes() + b"\0" * (1 << 20))
    refused(endless, urls6, "endless data", "failed")
    unsigned_url, urls7, _ = fleet.version(7, 7.0)
    tampered = {"model.onnx": urls7["model.onnx"].replace("md5=", "md5=x")}
    refused(unsigned_url, tampered, "answered 403", "failed")
    late, urls8, _ = fleet.version(8, 8.0)
    uri = urls8["model.onnx"].split("localhost:")[1].split("?")[0].split("/", 1)[1]
    gone = {"model.onnx": secure_link_url(fleet.cdn.base, "/" + uri, SECRET, -10)}
    refused(late, gone, "answered 410: the signed URL expired", "failed")

    wrong, urls9, _ = fleet.version(9, 9.0)
    wrong["signed"]["smoke"] = smoke(10.0)  # expects what version 9 does not answer
    refused(sign(wrong["signed"], {"fleet-1": fleet.key}), urls9, "smoke case 1", "failed")
    assert client.model_versions(MODEL)["on_disk"] == [1, 2]


def test_a_version_failing_in_service_is_rolled_back(fleet: Fleet) -> None:
    """Version 3 passes its smoke test (one row) but fails on batches of two: live failures 5%
    above version 2's within the health window bring version 2 back, reported."""
    manifest, urls, _ = fleet.version(2, 2.0)
    fleet.deliver(manifest, urls)
    fleet.wait_step("active", 2)
    manifest, urls, _ = fleet.version(3, 3.0, single_row=True)
    fleet.deliver(manifest, urls)
    fleet.wait_step("active", 3)
    client = fleet.edged.client
    pair = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 1, 1, 1]}]}
    for _ in range(30):
        with contextlib.suppress(Exception):
            client.infer_json(MODEL, pair)
    back = fleet.wait_step("rolled-back", 3)
    # the watch decides at its first look with 10 calls or more: up to 30, all refused (the
    # install's smoke test is edged's own call, counted nowhere)
    calls = int(re.match(r"[\d.]+% of (\d+) calls", back["why"])[1])  # type: ignore[index]
    assert 10 <= calls <= 30, back
    expected = f"100.0% of {calls} calls failed (version 2: 0.0%)"
    assert back["why"].startswith(expected), back
    assert back["active"] == 2
    assert answer(client) == ("2", 2.0)
    assert fleet.agent.status()["connected"]


def test_twenty_sigkills_while_downloading_and_installing_never_leave_a_partial_version(
    fleet: Fleet,
) -> None:
    """A 6 MiB version at 1 MiB/s; cloudsync is SIGKILLed 20 times, each at a random moment
    (0-0.3 s) after its download made progress again. After each kill version 1 or 2 serves and
    the repository holds only whole versions; the download resumes with Range requests, so
    nginx sends not much more than the file once. (edged killed while installing: below.)"""
    fleet.cdn.stop()
    fleet.cdn.rate = "1m"
    fleet.cdn.write_config()
    fleet.cdn.start()
    manifest, urls, path = fleet.version(2, 2.0, pad_bytes=6 << 20)
    size = path.stat().st_size
    fleet.deliver(manifest, urls)
    rng = random.Random(7)
    client = fleet.edged.client
    repository = fleet.edged.models / MODEL
    part = staging_of(fleet) / f"{MODEL}-2" / "model.onnx.part"

    def on_disk() -> int:
        return part.stat().st_size if part.exists() else 0

    for _ in range(20):
        # while it downloads: a kill once it has made progress since the restart; after that,
        # kills during the install or once active
        before, deadline = on_disk(), time.monotonic() + 5
        while on_disk() <= before and part.exists() == (before > 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        fleet.agent.signal(signal.SIGKILL)
        version, y = answer(client)
        assert (version, y) in (("1", 1.0), ("2", 2.0))
        assert client.model_versions(MODEL)["active"] in (None, 1, 2)
        for directory in [d for d in repository.iterdir() if d.is_dir()]:
            whole(directory)
        fleet.agent.start()
    fleet.wait_step("active", 2, timeout=60)
    assert answer(client) == ("2", 2.0)
    sent = [row for row in fleet.cdn.served() if row[0].endswith("/2/model.onnx")]
    ranges = [row for row in sent if row[3].startswith("bytes=")]
    total = sum(row[2] for row in sent)
    assert len(ranges) >= 5, f"the download resumed {len(ranges)} times with Range requests"
    print(
        f"{len(sent)} requests ({len(ranges)} with Range), {total} bytes sent for a file of {size}"
    )
    assert size <= total < 1.5 * size, f"{total} bytes sent for a file of {size}"
    resumed = [r.get("resumed_bytes", 0) for r in fleet.steps() if r["step"] == "downloaded"]
    assert resumed and resumed[-1] > 0  # what was on disk was not fetched again


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_during_the_download_is_reported_and_the_old_version_serves(
    fleet: Fleet,
) -> None:
    # edged's staging directory on a small file system of its own
    small = staging_of(fleet)
    text = fleet.agent.config.read_text()
    fleet.agent.signal(signal.SIGTERM)
    owner = small.stat()  # the disk is edged's, as its staging directory was
    options = f"size=12m,mode=0700,uid={owner.st_uid},gid={owner.st_gid}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(small)], check=True)
    try:
        fleet.agent.config.write_text(text.replace("retry_s = 2", "retry_s = 2\nmin_free_mb = 0"))
        fleet.cdn.stop()
        fleet.cdn.rate = "2m"
        fleet.cdn.write_config()
        fleet.cdn.start()
        fleet.agent.start()
        manifest, urls, _ = fleet.version(2, 2.0, pad_bytes=8 << 20)
        fleet.deliver(manifest, urls)
        fleet.wait_step("accepted", 2)
        filler = small / "filler"
        # another writer takes the space meanwhile
        with filler.open("wb") as f, contextlib.suppress(OSError):
            f.write(b"\0" * (12 << 20))
        failed = fleet.wait_step("failed", 2)
        assert "no space left" in failed["why"]
        assert answer(fleet.edged.client) == ("1", 1.0)
        filler.unlink()  # room again: the next try resumes and completes (another file system
        fleet.wait_step("active", 2, timeout=60)  # than the repository: copied in)
        assert answer(fleet.edged.client) == ("2", 2.0)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_edged_killed_while_installing_restarts_on_a_whole_version_and_the_install_completes(
    fleet: Fleet,
) -> None:
    """edged is SIGKILLed the moment a version's file is complete in staging (edged is about to
    check it) or the moment its directory appears in the repository (edged is loading and
    smoke-testing it): after each restart the version before or the new one serves, whole, and
    the install then completes (from the directory already moved in), nothing fetched again."""
    edged = fleet.edged
    repository = edged.models / MODEL
    staging = staging_of(fleet)
    for version in range(2, 6):
        manifest, urls, path = fleet.version(version, float(version), pad_bytes=24 << 20)
        staged_file = staging / f"{MODEL}-{version}" / "model.onnx"
        moved_in = repository / str(version)
        trigger = staged_file if version % 2 == 0 else moved_in
        fleet.deliver(manifest, urls)
        deadline = time.monotonic() + 60
        while not trigger.exists():
            assert time.monotonic() < deadline, f"{trigger} never appeared"
            time.sleep(0.001)
        assert edged.proc is not None
        edged.proc.kill()
        edged.proc.wait()
        edged.start()
        served = answer(edged.client)
        assert served in ((str(version - 1), version - 1.0), (str(version), float(version)))
        for directory in [d for d in repository.iterdir() if d.is_dir()]:
            whole(directory)
        fleet.wait_step("active", version, timeout=60)
        assert answer(edged.client) == (str(version), float(version))
        fetched = [r for r in fleet.cdn.served() if r[0].endswith(f"/{version}/model.onnx")]
        assert [r[2] for r in fetched] == [path.stat().st_size], "fetched once"
    cut = [r for r in fleet.steps() if r["step"] == "failed" and r.get("stage") == "install"]
    assert cut, "at least one install was cut short by the kill"


@pytest.mark.parametrize("damage", ["a byte flipped", "cut short"])
def test_a_version_damaged_on_disk_is_refused_the_one_before_serves_and_it_is_fetched_again(
    fleet: Fleet, damage: str
) -> None:
    """A delivered version's file damaged on disk (a byte of its weights flipped, which ONNX
    Runtime would load and serve wrong; or cut short, as a power cut leaves it), then edged
    started again: edged refuses that version naming the file and why, the version before
    serves, and its event says so; cloudsync, told by that event, reports the version damaged,
    fetches it again and installs it over itself, and it serves."""
    edged = fleet.edged
    manifest, urls, path = fleet.version(2, 2.0)
    fleet.deliver(manifest, urls)
    fleet.wait_step("active", 2)
    onnx = edged.models / MODEL / "2" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    if damage == "cut short":
        del data[len(data) // 2 :]
    else:
        data[-100] ^= 0x01  # in the initializers' raw data: the model still parses
    onnx.write_bytes(bytes(data))
    steps = len(fleet.steps())
    edged.stop()
    edged.start()

    versions = edged.client.model_versions(MODEL)
    assert (versions["active"], versions["serving"], versions["on_disk"]) == (2, [1], [1, 2])
    why = versions["damaged"]["2"]
    expected = f"has {len(data)} bytes, {path.stat().st_size} listed"
    assert why == (
        f"file 'model.onnx' {expected}"
        if damage == "cut short"
        else "file 'model.onnx': its SHA-256 is not the one listed"
    ), why
    reported = fleet.wait_step("damaged", 2, timeout=60)
    assert reported["why"] == f"on the node: {why}"
    repaired = fleet.outcome(2, steps, timeout=60)
    assert repaired["step"] == "active", repaired
    assert answer(edged.client) == ("2", 2.0)
    assert edged.client.model_versions(MODEL)["damaged"] == {}
    fetched = [r for r in fleet.cdn.served() if r[0].endswith("/2/model.onnx")]
    assert [r[1:3] for r in fetched] == [(200, path.stat().st_size)] * 2  # fetched again, whole
    whole(edged.models / MODEL / "2")
    wait_for(lambda: edged_events(fleet, "damaged"), 30, "edged's event at the fleet")
    events = edged_events(fleet, "damaged")
    assert (events[0]["model"], events[0]["level"]) == (MODEL, "error")
    assert why in events[0]["message"]


def edged_events(fleet: Fleet, reason: str) -> list[dict[str, Any]]:
    """edged's events at the fleet with this ``reason``."""
    found = (e.body for e in bodies(list(fleet.consumer.received), "events"))
    return [body for body in found if body.get("from") == "edged" and body.get("reason") == reason]


def test_a_delivery_waits_for_edged_to_start_and_refuses_a_model_edged_lacks(
    fleet: Fleet,
) -> None:
    assert fleet.edged.stop() == 0  # edged is down (or still loading) when the state comes
    manifest, urls, _ = fleet.version(2, 2.0)
    fleet.deliver(manifest, urls)
    time.sleep(2)
    assert not [s for s in fleet.steps() if s.get("version") == 2 and s["step"] != "accepted"]
    fleet.edged.start()
    fleet.wait_step("active", 2, timeout=30)  # asked again within seconds, not retry_s
    assert answer(fleet.edged.client) == ("2", 2.0)

    path = fleet.files / "other" / "model.onnx"
    scale_model(path, 5.0)
    uri = fleet.cdn.put("other/1/model.onnx", path.read_bytes())
    other = sign(make("other", 1, [file_entry(path)]), {"fleet-1": fleet.key})
    fleet.deliver(other, {"model.onnx": secure_link_url(fleet.cdn.base, uri, SECRET, 600)})
    refused = fleet.wait_step("refused", 1, model="other")
    assert refused["why"] == (
        "edged has no model 'other': a new model's version carries its config.pbtxt among its files"
    )


def test_a_new_model_a_new_config_and_a_removal_are_delivered_and_bad_ones_change_nothing(
    fleet: Fleet,
) -> None:
    client = fleet.edged.client
    one_row = (CONFIG % "").replace("max_batch_size: 4", "max_batch_size: 1")
    fresh = fleet.configured("fresh", 1, 3.0, CONFIG % "")
    broken = fleet.configured(MODEL, 2, 2.0, (CONFIG % "").replace("4", "-1"))
    fleet.deliver_body({"models": [fresh, broken]})
    # a model new to the node, with its config: installed, smoke-tested, serving
    assert fleet.wait_step("active", 1, model="fresh")["previous"] is None
    assert rows(client, "fresh", 2) == ("1", [3.0] * 4)
    # a broken config: refused by edged, version 1 serves as it did
    failed = fleet.wait_step("failed", 2)
    assert failed["stage"] == "install" and failed["why"].endswith("max_batch_size must be >= 0"), (
        failed
    )
    assert rows(client, MODEL, 4) == ("1", [1.0] * 8)
    assert client.model_versions(MODEL)["on_disk"] == [1]

    # a changed config for the model it has: in force with its version
    fleet.deliver_body({"models": [fresh, fleet.configured(MODEL, 3, 3.0, one_row)]})
    assert fleet.wait_step("active", 3)["previous"] == 1
    assert rows(client, MODEL, 1) == ("3", [3.0, 3.0])
    with pytest.raises(ClientError) as refused:
        rows(client, MODEL, 2)
    assert refused.value.status == 400

    # a removal: the model goes; a removal older than what is installed does nothing
    fleet.deliver_body({"models": [fleet.removal("fresh", 1), fleet.removal(MODEL, 2)]})
    # (version 2 of the model failed to install: a removal of that version is a new request)
    removed = fleet.wait_step("removed", 1, model="fresh")
    assert removed["versions"] == [1]
    stale = fleet.wait_step("refused", 2)
    assert stale["why"] == "version 2 is below 3, already accepted or installed here (rollback)"
    with pytest.raises(ClientError) as gone:
        rows(client, "fresh", 1)
    assert gone.value.status == 404
    assert (fleet.edged.models / ".fresh.removed").is_file()
    assert rows(client, MODEL, 1) == ("3", [3.0, 3.0])
    # the old manifest again (replayed): refused, the model stays removed
    seen = len(fleet.steps())
    fleet.deliver_body({"models": [fresh]})
    again = fleet.outcome(1, seen)
    assert again["step"] == "refused" and again["model"] == "fresh", again
    assert again["why"] == (
        "the model was removed at version 1: a version above it installs it again"
    )
    assert not (fleet.edged.models / "fresh").exists()
    # and a newer version brings it back
    fleet.deliver_body({"models": [fleet.configured("fresh", 2, 4.0, CONFIG % "")]})
    assert fleet.wait_step("active", 2, model="fresh")["previous"] is None
    assert rows(client, "fresh", 1) == ("2", [4.0, 4.0])


def test_a_rollback_is_refused_when_the_outbox_or_the_delivery_state_is_lost(
    fleet: Fleet,
) -> None:
    """Version 2 serves; a validly signed manifest of version 1 is refused as a rollback after
    the outbox file is recreated (the floor is in delivery.json), after both are gone (edged's
    versions are the floor), from an older cloudsync's floor in the outbox (moved to the file
    once), and while delivery.json is corrupt (no delivery at all: fail closed)."""
    manifest, urls, _ = fleet.version(2, 2.0)
    fleet.deliver(manifest, urls)
    fleet.wait_step("active", 2)
    client = fleet.edged.client
    state_file = fleet.agent.workdir / "delivery.json"
    assert json.loads(state_file.read_text()) == {MODEL: {"floor": 2}}
    old, urls1, _ = fleet.version(1, 1.0)
    outbox = ("outbox.db", "outbox.db-wal", "outbox.db-shm")

    def refused(remove: tuple[str, ...], says: str) -> None:
        after = len(fleet.steps())
        fleet.restart(remove=remove)
        fleet.deliver(old, urls1)
        row = fleet.outcome(1, after)
        assert row["step"] == "refused" and says in row["why"], row
        assert answer(client) == ("2", 2.0)
        assert client.model_versions(MODEL)["active"] == 2

    refused(outbox, "version 1 is below 2, already accepted or installed here (rollback)")
    refused((*outbox, "delivery.json"), "version 1 is below 2")
    assert not state_file.exists()  # nothing accepted since: edged's versions were the floor

    # an older cloudsync kept the floor in the outbox's state: it is moved to delivery.json
    with contextlib.closing(sqlite3.connect(fleet.agent.workdir / "outbox.db")) as db, db:
        db.execute(
            "INSERT OR REPLACE INTO state VALUES (?, ?)",
            [f"delivery/{MODEL}", json.dumps({"floor": 7})],
        )
    refused((), "version 1 is below 7")
    assert json.loads(state_file.read_text()) == {MODEL: {"floor": 7}}

    state_file.write_text('{"scale": {"floor": ')  # cut short: cannot be trusted
    after = len(fleet.steps())
    fleet.restart()
    newer, urls9, _ = fleet.version(9, 9.0)
    fleet.deliver(newer, urls9)
    row = fleet.outcome(9, after)
    assert row["step"] == "refused" and "delivery.json is not JSON" in row["why"], row
    assert "no delivery until it is repaired or removed" in row["why"]
    assert answer(client) == ("2", 2.0)


def test_urls_other_than_https_redirects_and_tls_1_2_are_refused_without_local_detail(
    fleet: Fleet,
) -> None:
    """Each refused or failed with a category in ``why``, no address, port or OS error; a
    refused URL leaves nothing on disk. Plain http to loopback only with the setting."""
    manifest, urls, path = fleet.version(2, 2.0)
    signed = urls["model.onnx"].removeprefix(fleet.cdn.base)  # /models/...?md5=...&expires=...
    closed = free_port()
    missing = secure_link_url(fleet.cdn.base, f"/models/{MODEL}/none/model.onnx", SECRET, 600)

    def why(url: str, step: str) -> str:
        after = len(fleet.steps())
        fleet.deliver(manifest, {"model.onnx": url})
        row = fleet.outcome(2, after)
        assert row["step"] == step, row
        text = str(row["why"])
        for detail in (
            "Errno",
            "refused by",
            "Connection refused",
            "127.0.0.1",
            "localhost",
            str(closed),
            str(fleet.cdn.port),
            "SSL",
            "/models/",
        ):
            assert detail not in text, row
        return text

    data = "data:application/octet-stream;base64,AAAA"
    assert why(path.as_uri(), "refused") == "model.onnx: URL scheme 'file' refused: https only"
    assert why(data, "refused") == "model.onnx: URL scheme 'data' refused: https only"
    assert "scheme 'ftp' refused" in why("ftp://cdn.example" + signed, "refused")
    assert why("http://cdn.example" + signed, "refused").endswith("plain http refused: https only")
    assert "plain http refused" in why(fleet.cdn.http_base + signed, "refused")
    assert not (staging_of(fleet) / f"{MODEL}-2").exists()  # refused before anything on disk
    assert why(fleet.cdn.base + "/moved" + signed, "failed").endswith("a redirect (not followed)")
    assert why(fleet.cdn.tls12_base + signed, "failed").endswith("TLS handshake failed")
    assert why(f"https://localhost:{closed}{signed}", "failed").endswith(
        "cannot connect to the download server"
    )
    assert why(missing, "failed").endswith("the server answered 404")
    assert [r[1] for r in fleet.cdn.served() if r[0].endswith("/2/model.onnx")] == [302]
    assert answer(fleet.edged.client) == ("1", 1.0)

    fleet.deliver_body({"models": []})  # nothing waiting when it starts again
    fleet.restart(("[delivery]\n", "[delivery]\nallow_http_loopback = true\n"))
    assert why("http://cdn.example" + signed, "refused").endswith(
        "plain http to a host that is not loopback refused: https only"
    )
    fleet.deliver(manifest, {"model.onnx": fleet.cdn.http_base + signed})
    fleet.wait_step("active", 2)
    assert answer(fleet.edged.client) == ("2", 2.0)


def test_a_staging_dir_that_is_not_edgeds_is_named_in_the_report(
    fleet: Fleet, tmp_path: Path
) -> None:
    staging = f'staging_dir = "{staging_of(fleet)}"'
    elsewhere = tmp_path / "elsewhere"  # cloudsync's own, but not the one edged installs from
    elsewhere.mkdir()
    owned_like(staging_of(fleet), elsewhere)
    fleet.restart((staging, f'staging_dir = "{elsewhere}"'))
    manifest, urls, _ = fleet.version(2, 2.0)
    fleet.deliver(manifest, urls)
    failed = fleet.wait_step("failed", 2)
    assert failed["stage"] == "install"
    assert "installs only from there" in failed["why"]
    assert "[delivery] staging_dir" in failed["why"] and "{state_dir}/staging" in failed["why"]
    assert answer(fleet.edged.client) == ("1", 1.0)
