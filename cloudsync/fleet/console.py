"""The fleet service's web console: server-rendered pages (Jinja2 templates, one hand-written
style sheet, no JavaScript) under ``/console/``, for people who would rather look than read.

Pages: the fleet at a glance, the nodes (paged by name both ways, searched by a part of the
name, filtered by state and label selector), a node, the enrolments, the deployments (each
with its nodes done, failed and waiting), the rollouts (with their stages, the nodes' states
and the gates' figures; a page that reloads itself while the rollout runs) and the audit log
(operator and up, as in the API).

Who is calling is the API's question with the API's answer: the login form takes an API token
(``[api] tokens``) and opens a session: a random id in a cookie (HttpOnly, SameSite=Strict,
Path=/console, Secure when the API serves TLS), its SHA-256 kept in the database with the
token's holder for SESSION_S (``cloudsync.fleet.sessions``), so that every replica knows it and
signing out ends it (the cookie was the API token itself, which signing out could not take
back). A session is as good as its holder's entry in ``[api] tokens``: removed there, it is
gone. Every form carries a CSRF token, an HMAC keyed by the session id, checked on each POST
with the request's Origin. The actions (pause, resume, promote and abort a rollout; set a
node's operator labels; approve or refuse an enrolment; revoke and reinstate a node, an
admin's) are the API's own (``cloudsync.fleet.actions``), so they are checked and audited as
the API's; one that cannot be undone (an abort, a revocation) asks first, on a page of its own;
a role too low sees no button, and a forged POST is a 403 (audited as the API audits one).
The database is called from the thread pool; each answer says its server time in
``Server-Timing``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from aiohttp import web

from cloudsync.fleet.actions import ROLES, WHO, Actions, EnrolmentActions, Refused, db
from cloudsync.fleet.alerting import Alerting
from cloudsync.fleet.audit import AuditLog
from cloudsync.fleet.commands import Commands
from cloudsync.fleet.config import Token
from cloudsync.fleet.deployments import Deployments
from cloudsync.fleet.gates import breached
from cloudsync.fleet.registry import MAX_INT, Registry
from cloudsync.fleet.rollouts import Rollout, Rollouts
from cloudsync.fleet.sessions import SESSION_S, Sessions
from cloudsync.protocol.labels import LabelError, check_labels
from edged.common.digits import whole

log = logging.getLogger("edgefleet.console")
FILES = Path(__file__).with_name("console")  # package data: the templates and console.css
COOKIE = "edgefleet_console"
CSRF_CONTEXT = b"edgefleet console csrf v1"
STATES = ("online", "stale", "offline", "unknown")
LIVE = ("running", "paused", "aborting")
ACTIONS = {  # what a rollout in a state can be told (rollouts.Rollouts.act says the same)
    "pause": ("running",),
    "resume": ("paused",),
    "promote": ("running",),
    "abort": ("running", "paused"),
}
MAX_TEXT = 200  # a query parameter's length (a search, a selector, a cursor)
PAGE_SIZES = (20, 50, 100, 200, 500)
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self';"
    " form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
}
Page = Callable[[web.Request], Awaitable[web.StreamResponse]]
TOKEN = web.RequestKey("console_token", str)  # the session's id (its CSRF token's key)


def page(role: str = "viewer", query: tuple[str, ...] = (), public: bool = False) -> Any:
    """A console handler with the role it needs and the query parameters it takes."""

    def mark(fn: Any) -> Any:
        fn.role, fn.query, fn.public = role, set(query), public
        return fn

    return mark


def csrf_of(token: str) -> str:
    """The CSRF token of a session: an HMAC keyed by its id (the same on every replica and
    across restarts; it tells nothing of the id)."""
    return hmac.new(token.encode(), CSRF_CONTEXT, hashlib.sha256).hexdigest()


def text_param(request: web.Request, name: str, default: str = "") -> str:
    value = request.query.get(name, default)
    if len(value) > MAX_TEXT or any(ord(c) < 32 for c in value):
        raise Refused(400, f"{name}: at most {MAX_TEXT} printable characters")
    return value


def size_param(request: web.Request, default: int = 50) -> int:
    value = whole(request.query.get("limit", str(default)), 3)
    if value not in PAGE_SIZES:
        raise Refused(400, f"limit: one of {', '.join(map(str, PAGE_SIZES))}")
    return value


def parse_labels(text: str, what: str = "labels") -> dict[str, str]:
    """``k=v, k2=v2`` (commas or new lines) as labels, checked (LabelError naming the part)."""
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in re.split(r"[,\n]", text))):
        key, sep, value = part.partition("=")
        if not sep:
            raise LabelError(f"{what}: {part[:40]!r} is not label=value")
        pairs[key.strip()] = value.strip()
    return check_labels(pairs, what)


def local_path(target: str) -> str:
    """Where a login goes next: a console page, nothing else (no open redirect)."""
    ok = target.startswith("/console/") and "//" not in target and "\\" not in target
    return target if ok and len(target) <= 1000 else "/console/"


def when(ms: Any) -> str:
    if not ms:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(int(ms) / 1000)) + "Z"


def ago(ms: Any, now_ms: int) -> str:
    if not ms:
        return "never"
    s = max(0, (now_ms - int(ms)) // 1000)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s // size} {unit} ago"
    return f"{s} s ago"


def url(path: str, **params: Any) -> str:
    """A console URL with the query parameters that have a value."""
    kept = {k: v for k, v in params.items() if v not in (None, "")}
    return path + ("?" + urlencode(kept) if kept else "")


def pairs(labels: Any) -> str:
    """An object's keys and values as ``k=v, k2=v2``."""
    return ", ".join(f"{k}={v}" for k, v in sorted(obj(labels).items()))


def obj(value: Any) -> dict[str, Any]:
    """A part of a node's message that should be an object, or {} (a node sends what it
    sends: a page never fails on it)."""
    return value if isinstance(value, dict) else {}


def scaled(value: Any, factor: float) -> str:
    """A number from a node's message times ``factor``, to one decimal; "—" if not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "—"
    return f"{value * factor:.1f}"


def pct(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, (int, float)) else "—"


class Console:
    """The console's pages over the service's repositories and the actions it shares with the
    API (``Actions``)."""

    def __init__(
        self,
        actions: Actions,
        *,
        registry: Registry,
        alerting: Alerting,
        rollouts: Rollouts,
        deployments: Deployments,
        commands: Commands,
        enrolling: EnrolmentActions,
        sessions: Sessions,
        audit: AuditLog,
        fleet: str,
        clock: Callable[[], int],
        secure: bool,
    ) -> None:
        self.actions, self.registry, self.alerting = actions, registry, alerting
        self.rollouts, self.deployments, self.commands = rollouts, deployments, commands
        self.enrolling, self.enrolments = enrolling, enrolling.enrolments
        self.sessions, self.audit, self.fleet, self.clock = sessions, audit, fleet, clock
        self.secure = secure  # the cookie's Secure flag: the API serves TLS
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(FILES),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(
            when=when,
            pairs=pairs,
            obj=obj,
            scaled=scaled,
            pct=pct,
            shown=lambda v: "—" if v is None else v,  # a field a node sent as null
            q=lambda s: quote(str(s), safe=""),
        )
        self.env.globals.update(url=url, ago=ago, STATES=STATES, PAGE_SIZES=PAGE_SIZES)
        self.css = (FILES / "console.css").read_bytes()

    def mount(self, app: web.Application, prefix: str) -> None:
        """The console's pages under ``prefix`` of the API's app."""
        sub = web.Application(middlewares=[self.session])
        routes: list[tuple[str, str, Page]] = [
            ("GET", "/", self.overview),
            ("GET", "/console.css", self.stylesheet),
            ("GET", "/login", self.login_form),
            ("POST", "/login", self.login),
            ("POST", "/logout", self.logout),
            ("GET", "/nodes", self.nodes),
            ("GET", "/nodes/{node}", self.node),
            ("POST", "/nodes/{node}/labels", self.set_labels),
            ("POST", "/nodes/{node}/revoke", self.revoke),
            ("POST", "/nodes/{node}/reinstate", self.reinstate),
            ("GET", "/enrolments", self.enrolment_list),
            ("POST", "/enrolments/{id}/{decision}", self.decide),
            ("GET", "/deployments", self.deployment_list),
            ("GET", "/deployments/{id}", self.deployment),
            ("GET", "/rollouts", self.rollout_list),
            ("GET", "/rollouts/{id}", self.rollout),
            ("POST", "/rollouts/{id}/{action}", self.act_on_rollout),
            ("GET", "/audit", self.audit_log),
        ]
        for method, path, handler in routes:
            sub.router.add_route(method, path, handler)
        app.add_subapp(prefix, sub)

    # ---- the session -------------------------------------------------------------------------

    @web.middleware
    async def session(self, request: web.Request, handler: Page) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            response = await self.checked(request, handler)
        except Refused as exc:
            response = self.render("error.html", request, status=exc.status, message=exc.message)
        except web.HTTPNotFound:
            response = self.render("error.html", request, status=404, message="no such page")
        except web.HTTPMethodNotAllowed:
            response = self.render("error.html", request, status=405, message="not here")
        except web.HTTPException:
            raise
        except Exception:  # one page's failure is a 500 page, the service goes on
            log.exception("%s %s", request.method, request.path)
            why = "internal error (the service's log says more)"
            response = self.render("error.html", request, status=500, message=why)
        response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
        response.headers.update(SECURITY_HEADERS)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    async def checked(self, request: web.Request, handler: Page) -> web.StreamResponse:
        """The caller's session, the request's origin and CSRF token, the role and the query
        parameters checked; then the page."""
        if request.path == "/console":
            return see_other("/console/")
        if request.method == "POST":
            origin = request.headers.get("Origin")  # none: not a browser's form ("null" is)
            if origin is not None and origin.partition("://")[2] != request.host:
                raise Refused(403, "a form from another site")
        if getattr(handler, "public", False):
            return await handler(request)
        token = request.cookies.get(COOKIE, "")
        who = await db(self.holder, token) if token and len(token) <= 512 else None
        if who is None:
            if request.method == "GET":
                return see_other(url("/console/login", next=request.path_qs))
            raise Refused(403, "not signed in (or the token is no longer known): sign in again")
        request[WHO], request[TOKEN] = who, token  # WHO: where the actions read it
        need = getattr(handler, "role", "viewer")  # unrouted: 404 or 405 follows
        if request.method == "POST":
            form = await request.post()
            sent = form.get("csrf")
            if not isinstance(sent, str) or not hmac.compare_digest(
                sent.encode(errors="replace"), csrf_of(token).encode()
            ):
                await self.actions.audit(
                    who, f"POST {request.path}", self.target(request), "refused: CSRF token"
                )
                raise Refused(403, "the form's CSRF token is missing or wrong: reload the page")
        if ROLES[who.role] < ROLES[need]:
            if request.method != "GET":  # audited as the API audits one
                await self.actions.audit(
                    who, f"{request.method} {request.path}", self.target(request), f"denied: {need}"
                )
            raise Refused(403, f"role {who.role} may not do this: {need} needed")
        unknown = set(request.query) - getattr(handler, "query", set(request.query))
        if unknown:
            raise Refused(400, f"query: no parameter {sorted(unknown)[0][:40]!r} here")
        return await handler(request)

    @staticmethod
    def target(request: web.Request) -> str:
        info = request.match_info
        return str(info.get("id") or info.get("node") or request.path)[:200]

    def render(
        self, name: str, request: web.Request, status: int = 200, **context: Any
    ) -> web.Response:
        who = request.get(WHO)
        token = request.get(TOKEN)
        body = self.env.get_template(name).render(
            who=who,
            may_act=who is not None and ROLES[who.role] >= ROLES["operator"],
            csrf=csrf_of(token) if token else "",
            now=self.clock(),
            fleet=self.fleet,
            path=request.path,
            status=status,
            **context,
        )
        return web.Response(text=body, status=status, content_type="text/html")

    # ---- sign in, sign out -------------------------------------------------------------------

    @page(public=True)
    async def stylesheet(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.css, content_type="text/css", headers={"Cache-Control": "max-age=3600"}
        )

    @page(public=True, query=("next",))
    async def login_form(self, request: web.Request) -> web.Response:
        return self.render(
            "login.html", request, next=local_path(text_param(request, "next")), message=""
        )

    @page(public=True)
    async def login(self, request: web.Request) -> web.Response:
        form = await request.post()
        token, target = form.get("token"), form.get("next")
        target = local_path(target if isinstance(target, str) else "")
        who = None
        if isinstance(token, str) and 0 < len(token) <= 512 and token.isprintable():
            token = token.strip()
            who = self.actions.holder(token)
        if who is None or not isinstance(token, str):
            why = "That token is not one of the service's [api] tokens."
            return self.render("login.html", request, status=401, next=target, message=why)
        await self.actions.audit(who, "console sign-in", "-", "done")
        session = await db(self.sessions.open, who.name)
        response = see_other(target)
        response.set_cookie(
            COOKIE,
            session,
            path="/console",
            httponly=True,
            samesite="Strict",
            secure=self.secure,
            max_age=SESSION_S,
        )
        return response

    def holder(self, session: str) -> Token | None:
        """Whose session this is, while it lasts and its holder has a token, or None."""
        name = self.sessions.holder(session)
        return None if name is None else self.actions.named(name)

    @page()
    async def logout(self, request: web.Request) -> web.Response:
        await db(self.sessions.close, request[TOKEN])
        await self.actions.audit(request[WHO], "console sign-out", "-", "done")
        response = see_other("/console/login")
        response.del_cookie(
            COOKIE, path="/console", httponly=True, samesite="Strict", secure=self.secure
        )
        return response

    # ---- the fleet at a glance ---------------------------------------------------------------

    @page()
    async def overview(self, request: web.Request) -> web.Response:
        seen = await db(self.overview_data, self.clock())
        return self.render("overview.html", request, **seen)

    def overview_data(self, now: int) -> dict[str, Any]:
        """Counted in SQL: states, versions (nodes grouped by their births' software and
        models), alerts firing, rollouts by state; the latest events and firing alerts."""
        registry = self.registry
        counts = registry.counts(now)
        firing = self.alerting.firing()
        return {
            "counts": counts,
            "total": sum(counts.values()),
            "software": registry.software(),
            "models": registry.serving(),
            "firing": firing,
            "firing_total": sum(int(r["n"]) for r in firing),
            "latest_alerts": [alert(r) for r in self.alerting.latest()],
            "events": registry.events(None, 10),
            "rollout_states": self.rollouts.states(),
            "running": self.rollouts.running(),
            "deployment_count": self.deployments.count(),
        }

    # ---- nodes -------------------------------------------------------------------------------

    @page(query=("state", "selector", "contains", "after", "before", "limit"))
    async def nodes(self, request: web.Request) -> web.Response:
        state = text_param(request, "state") or None
        if state not in (None, *STATES):
            raise Refused(400, f"state: {', '.join(STATES)}")
        chosen = text_param(request, "selector")
        try:
            selector = parse_labels(chosen, "selector")
        except LabelError as exc:
            raise Refused(400, f"selector: k=v,k2=v2 ({exc})") from None
        contains, after = text_param(request, "contains"), text_param(request, "after")
        before = "" if after else text_param(request, "before")
        limit = size_param(request)
        now = self.clock()
        found, more = await db(
            self.registry.nodes, now, state, selector, contains, after, limit, before
        )
        counts = await db(self.registry.counts, now)
        first, last = (found[0]["node"], found[-1]["node"]) if found else (None, None)
        if before:  # paged back: any before it (a full page may be the first), and after it
            if more and first:
                ahead, _ = await db(
                    self.registry.nodes, now, state, selector, contains, "", 1, first
                )
                more = more if ahead else None
            earlier, later = (first if more else None), (last or before)
        else:
            earlier, later = (first or after if after else None), more
        return self.render(
            "nodes.html",
            request,
            nodes=found,
            earlier=earlier,
            later=later,
            counts=counts,
            state=state or "",
            selector=chosen,
            contains=contains,
            paged=bool(after or before),
            limit=limit,
        )

    @page()
    async def node(self, request: web.Request) -> web.Response:
        name = request.match_info["node"]
        seen = await db(self.node_data, name, self.clock())
        if seen is None:
            raise Refused(404, f"no node {name[:80]!r} in fleet {self.fleet}")
        return self.render("node.html", request, **seen)

    def node_data(self, name: str, now: int) -> dict[str, Any] | None:
        row = self.registry.node(name, now)
        if row is None:
            return None
        return {
            "row": row,
            "beat": row["heartbeat"] or {},
            "history": self.registry.history(name, 20),
            "commands": self.commands.of_node(name, 20),
            "events": self.registry.events(name, 50),
            "alerts": [alert(a) for a in self.alerting.latest(name, 50)],
            "in_rollouts": self.rollouts.of_node(name),
            "barred": self.enrolments.is_barred(name),
        }

    @page(role="operator")
    async def set_labels(self, request: web.Request) -> web.StreamResponse:
        node = request.match_info["node"]
        form = await request.post()
        given = form.get("labels")
        try:
            labels = parse_labels(given if isinstance(given, str) else "")
        except LabelError as exc:
            raise await self.actions.refuse(
                request[WHO], "set labels", node, 422, str(exc)
            ) from None
        await self.actions.set_labels(request[WHO], node, labels)
        return see_other(f"/console/nodes/{quote(node, safe='')}")

    @page(role="admin")
    async def revoke(self, request: web.Request) -> web.StreamResponse:
        """The node's certificates revoked and its name barred (an admin's, asked first)."""
        node = request.match_info["node"]
        back = f"/console/nodes/{quote(node, safe='')}"
        if not await confirmed(request):
            return self.render(
                "confirm.html",
                request,
                title=f"Revoke {node}",
                message="Its certificates go into the broker's CRL and its open session is"
                " closed now; its name can enrol again only when an admin reinstates it.",
                action=f"{back}/revoke",
                back=back,
                keep="Keep it",
            )
        await self.enrolling.revoke(request[WHO], node, None, node)
        return see_other(back)

    @page(role="admin")
    async def reinstate(self, request: web.Request) -> web.StreamResponse:
        node = request.match_info["node"]
        await self.enrolling.reinstate(request[WHO], node)
        return see_other(f"/console/nodes/{quote(node, safe='')}")

    # ---- enrolments --------------------------------------------------------------------------

    @page(role="operator")
    async def enrolment_list(self, request: web.Request) -> web.Response:
        requests = await db(self.enrolments.list, None, 200)
        requests.sort(key=lambda e: e["state"] != "pending")  # pending first, newest first
        barred = await db(self.enrolments.barred)
        return self.render("enrolments.html", request, requests=requests, barred=barred)

    @page(role="operator")
    async def decide(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        await self.enrolling.decide(request[WHO], info["id"], info["decision"])
        return see_other("/console/enrolments")

    # ---- deployments and rollouts ------------------------------------------------------------

    @page()
    async def deployment_list(self, request: web.Request) -> web.Response:
        found = await db(self.deployments.all)
        progress = await db(self.deployments.progress_of, found)
        shown = [{**d.as_dict(), "nodes": progress[d.id]} for d in found]
        return self.render("deployments.html", request, deployments=shown)

    @page()
    async def deployment(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        found = await db(self.deployments.get, ident)
        if found is None:
            raise Refused(404, f"no deployment {ident[:80]!r}")
        progress = await db(self.deployments.progress, found)
        rollouts = await db(self.rollouts.all)
        return self.render(
            "deployment.html",
            request,
            d=found.as_dict(),
            progress=progress,
            rollouts=[r for r in rollouts if r.deployment == ident],
        )

    @page()
    async def rollout_list(self, request: web.Request) -> web.Response:
        found = await db(self.rollouts.all)
        found.sort(key=lambda r: (r.state not in LIVE, -r.created_ts))
        return self.render("rollouts.html", request, rollouts=found)

    @page()
    async def rollout(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        seen = await db(self.rollout_data, ident)
        if seen is None:
            raise Refused(404, f"no rollout {ident[:80]!r}")
        r: Rollout = seen["r"]
        actions = [
            a
            for a, states in ACTIONS.items()
            if r.state in states and (a != "promote" or r.phase == "soak")
        ]
        return self.render("rollout.html", request, actions=actions, live=r.state in LIVE, **seen)

    def rollout_data(self, ident: str) -> dict[str, Any] | None:
        """The rollout, its nodes by stage and state, and its gates' figures: the canary's
        and the other nodes' since the soak began, as the runner judges them."""
        rollouts = self.rollouts
        found = rollouts.get(ident)
        if found is None:
            return None
        nodes = rollouts.nodes(ident)
        states: dict[str, int] = {}
        by_stage = [dict[str, int]() for _ in found.stages]
        for row in nodes:
            states[row["state"]] = states.get(row["state"], 0) + 1
            stage = by_stage[min(row["stage"], len(by_stage) - 1)]
            stage[row["state"]] = stage.get(row["state"], 0) + 1
        sizes = [sum(1 for n in nodes if n["stage"] <= k) for k in range(len(found.stages))]
        canary = baseline = None
        why = ""
        if found.soak_since:
            canary, baseline = rollouts.figures(found, True), rollouts.figures(found, False)
            why = breached(found.gates, canary, baseline)
        return {
            "r": found,
            "states": states,
            "by_stage": by_stage,
            "sizes": sizes,
            "node_rows": nodes[:100],
            "node_total": len(nodes),
            "canary": canary,
            "baseline": baseline,
            "breach": why,
            "gates": found.gates,
        }

    @page(role="operator")
    async def act_on_rollout(self, request: web.Request) -> web.StreamResponse:
        ident, action = request.match_info["id"], request.match_info["action"]
        back = f"/console/rollouts/{quote(ident, safe='')}"
        if action == "abort" and not await confirmed(request):
            # not undone by a click: the nodes that got the version are rolled back
            return self.render(
                "confirm.html",
                request,
                title=f"Abort rollout {ident}",
                message="Every node that got its version is sent a signed rollback to the"
                " version it had; an aborted rollout cannot be resumed.",
                action=f"{back}/abort",
                back=back,
                keep="Keep it going",
            )
        await self.actions.act_on_rollout(request[WHO], ident, action)
        return see_other(back)

    # ---- the audit log -----------------------------------------------------------------------

    @page(role="operator", query=("before", "contains", "limit"))
    async def audit_log(self, request: web.Request) -> web.Response:
        text = text_param(request, "before")
        before = whole(text) if text else MAX_INT
        if before is None or (text and before >= MAX_INT):
            raise Refused(400, "before: an entry's id")
        contains, limit = text_param(request, "contains"), size_param(request)
        rows = await db(self.audit.before, before, contains, limit)
        more = rows[-1]["id"] if len(rows) == limit else None
        return self.render(
            "audit.html",
            request,
            entries=rows,
            more=more,
            contains=contains,
            before=text,
            limit=limit,
        )


async def confirmed(request: web.Request) -> bool:
    """Whether a form came from its confirmation page (``confirm.html``): what cannot be undone
    is asked first."""
    return (await request.post()).get("confirm") == "yes"


def see_other(location: str) -> web.Response:
    """A 303 to ``location`` (a page after its form: a reload does not post it again)."""
    return web.Response(status=303, headers={"Location": location})


def alert(row: dict[str, Any]) -> dict[str, Any]:
    """An alerts row with its labels and annotations as objects."""
    doc = dict(row)
    for key in ("labels", "annotations"):
        try:
            doc[key] = obj(json.loads(row[key] or "{}"))
        except ValueError:
            doc[key] = {}
    return doc
