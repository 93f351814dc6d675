"""The fleet service's registry and deployments (issue 24), each test on a real SQLite file and
on a real PostgreSQL (a cluster the module starts): what a batch of messages writes, what is
written once however often it comes, what a node's desired state becomes under several
deployments, and what a deployment body may hold."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.fleet.deployments import Deployment, Deployments, Invalid, check, plan
from cloudsync.fleet.registry import Message, Registry, model_of
from cloudsync.fleet.store import Store
from cloudsync.protocol import manifest
from cloudsync.protocol.envelope import Envelope

KEY = Ed25519PrivateKey.generate()
NOW = 1_800_000_000_000


def entry(model: str, version: int, key: Ed25519PrivateKey = KEY) -> dict[str, Any]:
    files = [{"path": "model.onnx", "sha256": "a" * 64, "length": 10}]
    doc = manifest.sign(manifest.make(model, version, files), {"k1": key})
    return {"manifest": doc, "urls": {"model.onnx": f"https://cdn/{model}/{version}"}}


def status(node: str, ts: int, state: str = "online", arrived: int = 0, **body: Any) -> Message:
    payload = Envelope(node, ts, {"state": state, **body}, ts=ts).encode()
    return Message("status", node, payload, arrived or ts + 5)


def heartbeat(node: str, ts: int, arrived: int | None = None, **body: Any) -> Message:
    doc = {"uptime_s": 1, "outbox": {"pending": 0}, **body}
    return Message("heartbeat", node, Envelope(node, ts, doc, ts=ts).encode(), arrived or ts + 100)


@pytest.fixture
def registry(store: Store) -> Registry:
    return Registry(store, offline_after_s=30)


def test_births_wills_and_history_are_written_once(registry: Registry) -> None:
    birth = status(
        "n1",
        NOW,
        labels={"site": "berlin"},
        hardware={"machine": "aarch64"},
        software={"cloudsync": "1.0"},
        models=[{"name": "m", "version": 2}],
    )
    will = status(
        "n1", NOW - 50, "offline", NOW + 1000, reason="connection lost"
    )  # made at connect
    done = registry.ingest([birth, birth])  # a replay: the retained birth again
    assert done.births == {"n1"} and done.counted == {"status": 2}
    row = registry.node("n1", NOW + 1000)
    assert row is not None
    assert (row["state"], row["labels"], row["hardware"], row["software"]) == (
        "online",
        {"site": "berlin"},
        {"machine": "aarch64"},
        {"cloudsync": "1.0"},
    )
    assert row["models"] == [{"name": "m", "version": 2, "state": None}]
    assert (row["since_ms"], row["first_seen_ms"], row["last_seen_ms"]) == (NOW, NOW + 5, NOW + 5)
    registry.ingest([will])  # arrival order rules: the will comes after the birth it follows
    row = registry.node("n1", NOW + 1000)
    assert row is not None and (row["state"], row["reason"]) == ("offline", "connection lost")
    assert row["labels"] == {"site": "berlin"}  # a will does not forget who the node is
    row = registry.node("n1", NOW + 1000)
    assert row is not None and row["since_ms"] == NOW + 1000  # when it came
    registry.ingest([will, status("n1", NOW + 9000)])  # the will again (a replay), a birth
    assert [(h["ts"], h["sent_ts"], h["state"]) for h in registry.history("n1")] == [
        (NOW + 9005, NOW + 9000, "online"),
        (NOW + 1000, NOW - 50, "offline"),
        (NOW + 5, NOW, "online"),
    ]


def test_a_version_installed_since_the_birth_shows_from_the_next_heartbeat(
    registry: Registry,
) -> None:
    born = [
        {"name": "m", "version": 2, "state": "READY"},
        {"name": "x", "version": 1, "state": "LOADING"},
    ]
    registry.ingest([status("n1", NOW, models=born)])
    registry.ingest([heartbeat("n1", NOW + 10_000, models={"m": 7, "new": 1})])
    row = registry.node("n1", NOW + 11_000)
    assert row is not None and row["models"] == [
        {"name": "m", "version": 7, "state": "READY"},
        {"name": "x", "version": 1, "state": "LOADING"},  # not serving yet: the birth's word
        {"name": "new", "version": 1, "state": "READY"},
    ]
    registry.ingest([status("n1", NOW + 20_000, models=born)])  # a birth newer than it rules
    row = registry.node("n1", NOW + 21_000)
    assert row is not None and [m["version"] for m in row["models"]] == [2, 1]
    registry.ingest([heartbeat("n1", NOW + 30_000, models=["not", "a", "mapping"])])
    row = registry.node("n1", NOW + 31_000)
    assert row is not None and [m["version"] for m in row["models"]] == [2, 1]


def test_heartbeats_are_counted_once_and_keep_the_node_fresh(registry: Registry) -> None:
    registry.ingest([status("n1", NOW)])
    done = registry.ingest(
        [
            heartbeat("n1", NOW + 10_000),
            heartbeat("n1", NOW + 10_000),
            heartbeat("n1", NOW + 20_000, NOW + 20_400),
        ]
    )
    assert done.sent_ms == [NOW + 10_000, NOW + 10_000, NOW + 20_000]
    row = registry.node("n1", NOW + 21_000)
    assert row is not None and row["heartbeats"] == 2  # the QoS 1 duplicate is not counted
    assert row["last_seen_ms"] == NOW + 20_400 and row["heartbeat"]["uptime_s"] == 1
    registry.ingest([heartbeat("n1", NOW + 15_000)])  # older than the last counted: late copy
    later = registry.node("n1", NOW + 21_000)
    assert later is not None and later["heartbeats"] == 2
    assert registry.node("n1", NOW + 51_000)["state"] == "stale"  # type: ignore[index]
    # a heartbeat from a node whose birth the service has not seen yet makes the node
    registry.ingest([heartbeat("n2", NOW)])
    assert registry.node("n2", NOW + 1000)["state"] == "online"  # type: ignore[index]


def test_poison_is_counted_and_the_rest_of_the_batch_written(registry: Registry) -> None:
    bad = [
        Message("status", "n9", b"not json", NOW),
        Message("heartbeat", "n9", b'{"v": 99}', NOW),
        status("n9", NOW, state="sleeping"),
        status("n9", NOW, labels={"bad key!": "x"}),
        status("n9", NOW, labels={"k": "v" * 64}),
        Message("events", "n9", Envelope("n9", 1, {"delivery": {"model": 3}}).encode(), NOW),
        Message("desired-models", "n9", Envelope("op", 1, {"models": "all"}).encode(), NOW),
    ]
    done = registry.ingest([*bad, status("n1", NOW)])
    assert done.poison == len(bad) and done.counted == {"status": 1}
    assert registry.node("n9", NOW) is None and registry.node("n1", NOW) is not None


def test_delivery_steps_and_desired_states(registry: Registry) -> None:
    registry.ingest([status("n1", NOW)])
    steps = [
        Envelope("n1", i, {"delivery": {"model": "m", "version": 3, "step": s}}, ts=NOW + i)
        for i, s in enumerate(["verified", "active"])
    ]
    stale = Envelope(
        "n1", 9, {"delivery": {"model": "m", "version": 3, "step": "verified"}}, ts=NOW - 1
    )
    registry.ingest([Message("events", "n1", e.encode(), NOW) for e in [*steps, stale]])
    desired = Envelope("op", 1, {"models": [entry("m", 3)]}).encode()
    done = registry.ingest([Message("desired-models", "n1", desired, NOW)])
    assert done.desired == {"n1"}
    row = registry.node("n1", NOW)
    assert row is not None
    assert [(s["model"], s["version"], s["step"]) for s in row["steps"]] == [("m", 3, "active")]
    assert row["desired"] == [{"model": "m", "version": 3}]
    registry.ingest([Message("desired-models", "n1", b"", NOW)])  # deleted
    assert registry.node("n1", NOW)["desired"] == []  # type: ignore[index]


def test_pages_filters_and_counts(registry: Registry) -> None:
    births = [status(f"n{i:04d}", NOW, labels={"site": "a" if i % 3 else "b"}) for i in range(2500)]
    registry.ingest([*births, status("n0007", NOW + 1, "offline")])
    seen, after, pages = [], "", 0
    while True:
        page, after = registry.nodes(NOW, limit=1000, after=after)  # type: ignore[assignment]
        seen += [r["node"] for r in page]
        pages += 1
        if after is None:
            break
    assert seen == [f"n{i:04d}" for i in range(2500)] and pages == 3
    site_b, _ = registry.nodes(NOW, selector={"site": "b"}, limit=1000)
    assert [r["node"] for r in site_b] == [f"n{i:04d}" for i in range(0, 2500, 3)][:834]
    offline, last = registry.nodes(NOW, state="offline")
    assert [r["node"] for r in offline] == ["n0007"] and last is None
    named, _ = registry.nodes(NOW, contains="n001")
    assert [r["node"] for r in named] == [f"n{i:04d}" for i in range(10, 20)]
    assert registry.counts(NOW) == {"online": 2499, "offline": 1}
    assert registry.counts(NOW + 60_000) == {"stale": 2499, "offline": 1}
    # operators' labels overlay the node's own
    assert registry.set_labels("n0001", {"site": "b", "tier": "gold"})
    row = registry.node("n0001", NOW)
    assert row is not None and row["labels"] == {"site": "b", "tier": "gold"}
    assert not registry.set_labels("nobody", {"a": "b"})


def dep(
    ident: str, selector: dict[str, str], priority: int, created: int, *entries: dict[str, Any]
) -> Deployment:
    return Deployment(ident, selector, priority, list(entries), created_ts=created)


def versions(entries: list[dict[str, Any]]) -> dict[str | None, int]:
    return {model_of(e): e["manifest"]["signed"]["version"] for e in entries}


def test_plan_priority_ties_labels_and_what_it_leaves_alone() -> None:
    deps = [
        dep("base", {}, 0, 1, entry("m", 1), entry("ocr", 4)),
        dep("berlin", {"site": "berlin"}, 10, 2, entry("m", 2)),
        dep("berlin-new", {"site": "berlin"}, 10, 3, entry("m", 3)),  # same priority, newer
        dep("gold", {"site": "berlin", "tier": "gold"}, 5, 9, entry("m", 9)),
    ]
    other = entry("asr", 7)  # set by edgefleet rollout, not by a deployment
    got, given = plan({"site": "berlin", "tier": "gold"}, deps, [other], set())
    assert versions(got) == {"asr": 7, "m": 3, "ocr": 4} and given == {"m", "ocr"}
    got, given = plan({"site": "paris"}, deps, [other, entry("m", 3)], {"m", "ocr"})
    assert versions(got) == {"asr": 7, "m": 1, "ocr": 4}
    paused = [Deployment("p", {}, 99, [entry("m", 5)], state="paused", created_ts=1), *deps]
    assert versions(plan({}, paused, [], set())[0]) == {"m": 1, "ocr": 4}
    # a model no deployment gives any more leaves the desired state (the node keeps running it)
    got, given = plan({"site": "paris"}, [], [other, entry("m", 1)], {"m"})
    assert versions(got) == {"asr": 7} and given == set()


def test_deployments_are_checked_field_by_field(store: Store) -> None:
    good = {"id": "d1", "selector": {"site": "a"}, "priority": 3, "models": [entry("m", 2)]}
    made = check(good)
    assert (made.id, made.selector, made.priority) == ("d1", {"site": "a"}, 3)
    anchors = {"k1": KEY.public_key()}
    assert check(good, anchors).models == good["models"]
    cases: list[tuple[Any, str]] = [
        ([], "body"),
        ({**good, "extra": 1}, "extra"),
        ({**good, "id": "_fleet"}, "id"),
        ({**good, "id": "a/b"}, "id"),
        ({**good, "selector": {"k": "x y"}}, "selector.k"),
        ({**good, "priority": True}, "priority"),
        ({**good, "priority": -1}, "priority"),
        ({**good, "models": []}, "models"),
        ({**good, "models": [{"manifest": {}}]}, "models[0]"),
        ({**good, "models": [{**entry("m", 2), "urls": {}}]}, "models[0].urls"),
        ({**good, "models": [entry("m", 2), entry("m", 3)]}, "models[1]: model m twice"),
        ({**good, "models": [{"manifest": {"signed": {}}, "urls": {}}]}, "models[0].manifest"),
    ]
    for body, field_named in cases:
        with pytest.raises(Invalid, match=field_named.replace("[", r"\[").replace("]", r"\]")):
            check(body)
    stranger = {**good, "models": [entry("m", 2, Ed25519PrivateKey.generate())]}
    with pytest.raises(Invalid, match=r"models\[0\].manifest: 0 valid signature"):
        check(stranger, anchors)
    kept = Deployments(store, lambda: NOW)
    assert kept.create(made, "alice") and not kept.create(made, "bob")
    got = kept.get("d1")
    assert got is not None and (got.created_by, got.created_ts) == ("alice", NOW)
    assert kept.delete("d1") and kept.get("d1") is None and not kept.delete("d1")


def test_egress_checkpoints_come_from_heartbeats_once_an_interval_and_garbage_is_none(
    store: Store,
) -> None:
    registry = Registry(store, checkpoint_s=60)
    good = {"seq": 12, "hash": "ab" * 32}

    def beat(ts: int, egress: Any) -> Message:
        return Message(
            "heartbeat", "n1", Envelope("n1", ts, {"egress": egress}, ts=ts).encode(), ts
        )

    hostile = [
        None,
        "x",
        [],
        {"edged": "x"},
        {"edged": {"seq": True, "hash": "ab" * 32}},
        {"edged": {"seq": 0, "hash": "ab" * 32}},
        {"edged": {"seq": 3, "hash": "AB" * 32}},
        {"edged": {"seq": 2**60, "hash": "ab" * 32}},
        {"other": good},
        {"edged": {"seq": 3, "hash": "ab" * 31}},
    ]
    done = registry.ingest([beat(NOW + i, egress) for i, egress in enumerate(hostile)])
    assert done.poison == 0 and registry.checkpoints("n1") == []  # kept, but no checkpoint
    registry.ingest([beat(NOW + 100, {"edged": good, "uplink": {**good, "seq": 40}})])
    registry.ingest([beat(NOW + 1_000, {"edged": {**good, "seq": 13}})])  # within a minute
    registry.ingest([beat(NOW + 61_000, {"edged": {**good, "seq": 14}, "uplink": None})])
    assert [(c["ledger"], c["seq"]) for c in registry.checkpoints("n1")] == [
        ("edged", 14),
        ("edged", 12),
        ("uplink", 40),
    ]
    assert registry.prune(NOW + 61_000, 86_400_000, 30_000) >= 2
    assert [c["seq"] for c in registry.checkpoints("n1")] == [14]
