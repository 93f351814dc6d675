"""The node registry: every node of the fleet as its messages tell it, kept in the database.

``ingest`` takes a batch of messages (topic kind, node, payload, arrival time) and writes them
in one transaction:

- ``status`` (births and wills, retained): the node's state, with its hardware, software,
  models and labels from the birth; each change of state goes into the node's history, keyed
  by the status's own time, so a status seen twice (a restart replays the retained ones; two
  replicas both see every status) is written once. The history is in the order statuses
  came: a will is made when its node connects, so its own time is before the birth's;``
- ``heartbeat``: counted, and the last one kept, when it is newer than the last one counted
  (a QoS 1 duplicate is not counted twice); ``last_seen`` is when the service got it;
- ``events``: a delivery's steps per model version (what rollouts and deployments wait for);
  every event is kept, and an alert sets the alert's state (``cloudsync.fleet.observe``);
- ``telemetry``: per model version, the figures a rollout's gates judge (requests, failures,
  p95, confidence; routes per model, as version ""), for the models being rolled out only
  (``watched``); and every record's figures added to the node's counters (``observe``);
- ``desired-models`` (retained): what each node is told to run now, by whoever published it;
- ``cmd-result``: the result of a command the service relayed (others are not its);
- ``enrol``: a new device's certificate request (cloudsync.fleet.enrolment), its answer to
  publish once the batch is written.

A payload that is not an envelope of the contract is counted (``poison``) and dropped; it never
ends the batch. A node's effective labels are its own (its birth) overlaid by the operators'.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cloudsync.fleet import commands, observe
from cloudsync.fleet.enrolment import Decision, Enrolments
from cloudsync.fleet.observe import Event, count_telemetry, keep_event, text
from cloudsync.fleet.store import Store, Tx, dumps
from cloudsync.protocol import envelope
from cloudsync.protocol.envelope import EnvelopeError
from cloudsync.protocol.labels import LabelError, check_labels, selects
from cloudsync.protocol.manifest import is_key, key_of
from cloudsync.protocol.telemetry import FAILED_OUTCOMES

log = logging.getLogger("edgefleet.registry")
FAILED_STEPS = ("failed", "rolled-back", "refused")  # a delivery step that is not coming
MAX_PAGE = 1000
MAX_INT = 2**53  # what a count or a time in a message may be (a BIGINT holds it)
HASH = re.compile(r"^[0-9a-f]{64}\Z")  # a SHA-256, hex
SERVING = {  # what a node's last heartbeat serves ({model: version}), as JSON text to group by
    # (SQLite's json_extract gives a string unquoted: only an object is taken; no "->" before
    # SQLite 3.38, and Ubuntu 22.04, JetPack 6's, has 3.37)
    "sqlite": "CASE json_type(heartbeat, '$.models') WHEN 'object'"
    " THEN json_extract(heartbeat, '$.models') END",
    "postgresql": "(heartbeat::jsonb -> 'models')::text",
}


class Message(NamedTuple):
    kind: str  # status, heartbeat, events, telemetry, desired-models, cmd-result, enrol
    node: str
    payload: bytes
    arrived_ms: int
    cmd_id: str = ""  # a command's id; an enrolment request's


@dataclass
class Ingested:
    """What a batch changed: the reconciler's triggers, and the figures."""

    births: set[str] = field(default_factory=set)  # nodes that came online (or are new)
    desired: set[str] = field(default_factory=set)  # nodes whose retained desired state changed
    steps: int = 0  # delivery steps written (a rollout may move on)
    sent_ms: list[int] = field(default_factory=list)  # heartbeats: when their nodes sent them
    counted: dict[str, int] = field(default_factory=dict)
    poison: int = 0
    events: list[Event] = field(default_factory=list)  # stored the first time (the ECS log's)
    decisions: list[Decision] = field(default_factory=list)  # enrolment answers to publish
    counters: int = 0  # counters moved by telemetry
    barred: set[str] = field(default_factory=set)  # revoked nodes that published: dropped
    revoked: int = 0  # their messages

    def merge(self, other: Ingested) -> None:
        self.births |= other.births
        self.desired |= other.desired
        self.steps += other.steps
        self.sent_ms += other.sent_ms
        self.poison += other.poison
        self.events += other.events
        self.decisions += other.decisions
        self.counters += other.counters
        self.barred |= other.barred
        self.revoked += other.revoked
        for kind, n in other.counted.items():
            self.counted[kind] = self.counted.get(kind, 0) + n


def count(value: Any) -> int:
    """A count from a message: an integer 0 to 2^53 (ValueError otherwise: poison)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_INT:
        raise ValueError(f"a count: {text(value, 40)}")
    return value


def number(value: Any) -> float:
    """A figure from a message: a finite number (ValueError otherwise: poison)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value) > 1e300:
        raise ValueError(f"a number: {text(value, 40)}")
    return float(value)


def serving(
    born: list[dict[str, Any]], heartbeat: Any, heartbeat_ts: int | None, born_ts: int | None
) -> list[dict[str, Any]]:
    """The models of a node's birth, with the versions its last heartbeat (its body, when newer)
    says are serving: a version installed since the node connected shows at once, not at its
    next birth. A model the heartbeat does not list keeps what the birth said."""
    newer = isinstance(heartbeat, dict) and (heartbeat_ts or 0) >= (born_ts or 0)
    now = heartbeat.get("models") if newer else None
    if not isinstance(now, dict):
        return born
    rows = [
        {**m, "version": now[m["name"]], "state": "READY"} if m["name"] in now else m for m in born
    ]
    named = {m["name"] for m in born}
    return rows + [
        {"name": str(n), "version": v, "state": "READY"} for n, v in now.items() if n not in named
    ]


def digest_models(entries: list[Any]) -> str:
    """A desired state's identity: the same entries, the same digest."""
    return hashlib.sha256(dumps(entries).encode()).hexdigest()[:32]


def model_of(entry: Any) -> str | None:
    """What a desired entry delivers: its model, or ``package:{name}`` (``Manifest.key``)."""
    try:
        signed = entry["manifest"]["signed"]
        return key_of(signed.get("type"), signed["model"])
    except (KeyError, TypeError, AttributeError):
        return None


def forget_telemetry(tx: Tx, before_ms: int) -> int:
    """The watched models' telemetry older than ``before_ms`` deleted (the rollouts say when
    none of theirs judges it): how many rows."""
    return int(tx.execute("DELETE FROM telemetry WHERE ts < ?", (before_ms,)).rowcount)


class Registry:
    def __init__(
        self,
        store: Store,
        offline_after_s: float = 30.0,
        enrolments: Enrolments | None = None,
        checkpoint_s: float = 3600.0,
    ) -> None:
        self.store, self.offline_after_ms = store, int(offline_after_s * 1000)
        self.enrolments = enrolments or Enrolments(store, None)
        self.checkpoint_ms = int(checkpoint_s * 1000)
        self.kept: dict[tuple[str, str], int] = {}  # (node, ledger): when its last was kept

    # ---- ingest ----------------------------------------------------------------------------

    def ingest(self, batch: Iterable[Message], watched: frozenset[str] = frozenset()) -> Ingested:
        done = Ingested()
        heartbeats: list[tuple[Any, ...]] = []
        first = ""
        with self.store.transaction() as tx:
            barred = {row["node"] for row in tx.rows("SELECT node FROM barred")}
            for msg in batch:
                # A revoked node's messages are not the fleet's: but its renewal (refused, it is
                # told why) and its going offline (the will the broker sends when it goes).
                if msg.node in barred and msg.kind not in ("renew", "status"):
                    self.drop_revoked(msg, done)
                    continue
                try:
                    self._one(tx, msg, watched, done, heartbeats, barred)
                    done.counted[msg.kind] = done.counted.get(msg.kind, 0) + 1
                except (
                    EnvelopeError,
                    LabelError,
                    ValueError,
                    TypeError,
                    KeyError,
                    AttributeError,
                ) as exc:
                    done.poison += 1
                    first = first or f"node {msg.node}, {msg.kind}: {text(exc, 200)}"
            # one statement for the batch's heartbeats: counted when newer than the last; in the
            # order of the nodes, as every replica writes them (no deadlock between two)
            heartbeats.sort(key=lambda h: (h[0], h[3]))
            tx.executemany(
                "INSERT INTO nodes (node, state, first_seen, last_seen, heartbeats,"
                " heartbeat_ts, heartbeat) VALUES (?, 'online', ?, ?, 1, ?, ?)"
                " ON CONFLICT (node) DO UPDATE SET heartbeats = nodes.heartbeats + 1,"
                " heartbeat_ts = excluded.heartbeat_ts, heartbeat = excluded.heartbeat,"
                " last_seen = CASE WHEN excluded.last_seen > nodes.last_seen"
                " THEN excluded.last_seen ELSE nodes.last_seen END"
                " WHERE excluded.heartbeat_ts > nodes.heartbeat_ts",
                heartbeats,
            )
        if done.poison:  # one line a batch, whatever a node floods
            log.warning(
                "%d message(s) not of the contract dropped; the first: %s", done.poison, first
            )
        return done

    @staticmethod
    def drop_revoked(msg: Message, done: Ingested) -> None:
        done.barred.add(msg.node)
        done.revoked += 1

    def _one(
        self,
        tx: Tx,
        msg: Message,
        watched: frozenset[str],
        done: Ingested,
        heartbeats: list[tuple[Any, ...]],
        barred: set[str],
    ) -> None:
        if msg.kind == "desired-models":
            self._desired(tx, msg, done)
            return
        if msg.kind == "enrol":  # a new device's request (its id in cmd_id)
            done.decisions.append(
                self.enrolments.request(tx, msg.cmd_id, msg.payload, msg.arrived_ms)
            )
            return
        if msg.kind == "renew":  # a node's next certificate
            done.decisions.append(self.enrolments.renew(tx, msg.node, msg.payload, msg.arrived_ms))
            return
        env = envelope.decode(msg.payload)
        if not 0 <= env.ts < MAX_INT:
            raise ValueError(f"ts {env.ts}: out of range")
        if msg.kind == "status":
            if msg.node in barred and env.body.get("state") != "offline":
                self.drop_revoked(msg, done)
            else:
                self._status(tx, msg, env, done)
        elif msg.kind == "heartbeat":
            heartbeats.append((msg.node, msg.arrived_ms, msg.arrived_ms, env.ts, dumps(env.body)))
            done.sent_ms.append(env.ts)
            self._checkpoints(tx, msg.node, env.body.get("egress"), msg.arrived_ms)
        elif msg.kind == "events":
            done.steps += self._event(tx, msg, env)
            event = keep_event(tx, msg.node, env, msg.arrived_ms)
            if event is not None:
                done.events.append(event)
        elif msg.kind == "telemetry":
            done.counters += count_telemetry(tx, msg.node, env, msg.arrived_ms)
            if watched:
                self._telemetry(tx, msg, env, watched)
        elif msg.kind == "cmd-result":
            commands.answered(tx, msg.cmd_id, msg.node, env.body, msg.arrived_ms)

    def _status(self, tx: Tx, msg: Message, env: envelope.Envelope, done: Ingested) -> None:
        body = env.body
        state = body.get("state")
        if state not in ("online", "offline"):
            raise ValueError(f"status: state {state!r} is not online or offline")
        reason = body.get("reason")
        if state == "online":
            labels = check_labels(body.get("labels", {}), "status.labels")
            models = [
                {"name": str(m.get("name")), "version": m.get("version"), "state": m.get("state")}
                for m in body.get("models", [])
                if isinstance(m, dict)
            ]
            tx.execute(
                "INSERT INTO nodes (node, state, reason, status_ts, first_seen, last_seen,"
                " hardware, software, models, node_labels) VALUES (?, 'online', NULL, ?, ?, ?,"
                " ?, ?, ?, ?) ON CONFLICT (node) DO UPDATE SET state = 'online', reason = NULL,"
                " status_ts = excluded.status_ts, hardware = excluded.hardware,"
                " software = excluded.software, models = excluded.models,"
                " node_labels = excluded.node_labels, last_seen = CASE WHEN"
                " excluded.last_seen > nodes.last_seen THEN excluded.last_seen"
                " ELSE nodes.last_seen END",
                (
                    msg.node,
                    env.ts,
                    msg.arrived_ms,
                    msg.arrived_ms,
                    dumps(_mapping(body.get("hardware"))),
                    dumps(_mapping(body.get("software"))),
                    dumps(models),
                    dumps(labels),
                ),
            )
            done.births.add(msg.node)
        else:
            # a will is made when the node connects: offline since it came (the first time)
            tx.execute(
                "INSERT INTO nodes (node, state, reason, status_ts, first_seen)"
                " VALUES (?, 'offline', ?, ?, ?) ON CONFLICT (node) DO UPDATE SET"
                " state = 'offline', reason = excluded.reason, status_ts = CASE WHEN"
                " nodes.state = 'offline' THEN nodes.status_ts ELSE excluded.status_ts END",
                (msg.node, text(reason or ""), msg.arrived_ms, msg.arrived_ms),
            )
        tx.execute(
            "INSERT INTO history (node, ts, state, reason, arrived) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            (msg.node, env.ts, state, text(reason or ""), msg.arrived_ms),
        )

    def _event(self, tx: Tx, msg: Message, env: envelope.Envelope) -> int:
        step = env.body.get("delivery")
        if not isinstance(step, dict):
            return 0  # not a delivery step
        model, version = step.get("model"), step.get("version")
        if not is_key(model):
            raise ValueError("events.delivery.model: a model name, or package:{name}")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 < version < 2**53:
            raise ValueError("events.delivery.version: a positive integer")
        tx.execute(
            "INSERT INTO steps (node, model, version, step, ts) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (node, model, version) DO UPDATE SET step = excluded.step,"
            " ts = excluded.ts WHERE excluded.ts >= steps.ts",
            (msg.node, model, version, text(step.get("step"), 32), env.ts),
        )
        return 1

    def _telemetry(
        self, tx: Tx, msg: Message, env: envelope.Envelope, watched: frozenset[str]
    ) -> None:
        metrics = env.body.get("metrics")
        if not isinstance(metrics, dict):
            return  # what programs post: the observability issue's
        rows = []
        for row in metrics.get("models", []):
            if not isinstance(row, dict) or row.get("model") not in watched:
                continue
            outcomes = row.get("outcomes", {})
            if not isinstance(outcomes, dict):
                raise ValueError("telemetry: outcomes")
            failed = count(sum(count(outcomes.get(o, 0)) for o in FAILED_OUTCOMES))
            scored = count(row.get("confidence_n") or 0)
            p95 = row.get("p95_ms")
            rows.append(
                (
                    msg.node,
                    env.ts,
                    str(row["model"]),
                    text(row.get("version"), 32),
                    count(row.get("requests", 0)),
                    failed,
                    number(p95) if p95 is not None else None,
                    scored,
                    number(row.get("confidence_mean") or 0) * scored,
                    0,
                    0,
                )
            )
        routes_by_model = metrics.get("routes") or {}
        if not isinstance(routes_by_model, dict):
            raise ValueError("telemetry: routes")
        for model, routes in routes_by_model.items():
            if model in watched and isinstance(routes, dict):
                total = count(sum(count(n) for n in routes.values()))
                rows.append(
                    (
                        msg.node,
                        env.ts,
                        model,
                        "",
                        0,
                        0,
                        None,
                        0,
                        0.0,
                        total,
                        count(routes.get("fallback", 0)),
                    )
                )
        tx.executemany(
            "INSERT INTO telemetry (node, ts, model, version, requests, failed, p95_ms, conf_n,"
            " conf_sum, routed, fallbacks) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            rows,
        )

    def _desired(self, tx: Tx, msg: Message, done: Ingested) -> None:
        done.desired.add(msg.node)
        if not msg.payload:  # the retained desired state was deleted
            tx.execute("DELETE FROM desired WHERE node = ?", (msg.node,))
            return
        env = envelope.decode(msg.payload)
        entries = env.body.get("models", [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("desired.models: a list of objects")
        self.desired(tx, msg.node, entries, count(env.seq), msg.arrived_ms)

    @staticmethod
    def desired(tx: Tx, node: str, entries: list[Any], seq: int, now_ms: int) -> None:
        """A node's desired state, as published with ``seq``: an older one (the broker's echo
        of what the service published before) does not replace a newer one."""
        tx.execute(
            "INSERT INTO desired (node, digest, models, ts, seq) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (node) DO UPDATE SET digest = excluded.digest,"
            " models = excluded.models, ts = excluded.ts, seq = excluded.seq"
            " WHERE excluded.seq >= desired.seq",
            (node, digest_models(entries), dumps(entries), now_ms, seq),
        )

    # ---- queries ---------------------------------------------------------------------------

    def row(self, raw: Mapping[str, Any], now_ms: int) -> dict[str, Any]:
        """A node as the API shows it."""
        own, set_by_operators = json.loads(raw["node_labels"]), json.loads(raw["labels"])
        state = raw["state"]
        heartbeat = json.loads(raw["heartbeat"]) if raw["heartbeat"] else None
        if state == "online" and raw["last_seen"] < now_ms - self.offline_after_ms:
            state = "stale"  # online by its status, no heartbeat for 3 intervals
        return {
            "node": raw["node"],
            "state": state,
            "reason": raw["reason"] or None,
            "since_ms": raw["status_ts"],
            "first_seen_ms": raw["first_seen"],
            "last_seen_ms": raw["last_seen"] or None,
            "heartbeats": raw["heartbeats"],
            "heartbeat": heartbeat,
            "hardware": json.loads(raw["hardware"]),
            "software": json.loads(raw["software"]),
            "models": serving(
                json.loads(raw["models"]), heartbeat, raw["heartbeat_ts"], raw["status_ts"]
            ),
            "labels": {**own, **set_by_operators},
            "node_labels": own,
            "operator_labels": set_by_operators,
        }

    def nodes(
        self,
        now_ms: int,
        state: str | None = None,
        selector: Mapping[str, str] | None = None,
        contains: str = "",
        after: str = "",
        limit: int = 100,
        before: str = "",
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of nodes by name after ``after``, and the cursor of the next page (None: the
        last page). ``state``: online, offline, stale. With ``before``: the page of those just
        before it (still in the order of their names), and None when it is the first."""
        limit = max(1, min(limit, MAX_PAGE))
        page: list[dict[str, Any]] = []
        cursor = before or after
        backwards = bool(before)
        sql = (
            "SELECT * FROM nodes WHERE node < ? ORDER BY node DESC LIMIT ?"
            if backwards
            else "SELECT * FROM nodes WHERE node > ? ORDER BY node LIMIT ?"
        )
        while True:
            raws = self.store.query(sql, (cursor, MAX_PAGE))
            for raw in raws:
                cursor = raw["node"]
                if contains and contains not in cursor:
                    continue
                row = self.row(raw, now_ms)
                if (state is None or row["state"] == state) and selects(
                    selector or {}, row["labels"]
                ):
                    page.append(row)
                    if len(page) == limit:
                        return (page[::-1], cursor) if backwards else (page, cursor)
            if len(raws) < MAX_PAGE:
                return (page[::-1], None) if backwards else (page, None)

    def node(self, name: str, now_ms: int) -> dict[str, Any] | None:
        raws = self.store.query("SELECT * FROM nodes WHERE node = ?", (name,))
        if not raws:
            return None
        row = self.row(raws[0], now_ms)
        row["steps"] = self.store.query(
            "SELECT model, version, step, ts FROM steps WHERE node = ? ORDER BY model, version",
            (name,),
        )
        desired = self.store.query("SELECT models, ts FROM desired WHERE node = ?", (name,))
        row["desired"] = (
            [
                {
                    "model": model_of(e),
                    "version": e.get("manifest", {}).get("signed", {}).get("version"),
                }
                for e in json.loads(desired[0]["models"])
            ]
            if desired
            else []
        )
        return row

    def history(self, name: str, limit: int = 100) -> list[dict[str, Any]]:
        return self.store.query(
            "SELECT arrived AS ts, state, reason, ts AS sent_ts FROM history WHERE node = ?"
            " ORDER BY arrived DESC, ts DESC LIMIT ?",
            (name, max(1, min(limit, MAX_PAGE))),
        )

    def set_labels(self, name: str, labels: Mapping[str, str]) -> bool:
        """The operators' labels of a node (all of them); False if the node is not known."""
        with self.store.transaction() as tx:
            done = tx.execute(
                "UPDATE nodes SET labels = ? WHERE node = ?",
                (dumps(check_labels(labels)), name),
            )
            return done.rowcount == 1

    def _checkpoints(self, tx: Tx, node: str, heads: Any, now_ms: int) -> None:
        """The node's egress ledgers' heads (``{"edged": {seq, hash}, "uplink": ...}``), one
        per ledger every ``checkpoint_ms``: anchors the node cannot rewrite later. What is not
        a head is no checkpoint (the heartbeat is kept anyway)."""
        if not isinstance(heads, dict):
            return
        for ledger, head in list(heads.items())[:4]:
            if not isinstance(head, dict) or ledger not in ("edged", "uplink"):
                continue
            seq, value = head.get("seq"), head.get("hash")
            if (
                isinstance(seq, bool)
                or not isinstance(seq, int)
                or not 0 < seq < MAX_INT
                or not isinstance(value, str)
                or not HASH.match(value)
            ):
                continue
            if now_ms - self.kept.get((node, ledger), -self.checkpoint_ms) < self.checkpoint_ms:
                continue
            tx.execute(
                "INSERT INTO egress_checkpoints (node, ledger, seq, hash, ts) VALUES"
                " (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (node, ledger, seq, value, now_ms),
            )
            self.kept[(node, ledger)] = now_ms

    def checkpoints(self, node: str, limit: int = 100) -> list[dict[str, Any]]:
        """A node's egress checkpoints, newest first."""
        return self.store.query(
            "SELECT ledger, seq, hash, ts FROM egress_checkpoints WHERE node = ?"
            " ORDER BY ts DESC, ledger LIMIT ?",
            (node, limit),
        )

    def prune(self, now_ms: int, events_keep_ms: int, checkpoints_keep_ms: int = 0) -> int:
        """Forget events (and resolved alerts) older than ``events_keep_ms``, telemetry record
        ids older than a day (a record the outbox sends again comes within hours), and egress
        checkpoints older than ``checkpoints_keep_ms``."""
        with self.store.transaction() as tx:
            done = 0
            if checkpoints_keep_ms:
                done = tx.execute(
                    "DELETE FROM egress_checkpoints WHERE ts < ?", (now_ms - checkpoints_keep_ms,)
                ).rowcount
            return done + observe.prune(tx, now_ms, events_keep_ms)

    def counts(self, now_ms: int) -> dict[str, int]:
        """Nodes by state (online, stale, offline, unknown)."""
        raws = self.store.query(
            "SELECT CASE WHEN state = 'online' AND last_seen < ? THEN 'stale' ELSE state END"
            " AS s, COUNT(*) AS n FROM nodes GROUP BY 1",
            (now_ms - self.offline_after_ms,),
        )
        counts = {raw["s"]: int(raw["n"]) for raw in raws}
        return counts

    def software(self, limit: int = 20) -> list[dict[str, Any]]:
        """The most common software of the nodes' births (``versions``) and how many run it."""
        rows = self.store.query(
            "SELECT software, COUNT(*) AS n FROM nodes GROUP BY software"
            " ORDER BY n DESC, software LIMIT ?",
            (limit,),
        )
        return [{"versions": json.loads(r["software"]), "n": int(r["n"])} for r in rows]

    def serving(self, limit: int = 20) -> list[tuple[tuple[str, str], int]]:
        """The model versions the nodes' last heartbeats serve, most served first: ((model,
        version), nodes). Grouped in SQL by the heartbeat's ``models`` (a node sends what it
        sends: what is not an object counts for nothing)."""
        models: dict[tuple[str, str], int] = {}
        rows = self.store.query(
            f"SELECT {SERVING[self.store.dialect]} AS m, COUNT(*) AS n"
            " FROM nodes WHERE heartbeat IS NOT NULL GROUP BY 1"
        )
        for r in rows:
            served = json.loads(r["m"] or "{}")
            for name, version in _mapping(served).items():
                key = (str(name), str(version))
                models[key] = models.get(key, 0) + int(r["n"])
        return sorted(models.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]

    def events(self, node: str | None, limit: int) -> list[dict[str, Any]]:
        """The latest events to arrive, of one node or of all."""
        where, params = ("WHERE node = ?", (node, limit)) if node else ("", (limit,))
        return self.store.query(
            "SELECT node, id, ts, arrived, priority, level, message FROM events"
            f" {where} ORDER BY arrived DESC LIMIT ?",
            params,
        )


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
