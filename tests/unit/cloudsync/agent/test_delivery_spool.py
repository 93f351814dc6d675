"""How cloudsync reads edged-updater's answers in the update spool (``Delivery.answered``):
each outcome becomes the delivery step and the state it must (a real outbox and state file),
the result file is taken once, and what the spool may hold instead (garbage, a link, another
release's result) is reported, never raised. The end-to-end way (a real broker, nginx, the
package's cloudsync and updater) is tests/packaging/test_updater.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.agent.config import DeliveryConfig
from cloudsync.agent.delivery import Delivery
from cloudsync.agent.outbox import Outbox
from cloudsync.protocol import spool
from cloudsync.protocol.manifest import Manifest, make, sign, verify

KEY = Ed25519PrivateKey.generate()


@pytest.fixture
def delivery(tmp_path: Path) -> Iterator[Delivery]:
    where = tmp_path / "updates"
    where.mkdir(mode=0o750)
    outbox = Outbox(tmp_path / "outbox.db")
    config = DeliveryConfig(spool_dir=where, staging_dir=tmp_path / "staging")
    yield Delivery(
        config, "f1", "n1", lambda: {"fleet-1": KEY.public_key()}, outbox, lambda _timeout: None
    )  # type: ignore[arg-type,return-value]
    outbox.close()


def release(version: int) -> Manifest:
    files = [{"path": "edged_1.0+1_amd64.deb", "sha256": "ab" * 32, "length": 10}]
    doc = sign(make("edged", version, files, deb_version="1.0+1"), {"fleet-1": KEY})
    return verify(doc, {"fleet-1": KEY.public_key()})


def answer(delivery: Delivery, result: Any) -> Path:
    path = delivery.config.spool_dir / spool.RESULT
    path.write_text(result if isinstance(result, str) else json.dumps(result))
    return path


def reports(delivery: Delivery) -> list[dict[str, Any]]:
    return [r.body["delivery"] for r in delivery.outbox.peek(1000) if "delivery" in r.body]


@pytest.mark.parametrize(
    ("outcome", "step", "then", "state"),
    [
        ("committed", "active", True, {"floor": 7, "handed": 0}),
        ("rolled-back", "rolled-back", True, {"failed": 7, "handed": 0}),
        ("refused", "failed", True, {"failed": 7, "handed": 0}),
        ("abandoned", "failed", False, {"handed": 0}),  # cut short before a change: again
    ],
)
def test_each_outcome_is_its_step_and_state(
    delivery: Delivery, outcome: str, step: str, then: bool, state: dict[str, int]
) -> None:
    manifest = release(7)
    (delivery.config.spool_dir / manifest.files[0].path).write_bytes(b"x" * 10)
    path = answer(
        delivery,
        {"version": 7, "outcome": outcome, "why": "because\udcff", "from": "1.0", "to": "1.0+1"},
    )
    assert delivery.answered(manifest) is then
    assert not path.exists()  # taken once
    [row] = reports(delivery)
    assert row == {
        "model": "package:edged",
        "version": 7,
        "step": step,
        "stage": "update",
        "outcome": outcome,
        "why": "because\\udcff",
        "deb_version": "1.0+1",
    }
    assert delivery.state("package:edged") == state
    # the package is gone from the spool once committed, kept for another try otherwise
    assert (delivery.config.spool_dir / manifest.files[0].path).exists() is (outcome != "committed")
    assert delivery.answered(manifest) is None  # nothing more to read


def test_another_releases_result_is_reported_as_its_own(delivery: Delivery) -> None:
    answer(delivery, {"version": 5, "outcome": "committed", "to": "0.9"})
    assert delivery.answered(release(7)) is None  # the current release goes on
    [row] = reports(delivery)
    assert (row["version"], row["step"], row["model"]) == (5, "active", "package:edged")
    assert delivery.state("package:edged") == {"floor": 5, "handed": 0}


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{not json", "edged-updater's result.json: not JSON"),
        ("[" * 60_000, "edged-updater's result.json: not JSON"),
        ("x" * (spool.MAX_RESULT + 1), "more than"),
        (None, "result.json: cannot be opened"),  # a link
        ({"outcome": "refused", "why": "no copy of edged 1.0 to go back to"}, "no copy"),
    ],
)
def test_what_else_the_spool_holds_is_reported_as_this_releases_failure(
    delivery: Delivery, tmp_path: Path, content: Any, says: str
) -> None:
    path = delivery.config.spool_dir / spool.RESULT
    if content is None:
        (tmp_path / "elsewhere").write_text('{"version": 7, "outcome": "committed"}')
        os.symlink(tmp_path / "elsewhere", path)
    else:
        answer(delivery, content)
    assert delivery.answered(release(7)) is True
    [row] = reports(delivery)
    assert row["step"] == "failed" and row["version"] == 7 and says in row["why"], row
    assert not os.path.lexists(path)
    assert delivery.state("package:edged") == {"failed": 7, "handed": 0}
