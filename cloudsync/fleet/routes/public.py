"""``/healthz``, ``/metrics`` and ``/v1/openapi.json``: asked without a token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from cloudsync.fleet.actions import db
from cloudsync.fleet.routes.base import Route

OPENAPI = Path(__file__).parent.with_name("openapi.json")  # package data; docs/fleet-api.json
PUBLIC = frozenset({"/healthz", "/metrics", "/v1/openapi.json"})


class PublicRoutes:
    def __init__(
        self,
        ping: Callable[[], None],
        broker: Callable[[], bool],
        runner: Callable[[], bool],
        replica: str,
        metrics: CollectorRegistry,
    ) -> None:
        self.ping, self.broker, self.runner, self.replica = ping, broker, runner, replica
        self.metrics_registry = metrics

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/healthz", self.healthz),
            Route("GET", "/metrics", self.metrics),
            Route("GET", "/v1/openapi.json", self.openapi),
        ]

    async def healthz(self, request: web.Request) -> web.Response:
        try:
            await db(self.ping)
            database = True
        except Exception:  # health says it, does not raise
            database = False
        broker = self.broker()
        ok = database and broker
        return web.json_response(
            {
                "ok": ok,
                "database": database,
                "broker": broker,
                "runner": self.runner(),
                "replica": self.replica,
            },
            status=200 if ok else 503,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics_registry), content_type="text/plain")

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=OPENAPI.read_bytes(), content_type="application/json")
