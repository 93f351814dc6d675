"""The knowledge base through a real daemon: ingest FAQ documents with the local embedding
model into Milvus Lite (or a Milvus server), find them again from paraphrased questions, answer
questions on the device or with the cloud's answer model, survive a restart."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.peer import free_port
from edged.client import Client, ClientError
from edged.common.egress import Ledger
from tests.conftest import ANSWER_MODEL, Cloud, Daemon, LoopThread, answer_model_config, wait_for

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


MORE_FAQ = [
    {
        "source": "faq/storage.md",
        "text": "Logs are kept for seven days in /var/log/edged and then rotated away.",
    },
    {
        "source": "faq/update.md",
        "text": "Software updates arrive over the air at night; the device restarts after one.",
    },
]
UNSURE = "Which logs can I read to debug a crash?"  # its best passage scores 0.33
SECRET = "The door code of the server room is 4417, changed every Monday."


def test_ask_answers_on_device_escalates_and_keeps_private_passages_home(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    """Close questions are answered from their passage on the device; the others go to the
    cloud's answer model (MLServer) with their passages, read back from its own journal; a
    private passage, a private question or a private namespace never leave."""
    cloud = faults_cleared
    config = f"""
[models]
load = ["text-embedding"]
{answer_model_config(cloud)}private_namespaces = ["hr"]
"""
    daemon = make_daemon(config=config).start()
    client = daemon.client
    wait_for(lambda: ANSWER_MODEL in client.status()["cloud"]["catalog"], 10, "the catalog")
    client.kb_ingest("faq", FAQ + MORE_FAQ)
    client.kb_ingest("ops", [{"source": "ops/doors.md", "text": SECRET, "private": True}])
    client.kb_ingest("ops", MORE_FAQ)
    client.kb_ingest("hr", [{"source": "hr/pay.md", "text": "Salaries are paid on the 25th."}])
    before = len(cloud.seen())

    for question, source in [
        ("How can I restart my unit?", "faq/power.md"),
        ("How long are the log files stored before deletion?", "faq/storage.md"),
        ("can I keep logs for longer than a week?", "faq/storage.md"),
    ]:
        near = client.kb_ask("faq", question)
        assert near["answered_by"] == "passage" and near["sources"] == [source], near
        assert near["route"] == "local" and near["passages"][0]["score"] >= 0.6
    assert len(cloud.seen()) == before  # answered on the device: nothing asked of the cloud

    far = client.kb_ask("faq", UNSURE)
    assert far["answered_by"] == ANSWER_MODEL and far["route"] == "cloud", far
    assert "seven days" in far["answer"] and "faq/storage.md" in far["sources"]
    (asked,) = [s for s in cloud.seen()[before:] if s["model"] == ANSWER_MODEL]
    assert asked["question"] == far["question"]
    assert asked["context"] == [p["text"] for p in far["passages"]]  # what it was given

    before = len(cloud.seen())
    for ns, question, params, why in [
        ("ops", UNSURE, "", "are private"),
        (
            "faq",
            UNSURE,
            "?private=true",
            "the question is private",
        ),
        ("hr", "When do we get the yearly bonus?", "", "are private"),
    ]:
        kept = client.call("POST", f"/v1/kb/{ns}/ask{params}", {"question": question})
        assert kept["route"] == "local" and why in kept["reason"], kept
        assert kept["answered_by"] == "passage" and kept["answer"]
    assert len(cloud.seen()) == before, "a private passage or question reached the cloud"
    assert not [s for s in cloud.seen() if SECRET in json.dumps(s)]

    cloud.proxy.reset()  # the cloud fails: the device says what it knows, in time
    started = time.monotonic()
    failed = client.kb_ask("faq", UNSURE)
    assert failed["answered_by"] == "passage" and "answer model failed" in failed["reason"]
    assert failed["sources"] == ["faq/storage.md"] and time.monotonic() - started < 10
    with pytest.raises(ClientError) as bad:
        client.call("POST", "/v1/kb/faq/ask", {"question": "x", "threshold": "high"})
    assert bad.value.status == 400


def test_a_milvus_server_by_uri(make_daemon: type[Daemon], tmp_path: Path) -> None:
    """``knowledge.uri`` names a Milvus server instead of a file: the same code over gRPC. The
    server here is milvus-lite's own (``milvus-lite server``, a separate process on loopback,
    speaking Milvus' gRPC API); a Milvus standalone or cluster is not available on this
    machine."""
    port = free_port()
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "milvus-lite"),
            "server",
            "--data-dir",
            str(tmp_path / "milvus"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        uri = f"http://127.0.0.1:{port}"
        config = f'[models]\nload = ["text-embedding"]\n[knowledge]\nuri = "{uri}"\n'
        daemon = make_daemon(config=config).start()
        client = daemon.client
        wait_for(lambda: client.kb_ingest("faq", FAQ)["chunks"] == 3, 30, "the server up")
        assert search(client, "how do I restart my unit?")[0]["source"] == "faq/power.md"
        assert daemon.stop() == 0
        assert not (daemon.workdir / "state" / "knowledge.db").exists()  # all in the server
        daemon.start()
        assert daemon.client.kb_stats("faq")["chunks"] == 3
        assert daemon.stop() == 0
    finally:
        server.terminate()
        server.wait(10)


@dataclass
class ChatServer(LoopThread):
    """A stand-in for an OpenAI-compatible server (vLLM, llama.cpp, Ollama...): none of them
    can run here without model weights from the network. It answers ``/v1/chat/completions``
    in OpenAI's documented format with the first passage it was given, keeps every request,
    and fails with ``status`` when set."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    port: int = 0
    delay: float = 0.0  # seconds before each answer: a language model takes its time

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _close(self) -> None:
        await self.runner.cleanup()

    async def complete(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw)
        sha256 = hashlib.sha256(raw).hexdigest()
        self.seen.append(
            {
                "auth": request.headers.get("Authorization"),
                **body,
                "sha256": sha256,
                "bytes": len(raw),
            }
        )
        await asyncio.sleep(self.delay)
        if self.status != 200:
            error = {"error": {"message": "model overloaded", "type": "server_error"}}
            return web.json_response(error, status=self.status)
        user = body["messages"][-1]["content"]
        first = user.split("[1] ", 1)[1].split("\n\n", 1)[0]
        message = {"role": "assistant", "content": f"From the manual: {first}"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [choice],
            }
        )


def test_ask_escalates_to_an_openai_compatible_endpoint(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    server = ChatServer().start()
    try:
        token = tmp_path / "llm.token"
        token.write_text("sk-test-123\n")
        token.chmod(0o600)  # edged refuses a token file others may read
        config = f"""
[models]
load = ["text-embedding"]
[knowledge]
answer_model = "llama-3.1-8b-instruct"
answer_url = "http://127.0.0.1:{server.port}/v1"
answer_token_file = "{token}"
"""
        daemon = make_daemon(config=config)
        daemon.give(token)
        daemon.start()
        client = daemon.client
        client.kb_ingest("faq", FAQ + MORE_FAQ)
        client.kb_ingest("faq", [{"source": "ops/doors.md", "text": SECRET, "private": True}])
        # no passage is that close; the model takes 1.5 s, beyond routing.max_latency_ms (500)
        server.delay = 1.5
        reply = client.kb_ask("faq", UNSURE, threshold=0.9)
        server.delay = 0.0
        assert reply["answered_by"] == "llama-3.1-8b-instruct" and reply["route"] == "cloud"
        assert reply["answer"].startswith("From the manual: "), reply
        assert reply["answer"].endswith(reply["passages"][0]["text"])
        (asked,) = server.seen
        assert asked["auth"] == "Bearer sk-test-123" and asked["temperature"] == 0
        assert asked["model"] == "llama-3.1-8b-instruct"
        user = asked["messages"][-1]["content"]
        assert UNSURE in user and all(p["text"] in user for p in reply["passages"])
        kept = client.kb_ask("faq", "What is the door code of the server room?", threshold=0.99)
        assert "private" in kept["reason"] and len(server.seen) == 1  # the secret stayed home
        # a task graph's answer node: a private question is refused before the endpoint
        answer = {"id": "a", "task": "answer", "inputs": {"question": "$q", "context": "$c"}}
        graph = {"nodes": [answer]}
        door = "What is the door code of the server room?"
        private = {"q": {"text": door, "private": True}, "c": SECRET}
        with pytest.raises(ClientError) as refused:
            client.run_task({"graph": graph, "inputs": private})
        assert refused.value.status == 503 and "the input is private" in refused.value.message
        assert len(server.seen) == 1
        sent = client.run_task({"graph": graph, "inputs": {"q": UNSURE, "c": FAQ[0]["text"]}})
        assert sent["nodes"][0]["route"] == "cloud" and len(server.seen) == 2
        assert sent["result"]["a"]["answer"] == f"From the manual: {FAQ[0]['text']}"
        server.status = 503
        failed = client.kb_ask("faq", UNSURE, threshold=0.9)
        assert failed["answered_by"] == "passage" and "model overloaded" in failed["reason"]
        # the egress ledger: one entry per question sent (the refused one too), before it left
        ledger = Ledger(daemon.workdir / "state" / "egress")
        entries = ledger.entries(match=lambda e: e["kind"] == "answer-model")
        assert [(e["sha256"], e["bytes"]) for e in entries] == [
            (s["sha256"], s["bytes"]) for s in server.seen
        ]
        assert f"(egress ledger entry {entries[0]['seq']})" in reply["reason"]
        assert all(
            e["endpoint"] == f"http://127.0.0.1:{server.port}/v1/chat/completions"
            and e["model"] == "llama-3.1-8b-instruct"
            and e["uid"] == os.getuid()
            for e in entries
        )
        assert daemon.stop() == 0
    finally:
        server.stop()
