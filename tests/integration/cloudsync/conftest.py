"""Fixtures of the cloudsync integration tests beside tests/conftest.py's (the fleet's PKI,
broker and agent): a real PostgreSQL for the fleet service's scaled mode."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import skip_or_fail
from tests.postgres import Postgres


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[Postgres]:
    why = Postgres.available()
    if why:
        skip_or_fail(why)
    server = Postgres(tmp_path / "pg").start()
    yield server
    server.stop()
