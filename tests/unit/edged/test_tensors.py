"""The protocol's tensor encoding, checked against Triton's own client library."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import example, given
from hypothesis import strategies as st

from edged.common.errors import InvalidRequest
from edged.oip.shm import Bound, Use
from edged.oip.tensors import (
    DATATYPES,
    InferResponse,
    RequestedOutput,
    bytes_tensor,
    check_shape,
    classify,
    confidence,
    datatype_of,
    decode_request,
    dump_json,
    element_count,
    encode_response,
    encode_tensors,
    encode_utf8,
    from_binary,
    from_json,
    from_region,
    is_count,
    parse_json,
    payload_bytes,
    place,
    response_document,
    text_tensor,
    to_binary,
    to_json,
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
    arrays: dict[str, np.ndarray] = {
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
    wanted = [
        triton.InferRequestedOutput("probabilities", binary_data=True),
        triton.InferRequestedOutput("label", binary_data=False, class_count=3),
    ]
    body, size = triton.InferenceServerClient.generate_request_body(
        [x], outputs=wanted, request_id="r2", parameters={"route": "local"}
    )
    request = decode_request(body, size)
    assert [(o.name, o.binary, o.classification, o.shm) for o in request.outputs] == [
        ("probabilities", True, 0, None),
        ("label", False, 3, None),
    ]
    assert (request.id, request.parameters, request.binary_output) == (
        "r2",
        {"route": "local"},
        False,
    )
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
    doc = {
        "inputs": [
            {
                "name": "t",
                "datatype": "BYTES",
                "shape": [2],
                "parameters": {"binary_data_size": len(chunk)},
            }
        ]
    }
    header = json.dumps(doc).encode()
    with pytest.raises(InvalidRequest, match="binary BYTES element header is truncated"):
        decode_request(header + chunk, len(header))


@pytest.mark.parametrize(
    ("shape", "ok"),
    [
        ([0], True),
        ([2, 0, 3], True),
        ([1] * 32, True),
        ([1] * 33, False),
        ([2**31 - 1], False),
        ([2**31], False),
        ([True], False),
    ],
)
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
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}
    ).encode()
    assert decode_request(body, len(body)).inputs["x"].tolist() == [1.0]
    with pytest.raises(InvalidRequest, match="JSON"):
        decode_request(body, 0)  # no header at all: nothing to decode
    with pytest.raises(InvalidRequest, match="but the body has only"):
        decode_request(body, len(body) + 1)


# ---- issue 32, second pass: every function of the module, its exact answers and refusals ----


def refusal(call: Callable[[], object]) -> str:
    """The message of the InvalidRequest that ``call`` raises, checked to be a 400."""
    with pytest.raises(InvalidRequest) as caught:
        call()
    assert caught.value.status == 400
    return caught.value.message


def request_body(inputs: list[dict[str, Any]], **rest: Any) -> bytes:
    return json.dumps({"inputs": inputs, **rest}).encode()


X = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}


@dataclass
class FakeShm:
    """A caller's shared memory as the decoders see it (Bound): one buffer, every region in it."""

    buffer: bytearray
    writes: list[tuple[Use, bytes]]

    def read(self, use: Use) -> memoryview:
        return memoryview(self.buffer)[use.offset : use.offset + use.byte_size]

    def write(self, use: Use, data: bytes) -> None:
        self.writes.append((use, data))


def fake_shm(content: bytes = b"") -> FakeShm:
    return FakeShm(bytearray(content), [])


def bound(fake: FakeShm) -> Bound:
    return cast(Bound, fake)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"NaN", "request body holds NaN: JSON has no NaN or Infinity (RFC 8259)"),
        (
            b'{"a": -Infinity}',
            "request body holds -Infinity: JSON has no NaN or Infinity (RFC 8259)",
        ),
        (b"{", "request body is not valid JSON: unexpected end of data: line 1 column 2 (char 1)"),
        (
            b"\xff",
            "request body is not valid JSON: str is not valid UTF-8: surrogates not"
            " allowed: line 1 column 1 (char 0)",
        ),
        (b"[" * 100_000, "request body is JSON nested too deeply"),
    ],
)
def test_a_body_that_is_not_json_is_refused_with_what_is_wrong(body: bytes, message: str) -> None:
    assert refusal(lambda: parse_json(body)) == message


def test_an_integer_of_too_many_digits_is_refused_not_crashed_on() -> None:
    message = refusal(lambda: parse_json(b"1" * 5000))
    assert message.startswith("request body holds a number edged cannot read: Exceeds the limit")


def test_json_in_and_out_round_trips_compactly() -> None:
    doc = {"a": [1, 2.5, "é"], "b": None}
    assert parse_json(b'{"a": [1, 2.5, "\\u00e9"], "b": null}') == doc
    assert dump_json(doc) == '{"a":[1,2.5,"\\u00e9"],"b":null}'


def test_numbers_json_cannot_carry_are_written_as_null_wherever_they_are() -> None:
    nan, inf = float("nan"), float("inf")
    doc = {"a": [nan, (inf, 1.0)], "b": {"c": -inf, "d": 2.0}, "e": "x", "f": 3, "g": True}
    assert dump_json(doc) == '{"a":[null,[null,1.0]],"b":{"c":null,"d":2.0},"e":"x","f":3,"g":true}'
    assert dump_json(nan) == "null"


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("12", True),
        ("0", True),
        ("9" * 18, True),
        ("9" * 19, False),
        ("", False),
        ("-1", False),
        ("²", False),
        ("١٢", False),
        ("1.5", False),
        (" 1", False),
    ],
)
def test_a_count_is_plain_ascii_digits_of_at_most_18(text: str, ok: bool) -> None:
    assert is_count(text) is ok


def test_text_becomes_utf8_bytes_tensors_and_a_lone_surrogate_is_named() -> None:
    assert encode_utf8("q", "wörld") == "wörld".encode()
    tensor = text_tensor("q", ["a", "é", ""])
    assert (tensor.dtype, tensor.shape, tensor.tolist()) == (
        np.dtype(object),
        (3,),
        [b"a", "é".encode(), b""],
    )
    assert refusal(lambda: text_tensor("query", ["ok", "\ud800"])) == (
        "'query' holds a string that is not valid Unicode"
    )
    empty = bytes_tensor([])
    assert (empty.dtype, empty.shape) == (np.dtype(object), (0,))


def test_a_bytes_tensor_keeps_each_item_as_one_element() -> None:
    tensor = bytes_tensor([b"ab", b"c"])
    assert tensor.shape == (2,)
    assert tensor[0] == b"ab" and tensor[1] == b"c"


@pytest.mark.parametrize("name", list(DATATYPES))
def test_every_datatype_names_its_numpy_dtype_back(name: str) -> None:
    assert datatype_of(np.zeros(2, dtype=DATATYPES[name])) == name


def test_strings_of_numpy_are_bytes_and_a_dtype_without_a_datatype_is_named() -> None:
    assert datatype_of(np.array([b"a"])) == "BYTES"
    assert datatype_of(np.array(["a"])) == "BYTES"
    assert refusal(lambda: datatype_of(np.zeros(1, dtype=np.complex64))) == (
        "numpy dtype complex64 has no Open Inference Protocol datatype"
    )


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        (np.array([0.2, 0.9, 0.5]), 0.2),
        (np.array([[0.2, 0.9], [0.6, 0.3], [0.7, 0.1]]), 0.6),
        (np.array([[[0.2, 0.9]], [[0.8, 0.1]]]), 0.8),
        (np.array(0.4), 1.0),
        (np.zeros((0, 3)), 1.0),
        (np.array([], dtype=np.float32), 1.0),
    ],
)
def test_confidence_is_the_least_sure_rows_best_score(scores: np.ndarray, expected: float) -> None:
    assert confidence(scores) == pytest.approx(expected)


def test_payload_bytes_counts_array_bytes_and_string_lengths() -> None:
    tensors = {
        "f": np.zeros((2, 3), dtype=np.float32),
        "b": np.array([b"abc", "de", None, 7], dtype=object),
        "i": np.zeros(1, dtype=np.int64),
    }
    assert payload_bytes(tensors) == 24 + 5 + 8
    assert payload_bytes({}) == 0


@pytest.mark.parametrize(
    ("shape", "count"), [([], 1), ([5], 5), ([2, 3, 4], 24), ([3, 0, 2], 0), ([1, 1], 1)]
)
def test_element_count_is_the_product_of_the_dimensions(shape: list[int], count: int) -> None:
    assert element_count(shape) == count
    assert element_count(iter(shape)) == count


SHAPE_RULE = "'shape' must be a list of at most 32 integers from 0 to 2147483647"


@pytest.mark.parametrize(
    "shape", [(1, 2), None, [1] * 33, [-1], [2**31], [True], [1.0], ["1"], [1, -1]]
)
def test_a_bad_shape_is_refused_with_the_rule(shape: Any) -> None:
    assert refusal(lambda: check_shape("t", shape)) == f"tensor 't': {SHAPE_RULE}"


def test_shapes_at_the_limits_are_taken_and_returned_as_lists() -> None:
    assert check_shape("t", [2**31 - 1]) == [2**31 - 1]
    assert check_shape("t", [1] * 32) == [1] * 32
    assert check_shape("t", []) == []
    assert check_shape("t", [0, 0]) == [0, 0]
    assert check_shape("t", [65536], "BYTES") == [65536]
    assert check_shape("t", [0, 65536, 0], "BYTES") == [0, 65536, 0]
    assert check_shape("t", [65537], "FP32") == [65537]


def test_shapes_past_the_element_limits_are_refused_counting_zeros_as_one() -> None:
    assert refusal(lambda: check_shape("t", [2**16, 2**15])) == (
        "tensor 't': shape [65536, 32768] is over the limit of 2147483647 elements"
    )
    assert refusal(lambda: check_shape("t", [0, 2**31 - 1, 2])) == (
        "tensor 't': shape [0, 2147483647, 2] is over the limit of 2147483647 elements"
    )
    assert refusal(lambda: check_shape("t", [65537], "BYTES")) == (
        "tensor 't': shape [65537] is over the limit of 65536 BYTES elements"
    )
    assert refusal(lambda: check_shape("t", [0, 2, 32769], "BYTES")) == (
        "tensor 't': shape [0, 2, 32769] is over the limit of 65536 BYTES elements"
    )


@pytest.mark.parametrize(
    ("data", "flat"),
    [
        (3, [3]),
        ([], []),
        ([[1, [2, 3]], 4, [[5]], []], [1, 2, 3, 4, 5]),
        ([[], [[]], [6]], [6]),
        (["a", ["b"]], ["a", "b"]),
    ],
)
def test_json_data_flattens_in_order(data: Any, flat: list[Any]) -> None:
    shape = [len(flat)]
    datatype = "BYTES" if flat and isinstance(flat[0], str) else "INT32"
    got = from_json("t", datatype, shape, data)
    expected = [s.encode() for s in flat] if datatype == "BYTES" else flat
    assert got.tolist() == expected


def test_data_nested_deeper_than_python_recurses_is_flattened() -> None:
    data: Any = [7]
    for _ in range(5000):
        data = [data]
    assert from_json("t", "INT8", [1], data).tolist() == [7]


@pytest.mark.parametrize(
    ("datatype", "data", "expected"),
    [
        ("BOOL", [True, False], [True, False]),
        ("UINT8", [0, 255], [0, 255]),
        ("INT8", [-128, 127], [-128, 127]),
        ("UINT16", [0, 65535], [0, 65535]),
        ("INT16", [-32768, 32767], [-32768, 32767]),
        ("UINT32", [0, 2**32 - 1], [0, 2**32 - 1]),
        ("INT32", [-(2**31), 2**31 - 1], [-(2**31), 2**31 - 1]),
        ("UINT64", [0, 2**64 - 1], [0, 2**64 - 1]),
        ("INT64", [-(2**63), 2**63 - 1], [-(2**63), 2**63 - 1]),
        ("FP16", [65504.0, -65504], [65504.0, -65504.0]),
        ("FP32", [3.4028234663852886e38, 1], [3.4028234663852886e38, 1.0]),
        ("FP64", [1.7976931348623157e308, -2], [1.7976931348623157e308, -2.0]),
        ("BYTES", ["hé", ""], ["hé".encode(), b""]),
    ],
)
def test_json_data_at_each_datatypes_limits_is_taken_exactly(
    datatype: str, data: list[Any], expected: list[Any]
) -> None:
    got = from_json("t", datatype, [1, 2], data)
    assert got.dtype == DATATYPES[datatype]
    assert got.shape == (1, 2)
    assert got.reshape(-1).tolist() == expected


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("BOOL", [1], "tensor 't': BOOL data must be true or false"),
        ("BYTES", [b"x".decode(), 1], "tensor 't': BYTES data must be strings"),
        ("BYTES", ["\udc80"], "'t' holds a string that is not valid Unicode"),
        ("INT8", [True], "tensor 't': INT8 data must be integers (not true/false or 1.0)"),
        ("UINT8", [1.0], "tensor 't': UINT8 data must be integers (not true/false or 1.0)"),
        ("UINT8", [256], "tensor 't': a value is out of range for UINT8"),
        ("UINT8", [-1], "tensor 't': a value is out of range for UINT8"),
        ("INT8", [128], "tensor 't': a value is out of range for INT8"),
        ("INT8", [-129], "tensor 't': a value is out of range for INT8"),
        ("UINT64", [2**64], "tensor 't': a value is out of range for UINT64"),
        ("INT64", [-(2**63) - 1], "tensor 't': a value is out of range for INT64"),
        ("FP32", [True], "tensor 't': FP32 data must be numbers"),
        ("FP32", ["1"], "tensor 't': FP32 data must be numbers"),
        ("FP32", [None], "tensor 't': FP32 data must be numbers"),
        ("FP32", [3.5e38], "tensor 't': a value is out of range for FP32"),
        ("FP32", [-3.5e38], "tensor 't': a value is out of range for FP32"),
        ("FP16", [65505.0], "tensor 't': a value is out of range for FP16"),
        ("FP64", [10**400], "tensor 't': a value is out of range for FP64"),
        (
            "FP32",
            [float("nan")],
            "tensor 't': FP32 data must be finite numbers (JSON has no NaN"
            " or Infinity; send such values as binary data)",
        ),
        (
            "FP64",
            [float("-inf")],
            "tensor 't': FP64 data must be finite numbers (JSON has no NaN"
            " or Infinity; send such values as binary data)",
        ),
    ],
)
def test_json_data_outside_its_datatype_is_refused_by_name(
    datatype: str, data: list[Any], message: str
) -> None:
    assert refusal(lambda: from_json("t", datatype, [len(data)], data)) == message


def test_json_data_must_fill_the_shape_exactly() -> None:
    assert refusal(lambda: from_json("t", "FP32", [2, 2], [1, 2, 3])) == (
        "tensor 't': shape [2, 2] needs 4 elements, 'data' has 3"
    )
    assert refusal(lambda: from_json("t", "INT8", [1], [1, 2])) == (
        "tensor 't': shape [1] needs 1 elements, 'data' has 2"
    )


def test_empty_tensors_of_every_kind_decode_from_empty_data() -> None:
    for datatype in DATATYPES:
        got = from_json("t", datatype, [0, 3], [])
        assert (got.shape, got.dtype) == ((0, 3), DATATYPES[datatype])


def test_non_finite_numbers_are_taken_where_the_transport_can_carry_them() -> None:
    got = from_json("t", "FP32", [3], [float("nan"), float("inf"), 2.0], finite=False)
    assert got.dtype == np.float32
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == 2.0
    only_nan = from_json("t", "FP16", [1], [float("nan")], finite=False)
    assert only_nan.dtype == np.float16 and np.isnan(only_nan[0])
    assert refusal(lambda: from_json("t", "FP32", [2], [float("inf"), 4e38], finite=False)) == (
        "tensor 't': a value is out of range for FP32"
    )


def test_integers_in_float_data_are_converted() -> None:
    got = from_json("t", "FP64", [2], [2**53, -3])
    assert got.tolist() == [float(2**53), -3.0]


def bytes_chunk(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def test_binary_bytes_elements_decode_in_order_including_empty_ones() -> None:
    got = from_binary("t", "BYTES", [2, 2], bytes_chunk(b"", b"ab", b"\x00\xff", b""))
    assert got.shape == (2, 2)
    assert got.reshape(-1).tolist() == [b"", b"ab", b"\x00\xff", b""]
    assert from_binary("t", "BYTES", [1], bytes_chunk(b"")).tolist() == [b""]
    assert from_binary("t", "BYTES", [0], b"").shape == (0,)
    assert from_binary("t", "BYTES", [2], memoryview(bytes_chunk(b"a", b"b"))).tolist() == [
        b"a",
        b"b",
    ]


def test_binary_bytes_with_more_elements_than_the_shape_are_refused() -> None:
    assert refusal(lambda: from_binary("t", "BYTES", [1], bytes_chunk(b"a", b"b", b"c"))) == (
        "tensor 't': shape [1] needs 1 elements, binary data has 2"
    )
    assert refusal(lambda: from_binary("t", "BYTES", [2], bytes_chunk(b"", b"", b""))) == (
        "tensor 't': shape [2] needs 2 elements, binary data has 3"
    )


def test_binary_bytes_with_fewer_elements_than_the_shape_are_refused() -> None:
    assert refusal(lambda: from_binary("t", "BYTES", [2], bytes_chunk(b"abcd"))) == (
        "tensor 't': shape [2] needs 2 elements, binary data has 1"
    )


def test_binary_bytes_too_short_for_the_shape_are_refused_before_parsing() -> None:
    assert refusal(lambda: from_binary("t", "BYTES", [3], bytes_chunk(b"", b"") + b"xyz")) == (
        "tensor 't': shape [3] needs 3 BYTES elements; the binary data (11 bytes) holds at most"
        " 2, edged takes at most 65536"
    )
    many = b"\0" * (4 * 65537)
    assert refusal(lambda: from_binary("t", "BYTES", [65537], many)) == (
        "tensor 't': shape [65537] needs 65537 BYTES elements; the binary data (262148 bytes)"
        " holds at most 65537, edged takes at most 65536"
    )
    assert from_binary("t", "BYTES", [65536], b"\0" * (4 * 65536)).shape == (65536,)


def test_a_binary_bytes_element_longer_than_the_data_is_refused() -> None:
    chunk = struct.pack("<I", 4) + b"abc"
    assert refusal(lambda: from_binary("t", "BYTES", [1], chunk)) == (
        "tensor 't': binary BYTES element is truncated"
    )
    exact = struct.pack("<I", 3) + b"abc"
    assert from_binary("t", "BYTES", [1], exact).tolist() == [b"abc"]


def test_a_truncated_element_header_is_named_when_called_directly() -> None:
    chunk = bytes_chunk(b"") + bytes_chunk(b"") + b"\0\0\0"
    assert refusal(lambda: from_binary("t", "BYTES", [2], chunk)) == (
        "tensor 't': binary BYTES element header is truncated"
    )


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != "BYTES"])
def test_binary_numbers_are_little_endian_and_a_copy_of_their_own(datatype: str) -> None:
    values = np.array([[1, 0], [1, 1], [0, 1]], dtype=DATATYPES[datatype])
    chunk = values.astype(values.dtype.newbyteorder("<")).tobytes()
    got = from_binary("t", datatype, [3, 2], chunk)
    assert got.dtype == DATATYPES[datatype]
    assert got.shape == (3, 2)
    np.testing.assert_array_equal(got, values)
    assert got.flags.writeable


def test_binary_numbers_are_read_little_endian_whatever_the_byte_order() -> None:
    assert from_binary("t", "INT32", [2], b"\x01\x00\x00\x00\x00\x01\x00\x00").tolist() == [
        1,
        256,
    ]
    assert from_binary("t", "FP32", [1], struct.pack("<f", 1.5)).tolist() == [1.5]


def test_binary_numbers_of_the_wrong_size_are_refused() -> None:
    assert refusal(lambda: from_binary("t", "FP32", [2, 2], b"\0" * 15)) == (
        "tensor 't': shape [2, 2] of FP32 needs 16 bytes, binary_data_size gives 15"
    )
    assert refusal(lambda: from_binary("t", "INT64", [1], b"\0" * 9)) == (
        "tensor 't': shape [1] of INT64 needs 8 bytes, binary_data_size gives 9"
    )
    assert from_binary("t", "UINT8", [0], b"").shape == (0,)


def test_an_input_in_shared_memory_is_read_without_a_second_copy() -> None:
    values = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    fake = fake_shm(b"\xaa" * 4 + values.tobytes())
    use = Use("r", 12, 4)
    got = from_region("t", "FP32", [3], use, bound(fake))
    np.testing.assert_array_equal(got, values)
    assert np.shares_memory(got, np.frombuffer(fake.buffer, dtype=np.uint8))


def test_a_bytes_input_in_shared_memory_is_parsed_from_the_region() -> None:
    chunk = bytes_chunk(b"hi", b"")
    got = from_region("t", "BYTES", [2], Use("r", len(chunk)), bound(fake_shm(chunk)))
    assert got.tolist() == [b"hi", b""]


def test_shared_memory_inputs_need_a_local_caller_and_the_right_size() -> None:
    assert refusal(lambda: from_region("t", "FP32", [1], Use("r", 4), None)) == (
        "input 't': shared memory is for callers on edged's sockets"
    )
    fake = fake_shm(b"\0" * 16)
    assert refusal(lambda: from_region("t", "FP32", [2], Use("r", 12), bound(fake))) == (
        "tensor 't': shape [2] of FP32 needs 8 bytes, shared_memory_byte_size gives 12"
    )


def test_outputs_asked_for_in_shared_memory_are_written_there() -> None:
    response = InferResponse(
        "m", "1", {"a": np.array([1, 2], dtype=np.int16), "b": np.array([b"xy"], dtype=object)}
    )
    fake = fake_shm()
    requested = [
        RequestedOutput("missing", shm=Use("r0", 8)),
        RequestedOutput("a", shm=Use("r1", 8, 2)),
        RequestedOutput("b", shm=Use("r2", 6)),
    ]
    placed = place(response, [RequestedOutput("a"), *requested], bound(fake))
    assert placed == {
        "a": {"shared_memory_region": "r1", "shared_memory_byte_size": 4},
        "b": {"shared_memory_region": "r2", "shared_memory_byte_size": 6},
    }
    assert fake.writes == [
        (Use("r1", 8, 2), b"\x01\x00\x02\x00"),
        (Use("r2", 6), b"\x02\x00\x00\x00xy"),
    ]


def test_outputs_not_in_shared_memory_need_no_caller_and_are_not_placed() -> None:
    response = InferResponse("m", "1", {"a": np.array([1], dtype=np.int16)})
    assert (
        place(response, [RequestedOutput("a"), RequestedOutput("b", shm=Use("r", 4))], None) == {}
    )
    assert (
        refusal(lambda: place(response, [RequestedOutput("a", shm=Use("r", 4))], None))
        == "output 'a': shared memory is for local callers"
    )


def test_a_refused_region_is_kept_on_the_request_for_its_models_call_to_fail_with() -> None:
    """Not raised by the decoder: the data plane raises it where the model's calls are counted,
    so that a refused region is a failure in the model's statistics. An output's region is
    refused before the model runs, the first refusal is the one kept."""
    region = {"shared_memory_region": "r", "shared_memory_byte_size": 4}
    output = {"name": "y", "parameters": region}
    doc = {"inputs": [{**X, "parameters": region}], "outputs": [output]}
    request = decode_request(json.dumps(doc).encode())
    assert request.refused is not None and "x" not in request.inputs
    assert request.refused.message == "input 'x': shared memory is for callers on edged's sockets"
    request = decode_request(json.dumps({"inputs": [X], "outputs": [output]}).encode())
    assert request.refused is not None
    assert request.refused.message == "output 'y': shared memory is for local callers"
    assert decode_request(json.dumps({"inputs": [X]}).encode()).refused is None


def test_a_header_length_outside_the_body_is_refused_with_both_numbers() -> None:
    body = request_body([X])
    assert refusal(lambda: decode_request(body, -1)) == (
        f"Inference-Header-Content-Length is -1 but the body has only {len(body)} bytes"
    )
    assert refusal(lambda: decode_request(b"{}", 3)) == (
        "Inference-Header-Content-Length is 3 but the body has only 2 bytes"
    )


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "request body must be a JSON object with an 'inputs' list"),
        ("x", "request body must be a JSON object with an 'inputs' list"),
        ({}, "request needs a non-empty 'inputs' list"),
        ({"inputs": {"name": "x"}}, "request needs a non-empty 'inputs' list"),
        ({"inputs": [X], "parameters": [1]}, "request 'parameters' must be an object"),
        ({"inputs": [X], "parameters": "p"}, "request 'parameters' must be an object"),
        ({"inputs": [1]}, "each input must be an object with a 'name'"),
        ({"inputs": [{"datatype": "FP32"}]}, "each input must be an object with a 'name'"),
        ({"inputs": [{"name": 1}]}, "each input must be an object with a 'name'"),
        ({"inputs": [X, X]}, "tensor 'x' is given twice"),
        (
            {"inputs": [{**X, "datatype": "fp32"}]},
            "tensor 'x': datatype 'fp32' is not one of BOOL, UINT8, UINT16, UINT32, UINT64, INT8,"
            " INT16, INT32, INT64, FP16, FP32, FP64, BYTES",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1], "data": [1]}]},
            "tensor 'x': datatype None is not one of BOOL, UINT8, UINT16, UINT32, UINT64, INT8,"
            " INT16, INT32, INT64, FP16, FP32, FP64, BYTES",
        ),
        ({"inputs": [{**X, "shape": None}]}, f"tensor 'x': {SHAPE_RULE}"),
        (
            {"inputs": [{**X, "datatype": "BYTES", "shape": [65537], "data": []}]},
            "tensor 'x': shape [65537] is over the limit of 65536 BYTES elements",
        ),
        ({"inputs": [{**X, "parameters": [1]}]}, "input 'x': 'parameters' must be an object"),
        (
            {"inputs": [{**X, "parameters": {"binary_data_size": -1}}]},
            "tensor 'x': binary_data_size must be an integer >= 0",
        ),
        (
            {"inputs": [{**X, "parameters": {"binary_data_size": True}}]},
            "tensor 'x': binary_data_size must be an integer >= 0",
        ),
        (
            {"inputs": [{**X, "parameters": {"binary_data_size": 4.0}}]},
            "tensor 'x': binary_data_size must be an integer >= 0",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "parameters": {}}]},
            "tensor 'x' has neither 'data' nor binary_data_size",
        ),
        (
            {
                "inputs": [
                    {
                        **X,
                        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": -4},
                    }
                ]
            },
            "input 'x': shared_memory_byte_size must be an integer >= 0",
        ),
        ({"inputs": [X], "outputs": {"name": "y"}}, "request 'outputs' must be a list"),
        (
            {"inputs": [X], "outputs": ["y"]},
            "each requested output must be an object with a 'name'",
        ),
        (
            {"inputs": [X], "outputs": [{"name": None}]},
            "each requested output must be an object with a 'name'",
        ),
        (
            {"inputs": [X], "outputs": [{"name": "y"}, {"name": "z"}, {"name": "y"}]},
            "output 'y' is requested twice",
        ),
        (
            {"inputs": [X], "outputs": [{"name": "y", "parameters": 3}]},
            "output 'y': 'parameters' must be an object",
        ),
        (
            {"inputs": [X], "outputs": [{"name": "y", "parameters": {"classification": -1}}]},
            "output 'y': classification must be an integer >= 0",
        ),
        (
            {"inputs": [X], "outputs": [{"name": "y", "parameters": {"classification": True}}]},
            "output 'y': classification must be an integer >= 0",
        ),
        (
            {"inputs": [X], "outputs": [{"name": "y", "parameters": {"classification": "2"}}]},
            "output 'y': classification must be an integer >= 0",
        ),
        (
            {"inputs": [X], "outputs": [{"name": "y", "parameters": {"shared_memory_region": 5}}]},
            "output 'y': shared_memory_region must be a region's name",
        ),
        ({"inputs": [X], "id": 7}, "request 'id' must be a string"),
    ],
)
def test_each_malformed_request_is_refused_with_its_exact_reason(doc: Any, message: str) -> None:
    assert refusal(lambda: decode_request(json.dumps(doc).encode())) == message


def test_absent_or_null_or_empty_fields_take_their_defaults() -> None:
    doc = {"inputs": [{**X, "parameters": None}], "parameters": None, "outputs": None, "id": None}
    request = decode_request(json.dumps(doc).encode())
    assert (request.id, request.parameters, request.outputs, request.binary_output) == (
        None,
        {},
        [],
        False,
    )
    assert request.inputs["x"].tolist() == [1.0]
    empty = decode_request(request_body([{**X, "parameters": {}}], parameters={}, outputs=[]))
    assert (empty.parameters, empty.outputs) == ({}, [])
    falsy = decode_request(request_body([X], parameters=[], outputs={}))
    assert (falsy.parameters, falsy.outputs) == ({}, [])


def test_requested_output_flags_are_decoded_per_output() -> None:
    outputs = [
        {"name": "a"},
        {"name": "b", "parameters": {"binary_data": 1, "classification": 0}},
        {"name": "c", "parameters": {"binary_data": 0, "classification": 5}},
        {"name": "d", "parameters": None},
        {"name": "e", "parameters": {"binary_data": None}},
        {
            "name": "f",
            "parameters": {
                "shared_memory_region": "r1",
                "shared_memory_byte_size": 8,
                "shared_memory_offset": 16,
            },
        },
    ]
    request = decode_request(request_body([X], outputs=outputs, id="q"))
    assert request.outputs == [
        RequestedOutput("a", None, 0, None),
        RequestedOutput("b", True, 0, None),
        RequestedOutput("c", False, 5, None),
        RequestedOutput("d", None, 0, None),
        RequestedOutput("e", None, 0, None),
        RequestedOutput("f", None, 0, Use("r1", 8, 16)),
    ]
    assert request.id == "q"


def test_the_binary_output_flag_follows_the_request_parameter() -> None:
    params: dict[str, Any] = {"binary_data_output": 1, "other": "kept"}
    request = decode_request(request_body([X], parameters=params))
    assert request.binary_output is True
    assert request.parameters == params
    off = decode_request(request_body([X], parameters={"binary_data_output": False}))
    assert off.binary_output is False


def binary_request(inputs: list[dict[str, Any]], chunks: list[bytes]) -> tuple[bytes, int]:
    header = request_body(inputs)
    return header + b"".join(chunks), len(header)


def test_binary_inputs_are_sliced_in_order_between_json_ones() -> None:
    a = np.array([1.0, 2.0], dtype=np.float32).tobytes()
    c = bytes_chunk(b"xy", b"")
    inputs: list[dict[str, Any]] = [
        {"name": "a", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
        {"name": "b", "datatype": "INT8", "shape": [1], "data": [3]},
        {"name": "e", "datatype": "INT8", "shape": [0], "parameters": {"binary_data_size": 0}},
        {
            "name": "c",
            "datatype": "BYTES",
            "shape": [2],
            "parameters": {"binary_data_size": len(c)},
        },
    ]
    body, size = binary_request(inputs, [a, c])
    request = decode_request(body, size)
    assert list(request.inputs) == ["a", "b", "e", "c"]
    assert request.inputs["a"].tolist() == [1.0, 2.0]
    assert request.inputs["b"].tolist() == [3]
    assert request.inputs["e"].shape == (0,)
    assert request.inputs["c"].tolist() == [b"xy", b""]


def test_a_binary_input_past_the_end_of_the_body_names_its_offset() -> None:
    inputs = [
        {"name": "a", "datatype": "UINT8", "shape": [2], "parameters": {"binary_data_size": 2}},
        {"name": "b", "datatype": "UINT8", "shape": [4], "parameters": {"binary_data_size": 4}},
    ]
    body, size = binary_request(inputs, [b"\1\2", b"\3\4\5"])
    assert refusal(lambda: decode_request(body, size)) == (
        "tensor 'b': binary data is truncated: needs 4 bytes at offset 2, the body has 3 left"
    )
    whole, size = binary_request(inputs, [b"\1\2", b"\3\4\5\6"])
    assert decode_request(whole, size).inputs["b"].tolist() == [3, 4, 5, 6]


def test_binary_bytes_that_no_input_claims_are_counted() -> None:
    inputs = [
        {"name": "a", "datatype": "UINT8", "shape": [1], "parameters": {"binary_data_size": 1}}
    ]
    body, size = binary_request(inputs, [b"\1", b"junk"])
    assert refusal(lambda: decode_request(body, size)) == (
        "the body has 4 bytes of binary data that no input claims"
    )
    json_only = request_body([X])
    assert refusal(lambda: decode_request(json_only + b"zz", len(json_only))) == (
        "the body has 2 bytes of binary data that no input claims"
    )


def test_a_body_without_a_header_length_is_all_json() -> None:
    request = decode_request(request_body([X]))
    assert request.inputs["x"].dtype == np.float32
    assert request.inputs["x"].tolist() == [1.0]
    assert refusal(lambda: decode_request(request_body([X]) + b"\0")).startswith(
        "request body is not valid JSON: unexpected content after document"
    )


def test_an_input_in_shared_memory_is_decoded_through_the_callers_regions() -> None:
    values = np.array([[7, -8]], dtype=np.int32)
    fake = fake_shm(b"\0" * 8 + values.tobytes())
    params = {"shared_memory_region": "in", "shared_memory_byte_size": 8, "shared_memory_offset": 8}
    doc = [{"name": "x", "datatype": "INT32", "shape": [1, 2], "parameters": params}]
    request = decode_request(request_body(doc), shm=bound(fake))
    np.testing.assert_array_equal(request.inputs["x"], values)


def test_json_output_data_is_flat_and_typed() -> None:
    assert to_json(np.array([[1, 2], [3, 4]], dtype=np.int8)) == [1, 2, 3, 4]
    assert to_json(np.array([[True], [False]])) == [True, False]
    assert to_json(np.array([0.5, 2.0], dtype=np.float32)) == [0.5, 2.0]
    assert to_json(np.array([], dtype=np.float64)) == []
    nan = float("nan")
    assert to_json(np.array([[nan, 1.5], [np.inf, -np.inf]], dtype=np.float16)) == [
        None,
        1.5,
        None,
        None,
    ]


def test_json_output_strings_are_text_and_bad_utf8_is_replaced() -> None:
    tensor = np.array([b"ok", "é".encode(), b"\xff", "s", 3], dtype=object)
    assert to_json(tensor) == ["ok", "é", "\ufffd", "s", "3"]
    assert to_json(np.array([["a", "bc"]])) == ["a", "bc"]
    assert to_json(np.array([b"a", b"bc"])) == ["a", "bc"]


def test_binary_output_data_is_little_endian_and_row_major() -> None:
    array = np.array([[1, 2], [3, 4]], dtype=np.int16).T
    assert to_binary(array) == struct.pack("<4h", 1, 3, 2, 4)
    big = np.array([1.5], dtype=">f4")
    assert to_binary(big) == struct.pack("<f", 1.5)
    assert to_binary(np.array([], dtype=np.float32)) == b""


def test_binary_output_strings_are_length_prefixed() -> None:
    tensor = np.array([[b"ab", "é"], [b"", 5]], dtype=object)
    assert to_binary(tensor) == bytes_chunk(b"ab", "é".encode(), b"", b"5")
    assert to_binary(np.array(["xy", "z"])) == bytes_chunk(b"xy", b"z")
    assert to_binary(np.array([], dtype=object)) == b""


def test_tensor_entries_carry_data_binary_sizes_or_their_place() -> None:
    arrays = {
        "j": np.array([[1, 2]], dtype=np.uint16),
        "b": np.array([b"hi"], dtype=object),
        "s": np.array([3.0], dtype=np.float64),
        "f": np.array([4], dtype=np.int64),
    }
    binary = {"b": True, "s": True, "j": False, "f": True}
    placed = {"s": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}
    entries, chunks = encode_tensors(arrays, binary, placed)
    assert entries == [
        {"name": "j", "datatype": "UINT16", "shape": [1, 2], "data": [1, 2]},
        {"name": "b", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}},
        {"name": "s", "datatype": "FP64", "shape": [1], "parameters": placed["s"]},
        {"name": "f", "datatype": "INT64", "shape": [1], "parameters": {"binary_data_size": 8}},
    ]
    assert chunks == [bytes_chunk(b"hi"), struct.pack("<q", 4)]
    plain, none = encode_tensors({"j": arrays["j"]}, {})
    assert (plain, none) == ([entries[0]], [])


def test_the_response_document_names_only_what_it_has() -> None:
    outputs = {"y": np.array([1], dtype=np.int8), "z": np.array([2], dtype=np.int8)}
    doc, chunks = response_document(InferResponse("m", "2", outputs), {"z": True})
    assert doc == {
        "model_name": "m",
        "model_version": "2",
        "outputs": [
            {"name": "y", "datatype": "INT8", "shape": [1], "data": [1]},
            {"name": "z", "datatype": "INT8", "shape": [1], "parameters": {"binary_data_size": 1}},
        ],
    }
    assert chunks == [b"\x02"]
    full = InferResponse("m", "2", outputs, id="", parameters={"route": "cloud"})
    doc, chunks = response_document(full)
    assert (doc["id"], doc["parameters"], chunks) == ("", {"route": "cloud"}, [])
    placed = {"y": {"shared_memory_region": "r", "shared_memory_byte_size": 1}}
    doc, chunks = response_document(InferResponse("m", "2", outputs), None, placed)
    assert doc["outputs"][0] == {
        "name": "y",
        "datatype": "INT8",
        "shape": [1],
        "parameters": placed["y"],
    }


def test_an_encoded_response_is_compact_json_then_its_binary_data() -> None:
    outputs = {"y": np.array([1, 2], dtype=np.uint8), "s": np.array([float("nan")])}
    body, length = encode_response(InferResponse("m", "1", outputs, id="i"), {"y": True})
    header = (
        b'{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"UINT8",'
        b'"shape":[2],"parameters":{"binary_data_size":2}},{"name":"s","datatype":"FP64",'
        b'"shape":[1],"data":[null]}],"id":"i"}'
    )
    assert (body, length) == (header + b"\x01\x02", len(header))
    json_only, none = encode_response(InferResponse("m", "1", {"y": outputs["y"]}), {"y": False})
    assert none is None
    assert json_only == (
        b'{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"UINT8",'
        b'"shape":[2],"data":[1,2]}]}'
    )


def test_a_response_header_length_counts_utf8_bytes() -> None:
    outputs = {"y": np.array([b"\xc3\xa9"], dtype=object)}
    body, length = encode_response(InferResponse("modèle", "1", outputs), {"y": True})
    assert length is not None
    assert json.loads(body[:length])["model_name"] == "modèle"
    assert body[length:] == bytes_chunk("é".encode())


def test_classification_of_one_row_is_one_row_of_top_k() -> None:
    top = classify(np.array([0.1, 0.7, 0.2, 0.7], dtype=np.float32), 3, ["a", "b", "c", "d"])
    assert top.shape == (3,)
    assert top.tolist() == [b"0.700000:1:b", b"0.700000:3:d", b"0.200000:2:c"]


def test_classification_is_per_row_of_a_batch_and_flattens_the_rest() -> None:
    scores = np.array([[[1, 2], [4, 3]], [[-1, -5], [-3, -2]]], dtype=np.int32)
    top = classify(scores, 2, None)
    assert top.shape == (2, 2)
    assert top.tolist() == [[b"4.000000:2", b"3.000000:3"], [b"-1.000000:0", b"-2.000000:3"]]


def test_classification_labels_apply_where_there_are_enough_of_them() -> None:
    scores = np.array([[0.1, 0.9, 0.5]])
    assert classify(scores, 5, ["a", "b"]).tolist() == [
        [b"0.900000:1:b", b"0.500000:2", b"0.100000:0:a"]
    ]
    assert classify(scores, 1, []).tolist() == [[b"0.900000:1"]]
    assert classify(scores, 0, None).shape == (1, 0)


@pytest.mark.parametrize(
    "scores",
    [
        np.array([b"a"], dtype=object),
        np.array([True]),
        np.array([], dtype=np.float32),
        np.zeros((2, 0)),
        np.array(["1.0"]),
    ],
)
def test_classification_needs_numbers(scores: np.ndarray) -> None:
    assert refusal(lambda: classify(scores, 1, None)) == (
        "classification needs a numeric output with at least one class"
    )


def test_classification_of_a_batch_of_two_dimensions_is_one_row_per_item() -> None:
    scores = np.array([[0.1, 0.9, 0.5], [0.8, 0.3, 0.4]], dtype=np.float64)
    assert classify(scores, 2, ["a", "b", "c"]).tolist() == [
        [b"0.900000:1:b", b"0.500000:2:c"],
        [b"0.800000:0:a", b"0.400000:2:c"],
    ]


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.integers(1, 40),
)
@example([1] * 20 + [2] * 20, 40)
@example([0, 2, 1, 2, 0, 1, 1, 2, 0, 2, 2, 1, 0, 0, 1, 2, 2, 0, 1, 2], 20)
def test_classification_ranks_by_score_and_ties_by_index(row: list[int], k: int) -> None:
    top = classify(np.array(row, dtype=np.float32), k, None)
    ranked = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
    assert top.tolist() == [f"{row[i]:f}:{i}".encode() for i in ranked]


def test_binary_errors_of_a_request_name_the_tensor() -> None:
    inputs = [
        {"name": "img", "datatype": "FP32", "shape": [3], "parameters": {"binary_data_size": 8}}
    ]
    body, size = binary_request(inputs, [b"\0" * 8])
    assert refusal(lambda: decode_request(body, size)) == (
        "tensor 'img': shape [3] of FP32 needs 12 bytes, binary_data_size gives 8"
    )


def test_bytes_in_shared_memory_that_do_not_parse_name_the_tensor() -> None:
    chunk = struct.pack("<I", 9) + b"abc"
    fake = fake_shm(chunk)
    assert refusal(lambda: from_region("words", "BYTES", [1], Use("r", 7), bound(fake))) == (
        "tensor 'words': binary BYTES element is truncated"
    )


def test_a_bytes_length_past_two_gigabytes_is_truncated_not_negative() -> None:
    """The 4-byte length is unsigned: 0xFFFFFFFC is 4 GiB less 4, not -4."""
    chunk = struct.pack("<I", 2**32 - 4) + b"abcd"
    assert refusal(lambda: from_binary("t", "BYTES", [2], chunk)) == (
        "tensor 't': binary BYTES element is truncated"
    )


def test_an_encoded_response_leaves_placed_outputs_out_of_the_body() -> None:
    outputs = {"y": np.array([1, 2], dtype=np.uint8)}
    placed = {"y": {"shared_memory_region": "out", "shared_memory_byte_size": 2}}
    body, length = encode_response(InferResponse("m", "1", outputs), {"y": True}, placed)
    assert length is None
    assert json.loads(body)["outputs"] == [
        {"name": "y", "datatype": "UINT8", "shape": [2], "parameters": placed["y"]}
    ]


def test_classification_ranks_unsigned_scores_highest_first() -> None:
    """Unsigned scores (a quantized model's uint8 output) rank as numbers: negating them to
    sort would wrap 0 around to the top."""
    top = classify(np.array([0, 5, 3], dtype=np.uint8), 3, None)
    assert top.tolist() == [b"5.000000:1", b"3.000000:2", b"0.000000:0"]
    wide = classify(np.array([[2**64 - 1, 0, 7]], dtype=np.uint64), 2, ["a", "b", "c"])
    assert wide.tolist() == [[b"18446744073709551616.000000:0:a", b"7.000000:2:c"]]
