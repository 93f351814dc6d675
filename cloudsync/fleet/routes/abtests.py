"""A/B tests of the cloud tier across the fleet: created, listed, one with its nodes' states,
stopped."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from cloudsync.fleet.abtests import ABTests
from cloudsync.fleet.abtests import check as check_ab_test
from cloudsync.fleet.actions import WHO, db
from cloudsync.fleet.commands import shown
from cloudsync.fleet.deployments import Invalid
from cloudsync.fleet.rollouts import Conflict
from cloudsync.fleet.routes.base import Calls, Route, error


class ABTestRoutes:
    def __init__(self, abtests: ABTests, wake: Callable[[], None], calls: Calls) -> None:
        self.abtests, self.wake, self.calls = abtests, wake, calls

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/ab-tests", self.index),
            Route("POST", "/v1/ab-tests", self.create, "operator"),
            Route("GET", "/v1/ab-tests/{id}", self.show, "viewer", ("nodes",)),
            Route("POST", "/v1/ab-tests/{id}/stop", self.stop, "operator"),
        ]

    async def index(self, request: web.Request) -> web.Response:
        found = await db(self.abtests.all)
        return web.json_response({"ab_tests": [t.as_dict() for t in found]})

    async def show(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        found = await db(self.abtests.get, ident)
        if found is None:
            return error(404, "no such A/B test")
        nodes = await db(self.abtests.nodes, ident)
        states: dict[str, int] = {}
        for row in nodes:
            states[row["state"]] = states.get(row["state"], 0) + 1
        doc = {**found.as_dict(), "nodes": states}
        if request.query.get("nodes") == "1":
            doc["node_states"] = [shown(row) for row in nodes]
        return web.json_response(doc)

    async def create(self, request: web.Request) -> web.Response:
        action = "create A/B test"
        doc = await self.calls.body(request, action, "-")
        target = str(doc.get("id", "-"))[:64] if isinstance(doc, dict) else "-"
        try:
            made = check_ab_test(doc)
        except Invalid as exc:
            return await self.calls.refuse(request, action, target, 422, str(exc))
        who = request[WHO]
        try:
            made = await db(self.abtests.create, made, who.name)
        except Conflict as exc:
            return await self.calls.refuse(request, action, made.id, 409, str(exc))
        await self.calls.audit(who, action, made.id, "done", made.split())
        self.wake()
        return web.json_response(made.as_dict(), status=201)

    async def stop(self, request: web.Request) -> web.Response:
        ident, who, action = request.match_info["id"], request[WHO], "stop A/B test"
        try:
            done = await db(self.abtests.stop, ident, who.name)
        except KeyError:
            return await self.calls.refuse(request, action, ident, 404, "no such A/B test")
        except Conflict as exc:
            return await self.calls.refuse(request, action, ident, 409, str(exc))
        await self.calls.audit(who, action, ident, "done")
        self.wake()
        return web.json_response(done.as_dict())
