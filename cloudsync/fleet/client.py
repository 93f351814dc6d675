"""edgefleet as a client of the fleet service (``--service URL``): the same commands, answered
by the service's HTTP API (docs/fleet-api.json) instead of the broker."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from cloudsync.fleet.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Failure,
    desired_urls,
    pairs,
)
from cloudsync.protocol.commands import sign
from cloudsync.protocol.envelope import now_ms
from cloudsync.protocol.labels import LabelError, check_labels

TOKEN_ENV = "EDGEFLEET_TOKEN"


class ServiceError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


class ServiceClient:
    def __init__(
        self, url: str, token: str, ca_file: str | None = None, timeout: float = 10.0
    ) -> None:
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout
        self.context = None
        if self.url.startswith("https://"):
            self.context = ssl.create_default_context(cafile=ca_file)
            self.context.minimum_version = ssl.TLSVersion.TLSv1_3

    @classmethod
    def from_args(
        cls, url: str, token_file: str | None, ca_file: str | None, timeout: float
    ) -> ServiceClient:
        """The token from ``token_file``, else $EDGEFLEET_TOKEN."""
        token = Path(token_file).read_text().strip() if token_file else os.environ.get(TOKEN_ENV)
        if not token:
            raise ServiceError(0, f"a token: --token-file or ${TOKEN_ENV}")
        return cls(url, token, ca_file, timeout)

    def call(self, method: str, path: str, body: Any = None, **query: Any) -> Any:
        params = {k: v for k, v in query.items() if v not in (None, "")}
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            url,
            data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(
                request, timeout=self.timeout, context=self.context
            ) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                message = exc.reason
            raise ServiceError(exc.code, str(message)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServiceError(0, f"cannot reach the service at {self.url}: {exc}") from None

    def nodes(self, page: int = 1000, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every node (the pages one after another), filtered as the API filters."""
        after = ""
        while True:
            got = self.call("GET", "/v1/nodes", limit=page, after=after, **filters)
            yield from got["nodes"]
            if got["next"] is None:
                return
            after = got["next"]


def listed(items: list[str], width: int) -> str:
    """``items`` joined by commas in at most ``width`` characters: as many as fit, then how
    many more ("-" for none)."""
    if not items:
        return "-"
    for n in range(len(items), 0, -1):
        rest = len(items) - n
        text = ", ".join(items[:n]) + (f" +{rest} more" if rest else "")
        if len(text) <= width:
            return text
    return f"+{len(items)} more"


def nodes_text(rows: list[dict[str, Any]], now_ms: int) -> str:
    lines = [f"{'NODE':20} {'STATE':8} {'HEARTBEAT':>10}  {'MODELS':30} LABELS"]
    for r in rows:
        seen = r.get("last_seen_ms")
        age = "-" if not seen else f"{max(0, now_ms - seen) / 1000:.0f}s ago"
        models = listed([f"{m['name']}:{m['version']}" for m in r.get("models", [])], 30)
        labels = labels_text(r.get("labels", {})) or "-"
        lines.append(f"{r['node']:20} {r['state']:8} {age:>10}  {models:30} {labels}")
    return "\n".join(lines)


def label_args(items: list[str], option: str) -> dict[str, str]:
    """``k=v`` arguments as labels, checked as the service checks them: a bad one is a usage
    error naming ``option``."""
    for item in items:
        if "=" not in item:
            raise Failure(f"{option} {item!r}: a label as name=value", EXIT_USAGE)
    try:
        return check_labels(pairs(items), option)
    except LabelError as exc:
        raise Failure(str(exc), EXIT_USAGE) from None


def labels_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def service(args: argparse.Namespace) -> ServiceClient:
    if not args.service:
        raise Failure(f"{args.command} needs the fleet service: --service URL", EXIT_USAGE)
    try:
        return ServiceClient.from_args(args.service, args.token_file, args.service_ca, args.timeout)
    except ServiceError as exc:  # no token
        raise Failure(str(exc), EXIT_USAGE) from None


def service_nodes(args: argparse.Namespace) -> tuple[Any, str]:
    """Every node from the service's registry (complete: the service knows every node)."""
    selector = label_args(args.selector, "--selector")
    filters = {"state": args.state, "selector": labels_text(selector)}
    rows = list(service(args).nodes(**filters))
    return rows, nodes_text(rows, now_ms())


def cmd_label(args: argparse.Namespace) -> tuple[Any, str]:
    labels = label_args(args.labels, "labels")
    done = service(args).call("PUT", f"/v1/nodes/{args.node}/labels", {"labels": labels})
    return done, f"{args.node}: operator labels {labels_text(done['operator_labels']) or 'none'}"


def deployment_text(d: dict[str, Any]) -> str:
    """A deployment as a person reads it: no signatures, no signed URLs."""
    lines = [
        f"deployment {d['id']}: {d['state']}, priority {d['priority']},"
        f" to {labels_text(d['selector']) or 'every node'}",
        f"  versions: {', '.join(f'{m}:{v}' for m, v in sorted(d['versions'].items()))}",
    ]
    nodes = d.get("nodes")
    if isinstance(nodes, dict):
        lines.append(
            f"  nodes: {nodes.get('done', 0)} of {nodes.get('targeted', 0)} done,"
            f" {nodes.get('failed', 0)} failed, {nodes.get('waiting', 0)} waiting"
        )
    for entry in d.get("models", []):
        signed = entry.get("manifest", {}).get("signed", {})
        for f in signed.get("files", []):
            lines.append(
                f"  {signed.get('model')}:{signed.get('version')} {f.get('path')}"
                f" ({f.get('length', '?')} bytes, sha256 {str(f.get('sha256', '?'))[:16]}...)"
            )
    lines.append(f"  created by {d.get('created_by') or '-'}")
    return "\n".join(lines)


def cmd_deploy(args: argparse.Namespace) -> tuple[Any, str]:
    client = service(args)
    if args.action == "list":
        found = client.call("GET", "/v1/deployments")["deployments"]
        lines = [f"{'ID':20} {'PRIORITY':>8}  {'SELECTOR':30} VERSIONS"]
        for d in found:
            selector = labels_text(d["selector"]) or "*"
            versions = ", ".join(f"{m}:{v}" for m, v in sorted(d["versions"].items()))
            lines.append(f"{d['id']:20} {d['priority']:>8}  {selector:30} {versions}")
        return found, "\n".join(lines)
    if not args.id:
        raise Failure(f"deploy {args.action}: the deployment's id", EXIT_USAGE)
    if args.action == "delete":
        return client.call("DELETE", f"/v1/deployments/{args.id}"), f"deleted {args.id}"
    if args.action == "show":
        found = client.call("GET", f"/v1/deployments/{args.id}")
        return found, deployment_text(found)
    if not args.manifest:
        raise Failure("deploy create: --manifest (edgefleet manifest makes one)", EXIT_USAGE)
    doc = json.loads(Path(args.manifest).read_text())
    body = {
        "id": args.id,
        "selector": label_args(args.selector, "--selector"),
        "priority": args.priority,
        "models": [{"manifest": doc, "urls": desired_urls(args, doc)}],
    }
    made = client.call("POST", "/v1/deployments", body)
    return made, deployment_text(made)


def cmd_ab(args: argparse.Namespace) -> tuple[Any, str]:
    """The fleet's A/B tests of cloud models: start one, list, show, stop."""
    client = service(args)
    if args.action == "list":
        found = client.call("GET", "/v1/ab-tests")["ab_tests"]
        lines = [f"{'ID':20} {'MODEL':24} {'ARM B':24} {'STATE':10} DECIDED"]
        lines += [
            f"{t['id']:20} {t['model']:24} {t['b_cloud_name']:24} {t['state']:10}"
            f" {t['decided'] or '-'}"
            for t in found
        ]
        return found, "\n".join(lines)
    if not args.id:
        raise Failure(f"ab {args.action}: the test's id", EXIT_USAGE)
    if args.action == "start":
        if not (args.model and args.b_cloud_name):
            raise Failure("ab start: --model and --b-cloud-name", EXIT_USAGE)
        body = {
            "id": args.id,
            "model": args.model,
            "b_cloud_name": args.b_cloud_name,
            "b_share": args.share,
            "selector": label_args(args.selector, "--selector"),
            "min_calls": args.min_calls,
            "confidence": args.confidence,
            "max_calls": args.max_calls,
            "latency_ms": args.latency_ms,
            "min_confidence": args.min_confidence,
            "min_score": args.min_score,
        }
        test = client.call("POST", "/v1/ab-tests", body)
    elif args.action == "stop":
        test = client.call("POST", f"/v1/ab-tests/{args.id}/stop")
    else:
        test = client.call("GET", f"/v1/ab-tests/{args.id}")
    a, b = test["arms"].get("a", {}), test["arms"].get("b", {})
    head = (
        f"A/B test {test['id']}: {test['model']} against {test['b_cloud_name']}"
        f" ({test['b_share']:.0%} of the calls), {test['state']}"
        f"{', decided: ' + test['decided'] if test['decided'] else ''}; good calls: a"
        f" {a.get('good', 0)} of {a.get('calls', 0)}, b {b.get('good', 0)} of"
        f" {b.get('calls', 0)}"
    )
    return test, "\n".join([head, *test.get("log", [])])


def cmd_checkpoints(args: argparse.Namespace) -> tuple[Any, str]:
    """A node's egress ledger checkpoints, newest first: ``SEQ:SHA256`` a line (the form of
    ``edgectl egress verify --checkpoint``), those of ``--ledger`` only."""
    found = service(args).call(
        "GET", f"/v1/nodes/{args.node}/egress-checkpoints", limit=args.limit
    )["checkpoints"]
    kept = [c for c in found if c["ledger"] == args.ledger]
    return kept, "\n".join(f"{c['seq']}:{c['hash']}" for c in kept)


def unwritten(done: dict[str, Any]) -> str:
    """A revocation's or reinstatement's broker files the service could not write, said."""
    if not done.get("unwritten"):
        return ""
    return (
        f"\nnot written: {', '.join(done['unwritten'])} ([enrolment]; the service says why"
        " in its log and tries again at its next full pass)"
    )


def cmd_enrol(args: argparse.Namespace) -> tuple[Any, str]:
    """New devices' certificates: a one-time token for a name, the requests, a decision."""
    client = service(args)
    if args.action == "token":
        if not args.target:
            raise Failure("enrol token: the node's name", EXIT_USAGE)
        made = client.call("POST", "/v1/enrolment-tokens", {"node": args.target, "ttl_s": args.ttl})
        return made, made["token"]
    if args.action == "list":
        found = client.call("GET", "/v1/enrolments", state=args.state)["enrolments"]
        lines = [f"{'REQUEST':32}  {'NODE':20} {'STATE':8} {'HOW':8} DECIDED BY"]
        for e in found:
            lines.append(
                f"{e['rid']:32}  {e['node']:20} {e['state']:8} {e['how']:8}"
                f" {e['decided_by'] or '-'}"
            )
        return found, "\n".join(lines)
    if args.action == "revoke":
        if bool(args.target) == bool(args.serial):
            raise Failure("enrol revoke: a node's name, or --serial", EXIT_USAGE)
        body = {"serial": args.serial} if args.serial else {"node": args.target}
        gone = client.call("POST", "/v1/revocations", body)
        return gone, f"revoked: {', '.join(gone['revoked']) or 'nothing new'}" + unwritten(gone)
    if args.action == "reinstate":
        if not args.target:
            raise Failure("enrol reinstate: the revoked node's name", EXIT_USAGE)
        done = client.call("DELETE", "/v1/revocations/" + urllib.parse.quote(args.target, safe=""))
        return done, f"node {done['node']}: may enrol again (a token or an approval)" + unwritten(
            done
        )
    if not args.target:
        raise Failure(f"enrol {args.action}: the request's id (edgefleet enrol list)", EXIT_USAGE)
    done = client.call("POST", f"/v1/enrolments/{args.target}/{args.action}")
    return done, f"request {done['rid']}: {done['state']}"


def service_rollout(args: argparse.Namespace) -> tuple[Any, str]:
    """A rollout run by the fleet service: created (it runs there, this returns), shown, or
    acted on (pause, resume, promote, abort)."""
    client = service(args)
    if args.action == "create":
        if not args.manifest:
            raise Failure("rollout create needs --manifest", EXIT_USAGE)
        doc = json.loads(Path(args.manifest).read_text())
        body: dict[str, Any] = {
            "id": args.id,
            "manifest": doc,
            "urls": desired_urls(args, doc),
            "stages": [float(s) / 100 for s in args.stages.split(",")],
            "soak_s": args.soak,
            "activation_timeout_s": args.activation_timeout,
            "max_unavailable": args.max_unavailable,
            "gates": {
                "max_failure": args.max_failure,
                "max_p95_increase": args.max_p95_increase,
                "max_fallback": args.max_fallback,
                "min_requests": args.min_requests,
                "max_confidence_drop": args.max_confidence_drop,
            },
        }
        if args.deployment:
            body["deployment"] = args.deployment
        if args.selector:
            body["selector"] = label_args(args.selector, "--selector")
        if args.window:
            body["window"] = args.window
        record = client.call("POST", "/v1/rollouts", body)
    elif args.action == "status":
        record = client.call("GET", f"/v1/rollouts/{args.id}")
    else:
        record = client.call("POST", f"/v1/rollouts/{args.id}/{args.action}")
    if args.wait is not None:
        record, args.exit_code = follow(client, record, args.wait, sys.stderr)
    why = f": {record['why']}" if record.get("why") else ""
    head = (
        f"rollout {record['id']}: {record['model']} version {record['version']},"
        f" {record['state']}{why}; stage {record['stage'] + 1} of {len(record['stages'])}"
    )
    return record, "\n".join([head, *record.get("log", [])])


ENDED = {"done": EXIT_OK, "aborted": EXIT_FAILED}


def progress(record: dict[str, Any], width: int = 20) -> str:
    """One line of a rollout's progress: its stage, phase, nodes by state and a bar of the
    nodes whose new version is active."""
    nodes: dict[str, int] = record.get("nodes", {})
    total = sum(nodes.values())
    active = nodes.get("active", 0)
    filled = width * active // total if total else 0
    states = ", ".join(f"{n} {k}" for k, n in sorted(nodes.items())) or "no nodes yet"
    return (
        f"rollout {record['id']}: {record['state']}, stage {record['stage'] + 1} of"
        f" {len(record['stages'])} ({record.get('phase', '-')})"
        f" [{'#' * filled}{'.' * (width - filled)}] {active}/{total} active; {states}"
    )


def follow(
    client: ServiceClient, record: dict[str, Any], limit_s: float, out: TextIO
) -> tuple[dict[str, Any], int]:
    """A rollout followed until it is done (exit 0) or aborted (1), its progress on ``out``
    (rewritten in place on a terminal, a line a change otherwise); past ``limit_s`` (0: no
    limit) it is left running there and the exit code is 4. A paused rollout is waited for:
    an operator may resume it."""
    deadline = time.monotonic() + limit_s if limit_s > 0 else float("inf")
    terminal = out.isatty()
    shown = ""
    while True:
        record = client.call("GET", f"/v1/rollouts/{record['id']}")
        line = progress(record)
        if line != shown:
            out.write(f"\r\x1b[K{line}" if terminal else f"{line}\n")
            out.flush()
            shown = line
        ended = record["state"] in ENDED
        if ended or time.monotonic() >= deadline:
            if terminal:
                out.write("\n")
            if not ended:
                out.write(f"still {record['state']} after {limit_s:g} s\n")
            return record, ENDED.get(record["state"], EXIT_TIMEOUT)
        time.sleep(1.0)


def service_cmd(
    args: argparse.Namespace, key: Any, name: str, cmd_args: dict[str, Any]
) -> dict[str, Any]:
    """A command signed here with the operator's key, relayed by the service, its result
    awaited (``--timeout``)."""
    client = service(args)
    node = client.call("GET", f"/v1/nodes/{args.node}")
    fleet = node["fleet"]  # the service's own
    if node.get("state") != "online":
        print(
            f"edgefleet: warning: {args.node} is {node.get('state')}: the command reaches it"
            f" only if it connects within the command's lifetime ({args.lifetime:g} s)",
            file=sys.stderr,
        )
    if args.fleet not in ("default", fleet):  # (its default: not given)
        raise Failure(f"--fleet {args.fleet}: the service serves fleet {fleet}", EXIT_USAGE)
    cmd_id, payload = sign(
        key, args.kid, args.cert_name, f"{fleet}/{args.node}", name, cmd_args, args.lifetime
    )
    client.call("POST", f"/v1/nodes/{args.node}/commands", {"command": json.loads(payload)})
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        kept = client.call("GET", f"/v1/commands/{cmd_id}")
        result = kept.get("result")
        if result is not None:
            if not result.get("ok"):
                raise Failure(f"{args.node}: {result.get('error')}", EXIT_FAILED)
            return dict(result)
        time.sleep(0.2)
    raise Failure(
        f"no result from {args.node} in {args.timeout} s (command {cmd_id})", EXIT_TIMEOUT
    )
