"""edgefleet: the operators' view of a fleet over the same MQTT contract (docs/PROTOCOL.md).

    edgefleet keygen --kid fleet-1              a fleet key: fleet-1.key (keep it), fleet-1.pub
                                                (install it on nodes as /etc/edged/trust/)
    edgefleet nodes                             a table of the fleet's nodes: online or offline
                                                (retained status, or no heartbeat for 3 intervals),
                                                last heartbeat, outbox depth, models
    edgefleet watch                             every message of the fleet as it arrives
    edgefleet cmd NODE ping [--arg k=v ...]     a signed command; prints the node's result
                                                (ping, status, models, routing, set-routing,
                                                reset-routing, reload, drain, resume, logs)

The broker: --host, --port, and a directory (--pki) holding ca.pem and the operator's
certificate {--cert-name}.pem/.key (its CN has the operators' ACL). Exit codes: 0 ok, 1 the
command failed or was refused, 2 usage, 3 the broker cannot be reached, 4 no answer in time.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.agent import COMMANDS
from cloudsync.commands import sign
from cloudsync.mqtt import envelope
from cloudsync.mqtt.envelope import EnvelopeError
from cloudsync.mqtt.sync import SyncClient
from cloudsync.mqtt.topics import LEAVES, TopicError, Topics, fleet_filter, parse
from edged.edgectl import UsageError, key_values

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_TIMEOUT = range(5)
OFFLINE_AFTER = 3  # heartbeat intervals without one: offline


class Failure(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def secure_link_url(base: str, uri: str, secret: str, lifetime_s: float = 3600.0) -> str:
    """A signed, expiring URL in the form nginx's secure_link checks (``secure_link_md5
    "$secure_link_expires$uri SECRET"``), as CDNs sign theirs."""
    expires = int(time.time() + lifetime_s)
    digest = hashlib.md5(f"{expires}{uri} {secret}".encode(), usedforsecurity=False).digest()
    token = base64.urlsafe_b64encode(digest).decode().rstrip("=")
    return f"{base.rstrip('/')}{uri}?md5={token}&expires={expires}"


def connect(args: argparse.Namespace) -> SyncClient:
    client = SyncClient(args.port, Path(args.pki), args.cert_name, host=args.host)
    if not client.connect(timeout=args.timeout):
        raise Failure(f"cannot connect to {args.host}:{args.port}", EXIT_UNREACHABLE)
    return client


def cmd_keygen(args: argparse.Namespace) -> str:
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    private, public = directory / f"{args.kid}.key", directory / f"{args.kid}.pub"
    if private.exists():
        raise Failure(f"{private} exists: a key is never overwritten", EXIT_USAGE)
    key = Ed25519PrivateKey.generate()
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return f"{private} (secret: signs commands)\n{public} (install on nodes: /etc/edged/trust/)"


def collect(args: argparse.Namespace) -> list[tuple[str, bytes]]:
    client = connect(args)
    try:
        for kind in ("status", "heartbeat"):
            client.subscribe(fleet_filter(args.fleet, kind))
        time.sleep(args.wait)  # retained statuses come at once; heartbeats within an interval
        return list(client.received)
    finally:
        client.close()


def nodes_table(messages: list[tuple[str, bytes]], now_ms: int) -> list[dict[str, Any]]:
    """A row per node from status and heartbeat messages (the latest of each)."""
    nodes: dict[str, dict[str, Any]] = {}
    for topic, payload in messages:
        try:
            where, env = parse(topic), envelope.decode(payload)
        except (TopicError, EnvelopeError):
            continue
        row = nodes.setdefault(where.node, {"node": where.node, "state": "unknown"})
        if where.kind == "status":
            row["state"] = env.body.get("state", "unknown")
            row["software"] = env.body.get("software", {})
            row["models"] = [m.get("name") for m in env.body.get("models", [])]
        elif where.kind == "heartbeat":
            row["heartbeat_ms"] = env.ts
            row["outbox"] = env.body.get("outbox", {}).get("pending")
    for row in nodes.values():
        seen = row.get("heartbeat_ms")
        row["heartbeat_age_s"] = None if seen is None else round((now_ms - seen) / 1000, 1)
    return sorted(nodes.values(), key=lambda r: r["node"])


def cmd_nodes(args: argparse.Namespace) -> tuple[Any, str]:
    rows = nodes_table(collect(args), envelope.now_ms())
    for row in rows:
        age = row["heartbeat_age_s"]
        if row["state"] == "online" and age is not None and age > OFFLINE_AFTER * args.interval:
            row["state"] = "offline (no heartbeat)"
    lines = [f"{'NODE':20} {'STATE':24} {'HEARTBEAT':>10} {'OUTBOX':>7}  MODELS"]
    for r in rows:
        age = "-" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.0f}s ago"
        outbox = "-" if r.get("outbox") is None else str(r["outbox"])
        models = ", ".join(str(m) for m in r.get("models", [])) or "-"
        lines.append(f"{r['node']:20} {r['state']:24} {age:>10} {outbox:>7}  {models}")
    return rows, "\n".join(lines)


def cmd_watch(args: argparse.Namespace) -> tuple[Any, str]:
    client = connect(args)
    for kind in LEAVES:
        client.subscribe(fleet_filter(args.fleet, kind))
    shown = 0
    deadline = time.monotonic() + args.wait if args.wait else None
    try:
        while deadline is None or time.monotonic() < deadline:
            for topic, payload in client.wait_messages(shown + 1, 0.5)[shown:]:
                shown += 1
                print(f"{topic} {payload.decode(errors='replace')}", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return None, ""


def cmd_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    key = serialization.load_pem_private_key(Path(args.sign_key).read_bytes(), None)
    if not isinstance(key, Ed25519PrivateKey):
        raise Failure(f"{args.sign_key} is not an Ed25519 private key", EXIT_USAGE)
    try:
        cmd_args = key_values(args.arg)
    except UsageError as exc:
        raise Failure(str(exc), EXIT_USAGE) from None
    topics = Topics(args.fleet, args.node)
    cmd_id, payload = sign(
        key, args.kid, args.cert_name, f"{args.fleet}/{args.node}", args.name, cmd_args,
        args.lifetime,
    )  # fmt: skip
    client = connect(args)
    try:
        client.subscribe(topics.cmd_result(cmd_id))
        if client.publish(topics.cmd(cmd_id), payload).is_failure:
            raise Failure("the broker refused the command (ACL?)", EXIT_FAILED)
        got = client.wait_messages(1, args.timeout)
    finally:
        client.close()
    if not got:
        raise Failure(f"no result from {args.node} in {args.timeout} s", EXIT_TIMEOUT)
    result = envelope.decode(got[0][1]).body
    if not result.get("ok"):
        raise Failure(f"{args.node}: {result.get('error')}", EXIT_FAILED)
    return result, json.dumps(result.get("result"), indent=2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgefleet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="localhost", help="the broker (default: localhost)")
    parser.add_argument("--port", type=int, default=8883)
    parser.add_argument("--pki", default="/etc/edged/fleet", help="ca.pem and the certificate")
    parser.add_argument("--cert-name", default="operator", help="{name}.pem and {name}.key")
    parser.add_argument("--fleet", default="default")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    sub = parser.add_subparsers(dest="command", required=True)
    keygen = sub.add_parser("keygen", help="a fleet signing key pair")
    keygen.add_argument("--kid", required=True, help="the key's name (nodes trust {kid}.pub)")
    keygen.add_argument("--dir", default=".", help="where to write it")
    keygen.set_defaults(fn=lambda args: (None, cmd_keygen(args)))
    nodes = sub.add_parser("nodes", help="the fleet's nodes, online or offline")
    nodes.add_argument("--wait", type=float, default=2.0, help="seconds to listen")
    nodes.add_argument("--interval", type=float, default=10.0, help="the heartbeat interval")
    nodes.set_defaults(fn=cmd_nodes)
    watch = sub.add_parser("watch", help="every message of the fleet")
    watch.add_argument("--wait", type=float, default=0, help="stop after this (0: Ctrl-C)")
    watch.set_defaults(fn=cmd_watch)
    cmd = sub.add_parser("cmd", help="a signed command to a node")
    cmd.add_argument("node")
    cmd.add_argument("name", help=COMMANDS)
    cmd.add_argument("--arg", action="append", default=[], help="name=value (JSON values too)")
    cmd.add_argument("--sign-key", required=True, help="the fleet key (PEM Ed25519)")
    cmd.add_argument("--kid", required=True, help="its name on the nodes")
    cmd.add_argument("--lifetime", type=float, default=300.0, help="seconds it stays valid")
    cmd.set_defaults(fn=cmd_cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        reply, text = args.fn(args)
    except Failure as exc:
        print(f"edgefleet: {exc}", file=sys.stderr)
        return exc.code
    except (TopicError, OSError, ValueError) as exc:
        print(f"edgefleet: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json and reply is not None:
        print(json.dumps(reply, indent=2))
    elif text:
        print(text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
