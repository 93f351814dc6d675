"""New devices' certificates: the requests and an operator's decision, one-time tokens,
revocations (the broker's CRL and ACL written again, an open session taken over) and
reinstatements."""

from __future__ import annotations

import re

from aiohttp import web

from cloudsync.fleet.actions import WHO, EnrolmentActions, db
from cloudsync.fleet.enrolment import MAX_TOKEN_S, Enrolments
from cloudsync.fleet.routes.base import Calls, Route, error, page_size
from cloudsync.protocol.enrol import EnrolError
from cloudsync.protocol.topics import NAME, TopicError, check_name

SERIAL = re.compile(r"^[0-9a-f]{1,40}\Z")  # a certificate's serial number, hex


class EnrolmentRoutes:
    def __init__(self, enrolments: Enrolments, acts: EnrolmentActions, calls: Calls) -> None:
        self.enrolments, self.acts, self.calls = enrolments, acts, calls
        self.clock = acts.clock

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/enrolments", self.index, "operator", ("state", "limit")),
            Route("POST", "/v1/enrolments/{id}/{action}", self.decide, "operator"),
            Route("POST", "/v1/enrolment-tokens", self.make_token, "operator"),
            Route("GET", "/v1/revocations", self.revocations, "operator"),
            # cutting a device off the fleet, and letting it back: an admin's (docs/SECURITY.md)
            Route("POST", "/v1/revocations", self.revoke, "admin"),
            Route("DELETE", "/v1/revocations/{node}", self.reinstate, "admin"),
        ]

    async def index(self, request: web.Request) -> web.Response:
        state = request.query.get("state")
        if state not in (None, "pending", "issued", "refused"):
            return error(400, "state: pending, issued or refused")
        limit = page_size(request)
        rows = await db(self.enrolments.list, state, limit)
        return web.json_response({"enrolments": rows})

    async def decide(self, request: web.Request) -> web.Response:
        rid, decision = request.match_info["id"], request.match_info["action"]
        state = await self.acts.decide(request[WHO], rid, decision)
        return web.json_response({"rid": rid, "state": state})

    async def make_token(self, request: web.Request) -> web.Response:
        action = "create enrolment token"
        doc = await self.calls.body(request, action, "-")
        node = doc.get("node") if isinstance(doc, dict) else None
        target = str(node)[:64] if node else "-"
        ttl = doc.get("ttl_s", 86400) if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or set(doc) - {"node", "ttl_s"}:
            return await self.calls.refuse(
                request, action, target, 422, 'body: {"node": name, "ttl_s": seconds}'
            )
        try:
            check_name("node", node)  # type: ignore[arg-type]
        except TopicError as exc:
            return await self.calls.refuse(request, action, target, 422, f"node: {exc}")
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, (int, float))
            or not (60 <= ttl <= MAX_TOKEN_S)
        ):
            return await self.calls.refuse(
                request, action, target, 422, f"ttl_s: 60 to {MAX_TOKEN_S} seconds"
            )
        who, now = request[WHO], self.clock()
        try:
            token = await db(self.enrolments.make_token, node, float(ttl), who.name, now)
        except EnrolError as exc:  # a reserved name, a revoked node
            return await self.calls.refuse(request, action, target, 409, str(exc))
        await self.calls.audit(who, action, str(node), "done", {"ttl_s": ttl})
        return web.json_response(
            {"token": token, "node": node, "expires_ms": now + int(ttl * 1000)}, status=201
        )

    async def revocations(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "revoked": await db(self.enrolments.revoked),
                "barred": await db(self.enrolments.barred),
            }
        )

    async def reinstate(self, request: web.Request) -> web.Response:
        """Lift the bar a revocation by name put on a node's name: it may enrol again."""
        return web.json_response(
            await self.acts.reinstate(request[WHO], request.match_info["node"])
        )

    async def revoke(self, request: web.Request) -> web.Response:
        """Revoke a node's certificates (``{"node"}``) or one (``{"serial"}``, hex): into the
        CRL at once (the broker refuses them from its next reload)."""
        action = "revoke certificate"
        doc = await self.calls.body(request, action, "-")
        ok = (
            isinstance(doc, dict)
            and len(doc) == 1
            and (
                (isinstance(doc.get("node"), str) and NAME.match(doc["node"]))
                or (isinstance(doc.get("serial"), str) and SERIAL.match(doc["serial"]))
            )
        )
        target = str(next(iter(doc.values())))[:64] if isinstance(doc, dict) and doc else "-"
        if not ok:
            return await self.calls.refuse(
                request, action, target, 422, 'body: {"node": name} or {"serial": hex}'
            )
        done = await self.acts.revoke(request[WHO], doc.get("node"), doc.get("serial"), target)
        return web.json_response(done)
