"""``edgectl kb``: the knowledge base. Ingest text and Markdown files (in requests of a bounded
size, with a progress bar), search, ask, stats and delete by source."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from edged.client import Client
from edged.common.terminal import UsageError
from edged.edgectl.base import format_table, read_input
from edged.knowledge.text import split_for_requests

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
        return hits, format_table(rows, ["SCORE", "SOURCE", "TEXT"])
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
            texts.append((path, read_input(path).decode("utf-8")))
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
