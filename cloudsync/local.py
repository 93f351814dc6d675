"""The local API on a Unix socket: programs on the device hand records to the outbox.

    POST /v1/records  {"records": [{"kind": "telemetry", "body": {...}, "priority": "telemetry",
                       "id": "...", "ttl_s": 3600}]}
        -> {"stored": n, "dropped": n}: each record is on disk (fsynced) when this answers;
           ``dropped``: the disk budget could not take them (counted in the outbox figures)
    GET  /v1/status   -> the agent: connected, node, heartbeats, outbox figures
    GET  /metrics     -> cloudsync's Prometheus metrics (cloudsync.exporter)

``kind`` is ``telemetry`` or ``events``; ``priority`` alert, event or telemetry (default: event
for events, telemetry for telemetry); ``id`` makes a record idempotent (a retry with the same id
is stored once). At most 10,000 records and 8 MiB a request.
"""

from __future__ import annotations

import json
import os
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cloudsync.outbox import Item, OutboxError

if TYPE_CHECKING:
    from cloudsync.agent import Agent

MAX_BODY = 8 << 20
MAX_RECORDS = 10_000
KINDS = {"telemetry": "telemetry", "events": "event"}


def items_of(doc: Any) -> list[Item]:
    """The request's records, or ValueError saying what is wrong."""
    records = doc.get("records") if isinstance(doc, dict) else None
    if not isinstance(records, list) or not records:
        raise ValueError('the body must be {"records": [{"kind": ..., "body": {...}}, ...]}')
    if len(records) > MAX_RECORDS:
        raise ValueError(f"at most {MAX_RECORDS} records a request")
    items = []
    for r in records:
        if not isinstance(r, dict) or r.get("kind") not in KINDS:
            raise ValueError(f"each record needs 'kind': one of {', '.join(KINDS)}")
        if not isinstance(r.get("body"), dict):
            raise ValueError("each record needs 'body' (an object)")
        record_id, ttl = r.get("id"), r.get("ttl_s")
        if record_id is not None and not (isinstance(record_id, str) and 0 < len(record_id) <= 64):
            raise ValueError("'id' must be a string of 1 to 64 characters")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
            raise ValueError("'ttl_s' must be a number of seconds")
        priority = r.get("priority", KINDS[r["kind"]])
        items.append(Item(r["kind"], r["body"], priority, record_id, ttl))
    return items


class Handler(BaseHTTPRequestHandler):
    server: LocalServer

    def log_message(self, format: str, *args: Any) -> None:  # no access log
        pass

    def _reply(self, status: int, doc: Any) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(200, self.server.agent.exporter.render(), CONTENT_TYPE_LATEST)
        elif self.path == "/v1/status":
            self._reply(200, self.server.agent.status())
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/v1/records":
            self._reply(404, {"error": f"no route {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._reply(413, {"error": f"the body is over {MAX_BODY} bytes"})
            return
        try:
            items = items_of(json.loads(self.rfile.read(length) or b"null"))
            stored = self.server.agent.outbox.put_many(items)
        except (ValueError, OutboxError) as exc:
            status = 507 if isinstance(exc, OutboxError) and "full" in str(exc) else 400
            self._reply(status, {"error": str(exc)})
            return
        dropped = sum(s is None for s in stored)
        self._reply(200, {"stored": len(stored) - dropped, "dropped": dropped})


class LocalServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: Path, mode: int, agent: Agent) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():
            path.unlink()
        self.agent = agent
        super().__init__(str(path), Handler)
        os.chmod(path, mode)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="local-api", daemon=True)
        thread.start()
        return thread
