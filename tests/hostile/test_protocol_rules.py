"""The protocol's decoding under hostile input, without a daemon: one rule per datatype for JSON
data (Triton's), limits checked before any array is built, strict JSON in and out, and a fuzz
of whole request bodies where the only way out is an answer or an InvalidRequest."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from edged.cloud import read_token
from edged.common.errors import ConfigError, InvalidRequest, PayloadTooLarge
from edged.config import CloudConfig, KnowledgeConfig
from edged.models.install import check_files
from edged.oip.tensors import (
    MAX_BYTES_ELEMENTS,
    InferResponse,
    decode_request,
    encode_response,
    is_count,
    parse_json,
)
from edged.pipelines.vad_ops import decode_wav, to_model_rate


def body(datatype: str, shape: list[int], data: Any) -> bytes:
    doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("datatype", "data", "expected"),
    [
        ("BOOL", [True, False], np.array([True, False])),
        ("INT64", [1, -2], np.array([1, -2], dtype=np.int64)),
        ("UINT8", [0, 255], np.array([0, 255], dtype=np.uint8)),
        ("FP32", [1, 2.5], np.array([1.0, 2.5], dtype=np.float32)),
        ("FP16", [[1.5], [-2]], np.array([1.5, -2.0], dtype=np.float16)),  # nested is fine
        ("BYTES", ["a", "é"], np.array([b"a", "é".encode()], dtype=object)),
    ],
)
def test_each_datatype_takes_its_own_json_values(
    datatype: str, data: list[Any], expected: np.ndarray
) -> None:
    (array,) = decode_request(body(datatype, [2], data)).inputs.values()
    assert array.dtype == expected.dtype and array.tolist() == expected.tolist()


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT64", [True, False], "integers"),  # a bool is not an integer
        ("INT64", [1.0, 2.0], "integers"),
        ("INT8", [1, 128], "out of range for INT8"),
        ("UINT64", [1, -1], "out of range for UINT64"),
        ("BOOL", [1, 0], "true or false"),
        ("FP32", [True, 1.0], "numbers"),
        ("FP32", [3.5e38, 1.0], "out of range for FP32"),  # was silently inf
        ("FP16", [70000.0, 1.0], "out of range for FP16"),
        ("FP64", [10**400, 1], "out of range"),
        ("BYTES", [1, "a"], "strings"),
        ("BYTES", [1.5, "a"], "strings"),
        ("BYTES", [True, "a"], "strings"),
        ("BYTES", [None, "a"], "strings"),
        ("BYTES", ["\ud800", "a"], "not valid Unicode"),
    ],
)
def test_values_of_another_type_or_out_of_range_are_refused_naming_the_tensor(
    datatype: str, data: list[Any], message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        decode_request(body(datatype, [2], data))
    assert "'x'" in caught.value.message


def test_a_number_past_float64_is_not_read_as_infinity() -> None:
    raw = b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [1e400]}]}'
    with pytest.raises(InvalidRequest, match="finite"):  # Python's json reads it as inf
        decode_request(raw)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_and_are_refused(constant: str) -> None:
    raw = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [%s]}]}'
    with pytest.raises(InvalidRequest, match="JSON has no NaN or Infinity"):
        decode_request(raw % constant.encode())


def test_answers_never_carry_nan_and_binary_keeps_it_exact() -> None:
    values = np.array([np.nan, np.inf, -np.inf, 1.5], dtype=np.float32)
    response = InferResponse("m", "1", {"y": values})
    text, header = encode_response(response)
    assert header is None
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the answer"))
    assert doc["outputs"][0]["data"] == [None, None, None, 1.5]
    np.testing.assert_array_equal(np.array(doc["outputs"][0]["data"], dtype=np.float32)[3], 1.5)
    raw, header = encode_response(response, {"y": True})
    assert header is not None
    np.testing.assert_array_equal(np.frombuffer(raw[header:], dtype="<f4"), values)


@pytest.mark.parametrize(
    "shape",
    [[0, 2**31 - 1, 2**31 - 1], [2**20, 2**20], [2**31 - 1, 2]],
)
def test_shapes_past_the_element_limit_are_refused_before_anything_is_built(
    shape: list[int],
) -> None:
    with pytest.raises(InvalidRequest, match="over the limit"):
        decode_request(body("FP32", shape, []))


def test_a_bytes_tensor_is_counted_before_it_is_parsed() -> None:
    count = 4_000_000  # 15 MiB of empty strings: 3.9 s and 160 MB to parse, before
    chunk = struct.pack("<I", 0) * count
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "BYTES",
                    "shape": [count],
                    "parameters": {"binary_data_size": len(chunk)},
                }
            ]
        }
    ).encode()
    raw = header + chunk
    tracemalloc.start()
    with pytest.raises(InvalidRequest, match=f"over the limit of {MAX_BYTES_ELEMENTS}"):
        decode_request(raw, len(header))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"
    # a shape that claims fewer elements than the data holds: refused without parsing them all
    small = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "BYTES",
                    "shape": [2],
                    "parameters": {"binary_data_size": len(chunk)},
                }
            ]
        }
    ).encode()
    with pytest.raises(InvalidRequest, match="needs 2 elements"):
        decode_request(small + chunk, len(small))


@pytest.mark.parametrize(
    "raw",
    [b"1" * 5000, b'{"a": ' + b"9" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe"],
)
def test_json_that_python_cannot_read_is_a_400(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_json(raw)


def test_counts_of_thousands_of_digits_are_not_counts() -> None:
    assert is_count("12") and not is_count("9" * 5000) and not is_count("-1")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
DATATYPES = st.sampled_from(
    ["BOOL", "UINT8", "INT32", "INT64", "UINT64", "FP16", "FP32", "FP64", "BYTES", "X", None]
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """Request bodies close to valid: real keys, any values, sometimes binary data after."""
    tensor = {
        "name": draw(st.text(max_size=4) | st.integers()),
        "datatype": draw(DATATYPES),
        "shape": draw(st.lists(st.integers(-2, 2**40), max_size=4) | JSON_VALUES),
        "data": draw(JSON_VALUES),
    }
    if draw(st.booleans()):
        tensor["parameters"] = {"binary_data_size": draw(st.integers(-1, 64) | JSON_VALUES)}
    doc = {"inputs": [tensor], "parameters": draw(JSON_VALUES), "outputs": draw(JSON_VALUES)}
    text = json.dumps(doc).encode()
    return text + draw(st.binary(max_size=64))


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=requests(), header=st.none() | st.integers(-1, 400))
def test_any_request_body_decodes_or_is_a_400(raw: bytes, header: int | None) -> None:
    try:
        request = decode_request(raw, header)
    except InvalidRequest as exc:
        assert exc.message and exc.status == 400
        return
    for array in request.inputs.values():
        assert isinstance(array, np.ndarray)


def wav_header(frames: int, rate: int, width: int = 1, channels: int = 1) -> bytes:
    """A PCM WAV file's header that promises ``frames`` frames (the data itself follows)."""
    size = frames * width * channels
    fmt = struct.pack(
        "<HHIIHH", 1, channels, rate, rate * width * channels, width * channels, 8 * width
    )
    return (
        b"RIFF"
        + struct.pack("<I", 36 + size)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + (b"data" + struct.pack("<I", size))
    )


def test_audio_is_bounded_in_samples_before_it_is_decoded() -> None:
    """38 MiB of 8-bit 192 kHz audio (198 s, under 600 s) took +1.04 GB to decode, before."""
    frames = 38 << 20
    data = wav_header(frames, 192_000) + bytes(frames)
    tracemalloc.start()
    with pytest.raises(PayloadTooLarge, match="at most 9600000 per request"):
        decode_wav(data, 600 * 16000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated to refuse it"


def test_resampling_costs_a_few_times_the_audio_not_float64_of_every_input_sample() -> None:
    pcm = np.zeros(192_000 * 50, dtype=np.float32)  # 50 s at 192 kHz: the most edged takes
    tracemalloc.start()
    out, rate = to_model_rate(pcm, 192_000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert rate == 16000 and len(out) == 16000 * 50
    assert peak < 2.5 * pcm.nbytes, f"{peak / pcm.nbytes:.1f} times the audio"


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    for mode in (0o644, 0o604, 0o620):
        token.chmod(mode)
        with pytest.raises(ConfigError, match="chmod 0600"):
            read_token(token)
    for mode in (0o600, 0o640, 0o400):
        token.chmod(mode)
        assert read_token(token) == "secret"


@pytest.mark.parametrize(
    ("section", "doc"),
    [
        (CloudConfig, {"url": "http://gw.example.com", "token_file": "/t"}),
        (CloudConfig, {"url": "grpc://10.0.0.1:8001", "token_file": "/t"}),
        (KnowledgeConfig, {"uri": "http://milvus:19530", "token_file": "/t"}),
        (
            KnowledgeConfig,
            {"answer_url": "http://llm/v1", "answer_model": "m", "answer_token_file": "/t"},
        ),
    ],
)
def test_a_token_never_travels_in_clear(section: type[Any], doc: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="would travel in clear"):
        section.model_validate(doc)
    here = {
        "gw.example.com": "127.0.0.1",
        "10.0.0.1": "localhost",
        "milvus": "127.0.0.1",
        "llm": "[::1]",
    }
    loopback = {}
    for key, value in doc.items():
        for host, local in here.items():
            value = value.replace(host, local)
        loopback[key] = value
    section.model_validate(loopback)  # plain to this machine is fine
    tls = {
        k: v.replace("http://", "https://").replace("grpc://", "grpcs://") for k, v in doc.items()
    }
    section.model_validate(tls)


@pytest.mark.parametrize("name", ["model\x00.onnx", "\ud800.onnx", "a/../b", "/etc/passwd", ""])
def test_an_install_file_name_edged_cannot_open_is_a_400(tmp_path: Path, name: str) -> None:
    """A name with a NUL byte or a lone surrogate, or outside the version: a 400, not a 500."""
    files = [{"path": name, "length": 1, "sha256": "0" * 64}]
    with pytest.raises(InvalidRequest):
        check_files(tmp_path, files)
