"""The region socket's reading of one message (edged.server.regions), without a daemon: any
bytes get a refusal that names what is wrong or a region with its descriptor, never another
exception; a caller off the allowed lists gets a 403 before its message is read."""

from __future__ import annotations

import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from edged.common.errors import EdgedError
from edged.common.live import Live
from edged.config import ServerConfig
from edged.oip.shm import Regions
from edged.server.access import Access, Peer
from edged.server.regions import MAX_MESSAGE, create, message_of, refusal

ALICE = Peer(pid=os.getpid(), uid=1000, gid=1000)
LIMIT = 1 << 20


def access(**settings: object) -> Access:
    return Access(Live(ServerConfig(admin_group="", **settings)))


JSONS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)
MESSAGES = (
    st.binary(max_size=MAX_MESSAGE + 64)
    | JSONS.map(lambda doc: json.dumps(doc).encode())
    | st.fixed_dictionaries(
        {"name": st.text(max_size=140) | st.integers(), "byte_size": JSONS | st.integers()}
    ).map(lambda doc: json.dumps(doc).encode())
)


def answer(
    regions: Regions, checks: Access, message: bytes
) -> tuple[dict[str, object], int | None]:
    """What the socket answers a message that is not an inference (``model``)."""
    try:
        doc = message_of(checks, ALICE, message)
        assert "model" not in doc or not isinstance(doc, dict)
        return create(regions, ALICE, doc, ServerConfig(max_request_bytes=LIMIT))
    except EdgedError as exc:
        return refusal(exc), None


@settings(max_examples=400, deadline=None)
@given(MESSAGES)
def test_any_message_gets_a_refusal_naming_the_field_or_a_region(message: bytes) -> None:
    regions = Regions()
    if b'"model"' in message:
        return  # an inference: the daemon's tests (tests/hostile/test_region_socket.py)
    reply, fd = answer(regions, access(), message)
    if fd is None:
        assert reply["status"] in (400, 413), reply
        assert any(
            word in str(reply["error"])
            for word in ("JSON", "not a key", "region name", "byte_size", "at most", "request body")
        ), reply
        assert regions.regions == {}
        return
    os.close(fd)
    doc = json.loads(message)
    assert reply == {
        "name": doc["name"],
        "byte_size": doc["byte_size"],
        "key": f"memfd:{doc['name']}",
    }
    assert list(regions.regions) == [(1000, doc["name"])]
    regions.close()


def test_a_caller_off_the_allowed_lists_is_refused_first() -> None:
    regions = Regions()
    reply, fd = answer(regions, access(allowed_uids=[0]), b"garbage")
    assert fd is None and reply["status"] == 403
    assert "uid 1000" in reply["error"] and "server.allowed_uids" in reply["error"]
    reply, fd = answer(regions, access(allowed_gids=[1000]), b'{"name": "a", "byte_size": 8}')
    assert fd is not None and reply["key"] == "memfd:a"
    os.close(fd)
    regions.close()
