"""The egress ledger against a real cloud (the tests' MLServer) reached through a recording
proxy (tests/hashproxy.py) that hashes every body as the cloud received it: each path that
leaves the device (the cloud route, a hedge, an escalation, over REST and gRPC) writes exactly
one entry per call, before the call, whose SHA-256 and size are the received body's; a private
request writes none; the answer's route trace points to its entries; a SIGKILL in the middle
of traffic leaves a chain that verifies; the off switch is itself recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edged.client import ClientError
from edged.common.egress import Ledger, verify
from tests.conftest import CLOUD_MODEL as MODEL
from tests.conftest import Cloud, Daemon, copy_model, linked_repository, wait_for
from tests.hashproxy import GrpcHashProxy, HashProxy
from tests.integration.edged.test_routing import ALWAYS_CLOUD, ask, cloud_state

pytestmark = pytest.mark.usefixtures("faults_cleared")


@pytest.fixture
def hashing(cloud: Cloud) -> Iterator[HashProxy]:
    proxy = HashProxy(f"http://{cloud.proxy.address}").start()
    yield proxy
    proxy.stop()


def start(
    make_daemon: type[Daemon],
    proxy: HashProxy,
    routing: str = "",
    extra: str = "",
    repository: Path | None = None,
    grpc_url: str = "",
) -> Daemon:
    from tests.conftest import MODELS

    config = f"""
[models]
load = ["{MODEL}"]
[cloud]
url = "{grpc_url or f"http://{proxy.address}"}"
[routing]
{routing}
{extra}
"""
    daemon = make_daemon(repository or MODELS, config=config).start()
    wait_for(lambda: MODEL in cloud_state(daemon.client)["catalog"], 10, "the cloud catalog")
    return daemon


def ledger_of(daemon: Daemon) -> Ledger:
    return Ledger(daemon.workdir / "state" / "egress")


def sent(daemon: Daemon, kind: str = "cloud-infer") -> list[dict[str, Any]]:
    return ledger_of(daemon).entries(limit=10_000, match=lambda e: e["kind"] == kind)


def test_every_cloud_call_is_one_entry_whose_hash_is_what_the_cloud_received(
    make_daemon: type[Daemon], hashing: HashProxy
) -> None:
    daemon = start(make_daemon, hashing)
    client = daemon.client
    answers = [ask(client, 31000 + i, route="cloud") for i in range(8)]
    hedged = ask(client, 31100, route="hedged")
    private = ask(client, 31200, route="cloud", private=True)
    assert all(a["route"] == "cloud" for a in answers) and private["route"] == "local"
    entries = sent(daemon)
    posts = [p for p in hashing.posts() if p["path"].endswith("/infer")]
    received = {p["id"]: p for p in posts}
    ids = [f"req-{31000 + i}" for i in range(8)]
    recorded = {e["request_id"]: e for e in entries}
    # one entry per call that reached the cloud, none for the private one; the entry comes
    # before the bytes, so a hedge cancelled in between (the device answered first) has one
    # and never arrives
    assert len(entries) == len(recorded) and len(posts) == len(received)
    assert set(received) <= set(recorded) and set(recorded) - set(received) <= {"req-31100"}
    assert set(ids) <= set(received) and "private-31200" not in recorded
    if hedged["route"] == "hedged":  # the hedge's cloud call was sent: it is recorded
        assert "req-31100" in recorded
    for ident, entry in recorded.items():
        if ident not in received:
            continue
        got = received[ident]
        assert (entry["sha256"], entry["bytes"]) == (got["sha256"], got["bytes"]), ident
        assert entry["endpoint"] == f"http://{hashing.address}" and entry["protocol"] == "rest"
        assert entry["model"] == entry["cloud_model"] == MODEL and entry["tier"] == "cloud"
        assert entry["uid"] == os.getuid() and entry["labels"] == {"embedding": "public"}
        assert entry["route"] in ("cloud", "hedged") and entry["reason"]
    # the answer's trace points to its entry
    _, explained = client.infer_answer(
        MODEL,
        {"embedding": np_embedding()},
        request_id="x-1",
        parameters={"route": "cloud", "explain": True},
    )
    (step,) = json.loads(explained["route_trace"])
    (entry,) = [e for e in sent(daemon) if e["request_id"] == "x-1"]
    assert step["egress"] == [entry["seq"]]
    report = verify(daemon.workdir / "state" / "egress")
    assert report.ok and report.last.seq == entry["seq"], report
    first = ledger_of(daemon).entries(limit=2)
    assert [e["kind"] for e in first] == ["genesis", "started"]
    assert first[1]["settings"] == {"segment_mb": 16.0, "max_mb": 256.0, "fsync_s": 1.0}


def np_embedding() -> Any:
    from tests.integration.edged.test_routing import embedding

    return embedding(7)


def test_an_escalation_is_recorded_and_a_private_one_never_leaves(
    make_daemon: type[Daemon], hashing: HashProxy, tmp_path: Path
) -> None:
    repository = linked_repository(tmp_path / "models", [MODEL])
    config = copy_model(repository, MODEL) / "config.pbtxt"
    escalate = 'parameters {\n  key: "escalate_below"\n  value { string_value: "0.95" }\n}\n'
    config.write_text(config.read_text() + escalate)
    daemon = start(make_daemon, hashing, repository=repository)
    answers = [ask(daemon.client, 32000 + i) for i in range(6)]
    private = [ask(daemon.client, 32100 + i, private=True) for i in range(3)]
    escalated = {f"req-{a['i']}" for a in answers if a["route"] == "escalated"}
    assert escalated and all(p["route"] == "local" for p in private)
    entries = sent(daemon)
    assert {e["request_id"] for e in entries} == escalated
    assert all(e["route"] == "escalated" and "confidence" in e["reason"] for e in entries)
    received = {p["id"]: p["sha256"] for p in hashing.posts()}
    assert all(received[e["request_id"]] == e["sha256"] for e in entries)


def test_over_grpc_each_call_is_recorded_once_with_the_messages_hash(
    make_daemon: type[Daemon], hashing: HashProxy, cloud: Cloud
) -> None:
    """gRPC: the ledger hashes the request message as serialized into its frame; a gRPC proxy
    that takes each message as raw bytes hashes what it received."""
    grpc_proxy = GrpcHashProxy(cloud.peer.grpc_url).start()
    try:
        daemon = start(
            make_daemon, hashing, routing=ALWAYS_CLOUD, grpc_url=f"grpc://{grpc_proxy.address}"
        )
        answers = [ask(daemon.client, 33000 + i) for i in range(5)]
        assert all(a["route"] == "cloud" for a in answers), answers
        entries = sent(daemon)
        received = grpc_proxy.calls("/ModelInfer")
        assert [e["request_id"] for e in entries] == [f"req-{33000 + i}" for i in range(5)]
        assert all(e["protocol"] == "grpc" for e in entries)
        assert [(e["sha256"], e["bytes"]) for e in entries] == [
            (r["sha256"], r["bytes"]) for r in received
        ]
    finally:
        grpc_proxy.stop()


def test_a_sigkill_mid_traffic_leaves_a_chain_that_verifies(
    make_daemon: type[Daemon], hashing: HashProxy
) -> None:
    daemon = start(make_daemon, hashing, routing=ALWAYS_CLOUD)
    stop = threading.Event()

    def traffic(first: int) -> None:
        for i in range(400):
            if stop.is_set():
                return
            try:
                ask(daemon.client, first + i)
            except Exception:  # the daemon is gone
                return

    threads = [threading.Thread(target=traffic, args=(34000 + 1000 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(hashing.posts()) >= 40, 30, "traffic to the cloud")
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    stop.set()
    for t in threads:
        t.join(30)
    directory = daemon.workdir / "state" / "egress"
    report = verify(directory)
    assert report.ok and report.entries >= 40, report
    recorded = {e["request_id"] for e in sent(daemon)}
    received = {p["id"] for p in hashing.posts() if p["path"].endswith("/infer")}
    assert received <= recorded  # nothing reached the cloud unrecorded
    daemon.start()  # goes on from the last whole entry
    wait_for(lambda: MODEL in cloud_state(daemon.client)["catalog"], 10, "the cloud catalog")
    ask(daemon.client, 39000)
    again = verify(directory)
    assert again.ok and again.entries > report.entries and again.torn == 0


def test_the_off_switch_is_recorded_and_then_nothing_is(
    make_daemon: type[Daemon], hashing: HashProxy
) -> None:
    daemon = start(make_daemon, hashing, routing=ALWAYS_CLOUD)
    ask(daemon.client, 35000)
    assert daemon.stop() == 0
    config = daemon.config.read_text() + "\n[egress]\nenabled = false\n"
    daemon.config.write_text(config)
    daemon.start()
    wait_for(lambda: MODEL in cloud_state(daemon.client)["catalog"], 10, "the cloud catalog")
    assert ask(daemon.client, 35001)["route"] == "cloud"
    kinds = [e["kind"] for e in ledger_of(daemon).entries(limit=100)]
    assert kinds == ["genesis", "started", "cloud-infer", "ledger-off"]
    assert verify(daemon.workdir / "state" / "egress").ok


def test_edgectl_and_the_admin_api_list_and_verify_the_ledger(
    make_daemon: type[Daemon], hashing: HashProxy
) -> None:
    daemon = start(make_daemon, hashing, routing=ALWAYS_CLOUD)
    client = daemon.client
    for i in range(3):
        ask(client, 36000 + i)
    (one,) = client.egress(request_id="req-36001")["entries"]
    assert one["kind"] == "cloud-infer" and one["uid"] == os.getuid()
    page = client.egress(kind="cloud-infer", limit=2)
    assert [e["request_id"] for e in page["entries"]] == ["req-36000", "req-36001"]
    assert page["next"] == page["entries"][-1]["seq"] and page["head"]["seq"] >= one["seq"] + 1
    rest = client.egress(kind="cloud-infer", after=page["next"])
    assert [e["request_id"] for e in rest["entries"]] == ["req-36002"] and rest["next"] is None
    assert client.status()["egress"]["head"] == page["head"]
    assert client.egress(uid=os.getuid() + 1)["entries"] == []
    with pytest.raises(ClientError) as refused:
        client.egress(bogus=1)
    assert refused.value.status == 400 and "'bogus' is no filter" in refused.value.message
    # superscript two and Arabic-Indic one: str.isdigit takes both, int() refuses the first
    # (was a 500) and reads the second as 1: neither is a whole number here
    for key, value in (
        ("after", "x"),
        ("uid", "-1"),
        ("since_ms", "9" * 17),
        ("limit", 0),
        ("limit", 1001),
        ("limit", "\u00b2"),
        ("uid", "\u0661"),
    ):
        with pytest.raises(ClientError) as refused:
            client.egress(**{key: value})
        assert refused.value.status == 400 and f"'{key}'" in refused.value.message, key
    for anchor in ("7:" + "g" * 64, "\u00b2:" + "a" * 64):
        with pytest.raises(ClientError) as refused:
            client.verify_egress([anchor])
        assert refused.value.status == 400 and "'checkpoint'" in refused.value.message

    def edgectl(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "edged.edgectl", "--socket", str(daemon.socket), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    listed = edgectl("--json", "egress", "list", "--request", "req-36002")
    assert listed.returncode == 0, listed.stderr
    assert [e["request_id"] for e in json.loads(listed.stdout)["entries"]] == ["req-36002"]
    table = edgectl("egress", "list", "--model", MODEL)
    assert table.returncode == 0 and "req-36000" in table.stdout and "cloud-infer" in table.stdout
    document = {
        "id": "x-explained",
        "inputs": [
            {"name": "embedding", "shape": [1, 384], "datatype": "FP32", "data": [0.01] * 384}
        ],
    }
    explained = subprocess.run(
        [
            sys.executable,
            "-m",
            "edged.edgectl",
            "--socket",
            str(daemon.socket),
            "--explain",
            "--route",
            "cloud",
            "infer",
            MODEL,
            "-",
        ],
        input=json.dumps(document),
        capture_output=True,
        text=True,
        timeout=60,
    )
    (entry,) = client.egress(request_id="x-explained")["entries"]
    assert f"sent: egress ledger entry {entry['seq']} (edgectl egress list)" in explained.stdout
    head = client.egress(limit=1)["head"]
    ok = edgectl("egress", "verify", "--checkpoint", f"{head['seq']}:{head['hash']}")
    assert ok.returncode == 0 and ok.stdout.startswith("ok: "), ok.stderr
    assert "checkpoints in the chain: 1" in ok.stdout
    wrong = edgectl("egress", "verify", "--checkpoint", f"{head['seq']}:{'0' * 64}")
    assert wrong.returncode == 1 and "is not the fleet's checkpoint" in wrong.stderr
    # an entry in the middle edited (fewer bytes said to have left): found, through edged and
    # offline over the directory
    directory = daemon.workdir / "state" / "egress"
    (segment,) = sorted(directory.glob("egress-*.jsonl"))
    text = segment.read_text()
    segment.write_text(text.replace(f'"bytes":{one["bytes"]}', '"bytes":1', 1))
    for args in (("egress", "verify"), ("egress", "verify", "--dir", str(directory))):
        found = edgectl(*args)
        assert found.returncode == 1 and "its hash is not its own" in found.stderr, found


def image_report_daemon(make_daemon: type[Daemon], hashing: HashProxy) -> Daemon:
    """edged with the OCR and text models, the answer model in the cloud behind ``hashing``,
    started, the cloud's catalog seen: image-report's report node can go to the cloud."""
    from tests.conftest import ANSWER_MODEL, MODELS
    from tests.integration.edged.test_tasks import OCR_MODELS, TEXT_MODELS

    config = f"""
[models]
load = {json.dumps(OCR_MODELS + TEXT_MODELS)}
[cloud]
url = "http://{hashing.address}"
[[cloud.models]]
name = "{ANSWER_MODEL}"
[knowledge]
answer_model = "{ANSWER_MODEL}"
"""
    daemon = make_daemon(MODELS, config=config).start()
    wait_for(
        lambda: ANSWER_MODEL in cloud_state(daemon.client)["catalog"], 10, "the cloud's catalog"
    )
    return daemon


def test_a_task_graphs_cloud_node_is_recorded(
    make_daemon: type[Daemon], hashing: HashProxy, cloud: Cloud
) -> None:
    """The image-report template: its report node asks the answer model in the cloud (the OIP
    one, through the router, as the knowledge store's escalations do), with the text read on
    the device, never the private image: one entry, whose hash is what the cloud received; the
    OCR steps on the private image, none."""
    from tests.conftest import ANSWER_MODEL
    from tests.integration.edged.test_tasks import INVOICE, b64, tasks
    from tests.media import text_image

    daemon = image_report_daemon(make_daemon, hashing)
    answer = tasks(
        daemon.client, {"template": "image-report", "inputs": {"image": b64(text_image(INVOICE))}}
    )
    assert answer["status"] == "ok"
    (entry,) = sent(daemon)
    (post,) = [p for p in hashing.posts() if p["path"].endswith("/infer")]
    assert (entry["model"], entry["route"]) == (ANSWER_MODEL, "cloud")
    assert (entry["sha256"], entry["bytes"]) == (post["sha256"], post["bytes"])
    assert set(entry["labels"]) == {"question", "context"}
