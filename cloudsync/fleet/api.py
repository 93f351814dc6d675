"""The fleet service's HTTP API: JSON over HTTP(S), described by docs/fleet-api.json (OpenAPI
3.1; ``GET /v1/openapi.json`` serves it).

Every call but ``/healthz``, ``/metrics`` and ``/v1/openapi.json`` carries
``Authorization: Bearer <token>``: the token's SHA-256 is looked up in ``[api] tokens`` (the
service never keeps a token itself), which gives the caller's name and role:

- **viewer** reads: nodes, their history, deployments, rollouts, commands and their results;
- **operator** also acts: sets labels, creates and deletes deployments, creates rollouts and
  pauses, resumes, promotes or aborts them, relays commands it signed itself, reads the audit
  log;
- **admin** may do everything.

No token, or an unknown one: 401. A role too low: 403, naming the role needed. Every action
(each call that changes something, and each one refused for its role or its body) goes into the
audit log with the caller, the target and the outcome. A body is at most ``[api] max_body_kb``
(413), must be JSON (400) and its fields are checked before anything is done (422 naming the
field); a query parameter an operation does not take is a 400 naming it. The database is called
from a thread pool, never from the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiohttp import web

from cloudsync.fleet.actions import ROLES, WHO, Actions, Refused
from cloudsync.fleet.config import Token
from cloudsync.fleet.routes.base import Handler, Route, error
from cloudsync.fleet.routes.public import OPENAPI, PUBLIC

__all__ = ["CONSOLE", "OPENAPI", "PUBLIC", "app"]

log = logging.getLogger("edgefleet.api")
CONSOLE = "/console"  # cloudsync.fleet.console: its own session (a cookie) and checks


class Guard:
    """The API's middleware: the caller from its bearer token, the route's role and query
    parameters checked, a refusal or a failure answered as JSON."""

    def __init__(self, actions: Actions) -> None:
        self.actions = actions

    def caller(self, request: web.Request) -> Token | None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        return self.actions.holder(token)

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC or request.path.startswith(CONSOLE):
            return await handler(request)  # the console checks its own cookie
        who = self.caller(request)
        if who is None:
            return error(401, "Authorization: Bearer <token> (an [api] tokens entry)")
        request[WHO] = who
        need = getattr(handler, "role", "viewer")  # unrouted: 404 or 405 follows
        unknown = set(request.query) - getattr(handler, "query", set(request.query))
        if unknown:
            return error(400, f"query: no parameter {sorted(unknown)[0]!r} here")
        if ROLES[who.role] < ROLES[need]:
            if request.method != "GET":
                await self.actions.audit(
                    who,
                    f"{request.method} {request.path}",
                    request.match_info.get("id", request.path),
                    f"denied: {need}",
                )
            return error(403, f"role {who.role} may not do this: {need} needed")
        try:
            return await handler(request)
        except Refused as exc:  # audited where it was refused
            return error(exc.status, exc.message)
        except web.HTTPException:
            raise
        except Exception:  # one call's failure is a 500, the service goes on
            log.exception("%s %s", request.method, request.path)
            return error(500, "internal error (the service's log says more)")


def app(routes: Iterable[Route], actions: Actions, max_body_kb: int) -> web.Application:
    """The API's app: ``routes`` (the route modules' tables) behind the guard."""
    application = web.Application(
        middlewares=[Guard(actions).guard], client_max_size=max_body_kb * 1024
    )
    application.on_response_prepare.append(no_sniff)
    for route in routes:
        application.router.add_route(route.method, route.path, _with_role(route))
    return application


async def no_sniff(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer, errors included, is what its Content-Type says: a browser must not guess
    (a JSON error echoing a caller's text read as HTML)."""
    response.headers["X-Content-Type-Options"] = "nosniff"


def _with_role(route: Route) -> Handler:
    """The route's handler with the role it needs and the query parameters it takes."""
    handler = route.handler

    async def call(request: web.Request) -> web.StreamResponse:
        return await handler(request)

    call.role = route.role  # type: ignore[attr-defined]
    call.query = set(route.query)  # type: ignore[attr-defined]
    return call
