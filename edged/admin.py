"""Operator controls while serving: the routing policy, reload and drain.

``edgectl`` calls them on the socket (``/v1/admin/...``), and so does cloudsync when a signed
fleet command asks. What they change outlives a restart: it is kept in
``{state_dir}/admin.json`` (written atomically), beside the config file rather than in it, so
that the operator's file stays theirs and a package upgrade never sees it changed.

- **Routing overrides**: a JSON merge patch (RFC 7396) over the config file's ``[routing]``
  keys: a key set replaces the file's value (``rules`` as a whole list), ``null`` takes the
  override away. The merged settings are validated whole before anything changes, so a bad patch
  is refused with the key it names and the policy in force stays. A reload re-reads the file and
  lays the overrides over it again.
- **Model versions**: install a staged version (checked, moved in, smoke-tested, then serving:
  ``edged.models.install``; a model new to the repository comes with its config.pbtxt),
  activate one on disk, roll back to the one before, remove a model. The active
  version of each model is kept, so a restart serves it (never a version that was staged and not
  yet activated), with the versions activated before it.
- **Cloud A/B**: a share of a model's cloud calls go to a second version on the cloud server
  (over the config's ``b_cloud_name``/``b_share``); the metrics say how each arm does.
- **Drain**: the local tier takes no new work (the path decision sees it as unavailable, with the
  operator's reason); what can go to the cloud goes there, the rest is answered 503. Drain waits
  for the local work in flight to finish (up to a timeout) and says how much is left; ``resume``
  ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from edged.cloud import CloudEndpoint
from edged.common.atomic import write_atomic
from edged.common.digits import whole
from edged.common.errors import (
    ConfigError,
    Conflict,
    EdgedError,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    Unavailable,
)
from edged.config import RoutingConfig, validate
from edged.egress import Ledger, anchors_of, verify
from edged.models import install
from edged.models.repository import VERSION, ModelManager, ModelVersion
from edged.router import Router

log = logging.getLogger(__name__)

ADMIN_FILE = "admin.json"
MAX_DRAIN_S = 3600.0
MAX_SCORES = 1000  # an A/B test's scores in one call
EGRESS_QUERY = frozenset({"after", "limit", "request_id", "model", "uid", "kind", "since_ms",
                          "until_ms"})  # fmt: skip
HISTORY = 10  # activations remembered per model


class Admin:
    def __init__(
        self,
        path: Path,
        router: Router,
        manager: ModelManager,
        reload: Callable[[], Awaitable[str | None]],
        keep_versions: int = 3,
        ready: Callable[[], bool] = lambda: True,
        staging: Path | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        """``router`` gets the settings; ``reload`` re-reads the config (the error, or None);
        ``keep_versions``: version directories kept on disk per model; ``staging``: where
        installs are taken from (default: ``staging`` beside ``path``, in the state
        directory); ``ledger``: the egress ledger ``GET /v1/admin/egress`` reads."""
        self.path = path
        self.staging = staging if staging is not None else path.with_name(install.STAGING)
        self.keep_versions = keep_versions
        self.ready = ready  # the models endpoints wait for the first load to finish
        self.router = router
        self.manager = manager
        self._reload = reload
        self.base = router.config  # the config file's [routing]
        self.overrides: dict[str, Any] = {}
        self.drained: dict[str, Any] | None = None
        self.history: dict[str, list[int]] = {}  # per model, the versions activated, oldest first
        self.ledger = ledger
        # cloud A/B set here: model (the first tier's) or model@tier -> b and share
        self.splits: dict[str, dict[str, Any]] = {}
        for tier in router.clouds:  # an A/B test's decision is kept as the operator's would be
            tier.on_decided = functools.partial(self._decided, tier.name)
        self._restore()

    # ---- what is kept --------------------------------------------------------------------

    def _restore(self) -> None:
        try:
            kept = json.loads(self.path.read_text())
            overrides, drained = kept.get("routing_overrides", {}), kept.get("drained")
            history = kept.get("models", {})
            splits = kept.get("cloud_ab", {})
            if (
                not isinstance(overrides, dict)
                or not isinstance(drained, (dict, type(None)))
                or not isinstance(history, dict)
                or not isinstance(splits, dict)
                or not all(
                    isinstance(v, list) and v and all(isinstance(i, int) for i in v)
                    for v in history.values()
                )
            ):
                raise ValueError("not the shape edged writes")
        except FileNotFoundError:
            return
        except (OSError, ValueError, AttributeError) as exc:
            log.error("admin: cannot read %s (%s); starting without its overrides", self.path, exc)
            return
        self.overrides = overrides
        self.configure(self.base)
        self.history = history
        self.manager.pinned.update({name: versions[-1] for name, versions in history.items()})
        for key, split in splits.items():
            model = key.partition("@")[0]
            try:
                self._split(model, split)
            except EdgedError as exc:
                log.error("admin: the cloud A/B of %s is not applied: %s", model, exc.message)
        if drained is not None:
            self.drained = drained
            self.router.drained = str(drained.get("reason") or "drained by the operator")
            log.warning("the local tier stays drained (since a previous run): %s",
                        self.router.drained)  # fmt: skip

    def _save(self, **change: Any) -> None:
        """Keep the state, with ``change`` (routing_overrides, drained, models, cloud_ab) laid
        over it, in admin.json: whole, fsynced (edged/atomic.py). Called before a change is
        applied: when it cannot be kept (a full disk), the change is refused (507) and nothing
        changes, in force or on disk."""
        state = {
            "routing_overrides": self.overrides,
            "drained": self.drained,
            "models": self.history,
            "cloud_ab": self.splits,
            **change,
        }
        try:
            write_atomic(self.path, json.dumps(state, indent=1))
        except OSError as exc:
            raise InsufficientStorage(
                f"not applied: it cannot be kept in {self.path} ({exc.strerror})"
            ) from None

    # ---- routing ---------------------------------------------------------------------------

    def merged(self, base: RoutingConfig, overrides: dict[str, Any]) -> RoutingConfig:
        doc = base.model_dump(exclude_unset=False)
        doc.update(overrides)
        return validate(RoutingConfig, doc, "routing")

    def configure(self, base: RoutingConfig) -> None:
        """The file's settings (at start and on reload) with the overrides laid over them."""
        self.base = base
        try:
            self.router.configure(self.merged(base, self.overrides))
        except ConfigError as exc:
            log.error(
                "admin: the routing overrides no longer fit the config file, so the file's"
                " settings apply alone until they are changed or reset: %s", exc.message,
            )  # fmt: skip
            self.router.configure(base)

    def routing(self) -> dict[str, Any]:
        """GET /v1/admin/routing: the settings in force, and which of them are overrides."""
        return {
            "routing": self.router.config.model_dump(mode="json"),
            "overrides": self.overrides,
            "kept_in": str(self.path),
        }

    def patch_routing(self, patch: Any) -> dict[str, Any]:
        """PATCH /v1/admin/routing: a merge patch of the overrides (null removes one)."""
        if not isinstance(patch, dict) or not patch:
            raise InvalidRequest(
                'the body must be a JSON object of [routing] settings, e.g. {"local_threshold_ms":'
                " 50}; null removes an override"
            )
        overrides = {k: v for k, v in {**self.overrides, **patch}.items() if v is not None}
        try:
            settings = self.merged(self.base, overrides)
        except ConfigError as exc:
            raise InvalidRequest(exc.message) from None
        self._save(routing_overrides=overrides)
        self.overrides = overrides
        self.router.configure(settings)
        log.info("routing overrides now %s", json.dumps(overrides, sort_keys=True))
        return self.routing()

    def reset_routing(self) -> dict[str, Any]:
        """DELETE /v1/admin/routing: the config file's settings again."""
        self._save(routing_overrides={})
        self.overrides = {}
        self.router.configure(self.base)
        log.info("routing overrides removed: the config file's settings apply")
        return self.routing()

    # ---- model versions ------------------------------------------------------------------

    def _entry(self, name: str) -> Any:
        if not self.ready():
            raise Unavailable("edged is still loading its models")
        return self.manager.entry(name)

    def versions(self, name: str) -> dict[str, Any]:
        """GET /v1/admin/models/{m}: the active version, those activated before, those on disk."""
        entry = self._entry(name)
        on_disk = sorted(
            int(d.name) for d in entry.directory.iterdir() if d.is_dir() and VERSION.match(d.name)
        )
        return {
            "model": name,
            "active": self.manager.pinned.get(name),
            "history": self.history.get(name, []),
            "on_disk": on_disk,
            "serving": entry.ready_versions,
            # versions refused at their last load because their files are not those installed
            "damaged": {
                str(v): mv.damaged for v, mv in sorted(entry.versions.items()) if mv.damaged
            },
        }

    def _activated(self, name: str, version: int, before: int | None) -> None:
        history = [v for v in self.history.get(name, []) if v != version]
        if before is not None and not history:
            history = [before]  # what served by version policy until now
        history = [*history, version][-HISTORY:]
        self._save(models={**self.history, name: history})
        self.history[name] = history

    def _pin_current(self, name: str) -> int | None:
        """Keep the version serving now as the active one before anything changes, so that a
        crash in the middle restarts on it (not on a version staged and not yet checked)."""
        entry = self._entry(name)
        current = self.manager.pinned.get(name)
        if current is None and entry.ready_versions:
            current = entry.ready_versions[-1]
        if current is not None and self.history.get(name, [None])[-1] != current:
            self._activated(name, current, None)
        return current

    @staticmethod
    def _version(doc: Any, required: bool = True) -> int | None:
        version = doc.get("version") if isinstance(doc, dict) else None
        if version is None and not required:
            return None
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise InvalidRequest("'version' must be a positive integer")
        return version

    async def install(self, name: str, doc: Any) -> dict[str, Any]:
        """POST /v1/admin/models/{m}/install {"version", "source", "files", "smoke"}: from a
        directory in the staging directory only (``edged.models.install``). A model the
        repository does not have is new: its version carries its config.pbtxt."""
        version = self._version(doc)
        assert version is not None and isinstance(doc, dict)
        files = doc.get("files")
        if not self.ready():
            raise Unavailable("edged is still loading its models")
        new = None
        if name not in self.manager.entries:
            new = install.new_model_directory(self.manager.repository, name, files)
        source = install.staged_source(self.staging, doc.get("source"))
        started = time.monotonic()
        current = None if new else self._pin_current(name)
        known = None if new else self.manager.entry(name).versions.get(version)
        if version == current and not (known and known.damaged):  # a damaged one: again over it
            raise InvalidRequest(f"version {version} of '{name}' is the active one")
        target = (new or self._entry(name).directory) / str(version)
        # reading and hashing gigabytes: in a thread, the loop goes on serving
        try:
            await asyncio.to_thread(install.stage, self.staging, str(source), files, target)
        except ConfigError as exc:  # the staging directory itself is not edged's
            raise Unavailable(exc.message) from None
        cases = doc.get("smoke", [])

        async def check(v: int) -> None:
            await install.smoke_test(self.manager, name, v, cases)
            if new is not None:  # it passed: the repository finds it from now on
                await asyncio.to_thread(install.publish_config, new, v)

        try:
            before = await self.manager.activate(name, version, check, new)
        except Exception:
            # a bad version leaves nothing behind (only what this install moved in goes, and
            # through the staging directory)
            await asyncio.to_thread(install.discard, self.staging, target)
            if new is not None:
                with contextlib.suppress(OSError):  # a new model's directory, now empty
                    new.rmdir()
            raise
        install.done(self.staging, target)
        self._activated(name, version, before)
        return {
            **self._pruned(name),
            "previous": before,
            "smoke_cases": len(cases) if isinstance(cases, list) else 0,
            "seconds": round(time.monotonic() - started, 3),
        }

    async def activate(self, name: str, doc: Any) -> dict[str, Any]:
        """POST /v1/admin/models/{m}/activate {"version"}: a version on disk serves (no
        version: the one active before, a rollback)."""
        version = self._version(doc, required=False)
        current = self._pin_current(name)
        if version is None:
            earlier = [v for v in self.history.get(name, []) if v != current]
            on_disk = set(self.versions(name)["on_disk"])
            earlier = [v for v in earlier if v in on_disk]
            if not earlier:
                raise NotFound(f"model '{name}' has no earlier version on disk to roll back to")
            version = earlier[-1]
        if version == current:
            return {**self.versions(name), "previous": current}
        if not (self._entry(name).directory / str(version)).is_dir():
            raise NotFound(f"model '{name}' has no version {version} on disk")

        async def check(v: int) -> None:
            return None

        before = await self.manager.activate(name, version, check)
        self._activated(name, version, before)
        log.warning("model %s: version %d active again (was %s)", name, version, before)
        return {**self.versions(name), "previous": before}

    async def remove(self, name: str) -> dict[str, Any]:
        """DELETE /v1/admin/models/{m}: the model stops serving (its requests in flight
        finish), its directory goes, and a tombstone beside it keeps the package from seeding it
        again. Refused (409) while a pipeline that serves calls it."""
        entry = self._entry(name)
        on_disk = self.versions(name)["on_disk"]
        history = {m: v for m, v in self.history.items() if m != name}
        self._save(models=history)  # a restart does not pin a model that is gone
        try:
            await self.manager.remove(name)
        except EdgedError:
            self._save()
            raise
        self.history = history
        await asyncio.to_thread(install.remove_model, self.staging, entry.directory)
        return {"model": name, "removed": on_disk}

    def _pruned(self, name: str) -> dict[str, Any]:
        entry = self._entry(name)
        keep = set(self.history.get(name, [])[-2:])
        removed = install.prune(entry.directory, self.keep_versions, keep)
        if removed:
            log.info("model %s: removed versions %s from disk", name, removed)
        return {**self.versions(name), "removed": removed}

    # ---- cloud A/B -------------------------------------------------------------------------

    def _split(self, model: str, doc: Any, persist: bool = False) -> dict[str, Any]:
        cloud = self._tier(doc.get("tier") if isinstance(doc, dict) else None)
        tier = cloud.name
        b_name = doc.get("b_cloud_name") if isinstance(doc, dict) else None
        share = doc.get("b_share", 0) if isinstance(doc, dict) else None
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise InvalidRequest("'b_share' must be a share of calls, 0 to 1")
        if share and (not isinstance(b_name, str) or not 0 < len(b_name) <= 128):
            raise InvalidRequest("'b_cloud_name' must name the cloud model of arm b")
        by = doc.get("decided_by", "edged")
        if by not in ("edged", "fleet"):
            raise InvalidRequest("'decided_by' must be 'edged' (this node's test decides) or"
                                 " 'fleet' (the fleet service's)")  # fmt: skip
        rule = {k: doc[k] for k in ("latency_ms", "min_confidence", "min_score") if k in doc}
        for key, value in rule.items():
            most = 3_600_000.0 if key == "latency_ms" else 1.0
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (0 <= value <= most)
            ):
                raise InvalidRequest(f"'{key}' must be a number, 0 to {most:g}")
        # kept even at share 0: the operator's "off" (or a test's) overrides the config file's
        split: dict[str, Any] = {"b_cloud_name": b_name, "b_share": float(share)}
        if by == "fleet":
            split["decided_by"] = by
        first = cloud is self.router.cloud
        if not first:
            split["tier"] = tier
        splits = {**self.splits, model if first else f"{model}@{tier}": {**split, **rule}}
        if persist:
            self._save(cloud_ab=splits)
        cloud.set_split(model, b_name, float(share), by == "fleet", **rule)
        self.splits = splits
        reply = {"model": model, "ab": cloud.state()["ab"].get(model)}
        return reply if first else {**reply, "tier": tier}

    def score(self, model: str, doc: Any) -> dict[str, Any]:
        """POST /v1/admin/cloud/{m}/ab/scores {"scores": [{"request_id", "score"}], "tier"}:
        an operator's scores of answers, counted by the model's A/B test (it must take
        scores: ab_min_score or the split's min_score)."""
        cloud = self._tier(doc.get("tier") if isinstance(doc, dict) else None)
        scores = doc.get("scores") if isinstance(doc, dict) else None
        if not isinstance(scores, list) or not 0 < len(scores) <= MAX_SCORES:
            raise InvalidRequest(f"'scores' must be a list of 1 to {MAX_SCORES} scores")
        checked = []
        for i, row in enumerate(scores):
            ident = row.get("request_id") if isinstance(row, dict) else None
            value = row.get("score") if isinstance(row, dict) else None
            if not isinstance(ident, str) or not 0 < len(ident) <= 256:
                raise InvalidRequest(f"'scores[{i}].request_id' must be a request's id")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (0 <= value <= 1)
            ):
                raise InvalidRequest(f"'scores[{i}].score' must be a number, 0 to 1")
            checked.append((ident, float(value)))
        test = cloud.tests.get(model)
        if test is None or test.min_score is None:
            raise Conflict(f"no A/B test of {model} on tier {cloud.name} takes scores")
        counted = sum(cloud.score(model, ident, value) for ident, value in checked)
        return {"model": model, "counted": counted, "not_waiting": len(checked) - counted}

    def _tier(self, name: Any) -> CloudEndpoint:
        """The cloud tier by name (None: the first)."""
        if self.router.cloud is None:
            raise NotFound("this edged has no cloud tier ([cloud] url)")
        if name is None:
            return self.router.cloud
        found = [t for t in self.router.clouds if t.name == name]
        if not found:
            names = ", ".join(t.name for t in self.router.clouds)
            raise InvalidRequest(f"'tier' must name a cloud tier: {names}")
        return found[0]

    # ---- the egress ledger -------------------------------------------------------------------

    async def egress(self, query: Mapping[str, str]) -> dict[str, Any]:
        """GET /v1/admin/egress: entries after ``after`` (a seq), oldest first, at most
        ``limit``, filtered by ``request_id``, ``model``, ``uid``, ``kind``, ``since_ms`` and
        ``until_ms`` (entry times, ms since the epoch); ``next``: the ``after`` of the next
        page (None: no more)."""
        ledger = self._ledger()
        unknown = set(query) - EGRESS_QUERY
        if unknown:
            raise InvalidRequest(f"'{sorted(unknown)[0]}' is no filter: {sorted(EGRESS_QUERY)}")
        numbers = {}
        for key in ("after", "limit", "uid", "since_ms", "until_ms"):
            if key in query:
                value = whole(query[key], 16)
                if value is None:
                    raise InvalidRequest(f"'{key}' must be a whole number")
                numbers[key] = value
        limit = numbers.get("limit", 100)
        if not 1 <= limit <= 1000:
            raise InvalidRequest("'limit' must be 1 to 1000")
        text = {k: query[k] for k in ("request_id", "model", "kind") if k in query}
        since, until = numbers.get("since_ms", 0), numbers.get("until_ms", 2**63)

        def match(entry: dict[str, Any]) -> bool:
            return (
                all(entry.get(k) == v for k, v in text.items())
                and ("uid" not in numbers or entry.get("uid") == numbers["uid"])
                and since <= entry["ts"] <= until
            )

        found = await asyncio.to_thread(ledger.entries, numbers.get("after", 0), limit, match)
        more = len(found) == limit
        return {"entries": found, "next": found[-1]["seq"] if more else None,
                "head": ledger.head.as_dict()}  # fmt: skip

    async def verify_egress(self, checkpoints: list[str]) -> dict[str, Any]:
        """GET /v1/admin/egress/verify[?checkpoint=SEQ:HASH...]: the whole chain walked (the
        fleet's checkpoints, each must be in it), and edged's own head: a file replaced or cut
        short under edged is a chain that verifies, but not one that holds edged's head."""
        ledger = self._ledger()
        try:
            anchors = anchors_of(checkpoints)
        except ValueError as exc:
            raise InvalidRequest(f"'checkpoint': {exc}") from None
        head = ledger.head if ledger.head.seq else None  # taken before the walk: in the files
        report = await asyncio.to_thread(verify, ledger.directory, anchors, head)
        return report.as_dict()

    def _ledger(self) -> Ledger:
        if self.ledger is None:
            raise NotFound("this edged keeps no egress ledger")
        return self.ledger

    def _decided(self, tier: str, model: str, b_cloud_name: str | None, share: float) -> None:
        """An A/B test promoted its winner: in force now, and kept like a PUT of the split."""
        doc = {"b_cloud_name": b_cloud_name, "b_share": share, "tier": tier}
        try:
            self._split(model, doc, persist=True)
        except EdgedError as exc:  # e.g. a full disk: in force until a restart
            log.error("admin: the cloud A/B decision of %s is not kept: %s", model, exc.message)
            self._tier(tier).set_split(model, b_cloud_name, share)

    def set_split(self, model: str, doc: Any) -> dict[str, Any]:
        """PUT /v1/admin/cloud/{m}/ab {"b_cloud_name", "b_share"} (share 0: arm a only;
        optional: "tier" (default: the first), "decided_by" edged or fleet, and the test's
        "latency_ms", "min_confidence")."""
        share = doc.get("b_share", 0) if isinstance(doc, dict) else 0
        cloud = self._tier(doc.get("tier") if isinstance(doc, dict) else None)
        if share and model not in self.manager.entries and model not in cloud.catalog:
            raise NotFound(
                f"no model '{model}' on the device or in the cloud tier {cloud.name}'s catalog:"
                " a split of it would split nothing"
            )
        reply = self._split(model, doc, persist=True)
        log.info("cloud A/B of %s: %s", model, reply["ab"] or "off")
        return reply

    # ---- reload and drain --------------------------------------------------------------------

    async def reload(self) -> dict[str, Any]:
        """POST /v1/admin/reload: as SIGHUP, answered when done."""
        error = await self._reload()
        return {"reloaded": error is None, "error": error}

    def _versions(self) -> list[ModelVersion]:
        return [mv for e in self.manager.entries.values() for mv in e.versions.values()]

    async def drain(self, doc: Any) -> dict[str, Any]:
        """POST /v1/admin/drain {"reason": "...", "timeout_s": 30}: no new local work; waits for
        the local work in flight, up to the timeout."""
        doc = {} if doc is None else doc
        if not isinstance(doc, dict) or set(doc) - {"reason", "timeout_s"}:
            raise InvalidRequest('the body must be {"reason": "...", "timeout_s": 30}')
        reason, timeout = doc.get("reason", ""), doc.get("timeout_s", 30.0)
        if not isinstance(reason, str) or len(reason) > 200:
            raise InvalidRequest("'reason' must be text of at most 200 characters")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise InvalidRequest("'timeout_s' must be a number of seconds")
        if not 0 <= timeout <= MAX_DRAIN_S:
            raise InvalidRequest(f"'timeout_s' must be 0 to {MAX_DRAIN_S:.0f}")
        why = f"drained by the operator{': ' + reason if reason else ''}"
        if self.drained is None:
            drained = {"reason": why, "since": time.time()}
            self._save(drained=drained)
            self.drained = drained
            self.router.drained = why
            log.warning("local tier %s", why)
        started = time.monotonic()
        busy = [asyncio.ensure_future(mv.idle.wait()) for mv in self._versions() if mv.inflight]
        if busy:
            _, pending = await asyncio.wait(busy, timeout=timeout)
            for waiter in pending:
                waiter.cancel()
        left = sum(mv.inflight for mv in self._versions())
        return {
            **self.drained,
            "drained": True,
            "local_inflight": left,
            "waited_s": round(time.monotonic() - started, 3),
        }

    def resume(self) -> dict[str, Any]:
        """POST /v1/admin/resume: the local tier takes work again."""
        if self.drained is not None:
            self._save(drained=None)
            self.drained = None
            self.router.drained = None
            log.warning("local tier resumed")
        return {"drained": False}
