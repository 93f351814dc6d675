"""Structured logs for edged and cloudsync: journald fields, or JSON lines with ECS field names.

What a request is about (its id, the model, the route and why) is bound once in a context
variable (``bind``, ``set_fields``) where the request is served; a filter copies it onto every
record logged meanwhile, in that task only, so log calls need not pass it. ``extra={"model":
...}`` at a call site wins over the bound value.

- ``journal``: journald's native protocol (systemd-python's JournalHandler: MESSAGE, PRIORITY,
  LOGGER, CODE_FILE, ...) plus MODEL, ROUTE, REASON, REQUEST_ID and NODE.
- ``json``: one JSON object per line (Elastic's ecs-logging: ``@timestamp``, ``log.level``,
  ``message``, ``log.logger``, ...) plus ``host.name`` (the node), ``service.name``,
  ``http.request.id`` and ``edged.model``, ``edged.route``, ``edged.reason``.
- ``text``: ``LEVEL logger: message``, with the time first unless journald adds its own.

A leaf: only the standard library, ecs-logging and, when installed, systemd-python.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import os
import random
import sys
from collections.abc import Iterator, Mapping
from typing import IO, Any, Literal

import ecs_logging

__all__ = [
    "ECS_FIELDS",
    "FIELDS",
    "JOURNAL_FIELDS",
    "ContextFilter",
    "EcsFormatter",
    "JournalHandler",
    "bind",
    "bound",
    "choose_format",
    "reset_fields",
    "set_fields",
    "setup_logging",
    "short_id",
    "under_journald",
]

journal: Any
try:  # imported by name: type checkers see the module or not depending on the build
    journal = importlib.import_module("systemd.journal")
except ImportError:  # the wheel-less systemd-python was not built: JSON lines instead
    journal = None

Chosen = Literal["journal", "json", "text"]

# The fields a request binds, as record attributes (and ``extra`` keys), journald field names
# and ECS field names. ECS has a field for the request id; the rest are ours, under "edged.".
FIELDS = ("request_id", "model", "route", "reason")
JOURNAL_FIELDS = {
    "request_id": "REQUEST_ID",
    "model": "MODEL",
    "route": "ROUTE",
    "reason": "REASON",
}
ECS_FIELDS = {
    "request_id": "http.request.id",
    "model": "edged.model",
    "route": "edged.route",
    "reason": "edged.reason",
}
TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"

_BOUND: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "edged_log_fields", default=None
)
_warned_no_journal = False


# ---- the bound context --------------------------------------------------------------------


def set_fields(**fields: str | None) -> contextvars.Token[Mapping[str, str] | None]:
    """Bind fields (``FIELDS``; None unbinds one) for the rest of this task, or until
    ``reset_fields`` with the token returned."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown log field(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
    merged = {**bound(), **fields}
    # A new mapping every time: a task created meanwhile keeps the one it copied.
    return _BOUND.set({k: v for k, v in merged.items() if v is not None})


def reset_fields(token: contextvars.Token[Mapping[str, str] | None]) -> None:
    """Undo ``set_fields`` (and every change made after it in this context)."""
    _BOUND.reset(token)


@contextlib.contextmanager
def bind(**fields: str | None) -> Iterator[None]:
    """Bind fields for the ``with`` block."""
    token = set_fields(**fields)
    try:
        yield
    finally:
        reset_fields(token)


def bound() -> Mapping[str, str]:
    """The fields bound in this context now."""
    return _BOUND.get() or {}


def short_id() -> str:
    """A request id for requests that came without one (12 hex digits): a name in the logs,
    not a secret (random's generator: a tenth of the cost of a getrandom call per request)."""
    return f"{random.getrandbits(48):012x}"


class ContextFilter(logging.Filter):
    """Copies the bound fields onto each record that does not carry them (``extra`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in bound().items():
            if getattr(record, key, None) is None:
                setattr(record, key, value)
        return True


# ---- formats ------------------------------------------------------------------------------


class EcsFormatter(ecs_logging.StdlibFormatter):
    """ecs-logging's JSON line, with the node, the service and our fields by their ECS names."""

    def __init__(self, node: str, service: str) -> None:
        # Our attributes are left out under their Python names and put back under ECS's.
        super().__init__(
            extra={"host.name": node, "service.name": service},
            exclude_fields=FIELDS,
            ensure_ascii=False,
        )

    def format_to_ecs(self, record: logging.LogRecord) -> dict[str, Any]:
        result: dict[str, Any] = super().format_to_ecs(record)
        for key, name in ECS_FIELDS.items():
            value = getattr(record, key, None)
            if value is None:
                continue
            *parents, leaf = name.split(".")
            node = result
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = str(value)
        return result


class JournalHandler(logging.Handler):
    """Records to journald's native protocol through systemd-python, with our fields as journal
    fields (MODEL, ROUTE, REASON, REQUEST_ID) and the node as NODE; a record logged with
    ``extra={"private": True}`` is marked ``PRIVATE=1``: its message never leaves the device
    (cloudsync.agent.journal)."""

    def __init__(self, node: str, service: str) -> None:
        super().__init__()
        if journal is None:
            raise RuntimeError("systemd-python is not installed: `pip install edged[systemd]`")
        self.journal = journal.JournalHandler(SYSLOG_IDENTIFIER=service, NODE=node)

    def emit(self, record: logging.LogRecord) -> None:
        fields = {
            JOURNAL_FIELDS[key]: str(value)
            for key in FIELDS
            if (value := getattr(record, key, None)) is not None
        }
        if getattr(record, "private", False):
            fields["PRIVATE"] = "1"
        if fields:  # a copy: other handlers see the record as it was
            record = logging.makeLogRecord({**record.__dict__, **fields})
        self.journal.emit(record)


# ---- choosing and installing --------------------------------------------------------------


def under_journald(stream: IO[str], environ: Mapping[str, str] | None = None) -> bool:
    """True when ``stream`` is the one systemd connected to journald ($JOURNAL_STREAM names its
    device and inode; a child whose stderr was redirected inherits the variable, not the
    stream)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        found = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):  # no descriptor (StringIO), or closed
        return False
    return (found.st_dev, found.st_ino) == (int(device), int(inode))


def choose_format(
    requested: str,
    stream: IO[str],
    environ: Mapping[str, str] | None = None,
    journal_available: bool | None = None,
) -> Chosen:
    """The format to use: ``auto`` is journal under journald (when systemd-python imports), text
    on a terminal, else json; ``journal`` without systemd-python is json."""
    have_journal = journal is not None if journal_available is None else journal_available
    if requested == "auto":
        if have_journal and under_journald(stream, environ):
            return "journal"
        try:
            terminal = stream.isatty()
        except (OSError, ValueError, AttributeError):
            terminal = False
        return "text" if terminal else "json"
    if requested == "journal":
        return "journal" if have_journal else "json"
    if requested in ("json", "text"):
        return requested  # type: ignore[return-value]
    raise ValueError(f"unknown log format '{requested}': auto, journal, json or text")


def setup_logging(
    level: str, format: str, node: str, service: str, stream: IO[str] | None = None
) -> Chosen:
    """Send the root logger's records to ``stream`` (stderr) or journald in the chosen format at
    ``level``; replaces what an earlier call installed; returns the format chosen."""
    global _warned_no_journal
    stream = sys.stderr if stream is None else stream
    chosen = choose_format(format, stream)
    handler: logging.Handler
    if chosen == "journal":
        handler = JournalHandler(node, service)
    else:
        handler = logging.StreamHandler(stream)
        if chosen == "json":
            handler.setFormatter(EcsFormatter(node, service))
        else:
            timed = "" if under_journald(stream) else "%(asctime)s "  # journald stamps its own
            handler.setFormatter(logging.Formatter(timed + TEXT_FORMAT))
    handler.addFilter(ContextFilter())
    handler.set_name(f"{__name__}:{service}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if (h.get_name() or "").startswith(f"{__name__}:")]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())  # SIGHUP changes it the same way (edged.app)
    if format == "journal" and chosen != "journal" and not _warned_no_journal:
        _warned_no_journal = True
        logging.getLogger(__name__).warning(
            "log.format is journal but systemd-python is not installed: logging JSON lines to"
            " stderr instead (install edged[systemd], or python3-systemd on Debian)"
        )
    return chosen
