"""The agent's own nets, without a broker: a thread body that fails is started again and
counted; a record too large to send goes to the dead letters instead of stopping the MQTT loop;
acks the disk cannot take are kept and not sent again meanwhile."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cloudsync.agent.config import Config
from cloudsync.agent.outbox import OutboxError
from cloudsync.agent.session import Agent


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    config = Config.model_validate(
        {
            "node": {"fleet": "f1", "name": "n1"},
            "outbox": {"path": str(tmp_path / "outbox.db")},
            "commands": {"trust_dir": str(tmp_path / "trust")},
            "edged": {"socket": str(tmp_path / "no-edged.sock")},
        }
    )
    return Agent(config)


def test_a_failing_thread_is_started_again_and_counted(
    agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def body() -> None:
        calls.append(len(calls))
        if len(calls) < 3:
            raise RuntimeError(f"failure {len(calls)}")

    with caplog.at_level(logging.ERROR, "cloudsync"):
        agent.supervise("worker", body)  # 1 s, then 2 s between the tries
    assert calls == [0, 1, 2] and agent.state.restarts == {"worker": 2}
    assert agent.status()["thread_restarts"] == {"worker": 2}
    assert 'cloudsync_thread_restarts_total{thread="worker"} 2.0' in agent.metrics.render().decode()
    assert [r.message for r in caplog.records].count(
        "the worker thread failed; it starts again in 1 s"
    ) == 1


def test_a_stop_ends_the_pause_between_tries(agent: Agent) -> None:
    def body() -> None:
        agent.stop()
        raise RuntimeError("failing while stopping")

    agent.supervise("edged", body)  # returns: no second try
    assert agent.state.restarts == {"edged": 1}


def test_a_record_too_large_to_send_is_dead_lettered_and_acks_wait_for_the_disk(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    published: list[str] = []

    class Sent:
        rc, mid = 0, 0

    def publish(topic: str, payload: bytes, qos: int, retain: bool = False) -> Any:
        published.append(topic)
        Sent.mid += 1
        return Sent

    monkeypatch.setattr(agent.client, "publish", publish)  # no broker in a unit test
    agent.state.connected = True
    agent.outbox.put("telemetry", {"n": 1})
    # as an older cloudsync could store it: a body over what an envelope may carry
    agent.outbox.db.execute("UPDATE outbox SET body = ?", ['{"pad":"' + "x" * 300_000 + '"}'])
    agent.outbox.put("telemetry", {"n": 2})
    agent.pump.turn(agent.state.connected)
    assert published == ["edge/v1/f1/n1/telemetry"]  # the second record only
    assert agent.outbox.stats()["dead_letters"] == 1
    # PUBACKed, and the disk cannot take the delete: kept, tried again, not sent twice
    agent.pump.acked = list(agent.pump.inflight.values())
    agent.pump.inflight.clear()

    def full(seqs: Any) -> int:
        raise OutboxError("database or disk is full", full=True)

    monkeypatch.setattr(agent.outbox, "ack", full)
    agent.pump.turn(agent.state.connected)
    agent.pump.turn(agent.state.connected)
    assert published == ["edge/v1/f1/n1/telemetry"] and agent.pump.acked
    # a long outage of the disk: what the broker has is held in memory up to a bound, then
    # sending waits (each peek excludes what is held)
    agent.pump.acked += list(range(10_000, 10_000 + 4 * agent.config.outbox.max_inflight))
    agent.outbox.put("telemetry", {"n": 3})
    agent.pump.turn(agent.state.connected)
    assert published == ["edge/v1/f1/n1/telemetry"]
    monkeypatch.undo()
    monkeypatch.setattr(agent.client, "publish", publish)
    agent.pump.acked = agent.pump.acked[:1]  # the record the broker has (the ids above are made up)
    agent.pump.write_again = 0.0
    agent.pump.turn(agent.state.connected)  # acked at last, and the next record sent
    assert not agent.pump.acked and len(published) == 2
    assert [r.body for r in agent.outbox.peek(10)] == [{"n": 3}]


@pytest.mark.parametrize(
    "what, says",
    [
        ("outbox", "cannot start: cannot open the outbox at"),
        ("trust", "cannot start: trust anchor"),
        ("socket", "cannot serve the local API on"),
    ],
)
def test_what_cannot_be_had_at_start_is_one_line(tmp_path: Path, what: str, says: str) -> None:
    """Before: an outbox that could not be opened ended cloudsync with a raw traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    (tmp_path / "trust").mkdir()
    if what == "trust":
        (tmp_path / "trust" / "fleet-1.pub").write_text("not a key")
    outbox = blocker / "outbox.db" if what == "outbox" else tmp_path / "outbox.db"
    socket = blocker / "cloudsync.sock" if what == "socket" else tmp_path / "cloudsync.sock"
    config = tmp_path / "cloudsync.toml"
    config.write_text(
        f'[outbox]\npath = "{outbox}"\n[commands]\ntrust_dir = "{tmp_path}/trust"\n'
        f'[local]\nsocket = "{socket}"\n[mqtt]\nhost = "127.0.0.1"\nport = 1\n'
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cloudsync.agent.cli",
            "--config",
            str(config),
            "--log-level",
            "error",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"cloudsync: {says}") and "Traceback" not in done.stderr, line


def test_a_rollback_the_delivery_reports_reaches_the_agents_state_and_metrics(
    agent: Agent,
) -> None:
    """The delivery is given the agent's ``on_rollback`` when it is made (nothing wired after):
    the model's rollback time is in the state the alerts read, kept in the outbox across a
    restart, and counted."""
    agent.delivery.report("rolled-back", model="ocr", version=3, why="failure rate")
    assert set(agent.state.rollbacks) == {"ocr"}
    text = agent.metrics.render().decode()
    assert 'cloudsync_model_rollbacks_total{model="ocr"} 1.0' in text
    assert 'cloudsync_model_last_rollback_timestamp_seconds{model="ocr"}' in text
    at = agent.state.rollbacks["ocr"]
    agent.outbox.close()
    again = Agent(agent.config)  # a restart: the time comes back from the outbox
    assert again.state.rollbacks == {"ocr": at}
