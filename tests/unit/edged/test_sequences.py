"""A stream's sequences (Triton's sequence batching, per stream): start, continue, end, the
idle timeout, the cap per model, and the parameters refused with their names."""

from __future__ import annotations

import time

import pytest

from edged.common.errors import InvalidRequest
from edged.request import Sequences


def test_a_sequence_keeps_its_state_until_it_ends() -> None:
    streams = Sequences(limit=2)
    first = streams.take("m", {"sequence_id": 7, "sequence_start": True}, idle_s=5)
    first.state["n"] = 1
    again = streams.take("m", {"sequence_id": 7}, idle_s=5)
    assert again is first and again.state == {"n": 1} and not again.end
    other = streams.take("other", {"sequence_id": 7, "sequence_start": True}, idle_s=5)
    assert other is not first  # per model
    last = streams.take("m", {"sequence_id": 7, "sequence_end": True}, idle_s=5)
    assert last is first and last.end
    with pytest.raises(InvalidRequest, match="sequence 7 is not open on this stream"):
        streams.take("m", {"sequence_id": 7}, idle_s=5)
    restarted = streams.take("other", {"sequence_id": 7, "sequence_start": True}, idle_s=5)
    assert restarted is not other and restarted.state == {}  # a start starts it again


def test_idle_sequences_go_and_the_cap_is_per_model() -> None:
    streams = Sequences(limit=2)
    for sid in ("a", "b"):
        streams.take("m", {"sequence_id": sid, "sequence_start": True}, idle_s=5)
    with pytest.raises(InvalidRequest, match="2 sequences are open on this stream already"):
        streams.take("m", {"sequence_id": "c", "sequence_start": True}, idle_s=5)
    streams.take("n", {"sequence_id": "c", "sequence_start": True}, idle_s=5)  # another model
    time.sleep(0.05)
    streams.take("m", {"sequence_id": "c", "sequence_start": True}, idle_s=0.01)  # a, b idle
    assert sorted(key for key in streams.open) == [("m", "c"), ("n", "c")]
    with pytest.raises(InvalidRequest, match=r"idle for over 0\.01 s"):
        streams.take("m", {"sequence_id": "a"}, idle_s=0.01)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({}, "'sequence_id' must be an integer > 0"),
        ({"sequence_id": 0}, "'sequence_id' must be"),
        ({"sequence_id": -3}, "'sequence_id' must be"),
        ({"sequence_id": True}, "'sequence_id' must be"),
        ({"sequence_id": ""}, "'sequence_id' must be"),
        ({"sequence_id": "x" * 257}, "'sequence_id' must be"),
        ({"sequence_id": 1.5}, "'sequence_id' must be"),
        ({"sequence_id": 1, "sequence_start": 1}, "'sequence_start' and 'sequence_end'"),
        ({"sequence_id": 1, "sequence_end": "yes"}, "'sequence_start' and 'sequence_end'"),
    ],
)
def test_bad_sequence_parameters_are_named(parameters: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        Sequences().take("m", parameters, idle_s=1)
