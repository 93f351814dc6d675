"""The fleet service's database for the unit tests that ask for ``store``: each such test runs
on a SQLite file and on a new database of the session's PostgreSQL cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cloudsync.fleet.store import Store
from tests.postgres import fleet_store


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    cluster = request.getfixturevalue("postgres_cluster") if request.param != "sqlite" else None
    store = fleet_store(request.param, tmp_path, cluster)
    assert store.dialect == request.param
    yield store
    store.close()
