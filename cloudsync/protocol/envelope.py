"""The envelope of every message: versioned JSON ``{v, id, ts, node, seq, body}``.

- ``v``: the envelope's major version (1). A reader refuses a major it does not know and keeps
  the keys it does not know (a minor version may add some; a signature covers them all).
- ``id``: the message's idempotency id (32 hex characters): a record sent twice carries the same
  id, so the receiver drops the second copy.
- ``ts``: when the record was made, milliseconds since the epoch (UTC).
- ``node``: the sending node's name (the operator's name for commands).
- ``seq``: the sender's sequence number for that kind of message, increasing: order within a
  priority is kept, and a gap shows a drop.
- ``body``: a JSON object, the message itself.

Encoded as compact JSON with sorted keys, so that the same envelope is the same bytes (the
command signature is over them).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

VERSION = 1
MAX_BYTES = 256 * 1024
# a record's body may be this large: room for the envelope's other fields (node, ids, seq, and
# keys a minor version adds) beside it
MAX_BODY_BYTES = MAX_BYTES - 2048
MAX_DEPTH = 32  # objects and lists nested deeper are refused (a reader's recursion)
REQUIRED = ("v", "id", "ts", "node", "seq", "body")


class EnvelopeError(ValueError):
    """Bytes that are not an envelope this reader can take."""


def new_id() -> str:
    return uuid.uuid4().hex


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def canonical(doc: dict[str, Any]) -> bytes:
    """The one byte form of a JSON object: sorted keys, no spaces, UTF-8; ValueError for what
    JSON cannot carry (NaN, infinities, text UTF-8 cannot encode)."""
    data = json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return data.encode()


@dataclass(frozen=True)
class Envelope:
    node: str
    seq: int
    body: dict[str, Any]
    id: str = field(default_factory=new_id)
    ts: int = field(default_factory=now_ms)
    v: int = VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # keys of a later minor version, or sig

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.extra,
            "v": self.v,
            "id": self.id,
            "ts": self.ts,
            "node": self.node,
            "seq": self.seq,
            "body": self.body,
        }

    def encode(self) -> bytes:
        data = canonical(self.as_dict())
        if len(data) > MAX_BYTES:
            raise EnvelopeError(f"an envelope of {len(data)} bytes is over {MAX_BYTES}")
        return data


def decode(data: bytes) -> Envelope:
    """Bytes as an Envelope, or EnvelopeError saying what is wrong."""
    if len(data) > MAX_BYTES:
        raise EnvelopeError(f"an envelope of {len(data)} bytes is over {MAX_BYTES}")
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EnvelopeError(f"not JSON: {printable(str(exc), 200)}") from None
    except RecursionError:
        raise EnvelopeError(f"nested deeper than {MAX_DEPTH} levels") from None
    if depth(doc) > MAX_DEPTH:
        raise EnvelopeError(f"nested deeper than {MAX_DEPTH} levels")
    if not isinstance(doc, dict):
        raise EnvelopeError("an envelope is a JSON object")
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise EnvelopeError(f"missing {', '.join(missing)}")
    if doc["v"] != VERSION:
        raise EnvelopeError(f"envelope version {doc['v']!r}: this reader knows {VERSION}")
    checks = [
        ("id", isinstance(doc["id"], str) and 0 < len(doc["id"]) <= 64),
        ("ts", _integer(doc["ts"]) and doc["ts"] >= 0),
        ("node", isinstance(doc["node"], str) and 0 < len(doc["node"]) <= 64),
        ("seq", _integer(doc["seq"]) and doc["seq"] >= 0),
        ("body", isinstance(doc["body"], dict)),
    ]
    bad = [name for name, good in checks if not good]
    if bad:
        raise EnvelopeError(f"bad {', '.join(bad)}")
    extra = {k: v for k, v in doc.items() if k not in REQUIRED}
    return Envelope(doc["node"], doc["seq"], doc["body"], doc["id"], doc["ts"], VERSION, extra)


def depth(doc: Any) -> int:
    """How deeply objects and lists nest in ``doc`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        elif not isinstance(value, list):
            continue
        deepest = max(deepest, level)
        stack.extend((v, level + 1) for v in value if isinstance(v, (dict, list)))
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def printable(text: str, limit: int = 500) -> str:
    """Text safe to keep and send: what UTF-8 cannot encode (a lone surrogate) escaped, and at
    most ``limit`` characters (a refusal may quote a sender's text)."""
    safe = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return safe if len(safe) <= limit else f"{safe[:limit]}... [{len(safe) - limit} more]"
