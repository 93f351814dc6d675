"""The operator's controls (edged's ``/v1/admin``): ``edgectl routing`` (show, set, reset the
routing overrides), ``drain`` and ``resume`` (the local tier out of and back in service) and
``reload`` (the config and the model repository, as SIGHUP)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from edged.client import Client, ClientError
from edged.common.terminal import UsageError, key_values


def cmd_routing(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """The routing settings, each marked when an override sets it; set or reset overrides."""
    if args.action == "set":
        if not args.settings:
            raise UsageError("routing set needs name=value settings, e.g. local_threshold_ms=50")
        reply = client.set_routing(key_values(args.settings))
    elif args.settings:
        raise UsageError(f"routing {args.action} takes no settings")
    else:
        reply = client.reset_routing() if args.action == "reset" else client.routing()
    overrides = reply["overrides"]
    lines = [
        f"{key} = {json.dumps(value)}{'   (override)' if key in overrides else ''}"
        for key, value in reply["routing"].items()
    ]
    return reply, "\n".join(lines)


def cmd_drain(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Take the local tier out of service, waiting up to --wait for its work in flight."""
    reply = client.drain(args.reason, args.wait)
    left = reply["local_inflight"]
    return reply, (
        f"local tier {reply['reason']}; "
        + (f"{left} local requests still running" if left else "no local work in flight")
    )


def cmd_resume(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """The local tier takes work again."""
    return client.resume(), "local tier resumed"


def cmd_reload(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Re-read the config and the model repository; a failed reload is a failed command."""
    reply = client.reload()
    if not reply["reloaded"]:
        raise ClientError(500, f"reload failed: {reply['error']}")
    return reply, "reloaded"
