"""The fleet service's repositories that the API and the console read and write (issue 45: no
SQL in the adapters), each test on a real SQLite file and a real PostgreSQL: the audit log, the
relayed commands, the console's sessions, and the read queries of the console's pages (what
the nodes run and serve, events and alerts, rollouts and deployments counted)."""

from __future__ import annotations

from typing import Any

import pytest

from cloudsync.fleet.alerting import Alerting
from cloudsync.fleet.audit import MAX_DETAIL, AuditLog
from cloudsync.fleet.commands import Commands
from cloudsync.fleet.config import Token
from cloudsync.fleet.deployments import Deployment, Deployments
from cloudsync.fleet.leases import Leases
from cloudsync.fleet.registry import Registry
from cloudsync.fleet.sessions import SESSION_S, Sessions, session_hash
from cloudsync.fleet.store import Store
from tests.fleetmessages import NOW, alert, msg, status

ALICE = Token(name="alice", role="operator", sha256="a" * 64)


class Clock:
    def __init__(self) -> None:
        self.ms = NOW

    def __call__(self) -> int:
        return self.ms


def test_the_audit_log_reads_forward_backward_and_by_a_part_of_a_field(store: Store) -> None:
    clock = Clock()
    log = AuditLog(store, clock)
    log.add(ALICE, "set labels", "n1", "done", {"site": "berlin"})
    clock.ms += 1
    log.add(ALICE, "pause rollout", "r_1", "refused: no such rollout")
    log.add(ALICE, "create deployment", "d%1", "done", {"x": "y" * (MAX_DETAIL + 10)})
    first, second, third = log.after(0, 10)
    assert (
        first["ts"],
        first["actor"],
        first["role"],
        first["action"],
        first["target"],
        first["outcome"],
        first["detail"],
    ) == (NOW, "alice", "operator", "set labels", "n1", "done", {"site": "berlin"})
    assert second["detail"] == {} and second["ts"] == NOW + 1
    assert set(third["detail"]) == {"truncated"} and len(third["detail"]["truncated"]) == MAX_DETAIL
    assert [r["id"] for r in log.after(first["id"], 1)] == [second["id"]]
    # backward, newest first; "_" and "%" are letters, not patterns
    assert [r["target"] for r in log.before(2**53, "", 10)] == ["d%1", "r_1", "n1"]
    assert [r["target"] for r in log.before(2**53, "r_", 10)] == ["r_1"]
    assert [r["target"] for r in log.before(2**53, "%", 10)] == ["d%1"]
    assert [r["target"] for r in log.before(third["id"], "", 1)] == ["r_1"]
    assert [r["target"] for r in log.before(2**53, "refused", 10)] == ["r_1"]  # the outcome


def test_a_command_is_kept_once_and_shown_with_its_result(store: Store) -> None:
    clock = Clock()
    commands = Commands(store, clock)
    sent = {"id": "c1", "name": "restart", "issuer": "ops", "kid": "k1"}
    commands.keep(sent, "n1", "alice")
    with pytest.raises(KeyError, match="c1 was sent already"):
        commands.keep(sent, "n2", "bob")
    clock.ms += 5
    commands.keep({**sent, "id": "c2"}, "n1", "alice")
    with store.transaction() as tx:  # the node's answer, as the registry writes it
        tx.execute(
            "UPDATE commands SET result = ?, result_ts = ? WHERE id = 'c1'",
            ('{"ok": true}', NOW + 9),
        )
    found = commands.get("c1")
    assert found is not None
    assert {
        k: found[k]
        for k in ("node", "name", "issuer", "kid", "actor", "sent_ts", "result", "result_ts")
    } == {
        "node": "n1",
        "name": "restart",
        "issuer": "ops",
        "kid": "k1",
        "actor": "alice",
        "sent_ts": NOW,
        "result": {"ok": True},
        "result_ts": NOW + 9,
    }
    assert commands.get("c3") is None
    assert [(c["id"], c["result"]) for c in commands.of_node("n1", 10)] == [
        ("c2", None),
        ("c1", {"ok": True}),
    ]
    assert [c["id"] for c in commands.of_node("n1", 1)] == ["c2"]
    assert commands.of_node("n2", 10) == []


def test_a_session_lasts_its_life_and_ends_when_closed(store: Store) -> None:
    clock = Clock()
    sessions = Sessions(store, clock)
    one, two = sessions.open("alice"), sessions.open("bob")
    assert one != two and len(one) >= 43
    assert (sessions.holder(one), sessions.holder(two), sessions.holder("x")) == (
        "alice",
        "bob",
        None,
    )
    kept = store.query("SELECT sha256 FROM console_sessions ORDER BY holder")
    assert [r["sha256"] for r in kept] == [session_hash(one), session_hash(two)]  # not the ids
    sessions.close(one)
    assert sessions.holder(one) is None and sessions.holder(two) == "bob"
    clock.ms += SESSION_S * 1000
    assert sessions.holder(two) is None  # expired
    sessions.open("carol")  # and an expired one is forgotten when the next opens
    assert [r["holder"] for r in store.query("SELECT holder FROM console_sessions")] == ["carol"]


def test_the_overview_counts_software_serving_models_events_and_alerts(store: Store) -> None:
    registry = Registry(store, offline_after_s=30)
    served: list[Any] = [{"m": "2"}, {"m": "2", "k": "1"}, "not an object"]
    batch = [status(node) for node in ("n1", "n2", "n3")]
    batch += [
        msg("heartbeat", node, {"models": models, "outbox": {"pending": 0}})
        for node, models in zip(("n1", "n2", "n3"), served, strict=True)
    ]
    batch += [
        msg("events", "n1", alert("firing", NOW), ident="a1", priority="alert"),
        msg(
            "events",
            "n2",
            {**alert("firing", NOW + 1, site="x"), "active_since_ms": NOW},
            ident="a2",
            priority="alert",
        ),
        msg("events", "n2", {"message": "hello"}, ident="e3", arrived=NOW + 50),
    ]
    registry.ingest(batch)
    assert registry.software() == [{"versions": {"cloudsync": "1.2", "edged": "1.3"}, "n": 3}]
    assert registry.serving() == [(("m", "2"), 2), (("k", "1"), 1)]
    assert registry.serving(1) == [(("m", "2"), 2)]
    assert [e["id"] for e in registry.events(None, 10)] == ["e3", "a2", "a1"]  # latest first
    assert {e["node"] for e in registry.events("n1", 10)} == {"n1"}
    assert len(registry.events(None, 2)) == 2
    alerting = Alerting(store, "f1", [], 30, lambda: NOW)
    assert alerting.firing() == [{"alertname": "EdgedLocalLoadHigh", "severity": "warning", "n": 2}]
    assert [a["node"] for a in alerting.latest()] == ["n2", "n1"]  # the latest to start first
    assert [a["node"] for a in alerting.latest("n1", 5)] == ["n1"]
    registry.ingest([msg("events", "n1", alert("resolved", NOW + 9), ident="a4", priority="alert")])
    assert [a["node"] for a in alerting.latest()] == ["n2"]  # firing only
    assert [a["state"] for a in alerting.latest("n1", 5)] == ["resolved"]  # a node's: all


def test_deployments_are_counted_and_their_progress_is_what_was_given_out(store: Store) -> None:
    deployments = Deployments(store, Clock())
    entry = {"manifest": {"signed": {"model": "m", "version": 1}}, "urls": {}}
    dep = Deployment("d1", {}, 1, [entry])
    nothing = {"targeted": 0, "done": 0, "failed": 0, "waiting": 0}
    assert deployments.count() == 0 and deployments.progress(dep) == nothing
    assert deployments.create(dep, "alice")
    given = (("n1", [entry]), ("n2", []), ("n3", [entry]), ("n4", [entry]), ("n5", [entry]))
    with store.transaction() as tx:
        for node, models in given:
            Registry.desired(tx, node, models, 1, NOW)
        for node in ("n1", "n2", "n4", "n5"):  # n3's is not the service's (not managed)
            tx.execute(
                "INSERT INTO managed (node, models, digest, ts) VALUES (?, '[]', '', ?)",
                (node, NOW),
            )
        # what their delivery reports say: n1 serves it, n4 failed, n5 is on its way; n3's
        # "active" is not this deployment's doing, and another version's step is not its
        for node, version, step in (
            ("n1", 1, "active"),
            ("n3", 1, "active"),
            ("n4", 1, "failed"),
            ("n5", 1, "downloaded"),
            ("n5", 2, "failed"),
        ):
            tx.execute(
                "INSERT INTO steps (node, model, version, step, ts) VALUES (?, 'm', ?, ?, ?)",
                (node, version, step, NOW),
            )
    assert deployments.count() == 1
    assert deployments.progress(dep) == {"targeted": 3, "done": 1, "failed": 1, "waiting": 1}


def test_a_lease_is_one_holders_until_it_expires_or_is_released(store: Store) -> None:
    leases = Leases(store)
    assert leases.take("runner", "a", NOW, 1000)
    assert not leases.take("runner", "b", NOW + 999, 1000)  # a's, until NOW + 1000
    assert leases.take("runner", "a", NOW + 999, 1000)  # renewed by its holder: to NOW + 1999
    assert not leases.take("runner", "b", NOW + 1500, 1000)
    assert leases.take("other", "b", NOW + 1500, 1000)  # another name, another lease
    assert leases.take("runner", "b", NOW + 2000, 1000)  # a's expired
    leases.release("runner", "a")  # not a's any more: nothing happens
    assert not leases.take("runner", "a", NOW + 2001, 1000)
    leases.release("runner", "b")
    assert leases.take("runner", "a", NOW + 2002, 1000)
