"""``edgectl models``: list, show, load and unload models; their versions, activate one, roll
back to the one before; remove one."""

from __future__ import annotations

import argparse
import json
from typing import Any

from edged.client import Client
from edged.common.terminal import UsageError
from edged.edgectl.base import format_table


def cmd_models(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """The model repository: one action on it (list, show, load, unload, versions, activate,
    rollback, remove)."""
    if args.action == "list":
        index = client.repository_index()
        rows = [[m["name"], m.get("version", "-"), m["state"], m.get("reason", "")] for m in index]
        return index, format_table(rows, ["MODEL", "VERSION", "STATE", "REASON"])
    if not args.name:
        raise UsageError(f"models {args.action} needs a model name")
    if args.action == "show":
        meta = client.model_metadata(args.name)
        return meta, json.dumps(meta, indent=2)
    if args.action in ("versions", "activate", "rollback"):
        if args.action == "versions":
            reply = client.model_versions(args.name)
        elif args.action == "activate" and args.version is None:
            raise UsageError("models activate needs a version (rollback: the one before)")
        else:
            reply = client.activate(args.name, args.version)
        active = reply["active"]
        serving = f"version {active} active" if active else f"serving {reply['serving']} by policy"
        return reply, (
            f"{args.name}: {serving}; activated before: {reply['history'][:-1] or '-'};"
            f" on disk: {reply['on_disk']}"
        )
    if args.version is not None:
        raise UsageError(f"models {args.action} takes no version")
    if args.action == "remove":
        reply = client.remove_model(args.name)
        return reply, f"removed {args.name} (versions {reply['removed'] or '-'} on disk)"
    if args.action == "load":
        client.load(args.name)
    else:
        client.unload(args.name)
    return {"model": args.name, "action": args.action}, f"{args.action}ed {args.name}"
