"""The egress ledger read by the operator: entries filtered and paged (``GET /v1/admin/
egress``), and the chain verified against the fleet's checkpoints and edged's own head."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from edged.common.digits import whole
from edged.common.egress import Ledger, anchors_of, verify
from edged.common.errors import InvalidRequest, NotFound

EGRESS_QUERY = frozenset(
    {"after", "limit", "request_id", "model", "uid", "kind", "since_ms", "until_ms"}
)


class EgressLog:
    def __init__(self, ledger: Ledger | None) -> None:
        self.ledger = ledger

    def _ledger(self) -> Ledger:
        if self.ledger is None:
            raise NotFound("this edged keeps no egress ledger")
        return self.ledger

    async def entries(self, query: Mapping[str, str]) -> dict[str, Any]:
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
        return {
            "entries": found,
            "next": found[-1]["seq"] if more else None,
            "head": ledger.head.as_dict(),
        }

    async def verify(self, checkpoints: list[str]) -> dict[str, Any]:
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
