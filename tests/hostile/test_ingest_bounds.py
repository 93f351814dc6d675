"""Issue 44, point 13: a 2,000,000-character ingest ran over 300 s with nothing to stop it
(every chunk is embedded before the answer). Now a request makes at most 2,048 chunks (under a
minute of embedding here), counted once the text is chunked and before any is embedded, and
is refused at once past that, naming the limit; edgectl kb ingest sends files in parts that
fit. A real daemon (its JSON limit raised to take the 2 MB body)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edged.client import ClientError
from edged.knowledge.service import MAX_INGEST_CHUNKS
from tests.conftest import Daemon

CONFIG = '[server]\nmax_json_bytes = 4194304\n[models]\nload = ["text-embedding"]\n'


def test_an_ingest_is_bounded_before_it_is_embedded(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config=CONFIG).start()
    client = daemon.client
    try:
        started = time.monotonic()
        with pytest.raises(ClientError) as refused:
            client.kb_ingest(
                "notes", [{"text": "words of a long text " * 90_000, "source": "big.txt"}]
            )
        took = time.monotonic() - started
        assert refused.value.status == 400
        assert refused.value.message.startswith("the documents make ")
        assert refused.value.message.endswith(
            f" chunks; at most {MAX_INGEST_CHUNKS} per request: send them in parts (edgectl kb"
            " ingest does)"
        )
        assert took < 60, took  # chunked, not embedded (was over 300 s)
        with pytest.raises(ClientError) as nothing:
            client.kb_stats("notes")
        assert nothing.value.status == 404  # nothing was written
        small = [{"text": "words of a short text " * 100, "source": "small.txt"}]
        assert client.kb_ingest("notes", small)["documents"] == 1
    finally:
        assert daemon.stop() == 0
