"""The device's system journal, read for an operator (the ``logs`` command, ``"source":
"journal"``): the lines of the units the config allows (edged's, cloudsync's, the updater's)
and systemd's own lines about them, since a time, at a level and above, the newest that fit
a byte cap. It needs no edged: the moment edged will not start is when its journal matters.

What leaves the device is a few fields of each entry, never the entry: the time, the unit, the
process, the level, the message (cut at 500 characters) and the request fields edged logs
(request id, model, route, reason). The journal's other fields (command lines, executables,
machine and boot ids, source files, whatever a program adds) stay. An entry logged with
``PRIVATE=1`` (edged.common.logs: ``extra={"private": True}``) leaves with its message
withheld and no request fields. Reading stops after ``MAX_SCANNED`` entries, said in the answer,
so that a filter matching nothing does not read a year of journal.

systemd-python is an optional import: without it the command fails, saying so.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from cloudsync.protocol.envelope import printable
from edged.common.logs import JOURNAL_FIELDS

LEVELS = {"debug": 7, "info": 6, "notice": 5, "warning": 4, "error": 3, "critical": 2}
NAMES = {0: "emergency", 1: "alert", 2: "critical", 3: "error", 4: "warning", 5: "notice"}
NAMES |= {6: "info", 7: "debug"}
MAX_MESSAGE = 500  # characters of one message
MAX_SCANNED = 200_000  # entries read at most for one answer
WITHHELD = "(private: kept on the device)"


def reader(directory: Path | None) -> Any:
    """A journal reader: the system's journal, or the journal files in ``directory``."""
    try:
        journal = importlib.import_module("systemd.journal")
    except ImportError:
        raise RuntimeError("this device cannot read its journal (no systemd-python)") from None
    return journal.Reader(path=str(directory)) if directory else journal.Reader()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def line(entry: dict[str, Any]) -> dict[str, Any]:
    """What of one entry leaves the device."""
    stamp = entry.get("__REALTIME_TIMESTAMP")
    pid = int(entry.get("_PID", 0) or 0)
    # systemd's own lines (PID 1) are about the unit they name, not the one they come from
    unit = entry.get("UNIT") if pid == 1 and entry.get("UNIT") else entry.get("_SYSTEMD_UNIT")
    out: dict[str, Any] = {
        "ts": int(stamp.timestamp() * 1000) if stamp is not None else 0,
        "unit": _text(unit or ""),
        "identifier": _text(entry.get("SYSLOG_IDENTIFIER", "")),
        "pid": pid,
        "level": NAMES.get(entry.get("PRIORITY", 6), "info"),
    }
    if _text(entry.get("PRIVATE", "")) == "1":
        return {**out, "message": WITHHELD}
    out["message"] = printable(_text(entry.get("MESSAGE", "")), MAX_MESSAGE)
    for key, field in JOURNAL_FIELDS.items():
        if field in entry:
            out[key] = printable(_text(entry[field]), 200)
    return out


def read(
    units: list[str],
    *,
    since_ms: int,
    level: str,
    lines: int,
    contains: str,
    directory: Path | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """The newest ``lines`` lines of ``units`` since ``since_ms`` at ``level`` and above
    (``contains`` in the message), oldest first, and how many entries were read."""
    floor = LEVELS[level]
    journal = reader(directory)
    try:
        for i, unit in enumerate(units):
            if i:
                journal.add_disjunction()
            journal.add_match(_SYSTEMD_UNIT=unit)
            journal.add_disjunction()
            journal.add_match(UNIT=unit, _PID="1")  # systemd's lines about the unit
        journal.seek_tail()
        found: list[dict[str, Any]] = []
        scanned = 0
        while len(found) < lines and scanned < MAX_SCANNED:
            entry = journal.get_previous()
            if not entry:
                break
            scanned += 1
            stamp = entry.get("__REALTIME_TIMESTAMP")
            if stamp is not None and stamp.timestamp() * 1000 < since_ms:
                break
            priority = entry.get("PRIORITY", 6)
            if not isinstance(priority, int) or priority > floor:
                continue
            kept = line(entry)
            if contains and contains not in kept["message"]:
                continue
            found.append(kept)
    finally:
        journal.close()
    return found[::-1], scanned
