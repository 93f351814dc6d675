"""The cloud's service time from its statistics (edged.served), without a server: Triton's
document as REST gives it and as gRPC's JSON does (64-bit numbers as strings), versions summed,
the difference between reads, a restarted server, and what is not a number skipped."""

from __future__ import annotations

from typing import Any

import pytest

from edged.served import ServiceTimes, totals


def stats(*rows: tuple[str, str, Any, Any]) -> dict[str, Any]:
    return {
        "model_stats": [
            {
                "name": name,
                "version": version,
                "inference_stats": {"success": {"count": count, "ns": ns}},
            }
            for name, version, count, ns in rows
        ]
    }


def test_versions_are_summed_and_grpcs_strings_read() -> None:
    doc = stats(("a", "1", 2, 4_000_000), ("a", "2", "3", "6000000"), ("b", "1", 0, 0))
    assert totals(doc) == {"a": (5, 10_000_000), "b": (0, 0)}


@pytest.mark.parametrize(
    "doc",
    [
        None,
        [],
        {"model_stats": "x"},
        {"model_stats": [5, {"name": 3}, {"name": "a", "inference_stats": []}]},
        stats(("a", "1", "many", 5)),
        stats(("a", "1", -1, 5)),
        stats(("a", "1", None, 5)),
    ],
)
def test_what_is_not_triton_statistics_teaches_nothing(doc: Any) -> None:
    assert totals(doc) == {}
    assert ServiceTimes().update(doc) == {}


def test_the_service_time_is_the_difference_between_reads() -> None:
    times = ServiceTimes()
    # the first read: the mean over all the server served (a prior)
    assert times.update(stats(("a", "1", 4, 400_000_000), ("b", "1", 0, 0))) == {"a": (0.1, 4)}
    # nothing new: nothing learned
    assert times.update(stats(("a", "1", 4, 400_000_000))) == {}
    # two more calls of 300 ms each
    assert times.update(stats(("a", "1", 6, 1_000_000_000))) == {"a": (pytest.approx(0.3), 2)}
    # the server restarted (its counters went back): afresh
    assert times.update(stats(("a", "1", 1, 50_000_000))) == {"a": (pytest.approx(0.05), 1)}
    assert times.as_ms() == {"a": 50.0}
