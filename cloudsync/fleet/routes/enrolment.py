"""New devices' certificates: the requests and an operator's decision, one-time tokens,
revocations (the broker's CRL and ACL written again, an open session taken over) and
reinstatements."""

from __future__ import annotations

import re
from collections.abc import Callable

from aiohttp import web

from cloudsync.fleet.actions import WHO, db
from cloudsync.fleet.enrolment import MAX_TOKEN_S, Decision, Enrolments
from cloudsync.fleet.routes.base import Calls, Route, error, page_size
from cloudsync.protocol.enrol import EnrolError
from cloudsync.protocol.topics import NAME, TopicError, check_name

SERIAL = re.compile(r"^[0-9a-f]{1,40}\Z")  # a certificate's serial number, hex


class EnrolmentRoutes:
    def __init__(
        self,
        enrolments: Enrolments,
        clock: Callable[[], int],
        answer: Callable[[Decision], bool],
        write_broker_files: Callable[[], list[str]],
        kick: Callable[[str], None],
        calls: Calls,
    ) -> None:
        self.enrolments, self.clock, self.answer = enrolments, clock, answer
        self.write_broker_files, self.kick, self.calls = write_broker_files, kick, calls

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/enrolments", self.index, "operator", ("state", "limit")),
            Route("POST", "/v1/enrolments/{id}/{action}", self.decide, "operator"),
            Route("POST", "/v1/enrolment-tokens", self.make_token, "operator"),
            Route("GET", "/v1/revocations", self.revocations, "operator"),
            Route("POST", "/v1/revocations", self.revoke, "operator"),
            Route("DELETE", "/v1/revocations/{node}", self.reinstate, "operator"),
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
        if decision not in ("approve", "refuse"):
            return await self.calls.refuse(
                request, f"{decision[:32]} enrolment", rid, 404, "a decision: approve or refuse"
            )
        action = f"{decision} enrolment"
        if self.enrolments.issuer is None:
            why = "no [enrolment] ca_cert and ca_key: nothing can be issued"
            return await self.calls.refuse(request, action, rid, 409, why)
        who = request[WHO]
        done = await db(self.enrolments.decide, rid, decision == "approve", who.name, self.clock())
        if done is None:
            return await self.calls.refuse(request, action, rid, 404, "no such request pending")
        self.answer(done)
        await self.calls.audit(who, action, rid, "done")
        return web.json_response({"rid": rid, "state": done.answer.state})

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
        node, action = request.match_info["node"], "reinstate node"
        if not NAME.match(node):
            return await self.calls.refuse(
                request, action, node[:64], 404, "node: not a node's name"
            )
        if not await db(self.enrolments.reinstate, node):
            return await self.calls.refuse(request, action, node, 404, "node: not revoked")
        unwritten = await db(self.write_broker_files)  # each file tried; never raises
        await self.calls.audit(request[WHO], action, node, "done", {"unwritten": unwritten})
        return web.json_response({"node": node, "barred": False, "unwritten": unwritten})

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
        if self.enrolments.issuer is None:
            why = "no [enrolment] ca_cert and ca_key: no CRL can be signed"
            return await self.calls.refuse(request, action, target, 409, why)
        who = request[WHO]
        done = await db(
            self.enrolments.revoke, who.name, self.clock(), doc.get("node"), doc.get("serial")
        )
        unwritten = await db(self.write_broker_files)  # each file tried; never raises
        if doc.get("node"):  # an open session goes at once (the service takes it over)
            self.kick(doc["node"])
        await self.calls.audit(
            who, action, target, "done", {"serials": done, "unwritten": unwritten}
        )
        return web.json_response({"revoked": done, "unwritten": unwritten})
