"""edgectl against a real daemon: answers, --json, and exit codes that tell what failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import Daemon
from tests.media import speech_in_silence, text_image


def edgectl(
    socket: Path, *args: str, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "edged.edgectl", "--socket", str(socket), *args],
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def test_status_and_models_list(daemon: Daemon) -> None:
    out = edgectl(daemon.socket, "status")
    assert out.returncode == 0
    assert b"ready" in out.stdout and b"text-encoder" in out.stdout
    assert b"load: " in out.stdout and b"memory " in out.stdout  # the device's load, sampled
    assert b"cloud: none configured" in out.stdout
    table = edgectl(daemon.socket, "capabilities").stdout.decode()
    rows = [line.split() for line in table.splitlines()]
    assert ["text-classification", "intent-classifier"] in [r[:2] for r in rows], table
    assert all(r[2].startswith("yes") for r in rows[1:])  # all are served locally
    assert all(r[-1] == "-" for r in rows[1:])  # no cloud tier
    load = json.loads(edgectl(daemon.socket, "--json", "status").stdout)["load"]
    assert load["memory_total"] > 0 and "procfs" in load["sources"]
    listing = json.loads(edgectl(daemon.socket, "--json", "models", "list").stdout)
    assert {"name": "ocr", "version": "1", "state": "READY", "reason": ""} in listing


def test_task_commands(daemon: Daemon, tmp_path: Path) -> None:
    embed = json.loads(edgectl(daemon.socket, "--json", "embed", "hello", "hi there").stdout)
    assert embed["dim"] == 384 and len(embed["embeddings"]) == 2
    intent = json.loads(
        edgectl(daemon.socket, "--json", "intent", "what is the GPU temperature").stdout
    )
    assert intent["intents"][0]["intent"] == "device-status"
    assert intent["route"] == "local" and intent["reason"]  # where it ran, and why
    image = tmp_path / "text.png"
    image.write_bytes(text_image(["Hello from edged"]))
    ocr = edgectl(daemon.socket, "ocr", str(image))
    assert ocr.returncode == 0 and b"edged" in ocr.stdout
    wav, _, _ = speech_in_silence("hello there", 0.5, 0.5)
    vad = json.loads(edgectl(daemon.socket, "--json", "vad", "-", stdin=wav).stdout)["segments"]
    assert len(vad) >= 1 and vad[0]["start"] > 0.3


def test_explain_prints_every_decision(daemon: Daemon) -> None:
    out = edgectl(daemon.socket, "--explain", "intent", "turn on the lights")
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode()
    assert "route: local: cloud excluded: no cloud tier is configured" in text
    # the pipeline and each of its steps: intent -> text-embedding -> text-encoder, classifier
    for model in ("intent", "text-embedding", "text-encoder", "intent-classifier"):
        assert f"  {model}: local" in text, text
    # asking for the cloud where there is none: served locally, and the answer says why
    asked = json.loads(edgectl(daemon.socket, "--json", "--route", "cloud", "intent", "hi").stdout)
    assert asked["route"] == "local" and "no cloud tier" in asked["reason"]


def test_kb_ingest_search_stats_delete(daemon: Daemon, tmp_path: Path) -> None:
    (tmp_path / "reboot.md").write_text(
        "# Rebooting\n\nHold the power button for ten seconds until the LED blinks twice."
    )
    (tmp_path / "wifi.txt").write_text("Change the Wi-Fi password under Network, Wireless.")
    files = [str(tmp_path / "reboot.md"), str(tmp_path / "wifi.txt")]
    ingest = edgectl(daemon.socket, "kb", "ingest", "cli_docs", *files)
    assert ingest.returncode == 0, ingest.stderr
    assert b"100%" in ingest.stderr and b"2 chunks" in ingest.stdout
    found = edgectl(daemon.socket, "--json", "kb", "search", "cli_docs", "how", "to", "restart")
    hits = json.loads(found.stdout)
    assert hits[0]["source"] == files[0] and hits[0]["score"] > hits[1]["score"]
    table = edgectl(daemon.socket, "kb", "search", "cli_docs", "wireless key", "-k", "1")
    assert b"wifi.txt" in table.stdout and b"SCORE" in table.stdout
    stats = json.loads(edgectl(daemon.socket, "--json", "kb", "stats", "cli_docs").stdout)
    assert stats["chunks"] == 2
    assert (
        "cli_docs"
        in json.loads(edgectl(daemon.socket, "--json", "kb", "stats").stdout)["namespaces"]
    )
    asked = edgectl(daemon.socket, "kb", "ask", "cli_docs", "how", "to", "reboot", "it?")
    assert asked.returncode == 0 and b"Hold the power button" in asked.stdout, asked.stdout
    assert b"answered by: passage (local); sources: " + files[0].encode() in asked.stdout
    (tmp_path / "secret.txt").write_text("The locker code is 4417.")
    kept = edgectl(daemon.socket, "--private", "kb", "ingest", "cli_docs", f"{tmp_path}/secret.txt")
    assert kept.returncode == 0, kept.stderr
    unsure = edgectl(
        daemon.socket, "--json", "kb", "ask", "cli_docs", "locker?", "--threshold", "0.99"
    )
    reply = json.loads(unsure.stdout)
    assert reply["answered_by"] == "passage" and "private" in reply["reason"], reply
    gone = edgectl(daemon.socket, "kb", "delete", "cli_docs", files[1])
    assert gone.returncode == 0 and b"deleted" in gone.stdout
    assert edgectl(daemon.socket, "kb", "search").returncode == 2  # no namespace: usage
    missing = edgectl(daemon.socket, "kb", "search", "no_such_kb", "anything")
    assert missing.returncode == 4  # 404


def test_infer_sends_a_request_document(daemon: Daemon, tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
        )
    )
    out = edgectl(daemon.socket, "infer", "text-embedding", str(request))
    assert out.returncode == 0
    assert json.loads(out.stdout)["outputs"][0]["shape"] == [1, 384]


def test_priority_and_timeout_reach_the_scheduler(daemon: Daemon, tmp_path: Path) -> None:
    urgent = edgectl(daemon.socket, "--priority", "1", "--timeout-ms", "5000", "intent", "hi")
    assert urgent.returncode == 0, urgent.stderr
    # The text models have 2 priority levels: 3 is refused, which proves the flag got there.
    refused = edgectl(daemon.socket, "--priority", "3", "embed", "hello")
    assert refused.returncode == 4 and b"priority 3 is outside 1..2" in refused.stderr
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {
                "inputs": [
                    {
                        "name": "embedding",
                        "datatype": "FP32",
                        "shape": [1, 384],
                        "data": [0.0] * 384,
                    }
                ]
            }
        )
    )
    refused = edgectl(daemon.socket, "--priority", "9", "infer", "intent-classifier", str(request))
    assert refused.returncode == 4 and b"priority 9 is outside 1..2" in refused.stderr


def test_exit_codes(daemon: Daemon, tmp_path: Path) -> None:
    assert edgectl(tmp_path / "absent.sock", "status").returncode == 3
    unknown = edgectl(daemon.socket, "models", "show", "no-such-model")
    assert unknown.returncode == 4
    assert b"unknown model 'no-such-model'" in unknown.stderr
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert edgectl(daemon.socket, "ocr", str(bad)).returncode == 4
    assert edgectl(daemon.socket, "nonsense").returncode == 2
    unreadable = edgectl(daemon.socket, "ocr", str(tmp_path / "absent.png"))
    assert unreadable.returncode == 2 and b"cannot read" in unreadable.stderr
    nameless = edgectl(daemon.socket, "models", "load")
    assert nameless.returncode == 2 and b"needs a model name" in nameless.stderr
