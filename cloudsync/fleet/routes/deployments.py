"""Deployments: the models a selector's nodes should run, created and deleted by operators; the
runner reconciles the nodes towards them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from cloudsync.fleet.actions import WHO, db
from cloudsync.fleet.deployments import Deployments, Invalid, check
from cloudsync.fleet.routes.base import Calls, Route, error


class DeploymentRoutes:
    def __init__(
        self,
        deployments: Deployments,
        anchors: dict[str, Any] | None,
        clock: Callable[[], int],
        reconcile: Callable[[], None],
        calls: Calls,
    ) -> None:
        self.deployments, self.anchors, self.clock = deployments, anchors, clock
        self.reconcile, self.calls = reconcile, calls

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/deployments", self.index),
            Route("POST", "/v1/deployments", self.create, "operator"),
            Route("GET", "/v1/deployments/{id}", self.show),
            Route("DELETE", "/v1/deployments/{id}", self.delete, "operator"),
        ]

    async def index(self, request: web.Request) -> web.Response:
        found = await db(self.deployments.all)
        return web.json_response({"deployments": [d.as_dict() for d in found]})

    async def show(self, request: web.Request) -> web.Response:
        found = await db(self.deployments.get, request.match_info["id"])
        if found is None:
            return error(404, "no such deployment")
        doc = found.as_dict()
        doc["nodes"] = await db(self.deployments.progress, found)
        return web.json_response(doc)

    async def create(self, request: web.Request) -> web.Response:
        action = "create deployment"
        doc = await self.calls.body(request, action, "-")
        target = str(doc.get("id", "-"))[:64] if isinstance(doc, dict) else "-"
        try:
            dep = check(doc, self.anchors, self.clock())
        except Invalid as exc:
            return await self.calls.refuse(request, action, target, 422, str(exc))
        who = request[WHO]
        if not await db(self.deployments.create, dep, who.name):
            return await self.calls.refuse(
                request, action, dep.id, 409, f"deployment {dep.id} exists"
            )
        await self.calls.audit(
            who,
            action,
            dep.id,
            "done",
            {
                "selector": dep.selector,
                "priority": dep.priority,
                "versions": dep.as_dict()["versions"],
            },
        )
        self.reconcile()
        created = await db(self.deployments.get, dep.id)
        return web.json_response(created.as_dict(), status=201)

    async def delete(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        if not await db(self.deployments.delete, ident):
            return await self.calls.refuse(
                request, "delete deployment", ident, 404, "no such deployment"
            )
        await self.calls.audit(request[WHO], "delete deployment", ident, "done")
        self.reconcile()
        return web.json_response({"deleted": ident})
