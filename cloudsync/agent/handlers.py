"""The command handlers: what a verified command does (docs/PROTOCOL.md lists them), run one at
a time by the agent's commands thread. Most are calls to edged's admin API; ``logs`` reads
edged's events or cloudsync's own log; a rollback also tells the delivery not to install that
version again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cloudsync.agent import journal
from cloudsync.agent.config import Config
from cloudsync.agent.delivery import Delivery
from cloudsync.protocol.commands import COMMANDS, Command
from cloudsync.protocol.envelope import MAX_BODY_BYTES, canonical, now_ms, printable
from edged.client import Client, ClientError
from edged.common.events import CAPACITY, EventLog

LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_LOG_LINES = 1000
MAX_LOG_MESSAGE = 500  # characters of one line in a ``logs`` result
MAX_DRAIN_WAIT_S = 600.0  # the command worker waits no longer for a drain
MAX_SINCE_S = 31 * 24 * 3600  # a journal read goes back a month at most
JOURNAL_ARGS = {"units", "since_s", "max_bytes"}


class Handlers:
    """The commands of one agent."""

    def __init__(
        self,
        node: str,
        config: Config,
        edged_client: Callable[..., Client],
        status: Callable[[], dict[str, Any]],
        delivery: Delivery,
        events: EventLog,
    ) -> None:
        self.node, self.config, self.edged_client, self.status = node, config, edged_client, status
        self.delivery, self.events = delivery, events

    def run(self, command: Command) -> Any:
        """One verified command (docs/PROTOCOL.md lists them); raising fails it."""
        name, args = command.name, command.args
        edged = self.edged_client()
        calls: dict[str, Callable[[], Any]] = {
            "ping": lambda: {"pong": True, "node": self.node, "ts": now_ms()},
            "status": self.status,
            "models": lambda: edged.call("POST", "/v2/repository/index"),
            "routing": edged.routing,
            "set-routing": lambda: edged.set_routing(args),
            "reset-routing": edged.reset_routing,
            "reload": lambda: _reloaded(edged.reload()),
            "drain": lambda: self.drain(args),
            "resume": edged.resume,
            "rollback": lambda: self.rollback(edged, command, args),
            "activate": lambda: edged.activate(_text(args, "model"), _version(args)),
            "versions": lambda: edged.model_versions(_text(args, "model")),
            "cloud-ab": lambda: edged.call(
                "PUT",
                f"/v1/admin/cloud/{_text(args, 'model')}/ab",
                {k: v for k, v in args.items() if k != "model"},
            ),
            "logs": lambda: self.logs(args),
        }
        if name not in calls:
            raise ValueError(f"unknown command '{name}' ({COMMANDS})")
        try:
            return calls[name]()
        except ClientError as exc:
            raise RuntimeError(f"edged: {exc}") from None

    def rollback(self, edged: Client, command: Command, args: dict[str, Any]) -> Any:
        """The version before of ``model`` serves again; with ``from``, only when that version
        is the active one (a rollout's rollback must not take a node that never got it back
        further)."""
        model, wrong = _text(args, "model"), args.get("from")
        if model.startswith("package:"):  # (a rollout's abort sends it to every node)
            why = (
                "a package goes back by itself (edged-updater) when it is not healthy here;"
                " one that is stays until a newer release is delivered"
            )
            return {"rolled_back": False, "why": why}
        active = edged.model_versions(model).get("active")
        if wrong is not None and active != wrong:
            return {"rolled_back": False, "active": active, "why": f"{wrong} is not active"}
        reply = edged.activate(model)
        if isinstance(active, int):
            self.delivery.rolled_back(model, active, f"command {command.id} by {command.issuer}")
        return {"rolled_back": True, **reply}

    def drain(self, args: dict[str, Any]) -> Any:
        """edged checks the arguments; the call waits as long as the drain may."""
        wait = args.get("timeout_s", 30.0)
        if isinstance(wait, (int, float)) and not isinstance(wait, bool):
            args = {**args, "timeout_s": min(float(wait), MAX_DRAIN_WAIT_S)}
            wait = args["timeout_s"]
        else:
            wait = 0.0
        edged = self.edged_client(self.config.edged.timeout_s + wait)
        return edged.call("POST", "/v1/admin/drain", args)

    def logs(self, args: dict[str, Any]) -> dict[str, Any]:
        """The last ``lines`` of edged's (or cloudsync's) log at ``level`` and above, with
        ``contains`` in them when given; or of the system journal (``"source": "journal"``)."""
        source = args.get("source", "edged")
        lines, level = args.get("lines", 100), args.get("level", "info")
        contains = args.get("contains", "")
        if source not in ("edged", "cloudsync", "journal"):
            raise ValueError("'source' must be edged, cloudsync or journal")
        known = {"source", "lines", "level", "contains"} | (
            JOURNAL_ARGS if source == "journal" else set()
        )
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"'{unknown[0]}' is not an argument of logs from {source}")
        if isinstance(lines, bool) or not isinstance(lines, int) or not 1 <= lines <= MAX_LOG_LINES:
            raise ValueError(f"'lines' must be 1 to {MAX_LOG_LINES}")
        if level not in LEVELS:
            raise ValueError(f"'level' must be one of {', '.join(LEVELS)}")
        if not isinstance(contains, str):
            raise ValueError("'contains' must be text")
        if source == "journal":
            return self.journal_logs(args, lines, level, contains)
        if source == "edged":
            edged = self.edged_client()
            last = edged.events(0, 1)["last"]
            reply = edged.events(max(0, last - CAPACITY), CAPACITY)
        else:
            reply = self.events.after(0, CAPACITY)
        floor = LEVELS.index(level)
        found = [
            {**e, "message": printable(str(e.get("message")), MAX_LOG_MESSAGE)}
            for e in reply["events"]
            if e.get("level") in LEVELS
            and LEVELS.index(e["level"]) >= floor
            and contains in str(e.get("message"))
        ][-lines:]
        # the newest lines that fit in one record (1,000 long lines would not)
        return {"source": source, "epoch": reply["epoch"], **newest(found, MAX_BODY_BYTES - 1024)}

    def journal_logs(
        self, args: dict[str, Any], lines: int, level: str, contains: str
    ) -> dict[str, Any]:
        """The system journal's lines of the units asked (of ``[commands] journal_units``;
        default edged's), the last ``since_s`` seconds, at most ``max_bytes`` of them."""
        allowed = self.config.commands.journal_units
        units = args.get("units", ["edged.service"])
        if not isinstance(units, list) or not units or not all(isinstance(u, str) for u in units):
            raise ValueError("'units' must be a list of unit names")
        for unit in units:
            if unit not in allowed:
                raise ValueError(
                    f"'units': {printable(unit, 80)!r} is not one this device sends"
                    f" ([commands] journal_units: {', '.join(allowed)})"
                )
        since_s = _number(args, "since_s", 3600, 1, MAX_SINCE_S)
        max_bytes = _number(args, "max_bytes", MAX_BODY_BYTES // 2, 1024, MAX_BODY_BYTES - 4096)
        units = sorted(set(units))
        found, scanned = journal.read(
            units,
            since_ms=now_ms() - since_s * 1000,
            level=level,
            lines=lines,
            contains=contains,
            directory=self.config.commands.journal_dir,
        )
        result = {"source": "journal", "units": units, **newest(found, max_bytes)}
        if scanned >= journal.MAX_SCANNED:
            result["scanned"] = scanned  # stopped there: older lines were not read
        return result


def newest(found: list[dict[str, Any]], room: int) -> dict[str, Any]:
    """``lines``: the newest of ``found`` (oldest first) that fit ``room`` bytes as JSON, and
    ``left_out``, how many older ones did not (absent when none)."""
    kept = 0
    for line in reversed(found):
        room -= len(canonical(line)) + 1
        if room < 0:
            break
        kept += 1
    result: dict[str, Any] = {"lines": found[len(found) - kept :]}
    return {**result, "left_out": len(found) - kept} if kept < len(found) else result


def _number(args: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"'{key}' must be {low} to {high}")
    return value


def _text(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"'{key}' must be given (text)")
    return value


def _version(args: dict[str, Any]) -> int:
    value = args.get("version")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("'version' must be given (an integer)")
    return value


def _reloaded(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply["reloaded"]:
        raise RuntimeError(f"edged's reload failed: {reply['error']}")
    return reply
