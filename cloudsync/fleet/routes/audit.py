"""The audit log, read forward a page at a time (operator and up)."""

from __future__ import annotations

from aiohttp import web

from cloudsync.fleet.actions import db
from cloudsync.fleet.audit import AuditLog
from cloudsync.fleet.registry import MAX_INT
from cloudsync.fleet.routes.base import Route, error, page_size
from edged.common.digits import whole


class AuditRoutes:
    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def routes(self) -> list[Route]:
        return [Route("GET", "/v1/audit", self.entries, "operator", ("after", "limit"))]

    async def entries(self, request: web.Request) -> web.Response:
        after = whole(request.query.get("after", "0"))
        if after is None or after >= MAX_INT:
            return error(400, "after: an entry's id")
        limit = page_size(request)
        rows = await db(self.audit.after, after, limit)
        return web.json_response(
            {"entries": rows, "next": rows[-1]["id"] if len(rows) == limit else None}
        )
