"""The knowledge base through a real daemon: ingest FAQ documents with the local embedding
model into Milvus Lite, find them again from paraphrased questions, survive a restart."""

from __future__ import annotations

from typing import Any

import pytest

from edged.client import Client, ClientError
from tests.conftest import Daemon

FAQ = [
    {
        "source": "faq/power.md",
        "text": "To reboot the device, hold the power button for ten seconds until the LED"
        " blinks twice, then release it.",
    },
    {
        "source": "faq/network.md",
        "text": "The Wi-Fi password can be changed in the settings page under Network, then"
        " Wireless, then Security.",
        "metadata": {"lang": "en"},
    },
    {
        "source": "faq/thermal.md",
        "text": "If the GPU runs hot, check that the fan is spinning and that the heatsink is"
        " not covered by dust.",
    },
]


def search(client: Client, query: str, **body: Any) -> list[dict[str, Any]]:
    return list(client.call("POST", "/v1/kb/faq/search", {"query": query, **body})["hits"])


def test_ingest_search_delete_and_restart(make_daemon: type[Daemon]) -> None:
    daemon = make_daemon(config='[models]\nload = ["text-embedding"]\n').start()
    client = daemon.client
    written = client.call("POST", "/v1/kb/faq/ingest", {"documents": FAQ})
    assert written == {"namespace": "faq", "documents": 3, "chunks": 3}
    again = client.call("POST", "/v1/kb/faq/ingest", {"documents": FAQ})  # idempotent
    assert again["chunks"] == 3 and client.call("GET", "/v1/kb/faq/stats")["chunks"] == 3
    for question, source in [
        ("how do I restart my unit?", "faq/power.md"),
        ("I forgot the wireless key, where do I set a new one", "faq/network.md"),
        ("the graphics processor is overheating", "faq/thermal.md"),
    ]:
        hits = search(client, question, k=2)
        assert hits[0]["source"] == source, (question, hits)
        assert hits[0]["score"] > hits[1]["score"]
    filtered = search(client, "restart", k=3, filter='metadata["lang"] == "en"')
    assert [h["source"] for h in filtered] == ["faq/network.md"]
    assert client.call("GET", "/v1/kb") == {"namespaces": ["faq"]}
    assert daemon.stop() == 0

    daemon.start()  # the same state directory
    client = daemon.client
    assert client.call("GET", "/v1/kb/faq/stats")["chunks"] == 3
    assert search(client, "how do I restart my unit?")[0]["source"] == "faq/power.md"
    client.call("POST", "/v1/kb/faq/delete", {"source": "faq/power.md"})
    assert client.call("GET", "/v1/kb/faq/stats")["chunks"] == 2
    for path, body, status in [
        ("/v1/kb/no_such/search", {"query": "x"}, 404),
        ("/v1/kb/bad-name/ingest", {"documents": FAQ}, 400),
        ("/v1/kb/faq/ingest", {"documents": "not a list"}, 400),
        ("/v1/kb/faq/search", {"query": ""}, 400),
        ("/v1/kb/faq/delete", {}, 400),
    ]:
        with pytest.raises(ClientError) as failed:
            client.call("POST", path, body)
        assert failed.value.status == status, (path, failed.value.message)
