"""``edgefleet serve``: the fleet service's process (config, logs, the HTTP server, signals)
and ``edgefleet token``."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import signal
import socket
import ssl
from pathlib import Path

from aiohttp import web

from cloudsync.fleet import api
from cloudsync.fleet import config as config_module
from cloudsync.fleet.actions import Actions, EnrolmentActions
from cloudsync.fleet.config import ApiConfig
from cloudsync.fleet.console import Console
from cloudsync.fleet.routes.abtests import ABTestRoutes
from cloudsync.fleet.routes.audit import AuditRoutes
from cloudsync.fleet.routes.base import Calls, RouteModule, manifest_anchors
from cloudsync.fleet.routes.commands import CommandRoutes
from cloudsync.fleet.routes.deployments import DeploymentRoutes
from cloudsync.fleet.routes.enrolment import EnrolmentRoutes
from cloudsync.fleet.routes.nodes import NodeRoutes
from cloudsync.fleet.routes.public import PublicRoutes
from cloudsync.fleet.routes.rollouts import RolloutRoutes
from cloudsync.fleet.service import Service
from cloudsync.fleet.store import StoreError
from edged.common import connections
from edged.common.errors import ConfigError
from edged.common.logs import setup_logging

log = logging.getLogger("edgefleet")


class CannotStart(Exception):
    """Why the service cannot start (the exit message)."""


def application(service: Service) -> web.Application:
    """The service's HTTP side, composed: each route module of the JSON API is given only the
    repositories and the publishing calls it uses, and the console under /console acts
    through the same ``Actions`` (no import between the two adapters)."""
    cfg, clock, fleet = service.config, service.clock, service.fleet
    actions = Actions(
        cfg.api.tokens,
        service.audit,
        service.registry,
        service.rollouts,
        service.reconcile_soon,
        service.wake.set,
    )
    calls = Calls(actions, cfg.api.idle_timeout_s, cfg.api.max_body_kb)
    enrolling = EnrolmentActions(
        actions,
        service.enrolments,
        clock,
        service.answer,
        service.write_broker_files,
        service.kick,
    )
    anchors = manifest_anchors(cfg.service.trust_dir)
    modules: list[RouteModule] = [
        PublicRoutes(
            service.store.ping,
            service.client.is_connected,
            lambda: service.holds_lease,
            service.replica,
            service.metrics.registry,
        ),
        NodeRoutes(service.registry, service.series, fleet, clock, actions, calls),
        CommandRoutes(
            service.commands,
            service.send_command,
            fleet,
            clock,
            calls,
            service.enrolments.is_barred,
        ),
        DeploymentRoutes(service.deployments, anchors, clock, service.reconcile_soon, calls),
        RolloutRoutes(service.rollouts, anchors, clock, service.wake.set, actions, calls),
        ABTestRoutes(service.abtests, service.wake.set, calls),
        EnrolmentRoutes(service.enrolments, enrolling, calls),
        AuditRoutes(service.audit),
    ]
    app = api.app([r for module in modules for r in module.routes()], actions, cfg.api.max_body_kb)
    Console(
        actions,
        registry=service.registry,
        alerting=service.alerting,
        rollouts=service.rollouts,
        deployments=service.deployments,
        commands=service.commands,
        enrolling=enrolling,
        sessions=service.sessions,
        audit=service.audit,
        fleet=fleet,
        clock=clock,
        secure=cfg.api.tls_cert is not None,
    ).mount(app, api.CONSOLE)
    return app


def tls_context(cfg: ApiConfig) -> ssl.SSLContext | None:
    """TLS 1.3 with ``[api] tls_cert`` and ``tls_key``; None (plain HTTP) without them."""
    if cfg.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return context


async def _serve(service: Service, app: web.Application) -> None:
    cfg = service.config.api
    # Whoever reaches the port may open connections: at most max_connections are held (503
    # above), and one that handles no request for idle_timeout_s is closed (issue 44: 1,100
    # half-sent request heads held every descriptor, /healthz did not answer).
    runner = web.AppRunner(
        app,
        access_log=None,
        keepalive_timeout=cfg.idle_timeout_s,
        logger=connections.QuietLog(logging.getLogger("aiohttp.server")),
    )
    await runner.setup()
    try:
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.create_server((cfg.host, cfg.port), family=family)
        site = connections.CappedSite(
            runner,
            sock,
            cfg.max_connections,
            who="edgefleet",
            setting="api.max_connections",
            ssl_context=tls_context(cfg),
            handshake_timeout_s=cfg.idle_timeout_s,
        )
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise CannotStart(f"cannot listen on {cfg.host}:{cfg.port}: {exc}") from None
    sweeper = asyncio.get_running_loop().create_task(
        connections.sweep_idle(runner, cfg.idle_timeout_s), name="idle-connections"
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "fleet %s, replica %s: API on %s:%s, broker %s:%s, database %s",
        service.fleet,
        service.replica,
        cfg.host,
        cfg.port,
        service.config.mqtt.host,
        service.config.mqtt.port,
        service.store.dialect,
    )
    try:
        await stop.wait()
    finally:
        sweeper.cancel()
        await runner.cleanup()


def serve(config_path: Path | None, log_level: str | None) -> None:
    try:
        config = config_module.load(config_path)
    except ConfigError as exc:
        raise CannotStart(str(exc)) from None
    setup_logging(
        log_level or config.log.level, config.log.format, config.service.replica_name(), "edgefleet"
    )
    if not config.api.tokens:
        log.warning("no [api] tokens: every call but /healthz and /metrics is refused (401)")
    try:
        service = Service(config)
        app = application(service)
    except (StoreError, OSError, ValueError) as exc:  # the database, the deploy key, trust
        raise CannotStart(f"cannot start: {exc}") from None
    service.start()
    try:
        asyncio.run(_serve(service, app))
    finally:
        service.stop()


def token(name: str, role: str) -> str:
    """A new token and the config lines that let it in (the token itself is shown once)."""
    value = secrets.token_urlsafe(32)
    digest = hashlib.sha256(value.encode()).hexdigest()
    return (
        f"token (give it to {name}; it is not kept anywhere): {value}\n\n"
        f'# add to [api] in edgefleet.toml:\n[[api.tokens]]\nname = "{name}"\n'
        f'role = "{role}"\nsha256 = "{digest}"'
    )
