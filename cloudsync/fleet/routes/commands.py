"""Commands an operator signed, relayed to a node (the service signs none of these: docs/
SECURITY.md), and their results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from cloudsync.fleet.actions import WHO, db
from cloudsync.fleet.commands import Commands
from cloudsync.fleet.routes.base import Calls, Route, error, page_size
from cloudsync.protocol import envelope
from cloudsync.protocol.topics import CMD_ID

Send = Callable[[str, str, bytes], bool]  # (node, command id, payload): published?


class CommandRoutes:
    def __init__(
        self,
        commands: Commands,
        send: Send,
        fleet: str,
        clock: Callable[[], int],
        calls: Calls,
        barred: Callable[[str], bool],
    ) -> None:
        self.commands, self.send, self.fleet, self.clock = commands, send, fleet, clock
        self.calls, self.barred = calls, barred

    def routes(self) -> list[Route]:
        return [
            Route("POST", "/v1/nodes/{node}/commands", self.send_command, "operator"),
            Route("GET", "/v1/nodes/{node}/commands", self.node_commands, "viewer", ("limit",)),
            Route("GET", "/v1/commands/{id}", self.command),
        ]

    async def send_command(self, request: web.Request) -> web.Response:
        """Relays a command an operator signed: checked for form, target and time, published,
        its result kept."""
        node = request.match_info["node"]
        action = "send command"
        doc = await self.calls.body(request, action, node)
        try:
            command = relayed(doc, f"{self.fleet}/{node}", self.clock())
        except ValueError as exc:
            return await self.calls.refuse(request, action, node, 422, str(exc))
        if await db(self.barred, node):  # its session is closed and the broker denies it
            return await self.calls.refuse(
                request, action, node, 409, f"node {node}: revoked, it can receive no command"
            )
        who = request[WHO]
        try:
            await db(self.commands.keep, command, node, who.name)
        except KeyError as exc:
            return await self.calls.refuse(request, action, node, 409, str(exc))
        if not self.send(node, command["id"], command["payload"]):
            return await self.calls.refuse(
                request, action, node, 503, "the broker is not connected"
            )
        detail = {k: command[k] for k in ("id", "name", "issuer", "kid")}
        await self.calls.audit(who, f"command {command['name']}", node, "sent", detail)
        return web.json_response({**detail, "node": node, "state": "sent"}, status=202)

    async def command(self, request: web.Request) -> web.Response:
        found = await db(self.commands.get, request.match_info["id"])
        return error(404, "no such command") if found is None else web.json_response(found)

    async def node_commands(self, request: web.Request) -> web.Response:
        limit = page_size(request)
        found = await db(self.commands.of_node, request.match_info["node"], limit)
        return web.json_response({"commands": found})


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
        raise ValueError(
            f"command.body.target: {envelope.printable(str(body.get('target')), 80)}"
            f" is not {target}"
        )
    name, exp = body.get("name"), body.get("exp")
    if not isinstance(name, str) or not name:
        raise ValueError("command.body.name: the command's name")
    if isinstance(exp, bool) or not isinstance(exp, int) or exp <= now_ms:
        raise ValueError("command.body.exp: expired, or not ms since the epoch")
    return {
        "id": env.id,
        "name": envelope.printable(name, 64),
        "issuer": env.node,
        "kid": kid,
        "payload": payload,
    }
