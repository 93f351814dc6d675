"""The nodes: listed, one, its history and egress checkpoints, its operator labels; and every
node's series for Prometheus (``/v1/fleet/metrics``)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from cloudsync.fleet.actions import WHO, Actions, db
from cloudsync.fleet.exporter import MAX_SHARDS, NodeSeries
from cloudsync.fleet.registry import Registry
from cloudsync.fleet.routes.base import Calls, Route, error, page_size
from cloudsync.protocol.labels import LabelError, check_labels
from edged.common.digits import whole


class NodeRoutes:
    def __init__(
        self,
        registry: Registry,
        series: NodeSeries,
        fleet: str,
        clock: Callable[[], int],
        actions: Actions,
        calls: Calls,
    ) -> None:
        self.registry, self.series, self.fleet, self.clock = registry, series, fleet, clock
        self.actions, self.calls = actions, calls

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/fleet/metrics", self.fleet_metrics, "viewer", ("shard", "shards")),
            Route(
                "GET",
                "/v1/nodes",
                self.nodes,
                "viewer",
                ("state", "selector", "contains", "after", "limit"),
            ),
            Route("GET", "/v1/nodes/{node}", self.node),
            Route("GET", "/v1/nodes/{node}/history", self.history),
            Route(
                "GET",
                "/v1/nodes/{node}/egress-checkpoints",
                self.egress_checkpoints,
                "viewer",
                ("limit",),
            ),
            Route("PUT", "/v1/nodes/{node}/labels", self.labels, "operator"),
        ]

    async def fleet_metrics(self, request: web.Request) -> web.Response:
        """Every node's series (cloudsync.fleet.exporter), for Prometheus with the token of a
        viewer: ``authorization: {credentials: ...}`` and ``honor_labels: true``; with
        ``shard`` and ``shards``, the nodes of one shard (one scrape target each)."""
        shard = whole(request.query.get("shard", "0"), 3)
        shards = whole(request.query.get("shards", "1"), 3)
        if shard is None or shards is None or not shard < shards <= MAX_SHARDS:
            return error(400, f"shard: 0 to shards - 1; shards: 1 to {MAX_SHARDS}")
        body = await db(self.series.render, shard, shards)
        return web.Response(
            body=body,
            content_type="text/plain",
            charset="utf-8",
            headers={"Cache-Control": "no-store"},
        )

    async def nodes(self, request: web.Request) -> web.Response:
        q = request.query
        state = q.get("state")
        if state not in (None, "online", "offline", "stale", "unknown"):
            return error(400, "state: online, offline, stale or unknown")
        limit = page_size(request)
        items = [p for p in q.get("selector", "").split(",") if p]
        bad = next((p for p in items if "=" not in p), None)
        if bad is not None:
            return error(400, f"selector: {bad[:80]!r} is not k=v (k=v,k2=v2)")
        try:
            selector = check_labels(dict(p.split("=", 1) for p in items), "selector")
        except LabelError as exc:
            return error(400, str(exc))
        now = self.clock()
        page, after = await db(
            self.registry.nodes,
            now,
            state,
            selector,
            q.get("contains", ""),
            q.get("after", ""),
            limit,
        )
        counts = await db(self.registry.counts, now)
        return web.json_response({"nodes": page, "next": after, "counts": counts})

    async def node(self, request: web.Request) -> web.Response:
        row = await db(self.registry.node, request.match_info["node"], self.clock())
        if row is None:
            return error(404, "no such node")
        return web.json_response({"fleet": self.fleet, **row})

    async def history(self, request: web.Request) -> web.Response:
        rows = await db(self.registry.history, request.match_info["node"])
        return web.json_response({"history": rows})

    async def egress_checkpoints(self, request: web.Request) -> web.Response:
        limit = page_size(request)
        found = await db(self.registry.checkpoints, request.match_info["node"], limit)
        return web.json_response({"checkpoints": found})

    async def labels(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        doc = await self.calls.body(request, "set labels", node)
        if not isinstance(doc, dict) or set(doc) != {"labels"}:
            return await self.calls.refuse(
                request, "set labels", node, 422, 'body: {"labels": {label: value}}'
            )
        labels = await self.actions.set_labels(request[WHO], node, doc["labels"])
        return web.json_response({"node": node, "operator_labels": labels})
