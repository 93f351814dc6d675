"""Issue 22: cloudsync's local API under a hostile caller, against a real cloudsync process.

No broker runs (the Broker object only names a port and certificates): cloudsync works offline
and keeps every record in its outbox, so what a request stored can be counted in /v1/status.

Before: a request could be 8 MiB while one record's envelope may be 256 KiB (a 300 KB record
was stored and could never be sent); ``Content-Length: -1`` read the stream to its end (a
100 MiB record stored, +410 MB); a non-numeric Content-Length, deep nesting or ``ttl_s: 1e300``
dropped the connection unanswered (an exception in the handler).

What must hold now: limits at the door, before the body is read; bad input is a 4xx naming the
field, and a refused request stores nothing; every connection that sends a whole request gets a
whole answer; after all of it, the same process answers, with its memory bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudsync.agent.local_api import (
    MAX_BODY,
    MAX_CONNECTIONS,
    MAX_READING,
    MAX_RECORDS,
    LocalServer,
)
from cloudsync.agent.outbox import Outbox
from cloudsync.protocol.envelope import MAX_BODY_BYTES
from tests.conftest import wait_for
from tests.hostile.conftest import fill
from tests.mosquitto import Broker, cloudsync_config

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
RECORD = {"kind": "telemetry", "body": {"t": 1}}
SEEN: Counter[str] = Counter()  # the statuses the fuzzers got, for the summary at the end
RSS_GROWTH = 100 << 20  # what the whole file may add to cloudsync's resident memory


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def doc(self) -> Any:
        return json.loads(self.body)


@dataclass
class Cloudsync:
    """A real ``python -m cloudsync.agent.cli`` (offline), its socket and log."""

    workdir: Path
    config: str
    proc: subprocess.Popen[bytes] | None = None
    first_pid: int = 0  # the process and its resident memory once it first answered
    first_rss: int = 0

    def __post_init__(self) -> None:
        self.socket = self.workdir / "cloudsync.sock"
        self.log = self.workdir / "cloudsync.log"
        (self.workdir / "cloudsync.toml").write_text(self.config)

    def start(self) -> Cloudsync:
        config = self.workdir / "cloudsync.toml"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cloudsync.agent.cli", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self.socket.exists, 20, "cloudsync's local API", self.proc)
        return self

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(20)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def figures(self) -> dict[str, Any]:
        """The outbox's figures from GET /v1/status: pending and the counters."""
        answer = exchange(self.socket, b"GET /v1/status HTTP/1.1\r\nHost: c\r\n\r\n")
        assert answer is not None and answer.status == 200, answer
        outbox = answer.doc()["outbox"]
        return {"pending": outbox["pending"], **outbox["counters"]}

    def rss(self, field: str = "VmRSS") -> int:
        """Its resident memory now (VmHWM: the most it has had), bytes."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) << 10
        raise AssertionError(f"no {field}")


def config_for(workdir: Path, pki: Path, outbox: Path | None = None) -> str:
    """cloudsync's config against a broker that never runs; alerts off, so that nothing but
    the test puts records in the outbox."""
    text = cloudsync_config(Broker(workdir / "mosquitto", pki), workdir, "f1")
    text += "[alerts]\nenabled = false\n"
    if outbox is not None:
        text = text.replace(f'path = "{workdir}/outbox.db"', f'path = "{outbox}"')
    return text


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Cloudsync]:
    workdir = tmp_path_factory.mktemp("cloudsync")
    agent = Cloudsync(workdir, config_for(workdir, pki)).start()
    agent.figures()  # warm: the first answer's imports and buffers are not growth
    assert agent.proc is not None
    agent.first_pid, agent.first_rss = agent.proc.pid, agent.rss()
    yield agent
    assert agent.stop() == 0, agent.logs()[-3000:]


# ---- talking to it ---------------------------------------------------------------------------


def exchange(path: Path, raw: bytes, timeout: float = 10.0, finish: bool = True) -> Answer | None:
    """Send raw bytes (``finish``: then end the stream, so the request is all there is), read
    the answer to its end; None when the connection closed without a whole answer."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        with contextlib.suppress(OSError):  # it may answer and close before reading it all
            sock.sendall(raw)
            if finish:
                sock.shutdown(socket.SHUT_WR)
        return receive(sock)


def receive(sock: socket.socket) -> Answer | None:
    """What comes back until the connection closes, as an answer (None: not a whole one)."""
    reply = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):
            reply += chunk
    return parse(reply)


def parse(reply: bytes) -> Answer | None:
    """A whole HTTP answer (status line, headers, as many body bytes as its Content-Length)."""
    head, sep, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    words = lines[0].split(" ", 2)
    if not sep or len(words) < 2 or not words[0].startswith("HTTP/") or not words[1].isdigit():
        return None
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    if int(headers.get("Content-Length", -1)) != len(body):
        return None
    return Answer(int(words[1]), headers, body)


def request(body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/records") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: cloudsync"]
    if headers is None:
        headers = {"Content-Length": str(len(body))}
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def records(*items: Any) -> bytes:
    return json.dumps({"records": list(items)}).encode()


def record(**fields: Any) -> dict[str, Any]:
    return {**RECORD, **fields}


def nested(levels: int) -> Any:
    doc: Any = 1
    for _ in range(levels):
        doc = {"a": doc}
    return doc


# ---- the table -------------------------------------------------------------------------------

BIG = "x" * 300_000  # issue 22: a 300 KB record was stored and could never be sent
HEADER_CASES = [
    ("no Content-Length", b"{}", {}, 411, "Content-Length"),
    ("Content-Length not a number", b"{}", {"Content-Length": "abc"}, 400, "Content-Length"),
    ("Content-Length -1", b"{}" * 50, {"Content-Length": "-1"}, 400, "Content-Length"),
    ("Content-Length 1e3", b"{}", {"Content-Length": "1e3"}, 400, "Content-Length"),
    ("Content-Length +2", b"{}", {"Content-Length": "+2"}, 400, "Content-Length"),
    ("Content-Length 5, 6", b"{}", {"Content-Length": "5, 6"}, 400, "Content-Length"),
    (
        "Content-Length past 8 MiB",
        b"{}",
        {"Content-Length": str(MAX_BODY + 1)},
        413,
        "Content-Length",
    ),
    ("Content-Length of 20 digits", b"{}", {"Content-Length": "9" * 20}, 413, "Content-Length"),
    (
        "chunked",
        b"2\r\n{}\r\n0\r\n\r\n",
        {"Transfer-Encoding": "chunked"},
        411,
        "Transfer-Encoding",
    ),
    (
        "a body shorter than announced",
        b'{"records":',
        {"Content-Length": "100"},
        400,
        "Content-Length",
    ),
]
BODY_CASES = [
    ("an empty body", b"", 400, "empty"),
    ("not JSON", b'{"records": [', 400, "not JSON"),
    ("not UTF-8", b'{"records": [{"kind": "telemetry", "body": {"t": "\xff"}}]}', 400, "UTF-8"),
    ("NaN", b'{"records": [{"kind": "telemetry", "body": {"t": NaN}}]}', 400, "NaN"),
    ("Infinity", b'{"records": [{"kind": "telemetry", "body": {"t": Infinity}}]}', 400, "Infinity"),
    (
        "-Infinity",
        b'{"records": [{"kind": "telemetry", "body": {"t": -Infinity}}]}',
        400,
        "-Infinity",
    ),
    ("1e400", b'{"records": [{"kind": "telemetry", "body": {"t": 1e400}}]}', 400, "1e400"),
    ("a 400-digit integer", records(record(body={"t": 10**400})), 400, "401 digits"),
    ("nesting past the recursion limit", b"[" * 100_000, 400, "nests too deeply"),
    ("a body nested 32 deep", records(record(body=nested(32))), 400, "records[0].body"),
    ("no records", b"{}", 400, "records"),
    ("records empty", records(), 400, "records"),
    ("records not a list", b'{"records": {"kind": "telemetry"}}', 400, "records"),
    ("too many records", records(*[RECORD] * (MAX_RECORDS + 1)), 413, "records"),
    ("a record not an object", records(RECORD, 5), 400, "records[1]"),
    ("kind missing", records({"body": {}}), 400, "records[0].kind"),
    ("kind unknown", records(record(kind="logs")), 400, "records[0].kind"),
    ("kind a list", records(record(kind=["telemetry"])), 400, "records[0].kind"),
    ("priority unknown", records(record(priority="urgent")), 400, "records[0].priority"),
    ("priority an object", records(record(priority={"a": 1})), 400, "records[0].priority"),
    ("id empty", records(record(id="")), 400, "records[0].id"),
    ("id of 65 characters", records(record(id="i" * 65)), 400, "records[0].id"),
    ("id with a newline", records(record(id="a\nb")), 400, "records[0].id"),
    ("id a number", records(record(id=5)), 400, "records[0].id"),
    ("id a lone surrogate", records(record(id="\ud800")), 400, "records[0].id"),
    ("ttl_s 1e300", records(record(ttl_s=1e300)), 400, "records[0].ttl_s"),
    ("ttl_s 0", records(record(ttl_s=0)), 400, "records[0].ttl_s"),
    ("ttl_s negative", records(record(ttl_s=-5)), 400, "records[0].ttl_s"),
    ("ttl_s a string", records(record(ttl_s="60")), 400, "records[0].ttl_s"),
    ("ttl_s true", records(record(ttl_s=True)), 400, "records[0].ttl_s"),
    ("ttl_s over 10 years", records(record(ttl_s=4e8)), 400, "records[0].ttl_s"),
    ("body missing", records({"kind": "events"}), 400, "records[0].body"),
    ("body a list", records(record(body=[1])), 400, "records[0].body"),
    ("a lone surrogate", records(record(body={"text": "\ud800"})), 400, "records[0].body.text"),
    (
        "a lone surrogate deeper",
        records(RECORD, record(body={"a": [1, {"b": "x\udfff"}]})),
        400,
        "records[1].body.a[1].b",
    ),
    (
        "a lone surrogate in a key",
        records(record(body={"k\ud800": 1})),
        400,
        'records[0].body["k\\ud800"]',
    ),
    (
        "a 300 KB record after a good one",
        records(RECORD, record(body={"b": BIG})),
        413,
        "records[1].body",
    ),
]


@pytest.mark.parametrize(
    ("raw", "status", "field"),
    [pytest.param(request(b, h), s, f, id=name) for name, b, h, s, f in HEADER_CASES]
    + [pytest.param(request(b), s, f, id=name) for name, b, s, f in BODY_CASES],
)
def test_each_bad_request_is_a_4xx_naming_the_field_and_stores_nothing(
    agent: Cloudsync, raw: bytes, status: int, field: str
) -> None:
    before = agent.figures()
    answer = exchange(agent.socket, raw)
    assert answer is not None, "no answer"
    assert answer.status == status, answer
    error = answer.doc()["error"]
    assert field in error, error
    assert "field" not in answer.doc() or error.startswith(answer.doc()["field"] + ": "), error
    assert agent.figures() == before


def test_a_good_request_is_stored_whole_and_a_retry_once(agent: Cloudsync) -> None:
    before = agent.figures()
    doc = records(
        RECORD,
        {"kind": "events", "body": {"door": "open"}, "priority": "alert", "id": "door-42"},
        record(id="t-1", ttl_s=3600, priority="event", extra="ignored"),
    )
    answer = exchange(agent.socket, request(doc))
    assert answer is not None and answer.status == 200, answer
    assert answer.doc() == {"stored": 3, "dropped": 0}
    again = exchange(agent.socket, request(records(record(id="door-42"))))
    assert again is not None and again.doc() == {"stored": 1, "dropped": 0}
    after = agent.figures()
    assert after["pending"] - before["pending"] == 3
    assert after["duplicate"] - before["duplicate"] == 1


def test_a_body_of_the_largest_size_is_stored_and_one_byte_more_is_a_413(
    agent: Cloudsync,
) -> None:
    """The largest body canonical JSON may have (envelope.MAX_BODY_BYTES) is taken."""
    largest = {"b": "x" * (MAX_BODY_BYTES - len('{"b":""}'))}
    answer = exchange(agent.socket, request(records(record(body=largest))))
    assert answer is not None and answer.status == 200, answer
    largest["b"] += "x"
    answer = exchange(agent.socket, request(records(record(body=largest))))
    assert answer is not None and answer.status == 413, answer
    assert f"{MAX_BODY_BYTES + 1} bytes" in answer.doc()["error"]


def test_a_100_mib_body_is_refused_before_it_is_read(agent: Cloudsync) -> None:
    """Content-Length -1 read the whole stream: a 100 MiB record, +410 MB."""
    body = b'{"records": [{"kind": "telemetry", "body": {"b": "' + b"x" * (100 << 20) + b'"}}]}'
    before, rss = agent.figures(), agent.rss()
    for length in ("-1", str(len(body))):
        answer = exchange(agent.socket, request(body, {"Content-Length": length}))
        assert answer is not None and answer.status in (400, 413), answer
        assert "Content-Length" in answer.doc()["error"]
    assert agent.figures() == before
    assert agent.rss() - rss < 16 << 20


def test_get_endpoints_still_answer(agent: Cloudsync) -> None:
    for path, kind in (("/v1/status", b"application/json"), ("/metrics", b"text/plain")):
        answer = exchange(agent.socket, f"GET {path} HTTP/1.1\r\nHost: c\r\n\r\n".encode())
        assert answer is not None and answer.status == 200, answer
        assert answer.headers["Content-Type"].encode().startswith(kind)
    answer = exchange(agent.socket, b"GET /nothing HTTP/1.0\r\n\r\n")
    assert answer is not None and answer.status == 404


# ---- fuzzed documents ------------------------------------------------------------------------

CLEAN_TEXT = st.text(max_size=10)  # what UTF-8 can encode
TEXT = st.text(st.characters() | st.sampled_from(["\ud800", "\udfff", "\x00"]), max_size=10)
CLEAN = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | CLEAN_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(CLEAN_TEXT, inner, max_size=4),
    max_leaves=16,
)
SCALAR = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(10**300, 10**320)
    | st.floats()  # NaN and the infinities too
    | st.sampled_from([1e300, -1e308, 5e-324, 2**63])
    | TEXT
)
JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=16,
)
GOOD = {
    "kind": st.sampled_from(["telemetry", "events"]),
    "body": st.dictionaries(CLEAN_TEXT, CLEAN, max_size=4),
    "priority": st.sampled_from(["alert", "event", "telemetry"]),
    "id": st.text("ab", min_size=1, max_size=2),  # repeats: duplicates are counted
    "ttl_s": st.floats(0.001, 1e6) | st.integers(1, 10**8),
}
HOSTILE = {
    "kind": st.sampled_from(["logs", "", "Telemetry", "result/x"]),
    "body": st.integers(28, 40).map(nested)
    | st.just({"b": BIG})
    | st.dictionaries(TEXT, JSON, min_size=1, max_size=4),
    "priority": st.sampled_from(["urgent", "", "Alert"]),
    "id": st.sampled_from(["", "i" * 65, "a\nb", "\ud800", "\x7f"]),
    "ttl_s": st.sampled_from([0, -1, 1e300, 4e8, 10**400, -0.0, 5e-324]),
}


@st.composite
def fuzzed_record(draw: st.DrawFn) -> Any:
    """A valid record, then none, one or two of its fields spoilt: removed, a hostile value
    for that field, or any JSON value at all."""
    record = {name: draw(GOOD[name]) for name in ("kind", "body")}
    for name in ("priority", "id", "ttl_s"):
        if draw(st.booleans()):
            record[name] = draw(GOOD[name])
    for name in draw(st.lists(st.sampled_from(list(GOOD)), max_size=2)):
        how = draw(st.sampled_from(["absent", "hostile", "hostile", "any"]))
        if how == "absent":
            record.pop(name, None)
        else:
            record[name] = draw(HOSTILE[name] if how == "hostile" else JSON)
    return record


DOCUMENT = (
    st.builds(lambda rs: {"records": rs}, st.lists(fuzzed_record(), min_size=1, max_size=4))
    | st.builds(lambda r: {"records": [r]}, JSON)
    | JSON
)


@FUZZ
@given(doc=DOCUMENT)
def test_fuzzed_documents_get_an_answer_and_a_200_stores_what_it_says(
    agent: Cloudsync, doc: Any
) -> None:
    body = json.dumps(doc).encode()  # NaN and Infinity as Python writes them; \ud800 escaped
    before = agent.figures()
    answer = exchange(agent.socket, request(body))
    after = agent.figures()
    assert answer is not None and answer.status in (200, 400, 411, 413), (answer, body[:300])
    SEEN[f"documents {answer.status}"] += 1
    delta = {name: after[name] - before[name] for name in after}
    if answer.status == 200:
        stored, dropped = answer.doc()["stored"], answer.doc()["dropped"]
        assert stored + dropped == len(doc["records"]), answer
        assert dropped == 0 and delta["dropped_budget"] == 0
        assert delta["put"] == stored
        assert delta["pending"] + delta["duplicate"] == stored, (answer, delta)
    else:
        error, field = answer.doc()["error"], answer.doc().get("field")
        assert field is None or error.startswith(f"{field}: "), error
        assert not any(delta.values()), (answer, delta)


# ---- raw bytes -------------------------------------------------------------------------------

LENGTHS = st.sampled_from(
    [
        b"-1",
        b"1e3",
        b"  5",
        b"99999999999999999999",
        b"0",
        b"5",
        b"abc",
        b"",
        b"5, 6",
        b"\xb2",
        b"0x10",
        b"+5",
        b"4" * 30,
        b"5\r\n Content-Length: 6",
    ]
) | st.integers(0, 120).map(lambda n: str(n).encode())
HEADER = st.sampled_from(
    [
        b"Transfer-Encoding: chunked",
        b"Expect: 100-continue",
        b"Connection: keep-alive",
        b"X: " + b"y" * 70_000,
        b"Host: c",
        b"no colon",
        b": empty name",
        b"\x00: \xff",
    ]
) | st.builds(lambda v: b"Content-Length: " + v, LENGTHS)
RAW_REQUEST = st.builds(
    lambda method, path, version, headers, body, cut: (
        method
        + b" "
        + path
        + version
        + b"\r\n"
        + b"".join(h + b"\r\n" for h in headers)
        + b"\r\n"
        + body
    )[: cut or None],
    st.sampled_from([b"POST", b"GET", b"PUT", b"HEAD", b"\x00", b"G\xffT", b"PRI", b""]),
    st.sampled_from(
        [
            b"/v1/records",
            b"/v1/status",
            b"/metrics",
            b"*",
            b"/\xff",
            b"//v1/records",
            b"/" + b"x" * 70_000,
        ]
    ),
    st.sampled_from([b" HTTP/1.1", b" HTTP/1.0", b" HTTP/2.0", b" HTTP/1.x", b"", b" http/1.1"]),
    st.lists(HEADER, max_size=4),
    st.binary(max_size=64) | st.just(records(RECORD)) | st.builds(records, JSON),
    st.none() | st.integers(1, 200),
)
FUZZED = {"requests": 0, "whole": 0, "answered": 0, "dropped": 0, "waited": 0}


def has_request_line(raw: bytes) -> bool:
    return bool(raw.decode("latin-1").split())


@FUZZ
@given(
    raw=RAW_REQUEST | st.binary(max_size=512) | st.sampled_from([b"\r\n" * 20, b"GET /v1/status"]),
    finish=st.integers(0, 9).map(bool),
)
def test_raw_http_garbage_always_gets_a_whole_answer(
    agent: Cloudsync, raw: bytes, finish: bool
) -> None:
    """``finish``: the request ends with the stream, so it is whole and must be answered;
    else the caller stops sending and gives up after 0.3 s (what came by then is checked)."""
    answer = exchange(agent.socket, raw, timeout=5.0 if finish else 0.3, finish=finish)
    FUZZED["requests"] += 1
    if finish and has_request_line(raw):
        FUZZED["whole"] += 1
        FUZZED["dropped"] += answer is None
        assert answer is not None, raw[:300]
    if answer is not None:
        FUZZED["answered"] += 1
        SEEN[f"raw {answer.status}"] += 1
        assert answer.status < 500 or answer.status in (501, 505), (answer, raw[:300])
        assert answer.status == 200 or "error" in answer.doc()
    elif not finish:
        FUZZED["waited"] += 1


def test_after_the_raw_fuzz_nothing_was_dropped(agent: Cloudsync) -> None:
    assert FUZZED["dropped"] == 0, FUZZED
    assert FUZZED["requests"] >= 100, FUZZED


# ---- connections, slow callers, a full disk --------------------------------------------------


def test_connections_over_the_cap_are_a_503_and_the_held_ones_still_served(
    agent: Cloudsync,
) -> None:
    extra = 3
    held = []
    try:
        for _ in range(MAX_CONNECTIONS + extra):
            sock = socket.socket(socket.AF_UNIX)
            held.append(sock)
            sock.connect(str(agent.socket))
            sock.settimeout(10)
        for sock in held[MAX_CONNECTIONS:]:  # answered at once, unread
            answer = receive(sock)
            assert answer is not None and answer.status == 503, answer
            assert answer.headers["Retry-After"] == "1"
        for sock in held[:MAX_CONNECTIONS]:  # waiting for their request: they get one
            sock.sendall(b"GET /v1/status HTTP/1.1\r\nHost: c\r\n\r\n")
            answer = receive(sock)
            assert answer is not None and answer.status == 200, answer
    finally:
        for sock in held:
            sock.close()
    agent.figures()


def test_bodies_read_at_once_are_bounded_and_a_503_asks_for_a_retry(agent: Cloudsync) -> None:
    """Four callers send 8 MiB bodies slowly: the fifth is told to retry (Retry-After), and
    once they end short, a request goes through again."""
    slow = []
    head = request(b"", {"Content-Length": str(MAX_BODY)}) + b'{"records": ['
    try:
        for _ in range(MAX_READING // MAX_BODY):
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(10)
            sock.connect(str(agent.socket))
            sock.sendall(head)
            slow.append(sock)
        body = records(RECORD)
        answer: Answer | None = None

        def refused() -> bool:
            nonlocal answer
            answer = exchange(agent.socket, request(body, {"Content-Length": str(MAX_BODY)}))
            return answer is not None and answer.status == 503

        wait_for(refused, 10, "a 503 while four bodies are being read")
        assert answer is not None and answer.headers["Retry-After"] == "1", answer
        assert "busy" in answer.doc()["error"]
        for sock in slow:  # they end short: a 400 each, and their room is free again
            sock.shutdown(socket.SHUT_WR)
            short = receive(sock)
            assert short is not None and short.status == 400, short
    finally:
        for sock in slow:
            sock.close()
    answer = exchange(agent.socket, request(records(RECORD)))
    assert answer is not None and answer.status == 200, answer


@pytest.fixture
def local_api(tmp_path: Path) -> Iterator[Path]:
    """An in-process LocalServer over a real outbox, with a 0.5 s read timeout (cloudsync's
    own is 30 s: too long to wait for here)."""
    outbox = Outbox(tmp_path / "outbox.db")
    server = LocalServer(
        tmp_path / "api.sock", 0o600, outbox, lambda: {"ok": True}, lambda: b"", read_timeout_s=0.5
    )
    thread = server.start()
    yield tmp_path / "api.sock"
    server.shutdown()
    server.server_close()
    thread.join(5)
    outbox.close()


def send_nothing(sock: socket.socket) -> None:
    pass


def send_half_a_request_line(sock: socket.socket) -> None:
    sock.sendall(b"POST /v1/rec")


def send_half_a_body(sock: socket.socket) -> None:
    sock.sendall(request(b'{"records": [', {"Content-Length": "100"}))


def trickle_a_body(sock: socket.socket) -> None:
    """A byte every 0.1 s: never idle for the read timeout, but 2 s for the whole body."""
    sock.sendall(request(b"", {"Content-Length": "20"}))
    for _ in range(20):
        sock.sendall(b" ")
        time.sleep(0.1)


@pytest.mark.parametrize(
    "send", [send_nothing, send_half_a_request_line, send_half_a_body, trickle_a_body]
)
def test_a_stalled_or_slow_request_is_a_408_within_the_read_timeout(
    local_api: Path, send: Callable[[socket.socket], Any]
) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(local_api))
        started = time.monotonic()
        with contextlib.suppress(OSError):
            send(sock)
        answer = receive(sock)
        took = time.monotonic() - started
    assert answer is not None and answer.status == 408, answer
    assert took < 2.5, took  # the trickle is cut at the deadline, not when it would end (2 s)


def test_a_full_disk_is_a_507_that_stores_nothing_and_a_retry_succeeds(
    tmp_path: Path, pki: Path, small_disk: Path
) -> None:
    workdir = tmp_path / "agent"
    workdir.mkdir()
    agent = Cloudsync(workdir, config_for(workdir, pki, small_disk / "outbox.db")).start()
    try:
        before = agent.figures()
        filler = fill(small_disk)
        answer = exchange(agent.socket, request(records(record(body={"b": "x" * 100_000}))))
        assert answer is not None and answer.status == 507, answer
        assert "full" in answer.doc()["error"]
        assert agent.figures() == before
        filler.unlink()
        answer = exchange(agent.socket, request(records(record(body={"b": "x" * 100_000}))))
        assert answer is not None and answer.status == 200, answer
    finally:
        assert agent.stop() == 0, agent.logs()[-3000:]


def test_the_costliest_documents_are_decoded_one_at_a_time(agent: Cloudsync) -> None:
    """8 MiB of empty objects decodes to ~200 MB of Python objects: six sent at once must not
    need six times that (those over the bodies read at once are told to retry)."""
    body = b'{"records": [{"kind": "telemetry", "body": {"a": [' + b"{}," * (MAX_BODY // 3 - 30)
    body += b"0]}}]}"
    peak = agent.rss("VmHWM")
    answer = exchange(agent.socket, request(body), timeout=60)
    assert answer is not None and answer.status == 413, answer
    one = agent.rss("VmHWM") - peak
    statuses: list[int | None] = []

    def post() -> None:
        answer = exchange(agent.socket, request(body), timeout=120)
        statuses.append(answer.status if answer else None)

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(statuses) <= {413, 503} and statuses.count(413) >= 4, statuses
    assert agent.rss("VmHWM") - peak < one + (64 << 20), (one, agent.rss("VmHWM") - peak)


# ---- after everything ------------------------------------------------------------------------


def test_after_everything_the_same_process_answers_with_bounded_memory(agent: Cloudsync) -> None:
    pid, rss = agent.first_pid, agent.first_rss
    assert agent.proc is not None and agent.proc.poll() is None and agent.proc.pid == pid
    agent.figures()
    grown = agent.rss() - rss
    print(f"VmRSS {rss >> 20} -> {agent.rss() >> 20} MiB; {FUZZED}; {sorted(SEEN.items())}")
    assert grown < RSS_GROWTH, grown
    assert "Traceback" not in agent.logs(), agent.logs()[-3000:]


def test_the_cap_and_the_read_timeout_are_settings(tmp_path: Path, pki: Path) -> None:
    """``[local] max_connections`` and ``read_timeout_s`` in the config file, read by a real
    process: the third of two allowed connections is a 503, a stalled request a 408."""
    workdir = tmp_path / "agent"
    workdir.mkdir()
    text = config_for(workdir, pki).replace(
        f'socket = "{workdir}/cloudsync.sock"',
        f'socket = "{workdir}/cloudsync.sock"\nread_timeout_s = 1\nmax_connections = 2',
    )
    agent = Cloudsync(workdir, text).start()
    held = []
    try:
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX)
            held.append(sock)
            sock.connect(str(agent.socket))
            sock.settimeout(10)
        over = receive(held[2])
        assert over is not None and over.status == 503, over
        started = time.monotonic()
        stalled = receive(held[0])  # it sends nothing: cut after read_timeout_s
        assert stalled is not None and stalled.status == 408, stalled
        assert time.monotonic() - started < 5
    finally:
        for sock in held:
            sock.close()
        assert agent.stop() == 0, agent.logs()[-3000:]
