"""Rollouts run by the service: created, listed, one with its nodes' states, and paused,
resumed, promoted or aborted (``Actions.act_on_rollout``, as the console does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from cloudsync.fleet.actions import WHO, Actions, db
from cloudsync.fleet.deployments import Invalid
from cloudsync.fleet.rollouts import Conflict, Rollout, Rollouts
from cloudsync.fleet.rollouts import check as check_rollout
from cloudsync.fleet.routes.base import Calls, Route, error


class RolloutRoutes:
    def __init__(
        self,
        rollouts: Rollouts,
        anchors: dict[str, Any] | None,
        clock: Callable[[], int],
        wake: Callable[[], None],
        actions: Actions,
        calls: Calls,
    ) -> None:
        self.rollouts, self.anchors, self.clock, self.wake = rollouts, anchors, clock, wake
        self.actions, self.calls = actions, calls

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/rollouts", self.index),
            Route("POST", "/v1/rollouts", self.create, "operator"),
            Route("GET", "/v1/rollouts/{id}", self.show, "viewer", ("nodes",)),
            Route("POST", "/v1/rollouts/{id}/{action}", self.act, "operator"),
        ]

    async def index(self, request: web.Request) -> web.Response:
        found = await db(self.rollouts.all)
        return web.json_response({"rollouts": [summary(r) for r in found]})

    async def show(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        found = await db(self.rollouts.get, ident)
        if found is None:
            return error(404, "no such rollout")
        nodes = await db(self.rollouts.nodes, ident)
        states: dict[str, int] = {}
        for row in nodes:
            states[row["state"]] = states.get(row["state"], 0) + 1
        doc = {
            **found.as_dict(),
            "nodes": states,
            "stage_sizes": [
                sum(1 for n in nodes if n["stage"] <= k) for k in range(len(found.stages))
            ],
        }
        if request.query.get("nodes") == "1":
            doc["node_states"] = nodes
        return web.json_response(doc)

    async def create(self, request: web.Request) -> web.Response:
        action = "create rollout"
        doc = await self.calls.body(request, action, "-")
        target = str(doc.get("id", "-"))[:64] if isinstance(doc, dict) else "-"
        try:
            made = check_rollout(doc, self.anchors, self.clock())
        except Invalid as exc:
            return await self.calls.refuse(request, action, target, 422, str(exc))
        who = request[WHO]
        try:
            made = await db(self.rollouts.create, made, who.name)
        except Conflict as exc:
            return await self.calls.refuse(request, action, made.id, 409, str(exc))
        await self.calls.audit(
            who,
            action,
            made.id,
            "done",
            {
                "model": made.model,
                "version": made.version,
                "stages": made.stages,
                "deployment": made.deployment,
                "selector": made.selector,
            },
        )
        self.wake()
        return web.json_response(summary(made), status=201)

    async def act(self, request: web.Request) -> web.Response:
        done = await self.actions.act_on_rollout(
            request[WHO], request.match_info["id"], request.match_info["action"]
        )
        return web.json_response(summary(done))


def summary(rollout: Rollout) -> dict[str, Any]:
    """A rollout without its manifest (the API's lists)."""
    doc = rollout.as_dict()
    doc.pop("entry")
    return doc
