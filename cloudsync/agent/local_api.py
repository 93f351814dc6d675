"""The local API on a Unix socket: programs on the device hand records to the outbox.

    POST /v1/records  {"records": [{"kind": "telemetry", "body": {...}, "priority": "telemetry",
                       "id": "...", "ttl_s": 3600}]}
        -> {"stored": n, "dropped": n}: each record is on disk (fsynced) when this answers;
           ``dropped``: the disk budget could not take them (counted in the outbox figures)
    GET  /v1/status   -> the agent: connected, node, heartbeats, outbox figures
    GET  /metrics     -> cloudsync's Prometheus metrics (cloudsync.agent.metrics)

A record: ``kind`` telemetry or events; ``body`` a JSON object, at most 260,096 bytes as
canonical JSON (envelope.MAX_BODY_BYTES: with its envelope it must fit one 256 KiB message) and
nested at most 31 levels (the envelope around it makes 32); ``priority`` alert, event or
telemetry (default: event for events, telemetry for telemetry); ``id`` 1 to 64 printable
characters, which makes the record idempotent (a retry with the same id is stored once);
``ttl_s`` seconds, more than 0 and at most 315,360,000 (10 years). Other keys of a record are
ignored.

A request is stored whole or not at all: every record is checked before any is stored, and the
size before the body is read. An error is ``{"error": "...", "field": "records[3].ttl_s"}``
(``field`` when one field is at fault; the error starts with it):

- 400: a Content-Length that is not digits, or several that differ; a body that ends before
  its Content-Length, is not UTF-8, not JSON, has NaN or Infinity, a number beyond a double's
  range (1.8e308; an integer of more than 308 digits) or nests too deeply; a record whose field
  is wrong, or holds text UTF-8 cannot encode (a lone surrogate such as \\ud800)
- 404: no such route
- 408: nothing came for 30 s before the request was whole, or its body took over 30 s
  (``[local] read_timeout_s``)
- 411: no Content-Length (Transfer-Encoding, chunked, is not taken)
- 413: a body over 8 MiB (refused before it is read), over 10,000 records, a record's body over
  260,096 bytes
- 503 (with Retry-After): over 32 connections at once (``[local] max_connections``), or a
  body that would take those being read at once over 32 MiB
- 507: the outbox's disk is full; nothing was stored, retry once there is space
- 500: a fault of cloudsync's own, logged with its traceback
- and what HTTP itself refuses: a request line or headers that do not parse (400), too long
  (414, 431), a method other than GET and POST (501), an HTTP version other than 1.x (505)

Each connection serves one request (HTTP/1.0 answers), and every request that arrives whole
gets an answer. Bodies are decoded one request at a time: 8 MiB of JSON can be ~200 MB of
Python objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cloudsync.agent.outbox import PRIORITIES, Item, Outbox, OutboxError
from cloudsync.protocol.envelope import (
    MAX_BODY_BYTES,
    MAX_BYTES,
    MAX_DEPTH,
    canonical,
    depth,
    printable,
)

log = logging.getLogger("cloudsync")

MAX_BODY = 8 << 20  # bytes of one request
MAX_RECORDS = 10_000  # records of one request
MAX_ID = 64  # characters of a record's id
MAX_TTL_S = 10 * 365 * 86_400  # a record's ttl_s: ten years
MAX_BODY_DEPTH = MAX_DEPTH - 1  # the envelope around a record's body is one level more
MAX_INT_DIGITS = 308  # an integer beyond a double's range (1.8e308) is refused, as a float is
MAX_LINE = 65536  # bytes of the request line (http.server's own limit)
MAX_BLANK_LINES = 8  # empty lines before a request line that are skipped (RFC 9112, 2.2)
READ_TIMEOUT_S = 30.0  # a request that stalls this long, or whose body takes longer, is a 408
MAX_CONNECTIONS = 32  # connections served at once; ThreadingMixIn starts a thread for each
# bodies read (and held until decoded) at once: a caller who sends many large bodies slowly
# cannot make cloudsync hold 32 of 8 MiB each
MAX_READING = 4 * MAX_BODY
KINDS = {"telemetry": "telemetry", "events": "event"}
SHAPE = '{"records": [{"kind": "telemetry", "body": {...}}, ...]}'


class Refused(ValueError):
    """A request refused: its HTTP status, what is wrong and, when one is at fault, the field
    (the message starts with it)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.status = status
        self.field = field


def body_length(lengths: list[str], transfer_encoding: str | None) -> int:
    """The body's length from the request's Content-Length headers, or Refused (411 none or a
    Transfer-Encoding, 400 not digits or several that differ, 413 over MAX_BODY)."""
    if transfer_encoding is not None:
        raise Refused(
            411,
            f"{printable(transfer_encoding, 40)!r} is not taken here: send the body with a"
            " Content-Length",
            "Transfer-Encoding",
        )
    if not lengths:
        raise Refused(
            411, "POST /v1/records needs one (the body's length in bytes)", "Content-Length"
        )
    found = set()
    for header in lengths:
        for part in str(header).split(","):
            value = part.strip(" \t")
            if not (value.isascii() and value.isdigit()):
                raise Refused(
                    400,
                    f"{printable(value, 40)!r} is not a length: digits only (bytes, 0 or more)",
                    "Content-Length",
                )
            found.add(value.lstrip("0") or "0")
    if len(found) > 1:
        shown = ", ".join(sorted(printable(v, 24) for v in found))
        raise Refused(400, f"several values ({shown}): send one", "Content-Length")
    (value,) = found
    if len(value) > len(str(MAX_BODY)) or int(value) > MAX_BODY:
        raise Refused(
            413,
            f"{printable(value, 24)} bytes: a request may be at most {MAX_BODY} bytes"
            f" ({MAX_RECORDS} records at most; send more requests)",
            "Content-Length",
        )
    return int(value)


def decode(data: bytes | bytearray) -> Any:
    """The body as JSON, or Refused (400) saying why not: not UTF-8, not JSON, NaN or Infinity,
    a number beyond a double's range, nested too deeply to decode."""
    if not data:
        raise Refused(400, f"the body is empty: send {SHAPE}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(
            400,
            f"the body is not UTF-8: byte {exc.start} is {exc.object[exc.start]:#04x}"
            " (JSON must be UTF-8)",
        ) from None
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_float, parse_int=_int)
    except RecursionError:
        raise Refused(
            400,
            f"the body nests too deeply to decode (a record's body may nest"
            f" {MAX_BODY_DEPTH} levels)",
        ) from None
    except ValueError as exc:
        raise Refused(400, f"the body is not JSON: {printable(str(exc), 200)}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (send null or a finite number)")


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{printable(text, 40)} is beyond a double's range (1.8e308)")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(
            f"an integer of {len(text.lstrip('-'))} digits is beyond a double's range (1.8e308)"
        )
    return int(text)


def items_of(doc: Any) -> list[Item]:
    """The request's records as outbox items, or Refused naming the first field at fault."""
    records = doc.get("records") if isinstance(doc, dict) else None
    if not isinstance(records, list) or not records:
        raise Refused(400, f"a non-empty list is needed: send {SHAPE}", "records")
    if len(records) > MAX_RECORDS:
        raise Refused(413, f"{len(records)} records: at most {MAX_RECORDS} a request", "records")
    return [item_of(f"records[{i}]", record) for i, record in enumerate(records)]


def item_of(where: str, record: Any) -> Item:
    """One record as an outbox item, or Refused naming the field at fault (``where``: the
    record's place in the request, e.g. ``records[3]``)."""
    if not isinstance(record, dict):
        raise Refused(400, f"a record is an object, not {_what(record)}", where)
    kind = record.get("kind")
    if not (isinstance(kind, str) and kind in KINDS):
        raise Refused(400, f"{_shown(record, 'kind')}: one of {', '.join(KINDS)}", f"{where}.kind")
    priority = record.get("priority")
    if priority is None:
        priority = KINDS[kind]
    elif not (isinstance(priority, str) and priority in PRIORITIES):
        raise Refused(
            400, f"{_what(priority)}: one of {', '.join(PRIORITIES)}", f"{where}.priority"
        )
    record_id = record.get("id")
    if record_id is not None and not (
        isinstance(record_id, str) and 0 < len(record_id) <= MAX_ID and record_id.isprintable()
    ):
        raise Refused(
            400,
            f"{_what(record_id)}: a string of 1 to {MAX_ID} printable characters",
            f"{where}.id",
        )
    ttl = record.get("ttl_s")
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL_S
    ):
        raise Refused(
            400,
            f"{_what(ttl)}: seconds, more than 0 and at most {MAX_TTL_S} (10 years)",
            f"{where}.ttl_s",
        )
    body = record.get("body")
    if not isinstance(body, dict):
        raise Refused(400, f"an object is needed, not {_shown(record, 'body')}", f"{where}.body")
    # the size before the depth: depth() holds a tuple for each object in a list, and a body
    # over the size may hold millions
    try:
        size = len(canonical(body))
    except UnicodeEncodeError:
        raise Refused(
            400,
            "text that UTF-8 cannot encode (a lone surrogate such as \\ud800): send valid Unicode",
            unencodable(body, f"{where}.body"),
        ) from None
    except RecursionError:
        raise Refused(400, f"nested deeper than {MAX_BODY_DEPTH} levels", f"{where}.body") from None
    except ValueError as exc:  # what JSON cannot carry, which decode() lets in no more
        raise Refused(400, printable(str(exc), 200), f"{where}.body") from None
    if size > MAX_BODY_BYTES:
        raise Refused(
            413,
            f"{size} bytes as canonical JSON: at most {MAX_BODY_BYTES} (one record goes in"
            f" one MQTT message of at most {MAX_BYTES} bytes with its envelope): split it",
            f"{where}.body",
        )
    nested = depth(body)
    if nested > MAX_BODY_DEPTH:
        raise Refused(
            400,
            f"nested {nested} levels deep: at most {MAX_BODY_DEPTH} (the"
            f" envelope around it makes {MAX_DEPTH})",
            f"{where}.body",
        )
    return Item(kind, body, priority, record_id, ttl)


def admit(data: bytes | bytearray) -> list[Item] | Refused:
    """A request's body as outbox items, or its refusal without its traceback (whose frames
    hold the decoded document: let go now, not once the refusal is answered) or context."""
    try:
        return items_of(decode(data))
    except Refused as exc:
        exc.__context__ = None  # a JSONDecodeError holds the whole text
        return exc.with_traceback(None)


def unencodable(value: Any, where: str) -> str:
    """Where in ``value`` the first text that UTF-8 cannot encode is (``where`` if none is)."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            for key in item:
                if not _encodable(key):
                    return _member(path, key)
            stack.extend((v, _member(path, k)) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return where


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _member(path: str, key: str) -> str:
    if key.isidentifier() and len(key) <= 40:
        return f"{path}.{key}"
    return f'{path}["{printable(key, 40)}"]'


def _shown(record: dict[str, Any], key: str) -> str:
    """A record's field, shown short and safe in an error (``missing`` if it has none)."""
    return _what(record[key]) if key in record else "missing"


def _what(value: Any) -> str:
    """A caller's value, shown short and safe in an error."""
    if isinstance(value, str):
        return repr(printable(value, 40))
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return printable(repr(value), 40)
    return "an object" if isinstance(value, dict) else "a list"


class Handler(BaseHTTPRequestHandler):
    """One connection, one request. Every request that arrives whole gets an answer: a refusal
    naming what is wrong, 408 when it stalls, or 500 (logged) when cloudsync itself fails."""

    server: LocalServer
    default_request_version = "HTTP/1.0"  # never HTTP/0.9: every answer has a status line
    answered = False  # this request's answer is begun: a failure after it cannot send another

    def log_message(self, format: str, *args: Any) -> None:  # no access log
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.read_timeout_s)  # each read; a body's too, whole

    def handle_one_request(self) -> None:
        """http.server's, with blank lines before the request line skipped and nothing let out
        unanswered."""
        self.answered = False
        self.close_connection = True
        self.request_version, self.command, self.requestline, self.path = "HTTP/1.0", "", "", ""
        try:
            self._handle_one_request()
        except TimeoutError:
            self._last_word(
                408, f"the request did not arrive within {self.server.read_timeout_s:g} s"
            )
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
            log.debug("local API: the caller went away: %s", exc)
        except Exception as exc:
            log.exception("local API: %s failed", printable(self.requestline, 200))
            self._last_word(
                500,
                f"cloudsync's local API failed on this request"
                f" ({type(exc).__name__}); cloudsync's log has the details",
            )

    def _handle_one_request(self) -> None:
        line = self.rfile.readline(MAX_LINE + 1)
        for _ in range(MAX_BLANK_LINES):
            if not line or str(line, "iso-8859-1").split():
                break
            line = self.rfile.readline(MAX_LINE + 1)
        self.raw_requestline = line
        if not line:  # the caller closed
            return
        if len(line) > MAX_LINE:
            self.send_error(414, f"the request line is over {MAX_LINE} bytes")
            return
        if not str(line, "iso-8859-1").split():
            self.send_error(400, "no request line (METHOD PATH HTTP/1.1) after blank lines")
            return
        if not self.parse_request():  # it answered
            return
        method = getattr(self, f"do_{self.command}", None)
        if method is None:
            self.send_error(501, f"method {printable(self.command, 20)!r}: GET or POST")
            return
        method()
        self.wfile.flush()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's refusals (a bad request line, too many headers...) as our JSON."""
        self.close_connection = True
        text = message or self.responses.get(code, ("refused", ""))[0]
        self._reply(code, {"error": printable(text, 300)})

    def _last_word(self, status: int, message: str) -> None:
        """An answer after a failure, if none was begun; the caller may be gone."""
        self.close_connection = True
        if not self.answered:
            with contextlib.suppress(OSError):
                self._reply(status, {"error": message})

    def _reply(self, status: int, doc: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json", headers)

    def _send(
        self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.answered = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(200, self.server.metrics(), CONTENT_TYPE_LATEST)
        elif self.path == "/v1/status":
            self._reply(200, self.server.status())
        else:
            self._reply(404, {"error": f"no route {printable(self.path, 200)}"})

    def do_POST(self) -> None:
        if self.path != "/v1/records":
            self._reply(404, {"error": f"no route {printable(self.path, 200)}"})
            return
        try:
            stored = self._post_records()
        except Refused as exc:
            doc = {"error": str(exc), **({"field": exc.field} if exc.field else {})}
            self._reply(exc.status, doc, {"Retry-After": "1"} if exc.status == 503 else None)
            return
        except OutboxError as exc:
            if exc.full:
                self._reply(
                    507,
                    {
                        "error": f"the outbox's disk is full; nothing was stored, retry"
                        f" once there is space ({printable(str(exc), 300)})"
                    },
                )
                return
            log.error("local API: the outbox could not store %s: %s", self.path, exc)
            self._reply(
                500,
                {
                    "error": f"the outbox could not store the records; nothing was"
                    f" stored ({printable(str(exc), 300)})"
                },
            )
            return
        dropped = sum(s is None for s in stored)
        self._reply(200, {"stored": len(stored) - dropped, "dropped": dropped})

    def _post_records(self) -> list[str | None]:
        """Admit, read, check and store one request's records (Refused at the first fault)."""
        length = body_length(
            self.headers.get_all("Content-Length") or [], self.headers.get("Transfer-Encoding")
        )
        with self.server.reading(length):
            data = self._read_body(length)
            # decoded one request at a time: a document of small objects is ~25 times its bytes
            with self.server.admission:
                admitted = admit(data)
                del data
                if not isinstance(admitted, Refused):
                    return self.server.outbox.put_many(admitted)
        raise admitted

    def _read_body(self, length: int) -> bytearray:
        """The body, all of it within read_timeout_s (TimeoutError), or Refused when the caller
        ends it short."""
        deadline = time.monotonic() + self.server.read_timeout_s
        data = bytearray()
        try:
            while len(data) < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                chunk = self.rfile.read1(min(length - len(data), 1 << 16))
                if not chunk:
                    raise Refused(
                        400,
                        f"the body ended after {len(data)} of the {length} bytes announced",
                        "Content-Length",
                    )
                data += chunk
        finally:
            self.connection.settimeout(self.server.read_timeout_s)
        return data


class LocalServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The local API's server: a thread per connection, at most ``max_connections`` at once
    (the next ones are answered 503 at once), each read with ``read_timeout_s``."""

    daemon_threads = True
    request_queue_size = 64  # socketserver's 5 made a burst of connects fail (EAGAIN)

    def __init__(
        self,
        path: Path,
        mode: int,
        outbox: Outbox,
        status: Callable[[], dict[str, Any]],
        metrics: Callable[[], bytes],
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():
            path.unlink()
        self.outbox, self.status, self.metrics = outbox, status, metrics
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.admission = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._reading = 0
        self._reading_lock = threading.Lock()
        super().__init__(str(path), Handler)
        os.chmod(path, mode)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="local-api", daemon=True)
        thread.start()
        return thread

    @contextlib.contextmanager
    def reading(self, length: int) -> Iterator[None]:
        """Room for a body of ``length`` bytes among those read at once, or Refused (503)."""
        with self._reading_lock:
            if self._reading and self._reading + length > MAX_READING:
                raise Refused(
                    503,
                    f"busy: {self._reading} bytes of requests are being read; retry in a second",
                )
            self._reading += length
        try:
            yield
        finally:
            with self._reading_lock:
                self._reading -= length

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._turn_away(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _turn_away(self, request: socket.socket) -> None:
        """503 to a connection over the cap, without waiting on it (this is the accept loop)."""
        body = json.dumps(
            {
                "error": f"busy: {self.max_connections} connections are being"
                " served; retry in a second"
            }
        ).encode()
        head = (
            "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(head.encode() + body)
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """What escaped a connection's handler: to cloudsync's log, not stderr."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("local API: a connection failed: %s", exc)
        else:
            log.error("local API: a connection failed", exc_info=True)
