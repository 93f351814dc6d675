"""``edgectl task``: task graphs from the shell. List the templates; explain a plan (its nodes,
their order, privacy and where each can run); run one (a template, free text that the intent
model reads, or a graph file), optionally printing each node as it starts and finishes."""

from __future__ import annotations

import argparse
import base64
import json
from typing import Any

from edged.client import Client, ClientError
from edged.common.terminal import UsageError
from edged.edgectl.base import format_table, read_input, request_params


def _task_inputs(items: list[str]) -> dict[str, Any]:
    """-i name=text, or name=@file for a file's bytes."""
    inputs: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise UsageError(f"an input is name=text or name=@file, not '{item}'")
        if value.startswith("@"):
            inputs[name] = {"base64": base64.b64encode(read_input(value[1:])).decode()}
        else:
            inputs[name] = value
    return inputs


def cmd_task(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """A task graph: the templates (list), its plan (explain), or its run and answer (run)."""
    if args.action == "list":
        reply = client.call("GET", "/v1/tasks")
        rows = [
            [
                t["template"],
                " -> ".join(n["task"] for n in t["nodes"]),
                ", ".join(t["inputs"]),
                ", ".join(t["private_inputs"]),
            ]
            for t in reply["templates"]
        ]
        return reply, format_table(rows, ["TEMPLATE", "NODES", "INPUTS", "PRIVATE"])
    if args.graph:
        try:
            doc: dict[str, Any] = {"graph": json.loads(read_input(args.graph))}
        except json.JSONDecodeError as exc:
            raise UsageError(f"{args.graph} is not valid JSON: {exc}") from None
    elif args.text:
        doc = {"text": args.text}
    elif args.what is not None:
        doc = {"template": args.what}
    else:
        raise UsageError("give a template name, --text or --graph")
    doc["inputs"] = _task_inputs(args.input)
    if args.private_input:
        doc["private"] = args.private_input
    if args.deadline_ms:
        doc["deadline_ms"] = args.deadline_ms
    if args.action == "explain":
        doc["run"] = False
    if args.progress and args.action == "run":
        reply = _follow(client.stream_task(doc, **request_params(args)), args.json)
    else:
        reply = client.run_task(doc, **request_params(args))
    if args.action == "explain":
        plan = reply["planned"]
        rows = [
            [
                n["id"],
                n["task"],
                ", ".join(n["after"]) or "-",
                "yes" if n["private"] else "no",
                str(n["deadline_ms"]),
                _tiers(n["estimate"]),
            ]
            for n in plan["nodes"]
        ]
        head = f"task {plan['task']}" + (
            f" (read as {plan['intent']['label']}, {plan['intent']['score']:.2f})"
            if plan.get("intent")
            else ""
        )
        table = format_table(rows, ["NODE", "TASK", "AFTER", "PRIVATE", "DEADLINE_MS", "CAN RUN"])
        return reply, f"{head}\norder: {' -> '.join(plan['order'])}\n{table}"
    rows = [
        [
            n["id"],
            n["task"],
            n["status"],
            n.get("route", "-"),
            f"{n['ended_ms'] - n['started_ms']:.0f}"
            if n.get("started_ms") is not None and n.get("ended_ms") is not None
            else "-",
            n.get("reason") or n.get("error", ""),
        ]
        for n in reply["nodes"]
    ]
    table = format_table(rows, ["NODE", "TASK", "STATUS", "ROUTE", "MS", "WHY"])
    result = json.dumps(reply["result"], indent=2)
    return reply, f"task {reply['task']}: {reply['status']}\n{table}\n{result}"


def _follow(events: Any, as_json: bool) -> dict[str, Any]:
    """Print each node as it starts and finishes; the answer, or the error as ClientError."""
    for event in events:
        kind = event["event"]
        if kind == "answer":
            return {k: v for k, v in event.items() if k != "event"}
        if kind == "error":
            raise ClientError(event["status"], event["error"])
        if as_json:
            line = json.dumps(event)
        elif kind == "started":
            line = f"{event['at_ms']:8.0f} ms  {event['node']} ({event['task']}) started"
        else:
            where = event.get("route") or event.get("error", "")
            line = f"{event['ended_ms']:8.0f} ms  {event['id']} {event['status']}: {where}"
        print(line, flush=True)
    raise ClientError(0, "the stream ended without an answer")


def _tiers(estimate: list[dict[str, Any]]) -> str:
    """Where a node's models can run now: local, cloud, or why not."""
    if not estimate:
        return "local (no model)"
    tiers = []
    for row in estimate:
        for tier in ("local", "cloud"):
            if (row.get(tier) or {}).get("available"):
                tiers.append(tier)
    return ", ".join(dict.fromkeys(tiers)) or "nowhere now"
