"""Drain and resume: the local tier takes no new work (the path decision sees it as unavailable,
with the operator's reason); what can go to the cloud goes there, the rest is answered 503.
Drain waits for the local work in flight to finish (up to a timeout) and says how much is left;
``resume`` ends it. A drain outlives a restart (admin.json)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from edged.admin.kept import Kept
from edged.common.errors import InvalidRequest
from edged.models.repository import ModelManager, ModelVersion
from edged.routing.router import Router

log = logging.getLogger("edged.admin")

MAX_DRAIN_S = 3600.0


class Drain:
    def __init__(self, kept: Kept, router: Router, manager: ModelManager) -> None:
        self.kept, self.router, self.manager = kept, router, manager

    def restore(self) -> None:
        """A drain kept by a previous run holds again."""
        if self.kept.drained is not None:
            self.router.drained = str(self.kept.drained.get("reason") or "drained by the operator")
            log.warning(
                "the local tier stays drained (since a previous run): %s", self.router.drained
            )

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
        if self.kept.drained is None:
            drained = {"reason": why, "since": time.time()}
            self.kept.save(drained=drained)
            self.kept.drained = drained
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
            **self.kept.drained,
            "drained": True,
            "local_inflight": left,
            "waited_s": round(time.monotonic() - started, 3),
        }

    def resume(self) -> dict[str, Any]:
        """POST /v1/admin/resume: the local tier takes work again."""
        if self.kept.drained is not None:
            self.kept.save(drained=None)
            self.kept.drained = None
            self.router.drained = None
            log.warning("local tier resumed")
        return {"drained": False}
