"""Fixtures for every cloudsync integration test: the fleet's PKI (test_cloudsync.py defines
it) and a real PostgreSQL for the fleet service's scaled mode."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import skip_or_fail
from tests.integration.cloudsync.test_cloudsync import pki  # noqa: F401
from tests.postgres import Postgres


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[Postgres]:
    why = Postgres.available()
    if why:
        skip_or_fail(why)
    server = Postgres(tmp_path / "pg").start()
    yield server
    server.stop()
