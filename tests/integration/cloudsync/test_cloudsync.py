"""cloudsync against a real Mosquitto (TLS 1.3, client certificates, ACLs): birth and last will,
heartbeats, and an offline boot whose records all arrive once the broker is up.

The operator side is a test client with a persistent session (as a fleet's consumer has one):
the broker queues for it while it is away, so nothing depends on who connects first.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench.peer import free_port
from cloudsync.agent.journal import WITHHELD
from cloudsync.protocol import envelope
from cloudsync.protocol.commands import sign
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import parse
from edged.client import ClientError
from tests.cloudsync_agent import NODE, Agent, bodies, last_status, online, operator
from tests.conftest import CLOUD_MODEL as MODEL
from tests.conftest import Cloud, Daemon, wait_for
from tests.integration.edged.test_routing import ask, edged_with_cloud
from tests.journal_files import JOURNAL, KEYS, REQUEST_KEYS, SECRET, entry, write
from tests.mosquitto import OPERATOR, Broker, edgefleet


def test_offline_boot_then_everything_arrives_birth_heartbeat_and_last_will(
    broker: Broker, agent: Agent
) -> None:
    broker.start()
    consumer = operator(broker)  # its session and subscription outlive the broker's restart
    consumer.close()
    broker.stop()

    agent.start()  # no broker: it boots and takes records
    telemetry = [{"kind": "telemetry", "body": {"n": i}, "id": f"t{i}"} for i in range(300)]
    alerts = [
        {"kind": "events", "priority": "alert", "body": {"alert": i}, "id": f"a{i}"}
        for i in range(5)
    ]
    assert agent.post(telemetry) == {"stored": 300, "dropped": 0}
    assert agent.post(alerts) == {"stored": 5, "dropped": 0}
    assert agent.post(telemetry[:10])["stored"] == 10  # a retry: the same ids, stored once
    state = agent.status()
    assert not state["connected"] and state["outbox"]["pending"] == 305

    broker.start()
    consumer = operator(broker)
    try:
        wait_for(lambda: agent.status()["outbox"]["pending"] == 0, 30, "the outbox drained")
        # count the records themselves: the birth and heartbeats arrive among them
        wait_for(lambda: len(_ids(consumer)) >= 305, 10, "every record")
        got = list(consumer.received)
        records = bodies(got, "telemetry") + bodies(got, "events")
        assert sorted(r.id for r in records) == sorted(
            {r["id"] for r in telemetry} | {r["id"] for r in alerts}
        )
        tele = [r.body["n"] for r in bodies(got, "telemetry")]
        assert tele == list(range(300))  # in order
        events = bodies(got, "events")
        assert [e.body["alert"] for e in events] == list(range(5))
        kinds = [parse(t).kind for t, _ in got if parse(t).kind in ("events", "telemetry")]
        assert kinds[:5] == ["events"] * 5  # posted last, delivered first: alerts go ahead

        births = [json.loads(p) for t, p in got if t == NODE.status]
        assert births[-1]["body"]["state"] == "online" and births[-1]["node"] == "n1"
        assert births[-1]["body"]["edged"]["reachable"] is False  # no edged: still a birth
        wait_for(lambda: len(bodies(consumer.received, "heartbeat")) >= 3, 10, "heartbeats")
        beat = bodies(consumer.received, "heartbeat")[-1]
        assert beat.body["outbox"]["counters"]["duplicate"] == 10

        assert agent.signal(signal.SIGKILL) == -signal.SIGKILL
        wait_for(lambda: last_status(consumer) == "offline", 10, "the last will")
        assert "connection lost" in json.dumps(consumer.received[-1][1].decode())
    finally:
        consumer.close()

    late = SyncClient(broker.port, broker.pki, OPERATOR)  # someone who comes later
    assert late.connect() and not late.subscribe(NODE.status)[0].is_failure
    try:
        (retained,) = late.wait_messages(1, 5)
        assert envelope.decode(retained[1]).body["state"] == "offline"  # retained
    finally:
        late.close()


def test_a_clean_stop_says_offline_and_bad_records_are_refused(
    broker: Broker, agent: Agent
) -> None:
    broker.start()
    agent.start()
    consumer = operator(broker)
    try:
        wait_for(lambda: agent.status()["connected"], 10, "connected")
        with pytest.raises(Exception) as bad:
            agent.post([{"kind": "logs", "body": {}}])
        assert "kind" in str(bad.value)
        assert agent.signal(signal.SIGTERM) == 0
        wait_for(lambda: last_status(consumer) == "offline", 10, "offline status")
        last = [envelope.decode(p) for t, p in consumer.received if t == NODE.status][-1]
        assert last.body["reason"] == "stopped"
    finally:
        consumer.close()


def test_10000_records_through_20_broker_restarts_and_5_sigkills_lose_nothing(
    broker: Broker, agent: Agent
) -> None:
    """The producer posts 10,000 records (alerts, events, telemetry) through the local API,
    retrying a batch with the same ids when cloudsync is down; meanwhile the broker is stopped
    and restarted 20 times and cloudsync is SIGKILLed and restarted 5 times. Every record the
    local API acknowledged reaches the consumer; a record seen twice is the same record (its id
    and body); within a priority, first arrivals come in the order records were posted."""
    broker.start()
    consumer = operator(broker)
    agent.start()
    total, batch = 10_000, 100

    def record(i: int) -> dict[str, Any]:
        priority = "alert" if i % 50 == 0 else "event" if i % 10 == 0 else "telemetry"
        kind = "telemetry" if priority == "telemetry" else "events"
        return {"kind": kind, "priority": priority, "id": f"r{i}", "body": {"i": i}}

    acknowledged: set[str] = set()
    done = threading.Event()

    def produce() -> None:
        for start in range(0, total, batch):
            chunk = [record(i) for i in range(start, start + batch)]
            while True:
                try:
                    agent.post(chunk)
                    break
                except (ClientError, OSError):
                    time.sleep(0.1)  # cloudsync is down: the same ids again
            acknowledged.update(r["id"] for r in chunk)
            time.sleep(0.1)  # spread over the restarts below: 10 s of posting
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        for n in range(20):
            time.sleep(0.4)
            broker.stop()
            time.sleep(0.2)
            broker.start()
            if n % 4 == 3:  # 5 times
                agent.signal(signal.SIGKILL)
                agent.start()
        producer.join(300)
        assert done.is_set()
        wait_for(lambda: agent.status()["outbox"]["pending"] == 0, 120, "the outbox drained")
        wait_for(lambda: len(_ids(consumer)) >= total, 60, "every record at the consumer")
    finally:
        consumer.close()
    seen = [
        envelope.decode(p) for t, p in consumer.received if parse(t).kind in ("telemetry", "events")
    ]
    assert len(acknowledged) == total and acknowledged <= {e.id for e in seen}
    first: dict[str, envelope.Envelope] = {}
    for e in seen:
        assert e.body == first.setdefault(e.id, e).body  # a duplicate is the same record
    by_priority: dict[str, list[int]] = {}
    for e in first.values():  # dicts keep the order of first arrival
        by_priority.setdefault(record(e.body["i"])["priority"], []).append(e.body["i"])
    for priority, order in by_priority.items():
        assert order == sorted(order), f"{priority} records out of order"
    # the stream contract (docs/PROTOCOL.md): per topic and priority, seq runs 1..n in one
    # epoch, one number per record; nothing was dropped here, so there is no gap
    # (each priority is one topic here: alerts and events on events, telemetry on telemetry)
    streams: dict[tuple[str, str], dict[int, str]] = {}
    for e in seen:
        stream = streams.setdefault((e.extra["epoch"], e.extra["priority"]), {})
        assert stream.setdefault(e.seq, e.id) == e.id  # a number is one record
    assert len({epoch for epoch, _ in streams}) == 1
    assert {priority: sorted(numbers) for (_, priority), numbers in streams.items()} == {
        p: list(range(1, len(order) + 1)) for p, order in by_priority.items()
    }
    print(
        f"{total} records, {len(seen) - total} duplicates, {agent.status()['outbox']['counters']}"
    )


def _ids(client: SyncClient) -> set[str]:
    return {
        envelope.decode(p).id
        for t, p in list(client.received)
        if parse(t).kind in ("telemetry", "events")
    }


def test_signed_commands_run_and_report_forged_expired_and_replayed_ones_are_refused(
    broker: Broker, agent: Agent
) -> None:
    with online(broker, agent) as (key, consumer):
        ping_id, ping = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping")
        _, forged = sign(Ed25519PrivateKey.generate(), "fleet-1", "mallory", "f1/n1", "status")
        forged_id = envelope.decode(forged).id
        expired_id, expired = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping", lifetime_s=-5)
        for cmd_id, payload in [(ping_id, ping), (forged_id, forged), (expired_id, expired)]:
            assert not consumer.publish(NODE.cmd(cmd_id), payload).is_failure
        results = wait_results(consumer, 3)
        assert results[ping_id]["ok"] and results[ping_id]["result"]["pong"] is True
        assert "does not verify" in results[forged_id]["error"]
        assert "expired" in results[expired_id]["error"]

        consumer.received.clear()
        assert not consumer.publish(NODE.cmd(ping_id), ping).is_failure  # the same again
        assert "replayed" in wait_results(consumer, 1)[ping_id]["error"]
        wait_for(lambda: bodies(consumer.received, "events"), 5, "the refusal's alert")
        alerts = bodies(consumer.received, "events")
        assert alerts[-1].body["alert"] == "command refused"


def wait_results(client: SyncClient, count: int) -> dict[str, dict[str, Any]]:
    wait_for(lambda: len(_results(client)) >= count, 10, f"{count} command results")
    return _results(client)


def test_edgefleet_keygen_cmd_and_nodes(broker: Broker, agent: Agent, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    made = edgefleet(broker, "keygen", "--kid", "fleet-1", "--dir", str(keys))
    assert made.returncode == 0 and (keys / "fleet-1.key").stat().st_mode & 0o777 == 0o600
    assert edgefleet(broker, "keygen", "--kid", "fleet-1", "--dir", str(keys)).returncode == 2
    (agent.workdir / "trust").mkdir()
    (agent.workdir / "trust" / "fleet-1.pub").write_bytes((keys / "fleet-1.pub").read_bytes())
    broker.start()
    agent.start()
    wait_for(lambda: agent.status()["connected"], 10, "connected")
    sign_with = ["--sign-key", str(keys / "fleet-1.key"), "--kid", "fleet-1"]
    pong = edgefleet(broker, "cmd", "n1", "ping", *sign_with)
    assert pong.returncode == 0 and '"pong": true' in pong.stdout, pong.stderr
    unknown = edgefleet(broker, "cmd", "n1", "reboot-now", *sign_with)
    assert unknown.returncode == 1 and "unknown command" in unknown.stderr
    table = edgefleet(broker, "nodes", "--wait", "3", "--interval", "1")  # a heartbeat or two
    assert table.returncode == 0
    (row,) = [line for line in table.stdout.splitlines() if line.startswith("n1 ")]
    assert " online " in row and "ago" in row, table.stdout
    agent.signal(signal.SIGKILL)
    gone = edgefleet(broker, "--json", "nodes", "--wait", "0.5")
    assert json.loads(gone.stdout)[0]["state"] == "offline"


def test_records_the_broker_refuses_go_to_the_dead_letters(
    broker: Broker, agent: Agent, tmp_path: Path
) -> None:
    """A node configured under another node's name (its certificate says n2): the broker's ACL
    refuses every record (PUBACK Not authorized); each goes to the dead letters with the reason,
    counted, and the outbox does not send it again."""
    agent.config.write_text(
        agent.config.read_text().replace("n1.pem", "n2.pem").replace("n1.key", "n2.key")
    )
    broker.start()
    agent.start()
    wait_for(lambda: agent.status()["connected"], 10, "connected")
    agent.post([{"kind": "telemetry", "body": {"n": i}} for i in range(5)])
    wait_for(lambda: agent.status()["outbox"]["dead_letters"] == 5, 10, "5 dead letters")
    state = agent.status()["outbox"]
    assert state["pending"] == 0 and state["counters"]["dead"] == 5
    assert "Not authorized" in agent.log.read_text()


def test_mqtt_over_websockets(tmp_path: Path, pki: Path) -> None:
    """transport = "websockets": the same session over wss (TLS 1.3) on the broker's websockets
    listener, for networks that let only HTTPS out."""
    broker = Broker(tmp_path / "mosquitto", pki, websockets_port=free_port()).start()
    agent = Agent(tmp_path / "agent", broker)
    try:
        agent.config.write_text(
            agent.config.read_text().replace(
                f"port = {broker.port}",
                f'port = {broker.websockets_port}\ntransport = "websockets"',
            )
        )
        consumer = operator(broker)
        agent.start()
        wait_for(lambda: agent.status()["connected"], 10, "connected over wss")
        agent.post([{"kind": "telemetry", "body": {"over": "wss"}, "id": "ws-1"}])
        wait_for(lambda: "ws-1" in _ids(consumer), 10, "the record over wss")
        consumer.close()
    finally:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.signal(signal.SIGTERM)
        broker.kill()


def test_edgeds_events_reach_the_fleet_once_across_restarts(
    broker: Broker, agent: Agent, make_daemon: type[Daemon]
) -> None:
    """A real edged's events (its log at INFO and above: models ready...) are read after a
    cursor kept in the outbox with the records, so a restarted cloudsync sends none twice."""
    edged = make_daemon(config='[models]\nload = ["intent-classifier"]\n').start()
    assert edged.client.events()["events"], "edged has events to send"
    agent.config.write_text(
        agent.config.read_text().replace(str(agent.workdir / "no-edged.sock"), str(edged.socket))
    )
    broker.start()
    consumer = operator(broker)
    agent.start()
    try:
        # the events come in several messages: wait for the one looked at, not the first
        def ready_events() -> list[envelope.Envelope]:
            return [e for e in _edged_events(consumer) if "ready" in e.body["message"]]

        wait_for(ready_events, 15, "edged's 'ready' event at the fleet")
        ready = ready_events()
        assert ready and ready[0].body["source"].startswith("edged")
        assert agent.status()["edged"]["reachable"]
        agent.signal(signal.SIGTERM)
        before = len(_edged_events(consumer))
        edged.client.call("POST", "/v2/repository/models/intent-classifier/unload")
        agent.start()
        wait_for(lambda: len(_edged_events(consumer)) > before, 15, "the new event")
        ids = [e.id for e in _edged_events(consumer)]
        assert len(ids) == len(set(ids)), "an event was sent twice"
    finally:
        consumer.close()
    with pytest.raises(ClientError):
        edged.client.call("GET", "/v1/events?after=x")
    assert edged.stop() == 0


def _edged_events(client: SyncClient) -> list[envelope.Envelope]:
    return [e for e in bodies(list(client.received), "events") if e.body.get("from") == "edged"]


def _results(client: SyncClient) -> dict[str, dict[str, Any]]:
    return {
        str(parse(t).cmd_id): envelope.decode(p).body
        for t, p in list(client.received)
        if parse(t).kind == "cmd-result"
    }


def _served(client: SyncClient, model: str) -> int:
    """Local calls of ``model`` counted by the telemetry records (each record once)."""
    records = {e.id: e.body for e in bodies(list(client.received), "telemetry")}
    return sum(
        row["requests"]
        for body in records.values()
        for row in body.get("metrics", {}).get("models", [])
        if row["model"] == model
    )


def test_fleet_commands_operate_edged_and_its_metrics_arrive_as_telemetry(
    broker: Broker, agent: Agent, make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    """A real edged with the real cloud tier (MLServer): heartbeats carry the link's RTT and the
    routing figures; telemetry counts every local call exactly once across a SIGKILL of
    cloudsync; signed commands set the routing policy, drain and resume the local tier, reload,
    and tail edged's and cloudsync's logs."""
    edged = edged_with_cloud(make_daemon, faults_cleared)
    config = agent.config.read_text()
    config = config.replace(str(agent.workdir / "no-edged.sock"), str(edged.socket))
    agent.config.write_text(config + "[telemetry]\ninterval_s = 1\n")
    key = agent.trust()
    broker.start()
    consumer = operator(broker)
    agent.start()

    def command(name: str, **args: Any) -> dict[str, Any]:
        cmd_id, payload = sign(key, "fleet-1", OPERATOR, "f1/n1", name, args)
        assert not consumer.publish(NODE.cmd(cmd_id), payload).is_failure
        wait_for(lambda: cmd_id in _results(consumer), 30, f"the result of {name}")
        return _results(consumer)[cmd_id]

    try:
        wait_for(lambda: agent.status()["connected"], 10, "connected")
        for i in range(20):
            assert ask(edged.client, i, route="local")["route"] == "local"

        def heartbeat_with_figures() -> dict[str, Any] | None:
            for beat in reversed(bodies(list(consumer.received), "heartbeat")):
                link, routing = beat.body["link"] or {}, beat.body["routing"]
                if routing.get("local", 0) >= 20 and link.get("rtt_s"):
                    return beat.body
            return None

        wait_for(heartbeat_with_figures, 15, "a heartbeat with the link's RTT and the routes")
        beat = heartbeat_with_figures()
        assert beat is not None and beat["link"]["up"] and 0 < beat["link"]["rtt_s"] < 1
        assert beat["cloud_scale_out"] is False  # edged's scale-out signal, for the fleet
        wait_for(lambda: _served(consumer, MODEL) == 20, 15, "telemetry counting 20 calls")
        agent.signal(signal.SIGKILL)
        for i in range(10):
            ask(edged.client, 100 + i, route="local")
        agent.start()
        wait_for(lambda: _served(consumer, MODEL) == 30, 15, "telemetry counting 30 calls")
        # the outbox delivered, then a heartbeat published after it arrived: a record sent
        # again across the kill would be here by now; nothing is counted twice
        wait_for(
            lambda: agent.status()["outbox"]["depth"].get("telemetry", 0) == 0,
            15,
            "the telemetry delivered",
        )
        beats = len(bodies(list(consumer.received), "heartbeat"))
        wait_for(
            lambda: len(bodies(list(consumer.received), "heartbeat")) > beats,
            15,
            "a heartbeat after it",
        )
        assert _served(consumer, MODEL) == 30
        (row, *_) = [
            r
            for e in bodies(list(consumer.received), "telemetry")
            for r in e.body["metrics"]["models"]
            if r["model"] == MODEL
        ]
        assert row["errors"] == 0 and row["p95_ms"] > 0 and row["version"] == "1"
        # a classifier (an output with labels): its mean best score, for drift gates
        assert 0 < row["confidence_mean"] <= 1 and row["confidence_n"] == row["requests"]

        done = command("set-routing", local_threshold_ms=42)
        assert done["ok"] and done["result"]["overrides"] == {"local_threshold_ms": 42}, done
        assert edged.client.routing()["routing"]["local_threshold_ms"] == 42
        bad = command("set-routing", bogus=1)
        assert not bad["ok"] and "unknown key" in bad["error"], bad
        assert command("routing")["result"]["routing"]["local_threshold_ms"] == 42

        drained = command("drain", reason="fleet maintenance", timeout_s=5)
        assert drained["ok"] and drained["result"]["local_inflight"] == 0, drained
        answer = ask(edged.client, 200)
        assert answer["route"] == "cloud" and "fleet maintenance" in answer["reason"]
        wait_for(
            lambda: any(
                "fleet maintenance" in str(b.body.get("drained"))
                for b in bodies(list(consumer.received), "heartbeat")
            ),
            10,
            "a heartbeat saying the node is drained",
        )
        logs = command("logs", lines=5, contains="drained")
        lines = logs["result"]["lines"]
        assert 1 <= len(lines) <= 5 and all("drained" in line["message"] for line in lines)
        assert lines[-1]["level"] == "warning" and lines[-1]["source"].startswith("edged")
        own = command("logs", source="cloudsync", contains="command", level="info")
        assert any("(drain)" in line["message"] for line in own["result"]["lines"]), own
        refused = command("logs", lines=0)
        assert not refused["ok"] and "'lines' must be 1 to 1000" in refused["error"]

        assert command("resume")["ok"] and edged.client.status()["drained"] is None
        assert ask(edged.client, 201, route="auto")["route"] == "local"
        assert command("reload")["result"] == {"reloaded": True, "error": None}
        assert command("reset-routing")["result"]["overrides"] == {}
    finally:
        consumer.close()
    assert edged.stop() == 0


def test_a_command_quoting_unencodable_text_is_refused_and_the_agent_lives_on(
    broker: Broker, agent: Agent
) -> None:
    """A command whose key id is a lone surrogate (issue 22, item 1) was refused, but the
    refusal quoting it could not be stored: the error escaped the MQTT callback, paho re-raised
    it and the process exited, again at every redelivery. Now: refused and reported once, the
    process lives on, and a valid command sent after it runs."""
    with online(broker, agent) as (key, consumer):
        assert agent.proc is not None
        pid = agent.proc.pid
        poison_id, payload = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping")
        doc = json.loads(payload)
        doc["kid"] = "\ud800" + "x" * 5000  # json.dumps writes it as the escape \\ud800
        assert not consumer.publish(NODE.cmd(poison_id), json.dumps(doc).encode()).is_failure
        error = wait_results(consumer, 1)[poison_id]["error"]
        assert error.startswith("refused: key '\\ud800xxx") and len(error) < 600, error
        wait_for(lambda: bodies(consumer.received, "events"), 5, "the refusal's alert")
        assert bodies(consumer.received, "events")[-1].body["alert"] == "command refused"
        ping_id, ping = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping")
        assert not consumer.publish(NODE.cmd(ping_id), ping).is_failure
        assert wait_results(consumer, 2)[ping_id]["result"]["pong"] is True
        assert agent.proc.poll() is None and agent.proc.pid == pid


def test_edgefleet_logs_reads_the_nodes_journal_while_edged_is_down(
    broker: Broker, agent: Agent, tmp_path: Path
) -> None:
    """Issue 48: ``edgefleet logs NODE`` through the real broker and the node's cloudsync (as
    its unit runs it), no edged on the node: its journal's lines of edged and systemd's about
    it; nothing else of an entry, a private line without its message; the answer capped."""
    keys = tmp_path / "keys"
    assert edgefleet(broker, "keygen", "--kid", "fleet-1", "--dir", str(keys)).returncode == 0
    (agent.workdir / "trust").mkdir()
    (agent.workdir / "trust" / "fleet-1.pub").write_bytes((keys / "fleet-1.pub").read_bytes())
    journal = agent.workdir / "journal"
    journal.mkdir()
    noisy = [entry(15 - i, "cloudsync.service", 6, f"retry {i}: " + "x" * 400) for i in range(3)]
    write(journal, sorted(JOURNAL + noisy, key=lambda e: int(e["__REALTIME_TIMESTAMP"])))
    text = agent.config.read_text()
    trusted = f'trust_dir = "{agent.workdir}/trust"\n'
    agent.config.write_text(text.replace(trusted, trusted + f'journal_dir = "{journal}"\n'))
    broker.start()
    agent.start()
    wait_for(lambda: agent.status()["connected"], 10, "connected")
    sign_with = ["--sign-key", str(keys / "fleet-1.key"), "--kid", "fleet-1"]
    shown = edgefleet(broker, "logs", "n1", "--since", "90m", *sign_with)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "edged.service[4242] info: edged 0.1.0 starting",
        "edged.service[4242] error: config error: server.bogus: not a key",
        "edged.service[1] warning: edged.service: Main process exited, code=exited, status=78",
        "edged.service[4242] warning: intent slow",
        f"edged.service[4242] warning: {WITHHELD}",
    ]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", line[:20]) for line in lines)
    # capped: the newest lines that fit, the others counted; nothing private or of the host
    capped = edgefleet(
        broker,
        "logs",
        "n1",
        "--unit",
        "edged",
        "--unit",
        "cloudsync",
        "--since",
        "3h",
        "--max-bytes",
        "1024",
        "--json",
        *sign_with,
    )
    assert capped.returncode == 0, capped.stderr
    answer = json.loads(capped.stdout)
    assert answer["units"] == ["cloudsync.service", "edged.service"]
    assert len(envelope.canonical(answer["lines"])) <= 1024 and answer["left_out"] >= 1
    assert answer["lines"][-1]["message"] == "connected to the broker"
    assert all(set(row) <= KEYS | REQUEST_KEYS for row in answer["lines"])
    for kept in (SECRET, "jetson-17", "patient 42", "Accepted publickey"):
        assert kept not in capped.stdout
    refused = edgefleet(broker, "logs", "n1", "--unit", "ssh.service", *sign_with)
    assert refused.returncode == 1
    assert "'units': 'ssh.service' is not one this device sends" in refused.stderr
    bad = edgefleet(broker, "logs", "n1", "--since", "yesterday", *sign_with)
    assert (bad.returncode, bad.stderr.strip()) == (
        2,
        "edgefleet: --since 'yesterday': a time like 90s, 30m, 2h or 3d",
    )
