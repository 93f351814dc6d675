"""What the fleet API's route modules share: a route table's row, the JSON error, a page's
size, the trusted manifest keys, and ``Calls``: a caller's body read within the limits and a
refusal answered, each audited through ``Actions``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from aiohttp import web

from cloudsync.fleet.actions import WHO, Actions, Refused
from cloudsync.fleet.config import Token
from cloudsync.fleet.registry import MAX_PAGE
from cloudsync.protocol.commands import load_anchors, load_scopes
from edged.common.digits import whole

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Route(NamedTuple):
    """One row of a route table: the role it needs and the query parameters it takes (others:
    400)."""

    method: str
    path: str
    handler: Handler
    role: str = "viewer"
    query: tuple[str, ...] = ()


class RouteModule(Protocol):
    """A route module: a resource's routes, its handlers bound to what it was given."""

    def routes(self) -> list[Route]: ...


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def page_size(request: web.Request) -> int:
    """A page's ``limit`` (default 100): 1 to MAX_PAGE, else a 400 (``Refused``)."""
    value = whole(request.query.get("limit", "100"), 6)
    if value is None or not 1 <= value <= MAX_PAGE:
        raise Refused(400, f"limit: 1 to {MAX_PAGE}")
    return value


def manifest_anchors(trust: Path | None) -> dict[str, Any] | None:
    """The keys that may sign manifests, as nodes count them (``[service] trust_dir``'s
    anchors without a scope), or None without a trust directory (nothing checked)."""
    if trust is None:
        return None
    scoped = load_scopes(trust)
    return {k: v for k, v in load_anchors(trust).items() if k not in scoped}


class Calls:
    """A call's body and its refusal, for every route module: audited through ``actions``."""

    def __init__(self, actions: Actions, idle_timeout_s: float, max_body_kb: int) -> None:
        self.actions = actions
        self.idle_timeout_s, self.max_body_kb = idle_timeout_s, max_body_kb

    async def audit(
        self, who: Token, action: str, target: str, outcome: str, detail: Any = None
    ) -> None:
        await self.actions.audit(who, action, target, outcome, detail)

    async def body(self, request: web.Request, action: str, target: str) -> Any:
        """The JSON body, or a 400/408/413 raised (and audited)."""
        who = request[WHO]
        timeout_s = self.idle_timeout_s
        try:
            raw = await asyncio.wait_for(request.read(), timeout_s)
        except asyncio.TimeoutError:
            await self.audit(who, action, target, "refused: body too slow")
            raise web.HTTPRequestTimeout(
                text=json.dumps(
                    {"error": f"body: not all there within {timeout_s:g} s (api.idle_timeout_s)"}
                ),
                content_type="application/json",
            ) from None
        except web.HTTPRequestEntityTooLarge:
            await self.audit(who, action, target, "refused: body too large")
            limit = self.max_body_kb
            raise web.HTTPRequestEntityTooLarge(
                max_size=limit * 1024,
                actual_size=request.content_length or 0,
                text=json.dumps({"error": f"body: more than {limit} KiB"}),
                content_type="application/json",
            ) from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            await self.audit(who, action, target, "refused: body is not JSON")
            raise web.HTTPBadRequest(
                text=json.dumps({"error": f"body: not JSON ({type(exc).__name__})"}),
                content_type="application/json",
            ) from None

    async def refuse(
        self, request: web.Request, action: str, target: str, status: int, message: str
    ) -> web.Response:
        refused = await self.actions.refuse(request[WHO], action, target, status, message)
        return error(refused.status, refused.message)
