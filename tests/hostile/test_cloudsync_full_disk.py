"""Issue 22: cloudsync on a full disk (a real tmpfs holds its outbox and its command nonces,
mounted by the test; root only).

While the disk is full cloudsync keeps running: a new local record is refused with 507 and
nothing of its request is stored, what the outbox already holds is still delivered, the
heartbeat and /metrics say the disk is full, and a command is refused (its nonce cannot be kept,
so a replay could not be told apart) with the refusal published without the outbox. When space
returns, records are taken again and every record the local API acknowledged reaches the
fleet: 0 restarts, 0 lost. The uplink's egress ledger, on the same disk, declares what went
while it could not record it.

Before: the nonce INSERT failed inside the MQTT callback and the process exited; a result that
could not be stored ended the commands thread silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cloudsync.protocol import envelope
from cloudsync.protocol.commands import sign
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import parse
from edged.client import ClientError
from edged.common.egress import Ledger, verify
from tests.cloudsync_agent import NODE, Agent, last_status, operator
from tests.conftest import wait_for
from tests.hostile.conftest import fill
from tests.hostile.test_cloudsync_poison import _results_by_id
from tests.mosquitto import OPERATOR, Broker


def post(agent: Agent, first: int, count: int) -> tuple[int, dict[str, Any]]:
    numbers = range(first, first + count)
    records = [{"kind": "telemetry", "id": f"r{i}", "body": {"i": i}} for i in numbers]
    try:
        return 200, agent.post(records)
    except ClientError as exc:
        return exc.status, {"error": exc.message}


def telemetry(client: SyncClient) -> set[str]:
    return {envelope.decode(p).id for t, p in list(client.received) if parse(t).kind == "telemetry"}


def heartbeats(client: SyncClient) -> list[dict[str, Any]]:
    return [
        envelope.decode(p).body for t, p in list(client.received) if parse(t).kind == "heartbeat"
    ]


def test_a_full_disk_refuses_new_records_keeps_delivering_and_loses_nothing(
    tmp_path: Path, pki: Path, small_disk: Path
) -> None:
    broker = Broker(tmp_path / "mosquitto", pki)
    agent = Agent(tmp_path / "agent", broker)
    agent.config.write_text(
        agent.config.read_text().replace(
            f'path = "{agent.workdir}/outbox.db"', f'path = "{small_disk}/outbox.db"'
        )
    )
    key = agent.trust()
    consumer: SyncClient | None = None
    try:
        agent.start()  # the broker is down: records wait in the outbox
        assert post(agent, 0, 200) == (200, {"stored": 200, "dropped": 0})
        filler = fill(small_disk)
        refused = [post(agent, 1000 + 100 * n, 100) for n in range(5)]
        assert all(status == 507 for status, _ in refused), refused
        assert "disk is full" in refused[0][1]["error"]
        assert agent.status()["outbox"]["pending"] == 200  # nothing of a refused request
        assert "cloudsync_outbox_disk_full 1.0" in agent.local.metrics()

        broker.start()
        consumer = operator(broker)
        wait_for(lambda: last_status(consumer) == "online", 15, "the birth")
        # still full: what it held is delivered all the same (it leaves the outbox later: the
        # deletes need the disk too)
        wait_for(lambda: len(telemetry(consumer)) >= 200, 30, "200 records delivered")
        wait_for(
            lambda: any(h["outbox"]["disk_full"] for h in heartbeats(consumer)),
            10,
            "a heartbeat that says the disk is full",
        )
        ping_id, ping = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping")
        assert not consumer.publish(NODE.cmd(ping_id), ping).is_failure
        wait_for(lambda: ping_id in _results_by_id(consumer), 10, "the refusal, without outbox")
        (refusal,) = _results_by_id(consumer)[ping_id]
        assert refusal["ok"] is False and "nonce cannot be kept" in refusal["error"], refusal

        filler.unlink()  # space again
        assert post(agent, 2000, 100) == (200, {"stored": 100, "dropped": 0})
        ping_id, ping = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping")
        assert not consumer.publish(NODE.cmd(ping_id), ping).is_failure
        wait_for(lambda: ping_id in _results_by_id(consumer), 10, "the ping's result")
        assert _results_by_id(consumer)[ping_id][0]["ok"] is True
        wait_for(lambda: agent.status()["outbox"]["pending"] == 0, 30, "the outbox drained")
        got = telemetry(consumer)
        acknowledged = {f"r{i}" for i in [*range(200), *range(2000, 2100)]}
        assert acknowledged <= got and not got & {f"r{i}" for i in range(1000, 1500)}
        status = agent.status()
        assert status["thread_restarts"] == {} and status["outbox"]["disk_full"] is False
        assert agent.proc is not None and agent.proc.poll() is None
        # the uplink's egress ledger (on the full disk too): what went while it could not
        # record is one declared gap, counted by stream, and the chain verifies
        uplink = small_disk / "uplink"
        (gap,) = Ledger(uplink).entries(limit=10_000, match=lambda e: e["kind"] == "unrecorded")
        assert gap["streams"]["telemetry"]["messages"] >= 1 and gap["until_ms"] >= gap["since_ms"]
        assert all(v["bytes"] > 0 for v in gap["streams"].values())
        report = verify(uplink)
        assert report.ok, report.error
        print(
            f"while full: 5 requests refused (507), 200 records delivered; {status['outbox']};"
            f" unrecorded: {gap['streams']}"
        )
    finally:
        if consumer is not None:
            consumer.close()
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
        broker.kill()
