"""edgefleet: the operators' view of a fleet over the same MQTT contract (docs/PROTOCOL.md).

    edgefleet keygen --kid fleet-1              a fleet key: fleet-1.key (keep it), fleet-1.pub
                                                (install it on nodes as /etc/edged/trust/);
                                                --commands rollback: a scoped key (deploy-1)
    edgefleet nodes                             a table of the fleet's nodes: online or offline
                                                (retained status, or no heartbeat for 3 intervals),
                                                last heartbeat, outbox depth, models; every
                                                node, or exit 4 and "partial list" if the
                                                broker did not hand every retained status
    edgefleet watch                             every message of the fleet as it arrives
    edgefleet logs NODE [--unit edged] [--since 1h] --sign-key F --kid K   the node's journal
                                                lines, even when edged is down
    edgefleet cmd NODE ping [--arg k=v ...]     a signed command; prints the node's result
                                                (ping, status, models, routing, set-routing,
                                                reset-routing, reload, drain, resume, logs)
    edgefleet manifest --model M --version N --file F ...   a signed model manifest
                                                (--remove: a signed removal)
    edgefleet trust make --version N --key KID=PUB ... --sign KID=KEY ...  a signed trust
                                                document (keys, --revoke CERT); trust publish
                                                FILE --node NODE: retained for those nodes

With the fleet service (``--service URL``, a token in --token-file or $EDGEFLEET_TOKEN):

    edgefleet serve [--config F]                run the service (docs/OPERATIONS.md)
    edgefleet token --name N --role R           a new API token and its config lines
    edgefleet --service URL nodes               every node, from the service's registry
    edgefleet --service URL label NODE k=v ...  set a node's operator labels (none: clear)
    edgefleet --service URL enrol token NODE    a one-time enrolment token for a new device
    edgefleet --service URL enrol list|approve RID|refuse RID    requests without a token
    edgefleet --service URL enrol revoke NODE   (an admin's) its certificates into the CRL,
                                                its session closed, its name barred
    edgefleet --service URL enrol reinstate NODE   the name may enrol again
    edgefleet --service URL deploy create ID --manifest F --url PATH=URL [--selector k=v]
                                                [--priority N]; deploy list; deploy delete ID
    edgefleet --service URL cmd NODE drain ...  signed here with your key, relayed and kept by
                                                the service (it holds no such key)
    edgefleet --service URL rollout create ID --manifest F ...   a canary rollout, run by the
                                                service (it goes on when this returns; only
                                                there: docs/PROTOCOL.md); rollout status,
                                                pause, resume, promote, abort ID; --wait
                                                [SECONDS]: followed to its end, its progress
                                                on stderr (exit 0 done, 1 aborted, 4 going)
    edgefleet --service URL checkpoints NODE   its egress ledgers' heads (SEQ:SHA256 lines)
    edgefleet --service URL ab start ID --model M --b-cloud-name B [--selector k=v]
                                                an A/B test of a cloud model over the nodes,
                                                decided by the service; ab list, show, stop ID

Without --service, the broker: --host, --port, and a directory (--pki) holding ca.pem and the
operator's certificate {--cert-name}.pem/.key (its CN has the operators' ACL). These options,
--json and --timeout go before or after the command's name. Exit codes: 0 ok, 1 the command
failed or was refused, 2 usage, 3 the broker (or the service) cannot be reached, 4 no answer
in time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cloudsync.fleet import abtests, daemon, gates
from cloudsync.fleet.client import (
    ServiceError,
    cmd_ab,
    cmd_checkpoints,
    cmd_deploy,
    cmd_enrol,
    cmd_label,
    listed,
    service_cmd,
    service_nodes,
    service_rollout,
)
from cloudsync.fleet.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    Failure,
)
from cloudsync.fleet.config import FleetServiceConfig
from cloudsync.fleet.registry import serving
from cloudsync.protocol import envelope, manifest, trust
from cloudsync.protocol.commands import COMMANDS, sign
from cloudsync.protocol.envelope import EnvelopeError
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import LEAVES, TopicError, Topics, barrier, fleet_filter, parse
from edged.common.settings import keys_help
from edged.common.terminal import UsageError, key_values, reader_may_go

OFFLINE_AFTER = 3  # heartbeat intervals without one: offline


def connect(args: argparse.Namespace) -> SyncClient:
    client = SyncClient(args.port, Path(args.pki), args.cert_name, host=args.host)
    if not client.connect(timeout=args.timeout):
        raise Failure(f"cannot connect to {args.host}:{args.port}", EXIT_UNREACHABLE)
    return client


def cmd_serve(args: argparse.Namespace) -> tuple[Any, str]:
    daemon.serve(args.config, args.log_level)
    return None, ""


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
    if not args.commands:
        return f"{private} (secret: signs commands)\n{public} (install on nodes: /etc/edged/trust/)"
    scope = directory / f"{args.kid}.commands"
    scope.write_text("".join(f"{name}\n" for name in args.commands))
    return (
        f"{private} (secret: signs only {', '.join(args.commands)})\n{public} and {scope}"
        " (install both on nodes: /etc/edged/trust/; without the scope file the key signs"
        " every command and manifests)"
    )


def collect(args: argparse.Namespace) -> tuple[list[tuple[str, bytes]], bool]:
    """The fleet's retained statuses and the heartbeats of ``--wait`` seconds, and whether every
    retained status came (the barrier came back within ``--timeout``)."""
    client = connect(args)
    marker, token = barrier(args.fleet), envelope.new_id()
    try:
        # subscribe and publish the marker back to back: the broker queues the subscription's
        # retained statuses, then the marker (topics.barrier)
        kinds = ("status", "heartbeat")
        client.client.subscribe([(fleet_filter(args.fleet, kind), 1) for kind in kinds])
        client.client.publish(marker, json.dumps({"barrier": token}).encode(), qos=1)
        scanned = 0

        def came() -> bool:  # what arrived since the last look only (thousands of statuses)
            nonlocal scanned
            new, scanned = client.received[scanned:], len(client.received)
            return any(t == marker and token.encode() in p for t, p in new)

        with client.changed:
            complete = client.changed.wait_for(came, args.timeout)
        time.sleep(args.wait)  # heartbeats come within an interval
        return [(t, p) for t, p in client.received if t != marker], complete
    finally:
        client.close()


def nodes_table(messages: list[tuple[str, bytes]], now_ms: int) -> list[dict[str, Any]]:
    """A row per node from status and heartbeat messages (the latest of each). Its models are
    the birth's with those its heartbeat says are serving, as the service counts them
    (``registry.serving``): a node born before edged had loaded its models lists them from its
    next heartbeat on."""
    nodes: dict[str, dict[str, Any]] = {}
    seen: dict[str, dict[str, Any]] = {}  # node: the birth's models, the heartbeat's, and when
    for topic, payload in messages:
        try:
            where, env = parse(topic), envelope.decode(payload)
        except (TopicError, EnvelopeError):
            continue
        row = nodes.setdefault(where.node, {"node": where.node, "state": "unknown"})
        parts = seen.setdefault(
            where.node, {"born": [], "beat": None, "born_ts": None, "beat_ts": None}
        )
        if where.kind == "status":
            row["state"] = env.body.get("state", "unknown")
            row["software"] = env.body.get("software", {})
            models = env.body.get("models")
            models = models if isinstance(models, list) else []
            parts["born"] = [
                m for m in models if isinstance(m, dict) and isinstance(m.get("name"), str)
            ]
            parts["born_ts"] = env.ts
        elif where.kind == "heartbeat":
            row["heartbeat_ms"] = parts["beat_ts"] = env.ts
            outbox = env.body.get("outbox")
            row["outbox"] = outbox.get("pending") if isinstance(outbox, dict) else None
            parts["beat"] = env.body
    for node, row in nodes.items():
        parts = seen[node]
        serving_now = serving(parts["born"], parts["beat"], parts["beat_ts"], parts["born_ts"])
        row["models"] = [m["name"] for m in serving_now]
        beat = row.get("heartbeat_ms")
        row["heartbeat_age_s"] = None if beat is None else round((now_ms - beat) / 1000, 1)
    return sorted(nodes.values(), key=lambda r: r["node"])


def cmd_nodes(args: argparse.Namespace) -> tuple[Any, str]:
    if args.service:
        return service_nodes(args)
    messages, complete = collect(args)
    rows = nodes_table(messages, envelope.now_ms())
    if not complete:  # the table is printed, the exit code says it is partial
        print(
            f"edgefleet: partial list ({len(rows)} nodes): the broker did not hand every"
            f" retained status within {args.timeout:g} s (its max_queued_messages must hold"
            " the fleet's statuses; --timeout waits longer)",
            file=sys.stderr,
        )
        args.exit_code = EXIT_TIMEOUT
    for row in rows:
        age = row["heartbeat_age_s"]
        if row["state"] == "online" and age is not None and age > OFFLINE_AFTER * args.interval:
            row["state"] = "offline (no heartbeat)"
    lines = [f"{'NODE':20} {'STATE':24} {'HEARTBEAT':>10} {'OUTBOX':>7}  MODELS"]
    width = max(30, shutil.get_terminal_size((120, 24)).columns - 66)  # the line fits
    for r in rows:
        age = "-" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.0f}s ago"
        outbox = "-" if r.get("outbox") is None else str(r["outbox"])
        models = listed([str(m) for m in r.get("models", [])], width)
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


def load_key(path: str) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), None)
    if not isinstance(key, Ed25519PrivateKey):
        raise Failure(f"{path} is not an Ed25519 private key", EXIT_USAGE)
    return key


def cmd_manifest(args: argparse.Namespace) -> tuple[Any, str]:
    """A signed manifest for a version's files (printed, or written to --out)."""
    files = [manifest.file_entry(Path(p)) for p in args.file]
    targets: dict[str, Any] = {}
    if args.target_fleet:
        targets["fleet"] = args.target_fleet
    if args.hardware:
        targets["hardware"] = args.hardware
    if args.nodes:
        targets["nodes"] = args.nodes
    smoke = json.loads(Path(args.smoke).read_text()) if args.smoke else []
    if bool(files) == args.remove:
        raise Failure("manifest: --file for each file of a version, or --remove", EXIT_USAGE)
    try:
        signed = manifest.make(
            args.model,
            args.version,
            files,
            args.lifetime,
            targets,
            smoke,
            args.remove,
            args.deb_version,
        )
    except manifest.ManifestError as exc:
        raise Failure(f"manifest: {exc}", EXIT_USAGE) from None
    keys = {}
    for item in args.sign:
        kid, _, path = item.partition("=")
        keys[kid] = load_key(path)
    doc = manifest.sign(signed, keys)
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text)
        what = "removal" if args.remove else f"{len(files)} files"
        return doc, f"{args.out}: {args.model} version {args.version}, {what}"
    return doc, text


NO_SERVICE_ROLLOUT = (
    "rollout: the fleet service runs rollouts (--service URL): they go on when this shell is"
    " gone, survive the service's restarts, and are judged and rolled back with its deploy key;"
    " one box without a service runs `edgefleet serve` on SQLite (docs/OPERATIONS.md)"
)


def cmd_rollout(args: argparse.Namespace) -> tuple[Any, str]:
    if not args.service:
        raise Failure(NO_SERVICE_ROLLOUT, EXIT_USAGE)
    return service_rollout(args)


def cmd_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    try:
        cmd_args = key_values(args.arg)
    except UsageError as exc:
        raise Failure(str(exc), EXIT_USAGE) from None
    result = run_command(args, args.name, cmd_args)
    return result, json.dumps(result.get("result"), indent=2)


def run_command(args: argparse.Namespace, name: str, cmd_args: dict[str, Any]) -> dict[str, Any]:
    """Command ``name`` signed with ``--sign-key`` and sent to ``args.node`` (through the
    service with --service, else the broker); the node's result, once it came (``--timeout``)."""
    key = load_key(args.sign_key)
    if args.service:
        return service_cmd(args, key, name, cmd_args)
    topics = Topics(args.fleet, args.node)
    cmd_id, payload = sign(
        key,
        args.kid,
        args.cert_name,
        f"{args.fleet}/{args.node}",
        name,
        cmd_args,
        args.lifetime,
    )
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
    return dict(result)


UNITS = {"edged": "edged.service", "cloudsync": "cloudsync.service"}
UNITS["updater"] = UNITS["edged-updater"] = "edged-updater.service"
SPANS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(text: str, option: str) -> int:
    """``90``, ``90s``, ``30m``, ``2h`` or ``3d`` as seconds; a usage error naming ``option``."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in SPANS else (text, "s")
    if not number.isdigit() or int(number) <= 0:
        raise Failure(f"{option} {text!r}: a time like 90s, 30m, 2h or 3d", EXIT_USAGE)
    return int(number) * SPANS[unit]


def cmd_logs(args: argparse.Namespace) -> tuple[Any, str]:
    """A node's journal lines (its ``logs`` command, source journal): edged's by default, and
    systemd's about it; answered by cloudsync whether edged runs or not."""
    units = [UNITS.get(u, u) for u in args.unit or ["edged"]]
    cmd_args: dict[str, Any] = {
        "source": "journal",
        "units": units,
        "since_s": seconds(args.since, "--since"),
        "level": args.level,
        "lines": args.lines,
        "max_bytes": args.max_bytes,
    }
    if args.contains:
        cmd_args["contains"] = args.contains
    result = run_command(args, "logs", cmd_args)["result"]
    text = [
        f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(row['ts'] / 1000))}Z"
        f" {row['unit'] or row['identifier']}[{row['pid']}] {row['level']}: {row['message']}"
        for row in result["lines"]
    ]
    if result.get("left_out"):
        text.append(f"({result['left_out']} older lines left out: over --max-bytes)")
    if result.get("scanned"):
        text.append(f"(read {result['scanned']} entries, then stopped: older ones not read)")
    return result, "\n".join(text) or f"no lines of {', '.join(units)} since {args.since}"


def load_public(path: str) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise Failure(f"{path} is not an Ed25519 public key", EXIT_USAGE)
    return key


def cmd_trust(args: argparse.Namespace) -> tuple[Any, str]:
    """``trust make``: a signed trust document; ``trust publish``: it, retained, to nodes."""
    if args.action == "publish":
        if not (args.file and args.node):
            raise Failure("trust publish FILE --node NODE (repeat)", EXIT_USAGE)
        doc = json.loads(Path(args.file).read_text())
        payload = envelope.Envelope(args.cert_name, envelope.now_ms(), doc).encode()
        client = connect(args)
        try:
            for node in args.node:
                if client.publish(
                    Topics(args.fleet, node).desired_trust, payload, retain=True
                ).is_failure:
                    raise Failure(f"the broker refused the document for {node} (ACL?)", EXIT_FAILED)
        finally:
            client.close()
        return {"published": args.node}, f"{args.file}: retained for {', '.join(args.node)}"
    if not (args.version and args.key and args.sign):
        raise Failure("trust make --version N --key KID=PUB (repeat) --sign KID=KEY", EXIT_USAGE)
    keys: dict[str, tuple[Ed25519PublicKey, list[str] | None]] = {}
    for item in args.key:
        kid, _, rest = item.partition("=")
        path, _, scope = rest.partition(":")
        keys[kid] = (load_public(path), scope.split(",") if scope else None)
    revoked = []
    for path in args.revoke:
        pem = Path(path).read_bytes()
        der = x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
        revoked.append(trust.fingerprint(der))
    signing = {kid: load_key(p) for kid, _, p in (i.partition("=") for i in args.sign)}
    try:
        signed = trust.make(args.version, keys, args.threshold, revoked, args.lifetime)
    except trust.TrustError as exc:
        raise Failure(f"trust: {exc}", EXIT_USAGE) from None
    doc = trust.sign(signed, signing)
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text)
        return doc, (
            f"{args.out}: trust version {args.version}, keys {sorted(keys)},"
            f" threshold {args.threshold}, {len(revoked)} revoked"
        )
    return doc, text


# The options of every command, before or after its name (``edgefleet nodes --json``).
GLOBAL_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--host", {"default": "localhost", "help": "the broker (default: localhost)"}),
    ("--port", {"type": int, "default": 8883}),
    ("--pki", {"default": "/etc/edged/fleet", "help": "ca.pem and the certificate"}),
    ("--cert-name", {"default": "operator", "help": "{name}.pem and {name}.key"}),
    ("--fleet", {"default": "default"}),
    ("--timeout", {"type": float, "default": 10.0, "help": "seconds to wait"}),
    ("--json", {"action": "store_true", "default": False, "help": "print the answer as JSON"}),
    ("--service", {"help": "the fleet service's URL (http[s]://host:port)"}),
    ("--token-file", {"help": "the service's API token (else $EDGEFLEET_TOKEN)"}),
    ("--service-ca", {"help": "the CA of the service's HTTPS certificate"}),
]


def add_global_options(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """The options every command takes; after a command's name they change only what is given
    (their defaults are the ones before it)."""
    group = parser.add_argument_group("options of every command") if after_command else parser
    for flag, settings in GLOBAL_OPTIONS:
        if after_command:
            settings = {**settings, "default": argparse.SUPPRESS}
        group.add_argument(flag, **settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgefleet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    keygen = sub.add_parser("keygen", help="a fleet signing key pair")
    keygen.add_argument("--kid", required=True, help="the key's name (nodes trust {kid}.pub)")
    keygen.add_argument("--dir", default=".", help="where to write it")
    keygen.add_argument(
        "--commands",
        action="append",
        default=[],
        help="scope the key to this"
        " command (repeat): {kid}.commands beside the .pub; the fleet service's"
        " deploy key: --commands rollback --commands cloud-ab",
    )
    keygen.set_defaults(fn=lambda args: (None, cmd_keygen(args)))
    nodes = sub.add_parser("nodes", help="the fleet's nodes, online or offline")
    nodes.add_argument(
        "--wait",
        type=float,
        default=2.0,
        help="seconds to listen for heartbeats once every retained status has come",
    )
    nodes.add_argument("--interval", type=float, default=10.0, help="the heartbeat interval")
    nodes.add_argument(
        "--state", choices=["online", "offline", "stale"], help="with --service: only these"
    )
    nodes.add_argument(
        "--selector",
        action="append",
        default=[],
        help="with --service: only nodes with this label (k=v, repeat)",
    )
    nodes.set_defaults(fn=cmd_nodes)
    serve = sub.add_parser(
        "serve",
        help="run the fleet service",
        description="Run the fleet service (docs/OPERATIONS.md). Its config's keys, section by"
        " section, with their defaults:\n\n" + "\n".join(keys_help(FleetServiceConfig)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", type=Path, help="TOML (default /etc/edgefleet/edgefleet.toml)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(fn=cmd_serve)
    tok = sub.add_parser("token", help="a new API token for the fleet service")
    tok.add_argument("--name", required=True, help="who holds it (the audit log's actor)")
    tok.add_argument("--role", required=True, choices=["viewer", "operator", "admin"])
    tok.set_defaults(fn=lambda args: (None, daemon.token(args.name, args.role)))
    label = sub.add_parser("label", help="set a node's operator labels (service)")
    label.add_argument("node")
    label.add_argument("labels", nargs="*", help="k=v (none: clear the operators' labels)")
    label.set_defaults(fn=cmd_label)
    deploy = sub.add_parser("deploy", help="continuous deployments to labels (service)")
    deploy.add_argument("action", choices=["create", "list", "show", "delete"])
    deploy.add_argument("id", nargs="?", help="the deployment's id (a name)")
    deploy.add_argument("--manifest", help="create: the signed manifest")
    deploy.add_argument("--url", action="append", default=[], help="create: PATH=signed URL")
    deploy.add_argument("--cdn", help="create: base URL of a CDN checking secure links")
    deploy.add_argument("--cdn-prefix", default="/models", help="create: the files' URI prefix")
    deploy.add_argument("--secure-link-secret-file", help="create: the CDN's secret")
    deploy.add_argument("--url-lifetime", type=float, default=30 * 24 * 3600.0, help="seconds")
    deploy.add_argument(
        "--selector", action="append", default=[], help="create: k=v (repeat; none: every node)"
    )
    deploy.add_argument("--priority", type=int, default=0, help="create: the higher wins")
    deploy.set_defaults(fn=cmd_deploy)
    ab = sub.add_parser(
        "ab",
        help="A/B tests of a cloud model across nodes, decided by the service (service)",
        description=abtests.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ab.add_argument("action", choices=["start", "list", "show", "stop"])
    ab.add_argument("id", nargs="?", help="the test's id (a name)")
    ab.add_argument("--model", help="start: the model whose cloud calls are split")
    ab.add_argument("--b-cloud-name", help="start: arm b, a version on the cloud server")
    ab.add_argument("--share", type=float, default=0.5, help="start: b's share of the calls")
    ab.add_argument(
        "--selector",
        action="append",
        default=[],
        help="start: k=v (repeat; none: every online node)",
    )
    ab.add_argument("--min-calls", type=int, default=200, help="start: of each arm, in all")
    ab.add_argument("--confidence", type=float, default=0.95, help="start: P(better) that decides")
    ab.add_argument("--max-calls", type=int, default=20000, help="start: then a stays")
    ab.add_argument(
        "--latency-ms",
        type=float,
        help="start: a slower call is not good (default: each node's [cloud] ab_latency_ms)",
    )
    ab.add_argument(
        "--min-confidence",
        type=float,
        help="start: a less sure answer is not good"
        " (default: each node's [cloud] ab_min_confidence)",
    )
    ab.add_argument(
        "--min-score",
        type=float,
        help="start: an operator's score below this is"
        " not good (default: each node's [cloud] ab_min_score)",
    )
    ab.set_defaults(fn=cmd_ab)
    anchors = sub.add_parser(
        "checkpoints",
        help="a node's egress ledger checkpoints, SEQ:SHA256 a line (service)",
        description="The heads of a node's egress ledgers as its heartbeats carried them, kept"
        " by the service (one an hour): on the node, edgectl egress verify --checkpoint SEQ:HASH"
        " fails on a ledger rewritten since.",
    )
    anchors.add_argument("node")
    anchors.add_argument(
        "--ledger",
        choices=["edged", "uplink"],
        default="edged",
        help="edged's (cloud calls) or cloudsync's (its messages)",
    )
    anchors.add_argument("--limit", type=int, default=100, help="the newest this many")
    anchors.set_defaults(fn=cmd_checkpoints)
    enrol = sub.add_parser("enrol", help="new devices' certificates (service)")
    enrol.add_argument(
        "action", choices=["token", "list", "approve", "refuse", "revoke", "reinstate"]
    )
    enrol.add_argument(
        "target",
        nargs="?",
        help="token, revoke, reinstate: the node's name; approve, refuse: the request's id",
    )
    enrol.add_argument("--serial", help="revoke: this certificate (hex) instead of a node's")
    enrol.add_argument("--ttl", type=float, default=86400.0, help="token: seconds it is good for")
    enrol.add_argument("--state", choices=["pending", "issued", "refused"], help="list: only")
    enrol.set_defaults(fn=cmd_enrol)
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
    logs = sub.add_parser(
        "logs",
        help="a node's journal: edged's lines and systemd's about it, even when edged is down",
        description="The node's system journal, read by its cloudsync (a signed logs command,"
        " source journal) and answered whether edged runs or not: the time, unit, process,"
        " level and message of each line, nothing else of the journal; a line edged marked"
        " private comes without its message. Only the units in the node's [commands]"
        " journal_units.",
    )
    logs.add_argument("node")
    logs.add_argument(
        "--unit",
        action="append",
        help="edged (the default), cloudsync, edged-updater, or a unit's full name (repeat)",
    )
    logs.add_argument("--since", default="1h", help="how far back: 90s, 30m, 2h, 3d (1h)")
    logs.add_argument(
        "--level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    logs.add_argument("--lines", type=int, default=200, help="the newest this many (1 to 1000)")
    logs.add_argument("--contains", default="", help="only lines whose message has this")
    logs.add_argument(
        "--max-bytes",
        type=int,
        default=65536,
        help="the answer's size at most (the node keeps the newest lines that fit)",
    )
    logs.add_argument("--sign-key", required=True, help="the fleet key (PEM Ed25519)")
    logs.add_argument("--kid", required=True, help="its name on the nodes")
    logs.add_argument("--lifetime", type=float, default=300.0, help="seconds it stays valid")
    logs.set_defaults(fn=cmd_logs)

    made = sub.add_parser(
        "manifest",
        help="a signed manifest of a model version's files, or of a model's removal",
        description="A config.pbtxt among the files is the version's own configuration (a"
        " model new to a node needs one; a rollback takes the one before's back). --remove:"
        " the model is removed from the nodes, and no version up to --version installs there"
        " afterwards.",
    )
    made.add_argument("--model", required=True)
    made.add_argument("--version", type=int, required=True, help="above every earlier one")
    made.add_argument("--file", action="append", default=[], help="a file of the version")
    made.add_argument("--remove", action="store_true", help="remove the model (no --file)")
    made.add_argument(
        "--deb-version",
        default="",
        help="a package manifest: --model edged,"
        " --file its .deb, this its Debian version (for edged-updater)",
    )
    made.add_argument(
        "--sign",
        action="append",
        required=True,
        help="KID=KEYFILE (repeat for a threshold of keys)",
    )
    made.add_argument("--lifetime", type=float, default=7 * 24 * 3600.0, help="seconds valid")
    made.add_argument("--target-fleet", help="only this fleet's nodes")
    made.add_argument("--hardware", action="append", help="only these machines (aarch64...)")
    made.add_argument("--nodes", action="append", help="only these nodes")
    made.add_argument("--smoke", help="a JSON file of smoke cases [{inputs, outputs}]")
    made.add_argument("--out", help="write it here instead of printing it")
    made.set_defaults(fn=cmd_manifest)

    held = sub.add_parser(
        "trust",
        help="the fleet's trust document: its signing keys and the revoked certificates",
        description="make: a trust document (docs/PROTOCOL.md, 'The fleet's trust'), signed by"
        " the threshold of the keys nodes trust now AND by its own threshold of its own keys;"
        " publish FILE: retained on each --node's desired/trust.",
    )
    held.add_argument("action", choices=["make", "publish"])
    held.add_argument("file", nargs="?", help="publish: the document")
    held.add_argument("--version", type=int, help="make: above the one in force on the nodes")
    held.add_argument(
        "--key",
        action="append",
        default=[],
        help="make: KID=PUBFILE, or KID=PUBFILE:cmd,cmd for a key that signs only those commands",
    )
    held.add_argument("--threshold", type=int, default=1, help="make: signatures needed")
    held.add_argument(
        "--revoke",
        action="append",
        default=[],
        help="make: a PEM certificate of an endpoint (broker, download server) nodes must refuse",
    )
    held.add_argument("--sign", action="append", default=[], help="make: KID=KEYFILE (repeat)")
    held.add_argument(
        "--lifetime", type=float, default=30 * 24 * 3600.0, help="make: seconds it may be taken"
    )
    held.add_argument("--out", help="make: write it here instead of printing it")
    held.add_argument("--node", action="append", default=[], help="publish: to this node")
    held.set_defaults(fn=cmd_trust)

    roll = sub.add_parser(
        "rollout",
        help="canary rollouts, run by the fleet service (--service): create, status, pause,"
        " resume, promote, abort",
        description="A canary rollout, run by the fleet service (--service URL): stages of the"
        " nodes, a soak per stage judged by the gates, a signed rollback on an abort (docs/"
        "PROTOCOL.md, Canary rollouts).\n\n" + (gates.__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    roll.add_argument("action", choices=["create", "status", "promote", "abort", "pause", "resume"])
    roll.add_argument("id", help="the rollout's id (a name)")
    roll.add_argument("--manifest", help="create: the signed manifest (edgefleet manifest)")
    roll.add_argument("--url", action="append", default=[], help="create: PATH=signed URL")
    roll.add_argument("--cdn", help="create: base URL of a CDN checking secure links")
    roll.add_argument("--cdn-prefix", default="/models", help="create: the files' URI prefix")
    roll.add_argument("--secure-link-secret-file", help="create: the CDN's secret")
    roll.add_argument("--url-lifetime", type=float, default=24 * 3600.0, help="seconds")
    roll.add_argument("--stages", default="10,100", help="create: percent of nodes per stage")
    roll.add_argument("--soak", type=float, default=600.0, help="create: seconds per stage")
    roll.add_argument(
        "--max-failure", type=float, default=0.05, help="gate: failure rate over the other nodes'"
    )
    roll.add_argument(
        "--max-p95-increase",
        type=float,
        default=1.0,
        help="gate: p95 latency growth (1.0: twice the other nodes')",
    )
    roll.add_argument(
        "--max-fallback", type=float, default=0.1, help="gate: fallback rate over the other nodes'"
    )
    roll.add_argument(
        "--max-confidence-drop",
        type=float,
        default=0.1,
        help="gate: mean confidence below the other nodes' (classifiers)",
    )
    roll.add_argument("--min-requests", type=int, default=20, help="gate: calls before judging")
    roll.add_argument("--activation-timeout", type=float, default=300.0, help="seconds")
    roll.add_argument(
        "--deployment", help="create: the deployment whose model this rollout changes"
    )
    roll.add_argument(
        "--selector",
        action="append",
        default=[],
        help="create: only nodes with this label (k=v, repeat)",
    )
    roll.add_argument(
        "--max-unavailable",
        type=int,
        default=0,
        help="create: nodes installing at once (0: a tenth)",
    )
    roll.add_argument("--window", help="create: HH:MM-HH:MM (UTC) when nodes may get it")
    roll.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=0.0,
        metavar="SECONDS",
        help="follow it to its end, its progress on stderr (at most SECONDS; none: no limit);"
        " exit 0 done, 1 aborted, 4 still going",
    )
    roll.set_defaults(fn=cmd_rollout)
    for command in sub.choices.values():
        add_global_options(command, after_command=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    return reader_may_go(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        reply, text = args.fn(args)
    except Failure as exc:
        print(f"edgefleet: {exc}", file=sys.stderr)
        return exc.code
    except ServiceError as exc:
        print(f"edgefleet: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE if exc.status == 0 else EXIT_FAILED
    except daemon.CannotStart as exc:
        print(f"edgefleet: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (TopicError, OSError, ValueError) as exc:
        print(f"edgefleet: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json and reply is not None:
        print(json.dumps(reply, indent=2))
    elif text:
        print(text)
    return int(getattr(args, "exit_code", EXIT_OK))


if __name__ == "__main__":
    sys.exit(main())
