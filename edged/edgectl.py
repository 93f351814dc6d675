"""``edgectl``: talk to the local edged from the shell.

Exit codes: 0 success; 1 the daemon failed the request (5xx); 2 usage error (bad arguments, an
unreadable file); 3 edged cannot be reached; 4 the request was rejected (4xx: bad input, unknown
model); 5 edged or the model is not ready (503, and `status` while edged is not ready).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import platform
import select
import shutil
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edged.client import Client, ClientError, default_socket
from edged.common.cli import UsageError, key_values
from edged.knowledge.text import split_for_requests

if TYPE_CHECKING:
    from rich.console import RenderableType

    from edged.top import Scrape

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_REJECTED, EXIT_NOT_READY = range(6)


def exit_code(error: ClientError) -> int:
    """The exit code that tells what failed."""
    if error.status == 0:
        return EXIT_UNREACHABLE
    if error.status == 503:
        return EXIT_NOT_READY
    if 400 <= error.status < 500:
        return EXIT_REJECTED
    return EXIT_FAILED


def _read(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]
    ]
    return "\n".join(lines)


def cmd_status(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    status = client.status()
    rows = [
        [m["name"], m.get("version", "-"), m["state"], m.get("reason", "")]
        for m in status["models"]
    ]
    text = (
        f"edged {status['version']} on {client.socket_path}: "
        f"{'ready' if status['ready'] else 'NOT READY'}, up {status['uptime_s']:.0f} s, "
        f"{status['inflight']} in flight\n"
        + (f"LOCAL TIER {status['drained'].upper()}\n" if status.get("drained") else "")
        + f"{_load_line(status.get('load') or {})}"
        f"{_cloud_line(status.get('cloud'))}"
        + _table(rows, ["MODEL", "VERSION", "STATE", "REASON"])
    )
    return status, text


def _load_line(load: dict[str, Any]) -> str:
    """One line of device load: the figures the providers could tell."""
    parts = []
    for key, label, unit in (
        ("cpu_percent", "cpu", "%"),
        ("memory_used_percent", "memory", "%"),
        ("gpu_percent", "gpu", "%"),
        ("temperature_c", "temp", " C"),
        ("power_w", "power", " W"),
    ):
        if load.get(key) is not None:
            parts.append(f"{label} {load[key]:.1f}{unit}")
    if load.get("throttled"):
        parts.append("THROTTLED")
    return f"load: {', '.join(parts)}\n" if parts else ""


def _cloud_line(cloud: dict[str, Any] | None) -> str:
    """One line on the cloud tier: link, RTT, circuit, catalog."""
    if not cloud:
        return "cloud: none configured\n"
    link = cloud["link"]
    rtt = f", rtt {link['rtt_s'] * 1000:.1f} ms" if link.get("rtt_s") is not None else ""
    return (
        f"cloud: {cloud['url']} link {'up' if link['up'] else 'DOWN'}{rtt},"
        f" circuit {cloud['breaker']}, serves {', '.join(cloud['catalog']) or 'nothing'}\n"
    )


def cmd_routing(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
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
    reply = client.drain(args.reason, args.wait)
    left = reply["local_inflight"]
    return reply, (
        f"local tier {reply['reason']}; "
        + (f"{left} local requests still running" if left else "no local work in flight")
    )


def cmd_resume(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    return client.resume(), "local tier resumed"


def cmd_reload(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    reply = client.reload()
    if not reply["reloaded"]:
        raise ClientError(500, f"reload failed: {reply['error']}")
    return reply, "reloaded"


def cmd_capabilities(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Task types and the tiers that serve their models, with measured latency."""
    found = client.capabilities()

    def tier(info: dict[str, Any] | None) -> str:
        if info is None:
            return "-"
        if not info["available"]:
            return f"no ({info['why_not']})"
        latency = info["latency_ms"]
        return "yes" + (f", {latency:.1f} ms over {info['calls']}" if latency is not None else "")

    rows = [
        [group["task_type"], m["model"], tier(m["local"]), tier(m["cloud"])]
        for group in found
        for m in group["models"]
    ]
    return found, _table(rows, ["TASK TYPE", "MODEL", "LOCAL", "CLOUD"])


def cmd_models(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    if args.action == "list":
        index = client.repository_index()
        rows = [[m["name"], m.get("version", "-"), m["state"], m.get("reason", "")] for m in index]
        return index, _table(rows, ["MODEL", "VERSION", "STATE", "REASON"])
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
    if args.action == "load":
        client.load(args.name)
    else:
        client.unload(args.name)
    return {"model": args.name, "action": args.action}, f"{args.action}ed {args.name}"


def _params(args: argparse.Namespace) -> dict[str, Any]:
    """Request parameters from the global flags: the scheduler's (--priority, --timeout-ms)
    and the router's (--route, --private, --explain)."""
    params: dict[str, Any] = {}
    if args.priority:
        params["priority"] = args.priority
    if args.timeout_ms:
        params["timeout"] = round(args.timeout_ms * 1000)
    if args.route != "auto":
        params["route"] = args.route
    if args.private:
        params["private"] = True
    if args.explain:
        params["explain"] = True
    return params


def _explained(reply: dict[str, Any], text: str, args: argparse.Namespace) -> str:
    """With --explain: where the work ran, why, and every decision of the request."""
    if not args.explain or "route" not in reply:
        return text

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    lines = [text, f"route: {reply['route']}: {reply['reason']}"]
    lines.append(
        f"  predicted {ms(reply.get('predicted_ms'))}, actual {ms(reply.get('actual_ms'))}"
    )
    trace = reply.get("route_trace") or []
    if isinstance(trace, str):  # OIP parameters carry it as JSON text
        trace = json.loads(trace)
    for step in trace:
        lines.append(
            f"  {step['model']}: {step['route']} (deadline {ms(step['deadline_ms'])},"
            f" predicted {ms(step['predicted_ms'])}, actual {ms(step.get('actual_ms'))})"
        )
        lines += [f"    {line}" for line in step["trace"]]
    return "\n".join(lines)


def cmd_infer(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Raw OIP inference: a request JSON document (file or -) is sent as it is, with the
    global flags' parameters added to its parameters."""
    doc = json.loads(_read(args.request))
    if not isinstance(doc, dict):
        raise UsageError("the request document must be a JSON object")
    params = _params(args)
    if params:
        doc["parameters"] = {**(doc.get("parameters") or {}), **params}
    reply = client.infer_json(args.model, doc, args.version)
    return reply, _explained(reply.get("parameters") or {}, json.dumps(reply, indent=2), args)


def cmd_embed(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    model = "text-embedding-int8" if args.int8 else "text-embedding"
    reply = client.task("embed", {"texts": args.texts, "model": model}, **_params(args))
    vectors = np.asarray(reply["embeddings"], dtype=np.float32)
    lines = [
        f"{t[:40]!r:44} [{', '.join(f'{x:.4f}' for x in v[:4])}, ...]"
        for t, v in zip(args.texts, vectors)
    ]
    if len(args.texts) > 1:
        sims = vectors @ vectors.T
        lines.append("cosine similarity:")
        lines += ["  " + " ".join(f"{x:6.3f}" for x in row) for row in np.asarray(sims)]
    return reply, _explained(reply, "\n".join(lines), args)


def cmd_intent(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    reply = client.task("intent", {"texts": args.texts}, **_params(args))
    text = "\n".join(f"{i['intent']:16} {i['score']:.3f}  {i['text']}" for i in reply["intents"])
    return reply, _explained(reply, text, args)


def cmd_ocr(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    reply = client.task("ocr", raw=_read(args.image), **_params(args))
    text = "\n".join(f"{line['score']:.3f}  {line['text']}" for line in reply["lines"])
    return reply, _explained(reply, text, args)


def cmd_vad(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    params = _params(args)
    if args.threshold is not None:
        params["threshold"] = args.threshold
    reply = client.task("vad", raw=_read(args.wav), **params)
    segments = reply["segments"]
    text = "\n".join(f"{s['start']:8.3f} s -> {s['end']:8.3f} s" for s in segments)
    return reply, _explained(reply, text or "no speech", args)


def _task_inputs(items: list[str]) -> dict[str, Any]:
    """-i name=text, or name=@file for a file's bytes."""
    inputs: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise UsageError(f"an input is name=text or name=@file, not '{item}'")
        if value.startswith("@"):
            inputs[name] = {"base64": base64.b64encode(_read(value[1:])).decode()}
        else:
            inputs[name] = value
    return inputs


def cmd_task(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    if args.action == "list":
        reply = client.call("GET", "/v1/tasks")
        rows = [
            [t["template"], " -> ".join(n["task"] for n in t["nodes"]),
             ", ".join(t["inputs"]), ", ".join(t["private_inputs"])]
            for t in reply["templates"]
        ]  # fmt: skip
        return reply, _table(rows, ["TEMPLATE", "NODES", "INPUTS", "PRIVATE"])
    if args.graph:
        try:
            doc: dict[str, Any] = {"graph": json.loads(_read(args.graph))}
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
        reply = _follow(client.stream_task(doc, **_params(args)), args.json)
    else:
        reply = client.run_task(doc, **_params(args))
    if args.action == "explain":
        plan = reply["planned"]
        rows = [
            [n["id"], n["task"], ", ".join(n["after"]) or "-", "yes" if n["private"] else "no",
             str(n["deadline_ms"]), _tiers(n["estimate"])]
            for n in plan["nodes"]
        ]  # fmt: skip
        head = f"task {plan['task']}" + (
            f" (read as {plan['intent']['label']}, {plan['intent']['score']:.2f})"
            if plan.get("intent")
            else ""
        )
        table = _table(rows, ["NODE", "TASK", "AFTER", "PRIVATE", "DEADLINE_MS", "CAN RUN"])
        return reply, f"{head}\norder: {' -> '.join(plan['order'])}\n{table}"
    rows = [
        [n["id"], n["task"], n["status"], n.get("route", "-"),
         f"{n['ended_ms'] - n['started_ms']:.0f}" if n.get("started_ms") is not None
         and n.get("ended_ms") is not None else "-", n.get("reason") or n.get("error", "")]
        for n in reply["nodes"]
    ]  # fmt: skip
    table = _table(rows, ["NODE", "TASK", "STATUS", "ROUTE", "MS", "WHY"])
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


KB_REQUEST_CHARS = 200_000  # text per ingest request: about 400 chunks, 10-20 s on a CPU


def cmd_kb(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """The knowledge base: ingest files, search, ask, stats, delete."""
    if args.action != "stats" and not args.namespace:
        raise UsageError(f"kb {args.action} needs a namespace")
    if args.action == "ingest":
        return _kb_ingest(client, args)
    if args.action in ("search", "ask") and not args.items:
        raise UsageError(f"kb {args.action} needs a question")
    if args.action == "search":
        hits = client.kb_search(args.namespace, " ".join(args.items), args.k, args.filter)
        rows = [[f"{h['score']:.3f}", h["source"], h["text"][:70].replace("\n", " ")] for h in hits]
        return hits, _table(rows, ["SCORE", "SOURCE", "TEXT"])
    if args.action == "ask":
        reply = client.kb_ask(args.namespace, " ".join(args.items), args.threshold, args.private)
        by = reply["answered_by"]
        lines = [
            reply["answer"] or "(nothing is known)",
            "",
            f"answered by: {by} ({reply['route']}); sources: {', '.join(reply['sources']) or '-'}",
            f"why: {reply['reason']}",
        ]
        return reply, "\n".join(lines)
    if args.action == "stats":
        stats = client.kb_stats(args.namespace)
        return stats, json.dumps(stats, indent=2)
    if not args.items:
        raise UsageError("kb delete needs the sources (files) whose chunks go")
    deleted = sum(client.kb_delete(args.namespace, source=source) for source in args.items)
    return {"deleted": deleted}, f"deleted {deleted} chunks"


def _kb_ingest(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Each file (text, or Markdown by its .md name) is a document whose source is its path;
    they go in requests of about 200,000 characters (a larger file in pieces cut at a heading
    or a paragraph), with a progress bar on stderr."""
    if not args.items:
        raise UsageError("kb ingest needs files")
    texts: list[tuple[str, str]] = []
    for path in args.items:
        try:
            texts.append((path, _read(path).decode("utf-8")))
        except UnicodeDecodeError:
            raise UsageError(f"{path} is not UTF-8 text") from None
    total = sum(len(text) for _, text in texts) or 1
    batch: list[dict[str, Any]] = []
    size = sent = chunks = 0
    started = time.monotonic()

    def send() -> None:
        nonlocal batch, size, sent, chunks
        if not batch:
            return
        chunks += client.kb_ingest(args.namespace, batch)["chunks"]
        sent += size
        batch, size = [], 0
        done = int(30 * sent / total)
        rate = chunks / max(time.monotonic() - started, 1e-6)
        print(
            f"\r[{'=' * done}{' ' * (30 - done)}] {100 * sent // total:3d}%"
            f"  {chunks} chunks  {rate:.0f}/s",
            end="",
            file=sys.stderr,
            flush=True,
        )

    for path, text in texts:
        for piece in split_for_requests(text, KB_REQUEST_CHARS):
            if size + len(piece) > KB_REQUEST_CHARS:
                send()
            batch.append({"text": piece, "source": path, "private": args.private})
            size += len(piece)
    send()
    print(file=sys.stderr)
    reply = {"namespace": args.namespace, "files": len(texts), "chunks": chunks}
    return reply, f"ingested {len(texts)} files into '{args.namespace}': {chunks} chunks"


def cmd_top(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """One frame (--once), or the live view until q or Ctrl-C, whose last frame stays printed."""
    if not args.interval > 0:
        raise UsageError("--interval must be more than 0 seconds")
    # a hung edged shows as unreachable within seconds instead of freezing the view (and q)
    reader = Client(client.socket_path, timeout=min(client.timeout, max(5.0, args.interval)))
    host = platform.node()  # edged answers on a Unix socket: it runs on this machine
    if args.once:
        from edged.top import render_frame  # rich only for top: the other commands start faster

        status, scrape = _top_read(reader)
        return status, _top_text(render_frame(status, scrape, host=host), args.no_color)
    if not sys.stdout.isatty():
        raise UsageError("top needs a terminal; --once prints one frame (for scripts)")
    return _top_live(reader, args.interval, args.no_color, host)


def _top_read(client: Client) -> tuple[dict[str, Any], Scrape]:
    """edged's status and a scrape of its metrics; ClientError when edged does not answer."""
    from edged.top import Scrape

    status = client.status()
    try:
        scrape = Scrape.parse(client.metrics())
    except ValueError as exc:
        raise ClientError(500, f"edged's /metrics is not Prometheus text: {exc}") from None
    return status, scrape


def _top_live(
    client: Client, interval: float, no_color: bool, host: str
) -> tuple[dict[str, Any], str]:
    """Read, draw, wait for a key, on the terminal's alternate screen; the last status read and
    the last frame as text for the normal screen."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    from edged.top import render_frame, render_unreachable

    console = Console(no_color=no_color, highlight=False)
    hint = Text(f"every {interval:g} s · q quits", style="dim")
    status: dict[str, Any] = {}
    previous: Scrape | None = None
    read_at, epoch = 0.0, None
    frame: RenderableType = Text("")
    with _keys() as pressed, Live(console=console, screen=True, auto_refresh=False) as live:
        try:
            while True:
                try:
                    status, scrape = _top_read(client)
                    now = time.monotonic()
                    if status.get("epoch") != epoch:  # edged restarted: its counters did too
                        previous = None
                    frame = render_frame(
                        status, scrape, previous, now - read_at if previous else None, host
                    )
                    previous, read_at, epoch = scrape, now, status.get("epoch")
                except ClientError as exc:
                    frame = render_unreachable(exc.message, interval, host)
                live.update(Group(frame, hint), refresh=True)
                if pressed(interval):
                    break
        except KeyboardInterrupt:
            pass
    return status, _top_text(frame, no_color)


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], bool]]:
    """A wait of up to some seconds that says whether q was pressed: the terminal in cbreak mode
    (keys one at a time, not echoed; Ctrl-C still a signal) and restored on the way out."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:  # no keyboard: Ctrl-C (SIGINT) is the way out

        def sleep(seconds: float) -> bool:
            time.sleep(seconds)
            return False

        yield sleep
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def pressed(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([fd], [], [], left)[0] and b"q" in os.read(fd, 64).lower():
                return True
        return False

    try:
        yield pressed
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _top_text(frame: RenderableType, no_color: bool) -> str:
    """A frame as text for stdout: coloured on a terminal (unless --no-color or $NO_COLOR), plain
    in a pipe, which gets 120 columns unless $COLUMNS says otherwise."""
    from rich.console import Console

    terminal = sys.stdout.isatty()
    width = shutil.get_terminal_size().columns if terminal or "COLUMNS" in os.environ else 120
    console = Console(
        file=io.StringIO(), force_terminal=terminal, no_color=no_color, width=width, highlight=False
    )
    with console.capture() as captured:
        console.print(frame)
    return captured.get().rstrip("\n")


def build_parser() -> argparse.ArgumentParser:
    """edgectl's argument parser."""
    parser = argparse.ArgumentParser(
        prog="edgectl",
        description=__doc__,
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
    sub = parser.add_subparsers(dest="command", required=True)

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
    sub.add_parser(
        "reload", help="re-read the config and the model repository (as SIGHUP), and wait"
    ).set_defaults(fn=cmd_reload)

    models = sub.add_parser(
        "models",
        help="list, show, load or unload models; their versions, activate one, roll back",
        description="versions: the active version, those activated before, those on disk;"
        " activate NAME VERSION: a version on disk serves (loaded, then switched to at once);"
        " rollback NAME: the version active before serves again.",
    )
    models.add_argument(
        "action", choices=["list", "show", "load", "unload", "versions", "activate", "rollback"]
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
    task.add_argument("--private-input", action="append", default=[],
                      help="an input that never leaves the device")  # fmt: skip
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgectl`` console script."""
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


if __name__ == "__main__":
    sys.exit(main())
