"""The protocol's tensor encoding, checked against Triton's own client library."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import tritonclient.http as triton

from edged.errors import InvalidRequest
from edged.protocol.tensors import (
    InferResponse,
    classify,
    decode_request,
    encode_response,
)


def triton_body(arrays: dict[str, np.ndarray], binary: bool) -> tuple[bytes, int | None]:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == object else triton.np_to_triton_dtype(array.dtype)
        item = triton.InferInput(name, list(array.shape), datatype)
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, request_id="r1")
    return body, json_size


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_requests_decode_to_the_same_arrays(binary: bool) -> None:
    strings = np.array([b"hello", "wörld".encode(), b""], dtype=object)
    arrays = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "i64": np.array([[-(2**40), 5]], dtype=np.int64),
        "u8": np.array([0, 255], dtype=np.uint8),
        "f16": np.array([1.5, -2.25], dtype=np.float16),
        "flag": np.array([True, False]),
        "text": strings,
    }
    body, json_size = triton_body(arrays, binary)
    request = decode_request(body, json_size)
    assert request.id == "r1"
    for name, array in arrays.items():
        got = request.inputs[name]
        assert got.shape == array.shape, name
        if array.dtype == object:
            assert list(got.reshape(-1)) == list(array.reshape(-1))
        else:
            assert got.dtype == array.dtype, name
            np.testing.assert_array_equal(got, array)


def test_binary_responses_decode_with_tritonclient() -> None:
    outputs = {
        "embedding": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32),
        "label": np.array([b"ask", b"image-report"], dtype=object),
    }
    response = InferResponse("m", "1", outputs, id="x")
    body, header_length = encode_response(response, {"embedding": True, "label": True})
    result = triton.InferResult.from_response_body(body, header_length=header_length)
    np.testing.assert_array_equal(result.as_numpy("embedding"), outputs["embedding"])
    assert list(result.as_numpy("label")) == [b"ask", b"image-report"]
    assert result.get_response()["id"] == "x"


def test_json_response_is_plain_json() -> None:
    response = InferResponse("m", "2", {"y": np.array([[1.0, 2.0]], dtype=np.float32)})
    body, header_length = encode_response(response)
    assert header_length is None
    doc = json.loads(body)
    assert doc["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}
    ]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"inputs": []}, "non-empty 'inputs'"),
        ([1, 2], "JSON object"),
        ({"inputs": [{"name": "x", "datatype": "FP99", "shape": [1], "data": [1]}]}, "FP99"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": [1, 2]}]}, "needs 3"),
        ({"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1.5]}]}, "integers"),
        ({"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [300]}]}, "range"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}, "numbers"),
        ({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [1]}]}, "strings"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}, "shape"),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [[1], [2, 3]]}]},
            "needs 2 elements",
        ),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}, "neither 'data'"),
    ],
)
def test_malformed_json_requests_name_the_problem(doc: object, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        decode_request(json.dumps(doc).encode())


def test_invalid_json_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        decode_request(b'{"inputs": [')


def test_truncated_binary_payload_is_rejected() -> None:
    body, json_size = triton_body({"x": np.ones((4, 4), dtype=np.float32)}, binary=True)
    with pytest.raises(InvalidRequest, match="truncated"):
        decode_request(body[:-5], json_size)


def test_binary_size_must_match_the_shape() -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [3],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    ).encode()
    with pytest.raises(InvalidRequest, match="needs 12 bytes"):
        decode_request(header + b"\0" * 8, len(header))


def test_unclaimed_binary_bytes_are_rejected() -> None:
    body, json_size = triton_body({"x": np.ones(2, dtype=np.float32)}, binary=True)
    with pytest.raises(InvalidRequest, match="no input claims"):
        decode_request(body + b"junk", json_size)


def test_header_length_past_the_body_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="only"):
        decode_request(b"{}", 10)


def test_classification_returns_top_k_with_labels() -> None:
    scores = np.array([[0.1, 0.7, 0.2]], dtype=np.float32)
    top = classify(scores, 2, ["a", "b", "c"])
    assert [s.decode() for s in top[0]] == ["0.700000:1:b", "0.200000:2:c"]


# ---- the survivors of mutation testing (issue 32), each killed here --------------------------


def test_the_requested_outputs_decode_with_their_names_flags_and_classification() -> None:
    x = triton.InferInput("x", [1], "FP32")
    x.set_data_from_numpy(np.array([1.0], dtype=np.float32), binary_data=False)
    wanted = [triton.InferRequestedOutput("probabilities", binary_data=True),
              triton.InferRequestedOutput("label", binary_data=False, class_count=3)]  # fmt: skip
    body, size = triton.InferenceServerClient.generate_request_body(
        [x], outputs=wanted, request_id="r2", parameters={"route": "local"}
    )
    request = decode_request(body, size)
    assert [(o.name, o.binary, o.classification, o.shm) for o in request.outputs] == [
        ("probabilities", True, 0, None), ("label", False, 3, None)]  # fmt: skip
    assert (request.id, request.parameters, request.binary_output) == ("r2", {"route": "local"},
                                                                       False)  # fmt: skip
    inputs = [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]
    plain = decode_request(json.dumps({"inputs": inputs}).encode())
    assert (plain.outputs, plain.binary_output, plain.id, plain.parameters) == ([], False, None, {})
    flagged = {"inputs": inputs, "parameters": {"binary_data_output": True}}
    every = decode_request(json.dumps(flagged).encode())
    assert every.binary_output is True


def test_the_answer_names_its_model_version_and_id() -> None:
    doc = json.loads(encode_response(InferResponse("m", "3", {}, id="q-1"))[0])
    assert (doc["model_name"], doc["model_version"], doc["id"]) == ("m", "3", "q-1")


def test_a_truncated_bytes_length_header_is_named() -> None:
    """Two BYTES elements: the second's 4-byte length header cut to 2 bytes."""
    chunk = struct.pack("<I", 3) + b"abc" + b"\x05\x00"
    doc = {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2],
                       "parameters": {"binary_data_size": len(chunk)}}]}  # fmt: skip
    header = json.dumps(doc).encode()
    with pytest.raises(InvalidRequest, match="binary BYTES element header is truncated"):
        decode_request(header + chunk, len(header))


@pytest.mark.parametrize(
    ("shape", "ok"),
    [([0], True), ([2, 0, 3], True), ([1] * 32, True), ([1] * 33, False), ([2**31 - 1], False),
     ([2**31], False), ([True], False)],
)  # fmt: skip
def test_shape_boundaries(shape: list[int], ok: bool) -> None:
    """A dimension of 0 (no elements), the most dimensions (32) and one more, the largest
    dimension (taken as a shape, refused as too many elements for data that is not there)."""
    count = int(np.prod(shape)) if ok else 0
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": [0.5] * count}]}
    if ok:
        assert decode_request(json.dumps(doc).encode()).inputs["x"].shape == tuple(shape)
    else:
        with pytest.raises(InvalidRequest, match="'x'"):
            decode_request(json.dumps(doc).encode())


def test_a_header_length_of_zero_or_the_whole_body() -> None:
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1],
                                   "data": [1]}]}).encode()  # fmt: skip
    assert decode_request(body, len(body)).inputs["x"].tolist() == [1.0]
    with pytest.raises(InvalidRequest, match="JSON"):
        decode_request(body, 0)  # no header at all: nothing to decode
    with pytest.raises(InvalidRequest, match="but the body has only"):
        decode_request(body, len(body) + 1)
