"""Deployments: desired model versions for the nodes a label selector picks, applied
continuously.

A deployment is ``{id, selector, priority, models}``: ``models`` lists desired-state entries
(``{"manifest", "urls"}``, as ``desired/models`` carries them), each a signed manifest. The
reconciler (``plan``) gives each node, per model, the entry of the deployment with the highest
priority among those that select it (a tie: the one created last, as Azure IoT Hub's automatic
deployments do). A node that joins, comes back, or gains a label gets what now selects it; one
that loses a label loses that deployment's models from its desired state (it keeps running what
it has: the desired state says what to install, never what to remove) and gets what a lower
deployment gives, if any. Entries of models no deployment ever gave the node (set by
a rollout without a deployment, or by hand) are left as they are.

The desired state is published retained, so a node that is offline gets it when it comes back,
from the broker, even if the service is down then. It is published only when it changes (its
digest differs from the retained one the service sees).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cloudsync.fleet.registry import FAILED_STEPS, digest_models, model_of
from cloudsync.fleet.store import Store, Tx, dumps
from cloudsync.protocol import manifest
from cloudsync.protocol.labels import check_labels, selects
from cloudsync.protocol.topics import NAME

log = logging.getLogger("edgefleet.deployments")
MAX_MODELS = 32
MAX_PRIORITY = 1_000_000


class Invalid(ValueError):
    """A request the API refuses (422); the message names the field."""


@dataclass
class Deployment:
    id: str
    selector: dict[str, str]
    priority: int
    models: list[dict[str, Any]]
    state: str = "active"
    created_ts: int = 0
    created_by: str = ""
    updated_ts: int = 0

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["versions"] = {model_of(e): _version(e) for e in self.models}
        return doc


def _version(entry: Mapping[str, Any]) -> Any:
    return entry["manifest"]["signed"]["version"]


def check(doc: Any, anchors: Mapping[str, Any] | None = None, now_ms: int = 0) -> Deployment:
    """A deployment from an API body, every field checked (Invalid names the first bad one).
    With ``anchors`` (the fleet's trust keys), every manifest must verify now."""
    if not isinstance(doc, dict):
        raise Invalid("body: an object {id, selector, priority, models}")
    unknown = set(doc) - {"id", "selector", "priority", "models"}
    if unknown:
        raise Invalid(f"{sorted(unknown)[0]}: not a field of a deployment")
    ident = doc.get("id")
    if not isinstance(ident, str) or not NAME.match(ident):
        raise Invalid("id: 1 to 64 letters, digits, _ or -, not first _")
    try:
        selector = check_labels(doc.get("selector", {}), "selector")
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    priority = doc.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise Invalid("priority: an integer")
    if not 0 <= priority <= MAX_PRIORITY:
        raise Invalid(f"priority: 0 to {MAX_PRIORITY}")
    models = doc.get("models")
    if not isinstance(models, list) or not 1 <= len(models) <= MAX_MODELS:
        raise Invalid(f"models: a list of 1 to {MAX_MODELS} entries {{manifest, urls}}")
    seen: set[str] = set()
    for i, entry in enumerate(models):
        where = f"models[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"manifest", "urls"}:
            raise Invalid(f"{where}: an object {{manifest, urls}}")
        signed = check_entry(entry, anchors, now_ms, where)
        if signed.key in seen:
            raise Invalid(f"{where}: model {signed.key} twice")
        seen.add(signed.key)
    return Deployment(ident, selector, priority, models)


def check_entry(
    entry: dict[str, Any], anchors: Mapping[str, Any] | None, now_ms: int, where: str = ""
) -> manifest.Manifest:
    """A desired-state entry ``{manifest, urls}``'s manifest, checked (verified against
    ``anchors`` when given) with a URL for each of its files; Invalid names the field, under
    ``where`` (a deployment's ``models[i]``; a rollout's entry is its body)."""
    field = f"{where}." if where else ""
    urls, doc_manifest = entry.get("urls"), entry.get("manifest")
    if not isinstance(urls, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in urls.items()
    ):
        raise Invalid(f"{field}urls: an object of file path: URL")
    try:
        if not isinstance(doc_manifest, dict):
            raise manifest.ManifestError("an object {signed, signatures}")
        signed = (
            manifest.verify(doc_manifest, dict(anchors), now=now_ms or None)
            if anchors
            else manifest.parse_signed(doc_manifest.get("signed"))
        )
    except manifest.ManifestError as exc:
        raise Invalid(f"{field}manifest: {exc}") from None
    missing = {f.path for f in signed.files} - set(urls)
    if missing:
        raise Invalid(f"{field}urls: no URL for {sorted(missing)[0]}")
    return signed


def plan(
    labels: Mapping[str, str],
    deployments: list[Deployment],
    current: list[dict[str, Any]],
    managed: set[str],
    held: set[str] | frozenset[str] = frozenset(),
) -> tuple[list[dict[str, Any]], set[str]]:
    """A node's desired entries and the models the service now gives it, from its effective
    ``labels``, the active ``deployments``, its ``current`` retained entries, the models
    the service gave it before (``managed``) and those a running rollout holds (``held``:
    kept as they are)."""
    winners: dict[str, tuple[tuple[int, int, str], dict[str, Any]]] = {}
    for dep in deployments:
        if dep.state != "active" or not selects(dep.selector, labels):
            continue
        rank = (dep.priority, dep.created_ts, dep.id)
        for entry in dep.models:
            name = model_of(entry)
            if name is None or name in held:
                continue
            if name not in winners or winners[name][0] < rank:
                winners[name] = (rank, entry)
    kept = [
        e
        for e in current
        if (name := model_of(e)) is not None
        and name not in winners
        and (name not in managed or name in held)
    ]
    given = [winners[name][1] for name in sorted(winners)]
    entries = sorted(kept + given, key=lambda e: model_of(e) or "")  # as rollouts compose them
    return entries, set(winners) | (managed & set(held))


def with_entry_in(tx: Tx, ident: str, model: str, entry: dict[str, Any], now_ms: int) -> None:
    """Deployment ``ident``'s entry for ``model`` replaced by ``entry`` (a rollout that is done
    leaves its version there), in the caller's transaction; nothing if it is gone."""
    rows = tx.rows("SELECT models FROM deployments WHERE id = ?", (ident,))
    if rows:
        models = [entry if model_of(e) == model else e for e in json.loads(rows[0]["models"])]
        tx.execute(
            "UPDATE deployments SET models = ?, updated_ts = ? WHERE id = ?",
            (dumps(models), now_ms, ident),
        )


@dataclass
class Deployments:
    """The deployments in the database."""

    store: Store
    clock: Callable[[], int]
    cache: list[Deployment] | None = field(default=None, repr=False)

    @staticmethod
    def load(r: dict[str, Any]) -> Deployment:
        return Deployment(
            r["id"],
            json.loads(r["selector"]),
            r["priority"],
            json.loads(r["models"]),
            r["state"],
            r["created_ts"],
            r["created_by"],
            r["updated_ts"],
        )

    def all(self) -> list[Deployment]:
        return [self.load(r) for r in self.store.query("SELECT * FROM deployments ORDER BY id")]

    def get(self, ident: str) -> Deployment | None:
        rows = self.store.query("SELECT * FROM deployments WHERE id = ?", (ident,))
        return self.load(rows[0]) if rows else None

    def count(self) -> int:
        return int(self.store.query("SELECT COUNT(*) AS n FROM deployments")[0]["n"])

    def progress(self, dep: Deployment) -> dict[str, int]:
        """How many nodes the service gave this deployment's entries to (``targeted``), and of
        those, by what their delivery reports say of the versions they were given: ``done``
        (every one active), ``failed`` (one failed, was refused or rolled back), ``waiting``
        (the others: not reported yet, downloading, installing)."""
        return self.progress_of([dep])[dep.id]

    def progress_of(self, deps: list[Deployment]) -> dict[str, dict[str, int]]:
        """``progress`` of each of ``deps`` by id, from one read of the desired states and
        one of the delivery steps (a list page reads them once, not once a deployment)."""
        wanted: dict[str, list[tuple[str, str, Any]]] = {}  # an entry: whose, what
        for dep in deps:
            for e in dep.models:
                wanted.setdefault(dumps(e), []).append((dep.id, str(model_of(e)), _version(e)))
        given: dict[str, dict[str, list[tuple[str, Any]]]] = {dep.id: {} for dep in deps}
        for r in self.store.query(
            "SELECT d.node, d.models FROM managed m JOIN desired d ON d.node = m.node"
        ):
            for key in {dumps(e) for e in json.loads(r["models"])} & wanted.keys():
                for ident, model, version in wanted[key]:
                    given[ident].setdefault(r["node"], []).append((model, version))
        models = sorted({model for whose in wanted.values() for _, model, _ in whose})
        steps: dict[tuple[str, str, Any], str] = {}
        if models and any(given.values()):
            marks = ", ".join("?" * len(models))
            for row in self.store.query(
                f"SELECT node, model, version, step FROM steps WHERE model IN ({marks})",
                tuple(models),
            ):
                steps[(row["node"], row["model"], row["version"])] = row["step"]
        out = {}
        for ident, nodes in given.items():
            done = failed = 0
            for node, versions in nodes.items():
                reported = [steps.get((node, model, version)) for model, version in versions]
                if any(step in FAILED_STEPS for step in reported):
                    failed += 1
                elif all(step == "active" for step in reported):
                    done += 1
            targeted = len(nodes)
            waiting = targeted - done - failed
            out[ident] = {"targeted": targeted, "done": done, "failed": failed, "waiting": waiting}
        return out

    def create(self, dep: Deployment, actor: str) -> bool:
        """False if a deployment has that id already."""
        now = self.clock()
        with self.store.transaction() as tx:
            done = tx.execute(
                "INSERT INTO deployments (id, selector, priority, models, state, created_ts,"
                " created_by, updated_ts) VALUES (?, ?, ?, ?, 'active', ?, ?, ?)"
                " ON CONFLICT (id) DO NOTHING",
                (dep.id, dumps(dep.selector), dep.priority, dumps(dep.models), now, actor, now),
            )
            return done.rowcount == 1

    def delete(self, ident: str) -> bool:
        with self.store.transaction() as tx:
            return tx.execute("DELETE FROM deployments WHERE id = ?", (ident,)).rowcount == 1


class Reconciler:
    """Publishes each node's desired state when what the deployments give it differs from what
    it has (run by one replica: the runner)."""

    def __init__(
        self,
        store: Store,
        deployments: Deployments,
        publish: Callable[[str, list[dict[str, Any]]], bool],
        holds: Callable[[], dict[str, set[str]]] = dict,
    ) -> None:
        self.store, self.deployments, self.publish = store, deployments, publish
        self.holds = holds
        self.published = 0

    def run(self, nodes: set[str] | None = None) -> int:
        """Reconcile ``nodes`` (None: every node); the number of desired states published."""
        active = [d for d in self.deployments.all() if d.state == "active"]
        holds = self.holds()
        query = (
            "SELECT n.node, n.node_labels, n.labels, d.models AS current, d.digest,"
            " m.models AS managed FROM nodes n LEFT JOIN desired d ON d.node = n.node"
            " LEFT JOIN managed m ON m.node = n.node"
        )
        if nodes is None:
            rows = self.store.query(query)
        else:
            rows, names = [], sorted(nodes)
            for i in range(0, len(names), 500):
                part = names[i : i + 500]
                marks = ", ".join("?" for _ in part)
                rows += self.store.query(f"{query} WHERE n.node IN ({marks})", tuple(part))
        sent = 0
        for row in rows:
            labels = {**json.loads(row["node_labels"]), **json.loads(row["labels"])}
            current = json.loads(row["current"]) if row["current"] else []
            before = set(json.loads(row["managed"])) if row["managed"] else set()
            entries, given = plan(labels, active, current, before, holds.get(row["node"], set()))
            digest = digest_models(entries)
            changed = digest != (row["digest"] or digest_models([]))
            if not changed and given == before:
                continue
            if changed and not self.publish(row["node"], entries):
                continue  # not on the broker: the next pass tries again
            self._remember(row["node"], given, digest)
            sent += changed
        self.published += sent
        return sent

    def _remember(self, node: str, given: set[str], digest: str) -> None:
        """The models the service gives the node now (what it published, the service's
        ``publish`` wrote as the node's desired state)."""
        with self.store.transaction() as tx:
            tx.execute(
                "INSERT INTO managed (node, models, digest, ts) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (node) DO UPDATE SET models = excluded.models,"
                " digest = excluded.digest, ts = excluded.ts",
                (node, dumps(sorted(given)), digest, self.deployments.clock()),
            )
