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

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from cloudsync.fleet.abtests import check as check_ab_test
from cloudsync.fleet.actions import ROLES, WHO, Actions, Refused, db
from cloudsync.fleet.commands import shown
from cloudsync.fleet.config import Token
from cloudsync.fleet.deployments import Invalid, check
from cloudsync.fleet.enrolment import MAX_TOKEN_S
from cloudsync.fleet.exporter import MAX_SHARDS
from cloudsync.fleet.registry import MAX_INT, MAX_PAGE
from cloudsync.fleet.rollouts import Conflict, Rollout
from cloudsync.fleet.rollouts import check as check_rollout
from cloudsync.fleet.service import Service
from cloudsync.protocol import envelope
from cloudsync.protocol.commands import load_anchors, load_scopes
from cloudsync.protocol.enrol import EnrolError
from cloudsync.protocol.labels import LabelError, check_labels
from cloudsync.protocol.topics import CMD_ID, NAME, TopicError, check_name

log = logging.getLogger("edgefleet.api")
OPENAPI = Path(__file__).with_name("openapi.json")  # package data; docs/fleet-api.json links it
PUBLIC = {"/healthz", "/metrics", "/v1/openapi.json"}
CONSOLE = "/console"  # cloudsync.fleet.console: its own session (a cookie) and checks
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERIAL = re.compile(r"^[0-9a-f]{1,40}\Z")  # a certificate's serial number, hex


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Api:
    def __init__(self, service: Service, actions: Actions) -> None:
        self.service, self.actions = service, actions
        trust = service.config.service.trust_dir
        self.anchors: dict[str, Any] | None = None
        if trust is not None:  # the keys that may sign manifests, as nodes count them
            scoped = load_scopes(trust)
            self.anchors = {k: v for k, v in load_anchors(trust).items() if k not in scoped}

    # ---- who calls -------------------------------------------------------------------------

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
                await self.actions.audit(who, f"{request.method} {request.path}",
                                         request.match_info.get("id", request.path),
                                         f"denied: {need}")  # fmt: skip
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

    async def body(self, request: web.Request, action: str, target: str) -> Any:
        """The JSON body, or a 400/413 raised (and audited)."""
        who = request[WHO]
        timeout_s = self.service.config.api.idle_timeout_s
        try:
            raw = await asyncio.wait_for(request.read(), timeout_s)
        except asyncio.TimeoutError:
            await self.actions.audit(who, action, target, "refused: body too slow")
            raise web.HTTPRequestTimeout(
                text=json.dumps(
                    {"error": f"body: not all there within {timeout_s:g} s (api.idle_timeout_s)"}
                ),
                content_type="application/json",
            ) from None
        except web.HTTPRequestEntityTooLarge:
            await self.actions.audit(who, action, target, "refused: body too large")
            limit = self.service.config.api.max_body_kb
            raise web.HTTPRequestEntityTooLarge(
                max_size=limit * 1024,
                actual_size=request.content_length or 0,
                text=json.dumps({"error": f"body: more than {limit} KiB"}),
                content_type="application/json",
            ) from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            await self.actions.audit(who, action, target, "refused: body is not JSON")
            raise web.HTTPBadRequest(
                text=json.dumps({"error": f"body: not JSON ({type(exc).__name__})"}),
                content_type="application/json",
            ) from None

    async def refuse(self, request: web.Request, action: str, target: str,
                     status: int, message: str) -> web.Response:  # fmt: skip
        refused = await self.actions.refuse(request[WHO], action, target, status, message)
        return error(refused.status, refused.message)

    # ---- public ----------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        try:
            await db(self.service.store.ping)
            database = True
        except Exception:  # health says it, does not raise
            database = False
        ok = database and self.service.client.is_connected()
        return web.json_response(
            {"ok": ok, "database": database, "broker": self.service.client.is_connected(),
             "runner": self.service.holds_lease, "replica": self.service.replica},
            status=200 if ok else 503,
        )  # fmt: skip

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.service.metrics.registry),
                            content_type="text/plain")  # fmt: skip

    async def fleet_metrics(self, request: web.Request) -> web.Response:
        """Every node's series (cloudsync.fleet.exporter), for Prometheus with the token of a
        viewer: ``authorization: {credentials: ...}`` and ``honor_labels: true``; with
        ``shard`` and ``shards``, the nodes of one shard (one scrape target each)."""
        shard, shards = request.query.get("shard", "0"), request.query.get("shards", "1")
        numbers = all(x.isdigit() and len(x) <= 3 for x in (shard, shards))
        if not (numbers and int(shard) < int(shards) <= MAX_SHARDS):
            return error(400, f"shard: 0 to shards - 1; shards: 1 to {MAX_SHARDS}")
        body = await db(self.service.series.render, int(shard), int(shards))
        return web.Response(body=body, content_type="text/plain", charset="utf-8",
                            headers={"Cache-Control": "no-store"})  # fmt: skip

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=OPENAPI.read_bytes(), content_type="application/json")

    # ---- nodes -----------------------------------------------------------------------------

    async def nodes(self, request: web.Request) -> web.Response:
        q = request.query
        state = q.get("state")
        if state not in (None, "online", "offline", "stale", "unknown"):
            return error(400, "state: online, offline, stale or unknown")
        limit = page_size(q.get("limit", "100"))
        if limit is None:
            return error(400, f"limit: 1 to {MAX_PAGE}")
        try:
            selector = check_labels(
                dict(p.split("=", 1) for p in q.get("selector", "").split(",") if p), "selector"
            )
        except (ValueError, LabelError) as exc:
            return error(400, f"selector: k=v,k2=v2 ({exc})")
        now = self.service.clock()
        page, after = await db(
            self.service.registry.nodes, now, state, selector, q.get("contains", ""),
            q.get("after", ""), limit,
        )  # fmt: skip
        counts = await db(self.service.registry.counts, now)
        return web.json_response({"nodes": page, "next": after, "counts": counts})

    async def node(self, request: web.Request) -> web.Response:
        row = await db(self.service.registry.node, request.match_info["node"],
                            self.service.clock())  # fmt: skip
        if row is None:
            return error(404, "no such node")
        return web.json_response({"fleet": self.service.config.service.fleet, **row})

    async def history(self, request: web.Request) -> web.Response:
        rows = await db(self.service.registry.history, request.match_info["node"])
        return web.json_response({"history": rows})

    async def egress_checkpoints(self, request: web.Request) -> web.Response:
        limit = page_size(request.query.get("limit", "100"))
        if limit is None:
            return error(400, f"limit: 1 to {MAX_PAGE}")
        found = await db(self.service.registry.checkpoints, request.match_info["node"],
                              limit)  # fmt: skip
        return web.json_response({"checkpoints": found})

    async def labels(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        doc = await self.body(request, "set labels", node)
        if not isinstance(doc, dict) or set(doc) != {"labels"}:
            return await self.refuse(request, "set labels", node, 422,
                                     'body: {"labels": {label: value}}')  # fmt: skip
        labels = await self.actions.set_labels(request[WHO], node, doc["labels"])
        return web.json_response({"node": node, "operator_labels": labels})

    # ---- deployments -----------------------------------------------------------------------

    async def deployments(self, request: web.Request) -> web.Response:
        found = await db(self.service.deployments.all)
        return web.json_response({"deployments": [d.as_dict() for d in found]})

    async def deployment(self, request: web.Request) -> web.Response:
        found = await db(self.service.deployments.get, request.match_info["id"])
        if found is None:
            return error(404, "no such deployment")
        doc = found.as_dict()
        doc["nodes"] = await db(self.service.deployments.progress, found)
        return web.json_response(doc)

    async def create_deployment(self, request: web.Request) -> web.Response:
        doc = await self.body(request, "create deployment", "-")
        target = str(doc.get("id", "-"))[:64] if isinstance(doc, dict) else "-"
        try:
            dep = check(doc, self.anchors, self.service.clock())
        except Invalid as exc:
            return await self.refuse(request, "create deployment", target, 422, str(exc))
        who = request[WHO]
        if not await db(self.service.deployments.create, dep, who.name):
            return await self.refuse(request, "create deployment", dep.id, 409,
                                     f"deployment {dep.id} exists")  # fmt: skip
        await self.actions.audit(who, "create deployment", dep.id, "done",
                      {"selector": dep.selector, "priority": dep.priority,
                       "versions": dep.as_dict()["versions"]})  # fmt: skip
        self.service.reconcile_soon()
        created = await db(self.service.deployments.get, dep.id)
        return web.json_response(created.as_dict(), status=201)

    async def delete_deployment(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        if not await db(self.service.deployments.delete, ident):
            return await self.refuse(request, "delete deployment", ident, 404,
                                     "no such deployment")  # fmt: skip
        await self.actions.audit(request[WHO], "delete deployment", ident, "done")
        self.service.reconcile_soon()
        return web.json_response({"deleted": ident})

    # ---- commands --------------------------------------------------------------------------

    async def send_command(self, request: web.Request) -> web.Response:
        """Relays a command an operator signed (the service signs none of these: docs/
        SECURITY.md): checked for form, target and time, published, its result kept."""
        node = request.match_info["node"]
        action = "send command"
        doc = await self.body(request, action, node)
        try:
            command = relayed(doc, f"{self.service.fleet}/{node}", self.service.clock())
        except ValueError as exc:
            return await self.refuse(request, action, node, 422, str(exc))
        who = request[WHO]
        try:
            await db(self.service.commands.keep, command, node, who.name)
        except KeyError as exc:
            return await self.refuse(request, action, node, 409, str(exc))
        if not self.service.send_command(node, command["id"], command["payload"]):
            return await self.refuse(request, action, node, 503, "the broker is not connected")
        detail = {k: command[k] for k in ("id", "name", "issuer", "kid")}
        await self.actions.audit(who, f"command {command['name']}", node, "sent", detail)
        return web.json_response({**detail, "node": node, "state": "sent"}, status=202)

    async def command(self, request: web.Request) -> web.Response:
        found = await db(self.service.commands.get, request.match_info["id"])
        return error(404, "no such command") if found is None else web.json_response(found)

    async def node_commands(self, request: web.Request) -> web.Response:
        limit = page_size(request.query.get("limit", "100"))
        if limit is None:
            return error(400, f"limit: 1 to {MAX_PAGE}")
        found = await db(self.service.commands.of_node, request.match_info["node"], limit)
        return web.json_response({"commands": found})

    # ---- rollouts --------------------------------------------------------------------------

    async def rollouts(self, request: web.Request) -> web.Response:
        found = await db(self.service.rollouts.all)
        return web.json_response({"rollouts": [summary(r) for r in found]})

    async def rollout(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        found = await db(self.service.rollouts.get, ident)
        if found is None:
            return error(404, "no such rollout")
        nodes = await db(self.service.rollouts.nodes, ident)
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

    async def create_rollout(self, request: web.Request) -> web.Response:
        action = "create rollout"
        doc = await self.body(request, action, "-")
        target = str(doc.get("id", "-"))[:64] if isinstance(doc, dict) else "-"
        try:
            made = check_rollout(doc, self.anchors, self.service.clock())
        except Invalid as exc:
            return await self.refuse(request, action, target, 422, str(exc))
        who = request[WHO]
        try:
            made = await db(self.service.rollouts.create, made, who.name)
        except Conflict as exc:
            return await self.refuse(request, action, made.id, 409, str(exc))
        await self.actions.audit(who, action, made.id, "done", {
            "model": made.model, "version": made.version, "stages": made.stages,
            "deployment": made.deployment, "selector": made.selector})  # fmt: skip
        self.service.wake.set()
        return web.json_response(summary(made), status=201)

    async def act_on_rollout(self, request: web.Request) -> web.Response:
        done = await self.actions.act_on_rollout(request[WHO], request.match_info["id"],
                                                 request.match_info["action"])  # fmt: skip
        return web.json_response(summary(done))

    # ---- A/B tests --------------------------------------------------------------------------

    async def ab_tests(self, request: web.Request) -> web.Response:
        found = await db(self.service.abtests.all)
        return web.json_response({"ab_tests": [t.as_dict() for t in found]})

    async def ab_test(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        found = await db(self.service.abtests.get, ident)
        if found is None:
            return error(404, "no such A/B test")
        nodes = await db(self.service.abtests.nodes, ident)
        states: dict[str, int] = {}
        for row in nodes:
            states[row["state"]] = states.get(row["state"], 0) + 1
        doc = {**found.as_dict(), "nodes": states}
        if request.query.get("nodes") == "1":
            doc["node_states"] = [shown(row) for row in nodes]
        return web.json_response(doc)

    async def create_ab_test(self, request: web.Request) -> web.Response:
        action = "create A/B test"
        doc = await self.body(request, action, "-")
        target = str(doc.get("id", "-"))[:64] if isinstance(doc, dict) else "-"
        try:
            made = check_ab_test(doc)
        except Invalid as exc:
            return await self.refuse(request, action, target, 422, str(exc))
        who = request[WHO]
        try:
            made = await db(self.service.abtests.create, made, who.name)
        except Conflict as exc:
            return await self.refuse(request, action, made.id, 409, str(exc))
        await self.actions.audit(who, action, made.id, "done", made.split())
        self.service.wake.set()
        return web.json_response(made.as_dict(), status=201)

    async def stop_ab_test(self, request: web.Request) -> web.Response:
        ident, who = request.match_info["id"], request[WHO]
        try:
            done = await db(self.service.abtests.stop, ident, who.name)
        except KeyError:
            return await self.refuse(request, "stop A/B test", ident, 404, "no such A/B test")
        except Conflict as exc:
            return await self.refuse(request, "stop A/B test", ident, 409, str(exc))
        await self.actions.audit(who, "stop A/B test", ident, "done")
        self.service.wake.set()
        return web.json_response(done.as_dict())

    # ---- enrolment -------------------------------------------------------------------------

    async def enrolments(self, request: web.Request) -> web.Response:
        state = request.query.get("state")
        if state not in (None, "pending", "issued", "refused"):
            return error(400, "state: pending, issued or refused")
        limit = page_size(request.query.get("limit", "100"))
        if limit is None:
            return error(400, f"limit: 1 to {MAX_PAGE}")
        rows = await db(self.service.enrolments.list, state, limit)
        return web.json_response({"enrolments": rows})

    async def decide_enrolment(self, request: web.Request) -> web.Response:
        rid, decision = request.match_info["id"], request.match_info["action"]
        if decision not in ("approve", "refuse"):
            return await self.refuse(request, f"{decision[:32]} enrolment", rid, 404,
                                     "a decision: approve or refuse")  # fmt: skip
        action = f"{decision} enrolment"
        if self.service.enrolments.issuer is None:
            why = "no [enrolment] ca_cert and ca_key: nothing can be issued"
            return await self.refuse(request, action, rid, 409, why)
        who = request[WHO]
        done = await db(self.service.enrolments.decide, rid, decision == "approve",
                             who.name, self.service.clock())  # fmt: skip
        if done is None:
            return await self.refuse(request, action, rid, 404, "no such request pending")
        self.service.answer(done)
        await self.actions.audit(who, action, rid, "done")
        return web.json_response({"rid": rid, "state": done.answer.state})

    async def create_enrolment_token(self, request: web.Request) -> web.Response:
        action = "create enrolment token"
        doc = await self.body(request, action, "-")
        node = doc.get("node") if isinstance(doc, dict) else None
        target = str(node)[:64] if node else "-"
        ttl = doc.get("ttl_s", 86400) if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or set(doc) - {"node", "ttl_s"}:
            return await self.refuse(request, action, target, 422,
                                     'body: {"node": name, "ttl_s": seconds}')  # fmt: skip
        try:
            check_name("node", node)  # type: ignore[arg-type]
        except TopicError as exc:
            return await self.refuse(request, action, target, 422, f"node: {exc}")
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, (int, float))
            or not (60 <= ttl <= MAX_TOKEN_S)
        ):
            return await self.refuse(request, action, target, 422,
                                     f"ttl_s: 60 to {MAX_TOKEN_S} seconds")  # fmt: skip
        who, now = request[WHO], self.service.clock()
        try:
            token = await db(self.service.enrolments.make_token, node, float(ttl),
                                  who.name, now)  # fmt: skip
        except EnrolError as exc:  # a reserved name, a revoked node
            return await self.refuse(request, action, target, 409, str(exc))
        await self.actions.audit(who, action, str(node), "done", {"ttl_s": ttl})
        return web.json_response(
            {"token": token, "node": node, "expires_ms": now + int(ttl * 1000)}, status=201
        )

    async def revocations(self, request: web.Request) -> web.Response:
        enrolments = self.service.enrolments
        return web.json_response({"revoked": await db(enrolments.revoked),
                                  "barred": await db(enrolments.barred)})  # fmt: skip

    async def reinstate(self, request: web.Request) -> web.Response:
        """Lift the bar a revocation by name put on a node's name: it may enrol again."""
        node, action = request.match_info["node"], "reinstate node"
        if not NAME.match(node):
            return await self.refuse(request, action, node[:64], 404, "node: not a node's name")
        if not await db(self.service.enrolments.reinstate, node):
            return await self.refuse(request, action, node, 404, "node: not revoked")
        unwritten = await db(self.service.write_broker_files)
        await self.actions.audit(request[WHO], action, node, "done", {"unwritten": unwritten})
        return web.json_response({"node": node, "barred": False, "unwritten": unwritten})

    async def revoke(self, request: web.Request) -> web.Response:
        """Revoke a node's certificates (``{"node"}``) or one (``{"serial"}``, hex): into the
        CRL at once (the broker refuses them from its next reload)."""
        action = "revoke certificate"
        doc = await self.body(request, action, "-")
        ok = isinstance(doc, dict) and len(doc) == 1 and (
            (isinstance(doc.get("node"), str) and NAME.match(doc["node"]))
            or (isinstance(doc.get("serial"), str) and SERIAL.match(doc["serial"]))
        )  # fmt: skip
        target = str(next(iter(doc.values())))[:64] if isinstance(doc, dict) and doc else "-"
        if not ok:
            return await self.refuse(request, action, target, 422,
                                     'body: {"node": name} or {"serial": hex}')  # fmt: skip
        if self.service.enrolments.issuer is None:
            why = "no [enrolment] ca_cert and ca_key: no CRL can be signed"
            return await self.refuse(request, action, target, 409, why)
        who = request[WHO]
        done = await db(self.service.enrolments.revoke, who.name, self.service.clock(),
                             doc.get("node"), doc.get("serial"))  # fmt: skip
        unwritten = await db(self.service.write_broker_files)  # each file tried; never raises
        if doc.get("node"):  # an open session goes at once (the service takes it over)
            self.service.kick(doc["node"])
        await self.actions.audit(who, action, target, "done",
                                 {"serials": done, "unwritten": unwritten})  # fmt: skip
        return web.json_response({"revoked": done, "unwritten": unwritten})

    # ---- audit -----------------------------------------------------------------------------

    async def audit_log(self, request: web.Request) -> web.Response:
        limit = page_size(request.query.get("limit", "100"))
        after = request.query.get("after", "0")
        if limit is None or not after.isdigit() or int(after) >= MAX_INT:
            return error(400, f"after: an entry's id; limit: 1 to {MAX_PAGE}")
        rows = await db(self.service.audit.after, int(after), limit)
        return web.json_response(
            {"entries": rows, "next": rows[-1]["id"] if len(rows) == limit else None}
        )

    # ---- the app ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        limit = self.service.config.api.max_body_kb * 1024
        app = web.Application(middlewares=[self.guard], client_max_size=limit)
        app.on_response_prepare.append(no_sniff)
        routes = [
            ("GET", "/healthz", self.healthz, "viewer", ()),
            ("GET", "/metrics", self.metrics, "viewer", ()),
            ("GET", "/v1/fleet/metrics", self.fleet_metrics, "viewer", ("shard", "shards")),
            ("GET", "/v1/openapi.json", self.openapi, "viewer", ()),
            ("GET", "/v1/nodes", self.nodes, "viewer",
             ("state", "selector", "contains", "after", "limit")),
            ("GET", "/v1/nodes/{node}", self.node, "viewer", ()),
            ("GET", "/v1/nodes/{node}/history", self.history, "viewer", ()),
            ("GET", "/v1/nodes/{node}/egress-checkpoints", self.egress_checkpoints, "viewer",
             ("limit",)),
            ("PUT", "/v1/nodes/{node}/labels", self.labels, "operator", ()),
            ("POST", "/v1/nodes/{node}/commands", self.send_command, "operator", ()),
            ("GET", "/v1/nodes/{node}/commands", self.node_commands, "viewer", ("limit",)),
            ("GET", "/v1/commands/{id}", self.command, "viewer", ()),
            ("GET", "/v1/deployments", self.deployments, "viewer", ()),
            ("POST", "/v1/deployments", self.create_deployment, "operator", ()),
            ("GET", "/v1/deployments/{id}", self.deployment, "viewer", ()),
            ("DELETE", "/v1/deployments/{id}", self.delete_deployment, "operator", ()),
            ("GET", "/v1/rollouts", self.rollouts, "viewer", ()),
            ("POST", "/v1/rollouts", self.create_rollout, "operator", ()),
            ("GET", "/v1/rollouts/{id}", self.rollout, "viewer", ("nodes",)),
            ("POST", "/v1/rollouts/{id}/{action}", self.act_on_rollout, "operator", ()),
            ("GET", "/v1/ab-tests", self.ab_tests, "viewer", ()),
            ("POST", "/v1/ab-tests", self.create_ab_test, "operator", ()),
            ("GET", "/v1/ab-tests/{id}", self.ab_test, "viewer", ("nodes",)),
            ("POST", "/v1/ab-tests/{id}/stop", self.stop_ab_test, "operator", ()),
            ("GET", "/v1/audit", self.audit_log, "operator", ("after", "limit")),
            ("GET", "/v1/enrolments", self.enrolments, "operator", ("state", "limit")),
            ("POST", "/v1/enrolments/{id}/{action}", self.decide_enrolment, "operator", ()),
            ("POST", "/v1/enrolment-tokens", self.create_enrolment_token, "operator", ()),
            ("GET", "/v1/revocations", self.revocations, "operator", ()),
            ("POST", "/v1/revocations", self.revoke, "operator", ()),
            ("DELETE", "/v1/revocations/{node}", self.reinstate, "operator", ()),
        ]  # fmt: skip
        for method, path, handler, role, query in routes:
            app.router.add_route(method, path, _with_role(handler, role, query))
        return app


async def no_sniff(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer, errors included, is what its Content-Type says: a browser must not guess
    (a JSON error echoing a caller's text read as HTML)."""
    response.headers["X-Content-Type-Options"] = "nosniff"


def relayed(doc: Any, target: str, now_ms: int) -> dict[str, Any]:
    """A signed command to relay, from ``{"command": <its envelope>}``: its id, name, issuer,
    kid and the bytes to publish (ValueError naming what is wrong). The node verifies the
    signature, the nonce and the lifetime; here its form, its target and its expiry."""
    if not isinstance(doc, dict) or set(doc) != {"command"} or not isinstance(doc["command"], dict):
        raise ValueError('body: {"command": <a command envelope, signed>}')
    try:
        payload = envelope.canonical(doc["command"])
        env = envelope.decode(payload)
    except (ValueError, envelope.EnvelopeError) as exc:
        raise ValueError(f"command: not an envelope ({exc})") from None
    kid, sig, body = env.extra.get("kid"), env.extra.get("sig"), env.body
    if not isinstance(kid, str) or not isinstance(sig, str):
        raise ValueError("command: unsigned (kid and sig): edgefleet cmd signs it")
    if not CMD_ID.match(env.id):
        raise ValueError("command.id: 1 to 64 letters, digits, _ or -")
    if body.get("target") != target:
        raise ValueError(f"command.body.target: {envelope.printable(str(body.get('target')), 80)}"
                         f" is not {target}")  # fmt: skip
    name, exp = body.get("name"), body.get("exp")
    if not isinstance(name, str) or not name:
        raise ValueError("command.body.name: the command's name")
    if isinstance(exp, bool) or not isinstance(exp, int) or exp <= now_ms:
        raise ValueError("command.body.exp: expired, or not ms since the epoch")
    return {"id": env.id, "name": envelope.printable(name, 64), "issuer": env.node,
            "kid": kid, "payload": payload}  # fmt: skip


def page_size(text: str) -> int | None:
    """A page's ``limit``: 1 to MAX_PAGE, else None (400)."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 1 <= value <= MAX_PAGE else None


def summary(rollout: Rollout) -> dict[str, Any]:
    """A rollout without its manifest (the API's lists)."""
    doc = rollout.as_dict()
    doc.pop("entry")
    return doc


def _with_role(handler: Handler, role: str, query: tuple[str, ...]) -> Handler:
    """``handler`` with the role it needs and the query parameters it takes (others: 400)."""

    async def call(request: web.Request) -> web.StreamResponse:
        return await handler(request)

    call.role = role  # type: ignore[attr-defined]
    call.query = set(query)  # type: ignore[attr-defined]
    return call
