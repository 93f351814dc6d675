"""``edgectl egress``: what left the device, from the egress ledger (edged/egress.py).

``list`` pages through the entries (filters: a request, a model, a caller's uid, a kind, a
time range); ``verify`` walks the whole chain, through edged, or offline over a copy of the
ledger's directory (``--dir``), and checks the fleet's checkpoints (``--checkpoint SEQ:HASH``)
are in it: a ledger edited, cut or rewritten since does not verify (exit 1). The files must also
hold the running edged's own head (through edged, or ``--dir`` of edged's own directory): a
file replaced or cut short under edged does not verify either. A copy, or files while edged is
not running, are verified alone, and the answer says they were not compared with edged."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from edged.client import Client, ClientError
from edged.common.digits import whole
from edged.common.egress import Checkpoint, anchors_of, verify
from edged.common.terminal import UsageError


def when_ms(text: str | None) -> int | None:
    """ms since the epoch, or an ISO 8601 time (UTC unless it says otherwise)."""
    if text is None:
        return None
    number = whole(text)
    if number is not None:
        return number
    try:
        at = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"'{text}': a time (ISO 8601, e.g. 2026-12-05T14:00Z) or ms") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.timezone.utc)
    return int(at.timestamp() * 1000)


def offline(client: Client, directory: Path, anchors: dict[int, str]) -> dict[str, Any]:
    """``verify --dir``: the files, compared with edged's head when they are the running edged's
    own (a shorter copy renamed over its segment verifies alone); a copy, or files while edged
    does not answer, alone, with why (``alone``)."""
    head, alone = None, "a copy: not edged's ledger directory"
    try:
        ledger = Client(client.socket_path, timeout=min(client.timeout, 10.0)).status()["egress"]
    except ClientError as exc:
        alone = f"edged does not answer: {exc.message}"
    else:
        if not ledger or not ledger["head"]["seq"]:
            alone = "edged's ledger is not open"
        elif same(Path(ledger["directory"]), directory):
            head = Checkpoint(ledger["head"]["seq"], ledger["head"]["hash"])
    report = verify(directory, anchors, head).as_dict()
    return report if head else {**report, "alone": alone}


def same(one: Path, other: Path) -> bool:
    try:
        return one.samefile(other)
    except OSError:
        return False


def line(entry: dict[str, Any]) -> str:
    at = datetime.datetime.fromtimestamp(entry["ts"] / 1000, datetime.timezone.utc)
    where = entry.get("endpoint") or ""
    what = entry.get("request_id") or entry.get("why") or ""
    return (
        f"{entry['seq']:>8} {at:%Y-%m-%d %H:%M:%S} {entry['kind']:<12} {what:<20.20}"
        f" {entry.get('model') or '':<22.22} {entry.get('uid', '')!s:>6}"
        f" {entry.get('route') or '':<9} {entry.get('bytes', '')!s:>8}"
        f" {(entry.get('sha256') or '')[:12]:<12} {where}"
    )


def cmd_egress(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    if args.action == "verify":
        checkpoints = args.checkpoint
        if args.dir:
            try:
                anchors = anchors_of(checkpoints)
            except ValueError as exc:
                raise UsageError(f"--checkpoint: {exc}") from None
            report = offline(client, Path(args.dir), anchors)
        else:
            try:
                report = client.verify_egress(checkpoints)
            except ClientError as exc:
                if exc.status:
                    raise
                raise ClientError(
                    0,
                    f"{exc.message} (--dir, e.g. /var/lib/edged/egress,"
                    " verifies the ledger's files alone, not compared with"
                    " edged's head)",
                ) from None
        last = report["last"]
        text = (
            f"{report['entries']} entries, seq {report['first_seq']} to {last['seq']}, head"
            f" {last['hash']}"
            + (
                f"; entries up to seq {report['pruned_through']} pruned (recorded)"
                if report["pruned_through"]
                else ""
            )
            + (
                f"; a torn last line of {report['torn_bytes']} bytes (no entry)"
                if report["torn_bytes"]
                else ""
            )
            + (f"; checkpoints in the chain: {len(report['anchors'])}" if report["anchors"] else "")
            + (
                f"; edged's head (seq {report['edged_head']['seq']}) is in it"
                if report["edged_head"]
                else f"; not compared with edged's head ({report.get('alone') or 'it has none'})"
            )
        )
        if not report["ok"]:
            raise ClientError(500, f"the egress ledger does not verify: {report['error']}")
        return report, f"ok: {text}"
    reply = client.egress(
        after=args.after,
        limit=args.limit,
        request_id=args.request,
        model=args.model,
        uid=args.uid,
        kind=args.kind,
        since_ms=when_ms(args.since),
        until_ms=when_ms(args.until),
    )
    lines = [
        f"{'SEQ':>8} {'TIME (UTC)':<19} {'KIND':<12} {'REQUEST':<20} {'MODEL':<22} {'UID':>6}"
        f" {'ROUTE':<9} {'BYTES':>8} {'SHA256':<12} ENDPOINT"
    ]
    lines += [line(e) for e in reply["entries"]]
    if reply["next"] is not None:
        lines.append(f"(more: --after {reply['next']})")
    return reply, "\n".join(lines)


def add_parser(sub: Any) -> None:
    egress = sub.add_parser(
        "egress",
        help="what left the device, from the egress ledger: list, verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    egress.add_argument("action", choices=["list", "verify"], nargs="?", default="list")
    egress.add_argument("--after", type=int, default=0, help="list: entries after this seq")
    egress.add_argument("--limit", type=int, default=100, help="list: at most (1-1000)")
    egress.add_argument("--request", help="list: this request id's entries")
    egress.add_argument("--model", help="list: this model's")
    egress.add_argument("--uid", type=int, help="list: this caller's (a uid)")
    egress.add_argument("--kind", help="list: cloud-infer, answer-model, started...")
    egress.add_argument("--since", help="list: from this time (ISO 8601, UTC, or ms)")
    egress.add_argument("--until", help="list: up to this time")
    egress.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="verify: SEQ:SHA256, one the fleet holds (repeat)",
    )
    egress.add_argument("--dir", help="verify: a copy of the ledger's directory, offline")
    egress.set_defaults(fn=cmd_egress)
