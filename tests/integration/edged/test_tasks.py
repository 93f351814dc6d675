"""Task graphs on a real edged (/v1/tasks) with the real cloud tier (MLServer behind the fault
proxy): the brief's hybrid example (OCR on the device, a report in the cloud, the image never
sent, checked in the cloud server's own journal), free text mapped to templates on the intent
model's held-out split, bad graphs refused naming the problem, concurrency, a degraded answer
and a deadline that cancels what is unfinished."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from edged.client import Client, ClientError
from tests.conftest import ANSWER_MODEL, Cloud, Daemon, unseen_intents, wait_for
from tests.integration.edged.test_admin import edgectl as edgectl_of
from tests.media import text_image

INVOICE = ["INVOICE 2041", "Date: 2026-11-30", "Total: $1,234.50", "Pay to: billing@acme.example"]
OCR_MODELS = ["ocr", "ocr-det", "ocr-rec", "ocr-cls"]
TEXT_MODELS = ["intent", "text-embedding", "text-encoder"]


def b64(data: bytes) -> dict[str, str]:
    return {"base64": base64.b64encode(data).decode()}


def tasks(client: Client, doc: dict[str, Any], query: str = "") -> dict[str, Any]:
    return dict(client.call("POST", "/v1/tasks" + query, doc))


def refused(client: Client, doc: dict[str, Any]) -> ClientError:
    with pytest.raises(ClientError) as caught:
        tasks(client, doc)
    return caught.value


def start_edged(make_daemon: type[Daemon], cloud: Cloud, more: str = "") -> Daemon:
    config = f"""
[models]
load = {json.dumps(OCR_MODELS + TEXT_MODELS)}
[cloud]
url = "http://{cloud.proxy.address}"
{more}
[[cloud.models]]
name = "{ANSWER_MODEL}"
[knowledge]
answer_model = "{ANSWER_MODEL}"
"""
    daemon = make_daemon(config=config).start()
    catalog = lambda: ANSWER_MODEL in daemon.client.status()["cloud"]["catalog"]  # noqa: E731
    wait_for(catalog, 10, "the cloud's catalog")
    return daemon


@pytest.fixture
def edged_with_cloud(make_daemon: type[Daemon], faults_cleared: Cloud) -> Daemon:
    return start_edged(make_daemon, faults_cleared)


def test_an_image_report_reads_on_the_device_and_reports_in_the_cloud_without_the_image(
    edged_with_cloud: Daemon, faults_cleared: Cloud
) -> None:
    client, cloud = edged_with_cloud.client, faults_cleared
    image = text_image(INVOICE)
    before = len(cloud.seen())
    answer = tasks(client, {"template": "image-report", "inputs": {"image": b64(image)}})
    print(json.dumps(answer["nodes"], indent=1))
    by_id = {n["id"]: n for n in answer["nodes"]}
    assert answer["status"] == "ok" and answer["degraded"] == []
    assert by_id["text"]["route"] == "local" and by_id["text"]["private"] is True
    assert by_id["fields"]["route"] == "local" and "rules" in by_id["fields"]["reason"]
    assert by_id["report"]["route"] == "cloud" and by_id["report"]["private"] is False
    read = answer["outputs"]["text"]["text"]
    assert read == "\n".join(line["text"] for line in client.ocr(image))  # as /v1/ocr reads it
    assert answer["outputs"]["fields"]["fields"]["total"] == "$1,234.50"
    report = answer["result"]["report"]["report"]
    assert report["summary"] and report["fields"]["total"] == "$1,234.50"

    # the cloud's side: one call, to the answer model, with the text read, never the image
    seen = cloud.seen()[before:]
    assert [s["model"] for s in seen] == [ANSWER_MODEL], seen
    assert any("1,234.50" in line for line in seen[0]["context"])
    journal = cloud.journal.read_bytes()
    assert base64.b64encode(image)[:64] not in journal and image[:64] not in journal

    # even when the caller wants the cloud for all of it, the private image stays
    before = len(cloud.seen())
    forced = tasks(
        client, {"template": "image-report", "inputs": {"image": b64(image)}}, "?route=cloud"
    )
    text_node = next(n for n in forced["nodes"] if n["id"] == "text")
    assert text_node["route"] == "local" and "private" in text_node["reason"], text_node
    assert [s["model"] for s in cloud.seen()[before:]] == [ANSWER_MODEL]

    # a request that marks everything private: nothing leaves, the report cannot be made
    before = len(cloud.seen())
    with pytest.raises(ClientError) as kept:
        tasks(
            client, {"template": "image-report", "inputs": {"image": b64(image)}}, "?private=true"
        )
    assert kept.value.status in (404, 503) and "node 'report'" in kept.value.message
    assert cloud.seen()[before:] == []


def test_free_text_is_mapped_to_its_template_on_sentences_it_never_saw(
    make_daemon: type[Daemon],
) -> None:
    """Sentences the intent model never saw (tests/intents-unseen.tsv): each one's label names
    the template it asks for, or none (smalltalk, device-status: a 400 saying what it read)."""
    daemon = make_daemon(config=f"[models]\nload = {json.dumps(TEXT_MODELS)}\n").start()
    client = daemon.client
    rows = unseen_intents()
    mapping = {
        "image-report": "image-report",
        "voice-command": "voice-command",
        "ask": "ask",
        "search": "search",
    }
    dummies = {"image": b64(b"\x89PNG"), "audio": b64(b"RIFF")}
    right = 0
    for row in rows:
        expected = mapping.get(row["label"])
        try:
            planned = tasks(client, {"text": row["text"], "inputs": dummies, "run": False})
            got = planned["planned"]["task"]
        except ClientError as exc:
            assert exc.status == 400 and "no template handles" in exc.message, exc
            got = None
        right += got == expected
        if got != expected:
            print(f"miss: {row['text']!r} {expected} -> {got}")
    # the free text fills the template's inputs: marked private once, every copy is private
    planned = tasks(
        client, {"text": "how do I restart the unit?", "private": ["text"], "run": False}
    )["planned"]
    assert planned["task"] == "ask" and planned["nodes"][0]["private"] is True, planned
    assert planned["private_inputs"] == ["query", "question", "text"]
    accuracy = right / len(rows)
    print(f"free text -> template: {right}/{len(rows)} = {accuracy:.3f}")
    assert len(rows) >= 30 and accuracy >= 0.9


def test_bad_graphs_are_refused_before_anything_runs(edged_with_cloud: Daemon) -> None:
    client = edged_with_cloud.client
    for graph, says in [
        (
            {
                "nodes": [
                    {"id": "a", "task": "extract", "inputs": {"text": "b.fields"}},
                    {"id": "b", "task": "extract", "inputs": {"text": "a.fields"}},
                ]
            },
            "the graph has a cycle: a -> b -> a",
        ),
        (
            {"nodes": [{"id": "a", "task": "summarize", "inputs": {"text": "$t"}}]},
            "node 'a': unknown task type 'summarize'",
        ),
        (
            {"nodes": [{"id": "a", "task": "report", "inputs": {"text": "read.text"}}]},
            "node 'a' input 'text' refers to 'read.text': there is no node 'read'",
        ),
    ]:
        error = refused(client, {"graph": graph, "inputs": {"t": "x"}})
        assert error.status == 400 and says in error.message, error
    for doc, says in [
        ({"template": "image-report", "inputs": {}}, "needs input(s): image"),
        ({"template": "nope"}, "no template 'nope'"),
        ({"template": "ask", "graph": {"nodes": []}}, "give one of"),
        ({"template": "ask", "inputs": {"question": "q"}, "deadline_ms": 0}, "'deadline_ms'"),
    ]:
        error = refused(client, doc)
        assert error.status == 400 and says in error.message, error
    catalog = client.call("GET", "/v1/tasks")["templates"]
    assert {t["template"] for t in catalog} >= {"image-report", "voice-command", "ask", "search"}


def test_independent_nodes_run_together_and_an_optional_failure_degrades_the_answer(
    edged_with_cloud: Daemon, faults_cleared: Cloud
) -> None:
    client, cloud = edged_with_cloud.client, faults_cleared
    graph = {
        "nodes": [
            {"id": "first", "task": "ocr", "inputs": {"image": "$a"}},
            {"id": "second", "task": "ocr", "inputs": {"image": "$b"}},
            {
                "id": "both",
                "task": "report",
                "inputs": {"text": "first.text"},
                "constraints": {"optional": True},
            },
            {"id": "kind", "task": "intent", "inputs": {"text": "second.text"}},
        ]
    }
    inputs = {"a": b64(text_image(INVOICE)), "b": b64(text_image(["Scan this receipt"]))}
    answer = tasks(client, {"graph": graph, "inputs": inputs})
    by_id = {n["id"]: n for n in answer["nodes"]}
    assert answer["status"] == "ok", answer["degraded"]
    # both reads started before either ended
    assert max(by_id["first"]["started_ms"], by_id["second"]["started_ms"]) < min(
        by_id["first"]["ended_ms"], by_id["second"]["ended_ms"]
    )
    assert set(answer["result"]) == {"both", "kind"}

    cloud.proxy.reset()  # the cloud's connections are reset: the optional report is given up
    degraded = tasks(client, {"graph": graph, "inputs": inputs})
    assert degraded["status"] == "degraded" and set(degraded["result"]) == {"kind"}
    (why,) = degraded["degraded"]
    assert why.startswith("node 'both' failed:"), why
    # a required node whose input comes from an optional one that failed, through a skipped one:
    # the task fails with the first failure's status and words
    chain = {
        "nodes": [
            {
                "id": "a",
                "task": "ocr",
                "inputs": {"image": "$a"},
                "constraints": {"optional": True},
            },
            {
                "id": "b",
                "task": "extract",
                "inputs": {"text": "a.text"},
                "constraints": {"optional": True},
            },
            {"id": "c", "task": "extract", "inputs": {"text": "b.fields"}},
        ]
    }
    error = refused(client, {"graph": chain, "inputs": {"a": b64(b"not an image")}})
    assert error.status == 400 and "node 'c' (extract) its input from 'b' is missing" in (
        error.message
    ), error
    report = {"id": "r", "task": "report", "inputs": {"text": "$t", "fields": "$f"}}
    bytes_fields = {"nodes": [report]}
    error = refused(client, {"graph": bytes_fields, "inputs": {"t": "x", "f": b64(b"\xff")}})
    assert error.status == 400 and "must be an extract node's fields" in error.message, error
    graph["nodes"][2]["constraints"] = {"optional": False}  # type: ignore[index]
    error = refused(client, {"graph": graph, "inputs": inputs})
    assert error.status == 503 and "node 'both' (report) failed" in error.message, error
    assert "runs only in the cloud, which cannot serve it now" in error.message


def test_the_deadline_cancels_unfinished_nodes(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    # a slow link, not a cut one: probes may take 2 s, so the link stays up at 1.5 s a call
    client = start_edged(make_daemon, cloud, "probe_timeout_s = 2.0").client
    cloud.proxy.delay(1.5)  # the report in the cloud cannot make it in time
    graph = {
        "nodes": [
            {"id": "fields", "task": "extract", "inputs": {"text": "$text"}},
            {"id": "report", "task": "report", "inputs": {"text": "$text"}},
            {"id": "kind", "task": "intent", "inputs": {"text": "report.report"}},
        ]
    }
    doc = {"graph": graph, "inputs": {"text": "\n".join(INVOICE)}, "deadline_ms": 1000}
    error = refused(client, doc)
    assert error.status == 504, error
    says = "task 'graph' passed its deadline of 1000 ms: cancelled kind, report (finished: fields)"
    assert says in error.message, error
    # the same as a stream: the nodes as they go, then the error
    events = list(client.stream_task(doc))
    seen = sorted((e["event"], e.get("node") or e.get("id")) for e in events[:-1])
    assert seen == [("finished", "fields"), ("started", "fields"), ("started", "report")], events
    assert events[-1]["event"] == "error" and events[-1]["status"] == 504
    assert says in events[-1]["error"]
    before = len(cloud.seen())  # a plan asked for as a stream is the plan, nothing runs
    (plan,) = client.stream_task({**doc, "run": False})
    assert plan["planned"]["order"] == ["fields", "report", "kind"]
    assert len(cloud.seen()) == before
    with pytest.raises(ClientError) as bad:  # a request that does not check out: a plain 400
        list(client.stream_task({"graph": {"nodes": []}}))
    assert bad.value.status == 400
    cloud.proxy.restore()
    doc["graph"]["nodes"].pop()  # type: ignore[attr-defined]
    assert tasks(client, {**doc, "deadline_ms": 20_000})["status"] == "ok"


def test_edgectl_task_lists_explains_and_runs(edged_with_cloud: Daemon, tmp_path: Path) -> None:
    image = tmp_path / "invoice.png"
    image.write_bytes(text_image(INVOICE))

    def edgectl(*args: str) -> subprocess.CompletedProcess[str]:
        return edgectl_of(edged_with_cloud, *args)

    listed = edgectl("task", "list")
    assert listed.returncode == 0
    assert re.search(r"^image-report +ocr -> extract -> report +image +image$", listed.stdout, re.M)
    explained = edgectl("task", "explain", "--text", "scan this receipt", "-i", f"image=@{image}")
    assert explained.returncode == 0, explained.stderr
    assert "task image-report (read as image-report" in explained.stdout
    assert "order: text -> fields -> report" in explained.stdout
    row = next(line for line in explained.stdout.splitlines() if line.startswith("report"))
    assert row.split()[-1] == "cloud", row  # the answer model is only in the cloud
    ran = edgectl("task", "run", "image-report", "-i", f"image=@{image}")
    assert ran.returncode == 0, ran.stderr
    assert "task image-report: ok" in ran.stdout and '"total": "$1,234.50"' in ran.stdout
    followed = edgectl("task", "run", "image-report", "--progress", "-i", f"image=@{image}")
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    order = [re.sub(r"^ *[\d.]+ ms  ", "", line) for line in lines[:6]]
    assert order[0] == "text (ocr) started" and order[1] == "text ok: local", lines
    assert order[-2:] == ["report (report) started", "report ok: cloud"], lines
    assert "task image-report: ok" in lines[6]
    missing = edgectl("task", "run", "image-report")
    assert missing.returncode == 4 and "needs input(s): image" in missing.stderr
