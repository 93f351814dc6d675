"""``edgectl``: talk to the local edged from the shell.

Exit codes: 0 success; 1 the daemon failed the request (5xx); 2 usage error (bad arguments, an
unreadable file); 3 edged cannot be reached; 4 the request was rejected (4xx: bad input, unknown
model); 5 edged or the model is not ready (503, and `status` while edged is not ready).
"""

from __future__ import annotations

import argparse
import json
import sys

from edged.client import Client, ClientError, default_socket
from edged.common.terminal import UsageError, reader_may_go
from edged.edgectl import egress
from edged.edgectl.admin import cmd_drain, cmd_reload, cmd_resume, cmd_routing
from edged.edgectl.base import EXIT_NOT_READY, EXIT_OK, EXIT_USAGE, exit_code
from edged.edgectl.inference import (
    cmd_embed,
    cmd_infer,
    cmd_intent,
    cmd_listen,
    cmd_ocr,
    cmd_vad,
)
from edged.edgectl.kb import cmd_kb
from edged.edgectl.models import cmd_models
from edged.edgectl.status import cmd_capabilities, cmd_status
from edged.edgectl.tasks import cmd_task
from edged.top_live import cmd_top


def build_parser() -> argparse.ArgumentParser:
    """edgectl's argument parser."""
    parser = argparse.ArgumentParser(
        prog="edgectl",
        description=__doc__,  # this module's docstring: what edgectl does, its exit codes
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--socket",
        default=default_socket(),
        help="edged's socket (default: $EDGED_SOCKET or %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for edged")
    parser.add_argument(
        "--priority",
        type=int,
        default=0,
        help="queue priority of inference calls: 1 is the most urgent (default: the model's)",
    )
    parser.add_argument(
        "--timeout-ms",
        type=float,
        default=0,
        help="the call's deadline: the queue gives up beyond it (429/504) and routing plans"
        " within it (default: none; routing assumes routing.max_latency_ms)",
    )
    parser.add_argument(
        "--route",
        choices=["auto", "local", "cloud", "hedged"],
        default="auto",
        help="where inference calls run: auto lets edged decide (default), local, cloud or"
        " hedged (both, the first answer wins); a private input stays local whatever is asked",
    )
    parser.add_argument("--private", action="store_true", help="the input never leaves the device")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print where each step ran and why: the router's whole decision trace",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("status", help="readiness and every model's state").set_defaults(fn=cmd_status)
    sub.add_parser(
        "capabilities", help="task types, and which models serve them on which tier"
    ).set_defaults(fn=cmd_capabilities)

    kb = sub.add_parser(
        "kb",
        help="the knowledge base: ingest files, search, ask, stats, delete",
        description="ingest: text and Markdown files (with --private, their chunks never leave"
        " the device); search: the chunks nearest a question; ask: an answer from the best"
        " chunk when it is close enough, else from the cloud's answer model with the top"
        " chunks (never private ones); stats; delete: by source.",
    )
    kb.add_argument("action", choices=["ingest", "search", "ask", "stats", "delete"])
    kb.add_argument("namespace", nargs="?", help="the namespace (stats without one: all)")
    kb.add_argument(
        "items", nargs="*", help="ingest: files; search, ask: the question; delete: sources"
    )
    kb.add_argument("-k", type=int, default=5, help="search: how many chunks (default 5)")
    kb.add_argument("--filter", default="", help='search: a filter, e.g. source == "faq.md"')
    kb.add_argument(
        "--threshold",
        type=float,
        help="ask: the score at which the best chunk is the answer (default: the daemon's)",
    )
    kb.set_defaults(fn=cmd_kb)

    routing = sub.add_parser(
        "routing",
        help="show, set or reset the routing settings (kept across restarts)",
        description="set overrides [routing] settings of the config file (name=value, JSON"
        " values; name=null removes one override); reset removes them all. They are kept in the"
        " state directory and outlive restarts and reloads.",
    )
    routing.add_argument("action", choices=["show", "set", "reset"], nargs="?", default="show")
    routing.add_argument("settings", nargs="*", help="set: name=value, e.g. local_threshold_ms=50")
    routing.set_defaults(fn=cmd_routing)

    drain = sub.add_parser(
        "drain",
        help="take the local tier out of service (the cloud serves what it can; kept across"
        " restarts until resume)",
    )
    drain.add_argument("--reason", default="", help="said in answers and in status")
    drain.add_argument(
        "--wait", type=float, default=30.0, help="seconds to wait for local work in flight"
    )
    drain.set_defaults(fn=cmd_drain)
    sub.add_parser("resume", help="the local tier takes work again").set_defaults(fn=cmd_resume)
    egress.add_parser(sub)
    sub.add_parser(
        "reload", help="re-read the config and the model repository (as SIGHUP), and wait"
    ).set_defaults(fn=cmd_reload)

    models = sub.add_parser(
        "models",
        help="list, show, load or unload models; their versions, activate one, roll back, remove",
        description="versions: the active version, those activated before, those on disk;"
        " activate NAME VERSION: a version on disk serves (loaded, then switched to at once);"
        " rollback NAME: the version active before serves again; remove NAME: it stops"
        " serving and its directory goes (refused while a pipeline calls it).",
    )
    models.add_argument(
        "action",
        choices=["list", "show", "load", "unload", "versions", "activate", "rollback", "remove"],
    )
    models.add_argument("name", nargs="?", help="model name (all but list)")
    models.add_argument("version", nargs="?", type=int, help="activate: the version")
    models.set_defaults(fn=cmd_models)

    infer = sub.add_parser("infer", help="send an Open Inference Protocol request document")
    infer.add_argument("model")
    infer.add_argument("request", help="request JSON file, or - for stdin")
    infer.add_argument("--version", help="model version (default: newest ready)")
    infer.set_defaults(fn=cmd_infer)

    embed = sub.add_parser("embed", help="sentence embeddings of texts")
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--int8", action="store_true", help="use the INT8 encoder (faster)")
    embed.set_defaults(fn=cmd_embed)

    intent = sub.add_parser("intent", help="the intent of each text")
    intent.add_argument("texts", nargs="+")
    intent.set_defaults(fn=cmd_intent)

    ocr = sub.add_parser("ocr", help="read the text in an image file")
    ocr.add_argument("image", help="image file (PNG, JPEG, ...), or - for stdin")
    ocr.set_defaults(fn=cmd_ocr)

    task = sub.add_parser(
        "task",
        help="run a task graph: a template, free text or a graph file (list, run, explain)",
        description="run: the nodes run where they fit, each routed on its own, and the answer"
        " says where and why; explain: the plan only (nodes, order, privacy, where each can"
        " run); list: the templates. Inputs: -i name=text or -i name=@file (bytes).",
    )
    task.add_argument("action", choices=["list", "run", "explain"])
    task.add_argument("what", nargs="?", help="the template's name")
    task.add_argument("--text", help="free text: the intent model picks the template")
    task.add_argument("--graph", help='a JSON file with the graph ({"nodes": [...]})')
    task.add_argument("-i", "--input", action="append", default=[], help="name=text or name=@file")
    task.add_argument(
        "--private-input", action="append", default=[], help="an input that never leaves the device"
    )
    task.add_argument("--deadline-ms", type=int, help="the task's time budget")
    task.add_argument(
        "--progress", action="store_true", help="run: print each node as it starts and finishes"
    )
    task.set_defaults(fn=cmd_task)

    watch = sub.add_parser(
        "top",
        help="a live view of load, cloud link, routes, queues and models (q quits)",
        description="Load, cloud link, route decisions and every model's queue, request rate,"
        " errors and latency percentiles over the last refresh, redrawn every --interval"
        " seconds; q or Ctrl-C quits and leaves the last frame printed. While edged does not"
        " answer, the view says so and keeps trying. --once prints one frame with totals (rates"
        " need two reads) and exits 3 when edged cannot be reached.",
    )
    watch.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1)",
    )
    watch.add_argument("--once", action="store_true", help="print one frame and exit")
    watch.add_argument(
        "--no-color", action="store_true", help="no colours (also with $NO_COLOR set)"
    )
    watch.set_defaults(fn=cmd_top)

    vad = sub.add_parser("vad", help="find speech in a WAV file")
    vad.add_argument("wav", help="WAV file, or - for stdin")
    vad.add_argument("--threshold", type=float, help="speech probability threshold (0.5)")
    vad.set_defaults(fn=cmd_vad)

    listen = sub.add_parser(
        "listen",
        help="stream audio to the wake word and print each event as it comes",
        description="Streams a 16 kHz mono 16-bit WAV file, or raw 16 kHz 16-bit little-endian"
        " PCM from stdin (a microphone: arecord -f S16_LE -r 16000 -c 1 -t raw | edgectl listen"
        " -), to a stateful model over POST /v2/models/{model}/stream, and prints each event as"
        " it comes: the wake phrases heard (wake-word), each wake phrase and the command said after"
        " it with its intent (voice-assistant), or the speech segments (vad-live), in seconds"
        " since the audio began.",
    )
    listen.add_argument("source", help="WAV file, or - for raw PCM on stdin")
    listen.add_argument(
        "--model",
        default="wake-word",
        help="wake-word (default), voice-assistant (the wake word, then the command), vad-live",
    )
    listen.set_defaults(fn=cmd_listen)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgectl`` console script."""
    return reader_may_go(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    client = Client(args.socket, timeout=args.timeout)
    try:
        reply, text = args.fn(client, args)
    except ClientError as exc:
        if args.json:
            print(json.dumps({"error": exc.message, "status": exc.status}))
        print(f"edgectl: {exc.message}", file=sys.stderr)
        return exit_code(exc)
    except json.JSONDecodeError as exc:
        print(f"edgectl: the request file is not valid JSON: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"edgectl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(reply, indent=2) if args.json else text)
    if args.command == "status" and not reply["ready"]:
        return EXIT_NOT_READY
    return EXIT_OK
