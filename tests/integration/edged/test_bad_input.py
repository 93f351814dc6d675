"""Bad input gets a 4xx that names the problem, and the next good request still succeeds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edged.client import Client
from tests.media import wav_bytes

GOOD_TEXT = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]}


def post(
    client: Client, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    status, _, payload = client.request("POST", path, body, headers or {})
    message = json.loads(payload).get("error", "") if status >= 400 else ""
    return status, message


def assert_still_serves(client: Client) -> None:
    status, _ = post(client, "/v2/models/text-embedding/infer", json.dumps(GOOD_TEXT).encode())
    assert status == 200
    assert client.embed(["still serving"]).shape == (1, 384)


def infer_doc(name: str, datatype: str, shape: list[int], data: list[object]) -> bytes:
    return json.dumps(
        {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}]}
    ).encode()


CASES = [
    ("malformed JSON", "/v2/models/text-embedding/infer", b'{"inputs": [', 400, "not valid JSON"),
    ("not an object", "/v2/models/text-embedding/infer", b"[1]", 400, "JSON object"),
    (
        "wrong dtype",
        "/v2/models/text-encoder/infer",
        infer_doc("input_ids", "FP32", [1, 2], [1.0, 2.0]),
        400,
        "must be INT64, got FP32",
    ),
    (
        "wrong shape",
        "/v2/models/intent-classifier/infer",
        infer_doc("embedding", "FP32", [1, 3], [0.1, 0.2, 0.3]),
        400,
        "the model expects [-1, 384]",
    ),
    (
        "unknown input",
        "/v2/models/text-embedding/infer",
        infer_doc("txt", "BYTES", [1], ["a"]),
        400,
        "has no input 'txt'",
    ),
    (
        "unknown model",
        "/v2/models/no-such-model/infer",
        json.dumps(GOOD_TEXT).encode(),
        404,
        "unknown model 'no-such-model'",
    ),
    (
        "unknown version",
        "/v2/models/text-embedding/versions/42/infer",
        json.dumps(GOOD_TEXT).encode(),
        404,
        "no version 42",
    ),
    (
        "bad version",
        "/v2/models/text-embedding/versions/latest/infer",
        json.dumps(GOOD_TEXT).encode(),
        400,
        "positive integer",
    ),
    ("non-image bytes to OCR", "/v1/ocr", b"%PDF-1.4 certainly not a picture", 400, "not an image"),
    ("empty body to OCR", "/v1/ocr", b"", 400, "empty"),
    ("non-WAV bytes to VAD", "/v1/vad", b"RIFX0000WAVEjunk", 400, "WAV"),
    ("task API without texts", "/v1/embed", b'{"words": ["a"]}', 400, "needs 'texts'"),
    ("task API with numbers", "/v1/intent", b'{"texts": [1, 2]}', 400, "list of strings"),
    (
        "task API with another model",
        "/v1/embed",
        b'{"texts": ["a"], "model": "ocr"}',
        400,
        "'model' must be one of",
    ),
    ("bad VAD parameter", "/v1/vad?threshold=7", b"RIFF", 400, "threshold"),
    (
        "huge shape, no data",
        "/v2/models/intent-classifier/infer",
        infer_doc("embedding", "FP32", [0, 2**63], []),
        400,
        "'shape' must be a list",
    ),
    (
        "boolean in a shape",
        "/v2/models/intent-classifier/infer",
        infer_doc("embedding", "FP32", [True], [1.0]),
        400,
        "'shape' must be a list",
    ),
    (
        "non-ASCII digit version",
        "/v2/models/text-embedding/versions/%C2%B2/infer",
        json.dumps(GOOD_TEXT).encode(),
        400,
        "positive integer",
    ),
    (
        "output parameters not an object",
        "/v2/models/text-embedding/infer",
        json.dumps({**GOOD_TEXT, "outputs": [{"name": "embedding", "parameters": [1]}]}).encode(),
        400,
        "'parameters' must be an object",
    ),
    (
        "output requested twice",
        "/v2/models/text-embedding/infer",
        json.dumps(
            {**GOOD_TEXT, "outputs": [{"name": "embedding"}, {"name": "embedding"}]}
        ).encode(),
        400,
        "requested twice",
    ),
    (
        "non-string id",
        "/v2/models/text-embedding/infer",
        json.dumps({**GOOD_TEXT, "id": {"a": 1}}).encode(),
        400,
        "'id' must be a string",
    ),
    (
        "lone surrogate in BYTES",
        "/v2/models/text-embedding/infer",
        b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["\\ud800"]}]}',
        400,
        "not valid Unicode",
    ),
    (
        "lone surrogate in the task API",
        "/v1/embed",
        b'{"texts": ["\\ud800"]}',
        400,
        "not valid Unicode",
    ),
    ("JSON nested too deeply", "/v1/embed", b"[" * 100000, 400, "nested too deeply"),
    (
        "classification of a string output",
        "/v2/models/intent/infer",
        json.dumps(
            {**GOOD_TEXT, "outputs": [{"name": "intent", "parameters": {"classification": 1}}]}
        ).encode(),
        400,
        "numeric output",
    ),
    (
        "too many texts",
        "/v1/embed",
        json.dumps({"texts": ["a"] * 257}).encode(),
        400,
        "at most 256",
    ),
    (
        "too many texts through OIP",
        "/v2/models/text-embedding/infer",
        infer_doc("text", "BYTES", [257], ["a"] * 257),
        400,
        "at most 256 per request",
    ),
    (
        "too long for the encoder",
        "/v2/models/text-encoder/infer",
        json.dumps(
            {
                "inputs": [
                    {"name": n, "datatype": "INT64", "shape": [1, 600], "data": [1] * 600}
                    for n in ("input_ids", "attention_mask", "token_type_ids")
                ]
            }
        ).encode(),
        400,
        "rejected the input",
    ),
]


@pytest.mark.parametrize(
    ("what", "path", "body", "status", "message"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request_is_named_and_the_daemon_keeps_serving(
    client: Client, what: str, path: str, body: bytes, status: int, message: str
) -> None:
    got_status, got_message = post(client, path, body)
    assert got_status == status, got_message
    assert message in got_message
    assert_still_serves(client)


def test_body_over_the_limit_gets_413(client: Client) -> None:
    # The session daemon's server.max_request_bytes is 8 MiB.
    status, message = post(client, "/v1/ocr", b"\0" * (9 * 1024 * 1024))
    assert status == 413
    assert "over the limit of 8388608 bytes" in message
    assert_still_serves(client)


def test_truncated_binary_payload_gets_400(client: Client) -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "embedding",
                    "datatype": "FP32",
                    "shape": [1, 384],
                    "parameters": {"binary_data_size": 384 * 4},
                }
            ]
        }
    ).encode()
    body = header + np.zeros(100, np.float32).tobytes()
    status, message = post(
        client,
        "/v2/models/intent-classifier/infer",
        body,
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400
    assert "truncated" in message
    assert_still_serves(client)


@pytest.mark.parametrize("value", ["abc", "-1", "\u00b2".encode().decode("latin-1")])
def test_bad_header_length_gets_400(client: Client, value: str) -> None:
    status, message = post(
        client, "/v2/models/text-embedding/infer", b"{}", {"Inference-Header-Content-Length": value}
    )
    assert status == 400 and "Inference-Header-Content-Length" in message


def test_audio_at_an_absurd_sample_rate_is_refused(client: Client) -> None:
    wav = wav_bytes(np.zeros(200_000, np.float32), rate=1)
    status, message = post(client, "/v1/vad", wav)
    assert status == 400 and "sample rate 1 Hz" in message
    assert_still_serves(client)


def test_unknown_route_gets_a_json_404(client: Client) -> None:
    status, _, payload = client.request("GET", "/v2/nothing/here")
    assert status == 404
    assert "error" in json.loads(payload)


def test_batch_over_max_batch_size_is_refused(client: Client) -> None:
    rows = 65
    body = infer_doc("embedding", "FP32", [rows, 384], [0.0] * (rows * 384))
    status, message = post(client, "/v2/models/intent-classifier/infer", body)
    assert status == 400 and "max_batch_size 64" in message
