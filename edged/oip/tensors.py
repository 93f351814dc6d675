"""Tensors of the Open Inference Protocol: datatypes, JSON data and the binary tensor extension.

Everything here is pure: bytes and dicts in, numpy arrays out (and back). Errors are
``InvalidRequest`` with a message that names the tensor and what was wrong with it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from edged.common.errors import InvalidRequest
from edged.oip.shm import Bound, Use, use_of

# OIP datatype name -> numpy dtype. BYTES tensors are numpy object arrays of ``bytes``.
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_DIMS = 32
MAX_DIM = 2**31 - 1
# Limits checked before any array is built (docs/API.md, "Limits"): the elements of one tensor
# (zero dimensions counted as one, so [0, 2**31-1, 2**31-1] is refused too), and the strings of
# one BYTES tensor (each is a Python object: 15 MiB of empty strings would be 3.9 million).
MAX_ELEMENTS = 2**31 - 1
MAX_BYTES_ELEMENTS = 65536
MAX_COUNT_DIGITS = 18  # a count in a header or a path: 10**18 is far past any real one


NOT_JSON = re.compile(rb"-?Infinity|NaN")


def parse_json(body: bytes) -> Any:
    """A JSON body, or InvalidRequest: not JSON, not UTF-8, nested too deeply (past 1,024),
    NaN or Infinity (not JSON, though Python writes them), a number past a double's range.

    orjson, not the standard library: the event loop stalls while any thread holds the GIL,
    which a decoder does for the whole document (15 MiB of numbers: 972 ms with ``json``,
    268 ms with orjson). An integer past 64 bits is read as a double (the tensor's range check
    then refuses it where it must be an integer)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        found = NOT_JSON.match(body, max(0, exc.pos - 1)) or NOT_JSON.match(body, exc.pos)
        if found:
            name = found.group().decode()
            raise InvalidRequest(
                f"request body holds {name}: JSON has no NaN or Infinity (RFC 8259)"
            ) from None
        if exc.msg.startswith("depth limit"):
            raise InvalidRequest("request body is JSON nested too deeply") from None
        # JSON, but a number past a double or a lone surrogate, which orjson refuses: a small
        # document is read as the standard library reads it, so that the tensor that holds it
        # is named (out of range, not valid Unicode)
        if exc.msg.startswith(LENIENT) and len(body) <= LENIENT_BYTES:
            return _parse_stdlib(body)
        if exc.msg.startswith("number is infinity"):
            raise InvalidRequest(f"request body holds a number edged cannot read: {exc}") from None
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


LENIENT = (
    "number is infinity",
    "no low surrogate",
    "invalid high surrogate",
    "invalid low surrogate",
)
LENIENT_BYTES = 1 << 20


def _no_constant(name: str) -> Any:
    raise InvalidRequest(f"request body holds {name}: JSON has no NaN or Infinity (RFC 8259)")


def _parse_stdlib(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is JSON nested too deeply") from None
    except ValueError as exc:  # Python's own limit on the digits of an integer
        raise InvalidRequest(f"request body holds a number edged cannot read: {exc}") from None


def dump_json(doc: Any) -> str:
    """Strict JSON out (RFC 8259): NaN and infinities, which JSON has no words for, as null
    (JavaScript's JSON.stringify does the same; numpy reads null back as NaN)."""
    try:
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)
    except ValueError:  # rare: walk the document once more, replacing what JSON cannot carry
        return json.dumps(_finite(doc), separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def is_count(text: str) -> bool:
    """True for a plain decimal number of ASCII digits ("12"; not "²", "-1", "" or 5,000
    digits)."""
    return text.isascii() and text.isdigit() and len(text) <= MAX_COUNT_DIGITS


def encode_utf8(name: str, text: str) -> bytes:
    """A string as UTF-8, or InvalidRequest (lone surrogates cannot be encoded)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{name}' holds a string that is not valid Unicode") from None


def bytes_tensor(items: list[bytes]) -> np.ndarray:
    """A 1-D BYTES tensor (numpy object array) of ``items``."""
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def text_tensor(name: str, texts: list[str]) -> np.ndarray:
    """Strings as a 1-D BYTES tensor of UTF-8; ``name`` says which input is bad, if one is."""
    return bytes_tensor([encode_utf8(name, t) for t in texts])


def datatype_of(array: np.ndarray) -> str:
    """The OIP datatype name of a numpy array."""
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    for name, dtype in DATATYPES.items():
        if dtype == array.dtype:
            return name
    raise InvalidRequest(f"numpy dtype {array.dtype} has no Open Inference Protocol datatype")


@dataclass
class RequestedOutput:
    """An output the client asked for, and whether it wants it as binary data."""

    name: str
    binary: bool | None = None
    classification: int = 0
    shm: Use | None = None  # written into a shared-memory region instead of the answer


@dataclass
class InferRequest:
    """A decoded inference request."""

    inputs: dict[str, np.ndarray]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: list[RequestedOutput] = field(default_factory=list)
    binary_output: bool = False
    # A shared-memory region it names was refused (the first such refusal): the call of its
    # model fails with this where its model's calls are counted, not in the decoder, so that the
    # refusal counts as that model's failure (the input it would have read is missing).
    refused: InvalidRequest | None = None


@dataclass
class InferResponse:
    """An inference result before encoding."""

    model_name: str
    model_version: str
    outputs: dict[str, np.ndarray]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


def confidence(array: np.ndarray) -> float:
    """A classifier's confidence in its answer: the least sure row's best score (1 for an
    empty output)."""
    values = np.asarray(array, dtype=np.float64)
    if values.ndim == 0 or values.size == 0:
        return 1.0
    best = values.max(axis=-1) if values.ndim > 1 else values
    return float(best.min())


def payload_bytes(tensors: Mapping[str, np.ndarray]) -> int:
    """The bytes of a request's tensors (BYTES elements: their lengths)."""
    total = 0
    for array in tensors.values():
        if array.dtype == object:
            total += sum(len(v) for v in array.ravel() if isinstance(v, (bytes, str)))
        else:
            total += array.nbytes
    return total


def element_count(shape: Iterable[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def check_shape(name: str, raw: Any, datatype: str = "") -> list[int]:
    """A tensor's shape: a list of at most MAX_DIMS integers from 0 to MAX_DIM, of at most
    MAX_ELEMENTS elements (MAX_BYTES_ELEMENTS for BYTES), zero dimensions counted as one."""
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_DIMS
        or not all(type(d) is int and 0 <= d <= MAX_DIM for d in raw)
    ):
        raise InvalidRequest(
            f"tensor '{name}': 'shape' must be a list of at most {MAX_DIMS} integers"
            f" from 0 to {MAX_DIM}"
        )
    limit = MAX_BYTES_ELEMENTS if datatype == "BYTES" else MAX_ELEMENTS
    if element_count(max(d, 1) for d in raw) > limit:
        what = "BYTES elements" if datatype == "BYTES" else "elements"
        raise InvalidRequest(f"tensor '{name}': shape {raw} is over the limit of {limit} {what}")
    return list(raw)


def _flatten(data: Any) -> list[Any]:
    """JSON ``data`` (flat, nested or one scalar) as a flat list, without recursion."""
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def from_json(
    name: str, datatype: str, shape: list[int], data: Any, finite: bool = True
) -> np.ndarray:
    """The JSON ``data`` of one tensor as an array, one rule per datatype (Triton's): BOOL
    takes true/false; integer types take integers in their range (not true, not 1.0); float
    types take numbers (not true), finite (JSON has no NaN or Infinity; ``finite=False`` for
    gRPC's typed contents, which do) and in range (3.5e38 is not an FP32); BYTES takes strings.
    The element count must match the shape."""
    dtype = DATATYPES[datatype]
    flat = _flatten(data)
    count = element_count(shape)
    if len(flat) != count:
        raise InvalidRequest(
            f"tensor '{name}': shape {shape} needs {count} elements, 'data' has {len(flat)}"
        )
    if datatype == "BYTES":
        if not all(type(v) is str for v in flat):
            raise InvalidRequest(f"tensor '{name}': BYTES data must be strings")
        out = np.empty(count, dtype=object)
        out[:] = [encode_utf8(name, s) for s in flat]
        return out.reshape(shape)
    if datatype == "BOOL":
        if not all(type(v) is bool for v in flat):
            raise InvalidRequest(f"tensor '{name}': BOOL data must be true or false")
        return np.array(flat, dtype=dtype).reshape(shape)
    if dtype.kind in "iu":
        if not all(type(v) is int for v in flat):
            raise InvalidRequest(
                f"tensor '{name}': {datatype} data must be integers (not true/false or 1.0)"
            )
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise InvalidRequest(f"tensor '{name}': a value is out of range for {datatype}")
        return np.array(flat, dtype=dtype).reshape(shape)
    if not all(type(v) is float or type(v) is int for v in flat):
        raise InvalidRequest(f"tensor '{name}': {datatype} data must be numbers")
    try:
        values = np.array(flat, dtype=np.float64)
    except OverflowError:  # an integer past float64
        raise InvalidRequest(f"tensor '{name}': a value is out of range for {datatype}") from None
    good = np.isfinite(values)
    if finite and not good.all():
        raise InvalidRequest(
            f"tensor '{name}': {datatype} data must be finite numbers (JSON has no NaN or"
            " Infinity; send such values as binary data)"
        )
    if (
        dtype != np.float64
        and values.size
        and np.abs(values[good]).max(initial=0.0) > float(np.finfo(dtype).max)
    ):
        raise InvalidRequest(f"tensor '{name}': a value is out of range for {datatype}")
    return values.astype(dtype).reshape(shape)


def from_binary(
    name: str, datatype: str, shape: list[int], chunk: bytes | memoryview, copy: bool = True
) -> np.ndarray:
    """One tensor of the binary tensor extension as an array, checking its size (``copy``
    False: a view of ``chunk`` where the byte order allows, for a buffer of edged's own)."""
    count = element_count(shape)
    if datatype == "BYTES":
        if count > MAX_BYTES_ELEMENTS or 4 * count > len(chunk):  # before parsing any
            raise InvalidRequest(
                f"tensor '{name}': shape {shape} needs {count} BYTES elements; the binary data"
                f" ({len(chunk)} bytes) holds at most {len(chunk) // 4}, edged takes at most"
                f" {MAX_BYTES_ELEMENTS}"
            )
        items: list[bytes] = []
        offset = 0
        while offset < len(chunk) and len(items) <= count:
            if offset + 4 > len(chunk):
                raise InvalidRequest(f"tensor '{name}': binary BYTES element header is truncated")
            (length,) = struct.unpack_from("<I", chunk, offset)
            offset += 4
            if offset + length > len(chunk):
                raise InvalidRequest(f"tensor '{name}': binary BYTES element is truncated")
            items.append(bytes(chunk[offset : offset + length]))
            offset += length
        if len(items) != count:
            raise InvalidRequest(
                f"tensor '{name}': shape {shape} needs {count} elements,"
                f" binary data has {len(items)}"
            )
        out = np.empty(count, dtype=object)
        out[:] = items
        return out.reshape(shape)
    dtype = DATATYPES[datatype]
    expected = count * dtype.itemsize
    if len(chunk) != expected:
        raise InvalidRequest(
            f"tensor '{name}': shape {shape} of {datatype} needs {expected} bytes,"
            f" binary_data_size gives {len(chunk)}"
        )
    array = np.frombuffer(chunk, dtype=dtype.newbyteorder("<"))
    return array.astype(dtype, copy=copy).reshape(shape)


def from_region(
    name: str, datatype: str, shape: list[int], use: Use, shm: Bound | None
) -> np.ndarray:
    """An input that a shared-memory region holds (read once, into an array of its own)."""
    if shm is None:
        raise InvalidRequest(f"input '{name}': shared memory is for callers on edged's sockets")
    if datatype != "BYTES":  # its size is known: checked before anything is read
        expected = element_count(shape) * DATATYPES[datatype].itemsize
        if use.byte_size != expected:
            raise InvalidRequest(
                f"tensor '{name}': shape {shape} of {datatype} needs {expected} bytes,"
                f" shared_memory_byte_size gives {use.byte_size}"
            )
    return from_binary(name, datatype, shape, shm.read(use), copy=False)


def check_output_region(name: str, use: Use, shm: Bound | None) -> None:
    """Refuse an output's region before its model runs (not after, with the work done): one
    this caller has not registered, that ``use`` does not fit in, or that edged cannot write."""
    if shm is None:
        raise InvalidRequest(f"output '{name}': shared memory is for local callers")
    shm.check(use)


def place(
    response: InferResponse, requested: Iterable[RequestedOutput], shm: Bound | None
) -> dict[str, dict[str, Any]]:
    """The outputs asked for in shared memory, written there; their answer's parameters."""
    placed: dict[str, dict[str, Any]] = {}
    for wanted in requested:
        if wanted.shm is None or wanted.name not in response.outputs:
            continue
        if shm is None:
            raise InvalidRequest(f"output '{wanted.name}': shared memory is for local callers")
        data = to_binary(response.outputs[wanted.name])
        shm.write(wanted.shm, data)
        placed[wanted.name] = {
            "shared_memory_region": wanted.shm.region,
            "shared_memory_byte_size": len(data),
        }
    return placed


def decode_request(
    body: bytes, header_length: int | None = None, shm: Bound | None = None
) -> InferRequest:
    """Decode a REST inference request body (JSON, or JSON followed by binary tensor data;
    inputs in shared memory read through ``shm``)."""
    view = memoryview(body)  # the binary data is sliced, never copied, until arrays are built
    if header_length is None:
        header, binary = body, view[len(body) :]
    else:
        if header_length < 0 or header_length > len(body):
            raise InvalidRequest(
                f"{HEADER_LENGTH} is {header_length} but the body has only {len(body)} bytes"
            )
        header, binary = bytes(view[:header_length]), view[header_length:]
    return decode_document(parse_json(header), binary, shm)


def decode_document(doc: Any, binary: memoryview, shm: Bound | None = None) -> InferRequest:
    """``decode_request`` of a parsed JSON document and the binary data after it."""
    if not isinstance(doc, dict):
        raise InvalidRequest("request body must be a JSON object with an 'inputs' list")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidRequest("request needs a non-empty 'inputs' list")
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidRequest("request 'parameters' must be an object")

    inputs: dict[str, np.ndarray] = {}
    refused: InvalidRequest | None = None  # a region refused: InferRequest.refused
    offset = 0
    for raw in raw_inputs:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidRequest("each input must be an object with a 'name'")
        name = raw["name"]
        if name in inputs:
            raise InvalidRequest(f"tensor '{name}' is given twice")
        datatype = raw.get("datatype")
        if datatype not in DATATYPES:
            raise InvalidRequest(
                f"tensor '{name}': datatype {datatype!r} is not one of {', '.join(DATATYPES)}"
            )
        shape = check_shape(name, raw.get("shape"), datatype)
        params = raw.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidRequest(f"input '{name}': 'parameters' must be an object")
        size = params.get("binary_data_size")
        use = use_of(f"input '{name}'", params)
        if use is not None:
            try:
                inputs[name] = from_region(name, datatype, shape, use, shm)
            except InvalidRequest as exc:
                refused = refused or exc
        elif size is not None:
            if type(size) is not int or size < 0:
                raise InvalidRequest(f"tensor '{name}': binary_data_size must be an integer >= 0")
            if offset + size > len(binary):
                raise InvalidRequest(
                    f"tensor '{name}': binary data is truncated: needs {size} bytes at offset"
                    f" {offset}, the body has {len(binary) - offset} left"
                )
            inputs[name] = from_binary(name, datatype, shape, binary[offset : offset + size])
            offset += size
        elif "data" in raw:
            inputs[name] = from_json(name, datatype, shape, raw["data"])
        else:
            raise InvalidRequest(f"tensor '{name}' has neither 'data' nor binary_data_size")
    if offset != len(binary):
        raise InvalidRequest(
            f"the body has {len(binary) - offset} bytes of binary data that no input claims"
        )

    outputs: list[RequestedOutput] = []
    raw_outputs = doc.get("outputs") or []
    if not isinstance(raw_outputs, list):
        raise InvalidRequest("request 'outputs' must be a list")
    for raw in raw_outputs:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidRequest("each requested output must be an object with a 'name'")
        if any(o.name == raw["name"] for o in outputs):
            raise InvalidRequest(f"output '{raw['name']}' is requested twice")
        params = raw.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidRequest(f"output '{raw['name']}': 'parameters' must be an object")
        binary_flag = params.get("binary_data")
        classification = params.get("classification", 0)
        if type(classification) is not int or classification < 0:
            raise InvalidRequest(f"output '{raw['name']}': classification must be an integer >= 0")
        use = use_of(f"output '{raw['name']}'", params)
        if use is not None and refused is None:
            try:
                check_output_region(raw["name"], use, shm)
            except InvalidRequest as exc:
                refused = exc
        outputs.append(
            RequestedOutput(
                raw["name"], None if binary_flag is None else bool(binary_flag), classification, use
            )
        )
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest("request 'id' must be a string")
    return InferRequest(
        inputs=inputs,
        id=request_id,
        parameters=parameters,
        outputs=outputs,
        binary_output=bool(parameters.get("binary_data_output", False)),
        refused=refused,
    )


def to_json(array: np.ndarray) -> list[Any]:
    """A tensor as the flat JSON ``data`` list (BYTES as UTF-8 strings; NaN and infinities,
    which JSON cannot carry, as null, as JavaScript's JSON.stringify writes them: numpy reads
    null back as NaN; binary data carries them exactly)."""
    flat = array.reshape(-1)
    if flat.dtype == object or flat.dtype.kind in "SU":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    if flat.dtype.kind == "f" and not np.isfinite(flat).all():
        good = np.isfinite(flat)
        return [v if ok else None for v, ok in zip(flat.tolist(), good.tolist())]
    return list(flat.tolist())


def to_binary(array: np.ndarray) -> bytes:
    """A tensor as binary tensor data (BYTES: 4-byte little-endian length + bytes each)."""
    if array.dtype == object or array.dtype.kind in "SU":
        parts = []
        for v in array.reshape(-1):
            b = v if isinstance(v, bytes) else str(v).encode("utf-8")
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def encode_tensors(
    arrays: Mapping[str, np.ndarray],
    binary: Mapping[str, bool],
    placed: Mapping[str, dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Tensor entries for a request or response body, and the binary chunks that follow it
    (for the names that ``binary`` marks), in order; those ``placed`` in shared memory carry
    its parameters instead of data."""
    entries = []
    chunks: list[bytes] = []
    for name, array in arrays.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(array),
            "shape": list(array.shape),
        }
        if placed and name in placed:
            entry["parameters"] = placed[name]
        elif binary.get(name):
            chunk = to_binary(array)
            entry["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            entry["data"] = to_json(array)
        entries.append(entry)
    return entries, chunks


def response_document(
    response: InferResponse,
    binary: Mapping[str, bool] | None = None,
    placed: Mapping[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], list[bytes]]:
    """A response as its JSON document, and the binary data of the outputs sent that way."""
    outputs, chunks = encode_tensors(response.outputs, binary or {}, placed)
    doc: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outputs,
    }
    if response.id is not None:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    return doc, chunks


def encode_response(
    response: InferResponse,
    binary: Mapping[str, bool] | None = None,
    placed: Mapping[str, dict[str, Any]] | None = None,
) -> tuple[bytes, int | None]:
    """Encode a response; returns the body and the JSON header length when binary data follows."""
    doc, chunks = response_document(response, binary, placed)
    header = dump_json(doc).encode("utf-8")
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def classify(scores: np.ndarray, k: int, labels: list[str] | None) -> np.ndarray:
    """Triton's classification extension: the top ``k`` of each row as "score:index[:label]"."""
    if scores.dtype == object or scores.dtype.kind not in "iuf" or scores.size == 0:
        raise InvalidRequest("classification needs a numeric output with at least one class")
    batched = scores.reshape(scores.shape[0], -1) if scores.ndim > 1 else scores.reshape(1, -1)
    rows = []
    for row in batched:
        # highest first, ties by index; as floats: an unsigned row negated would wrap around
        top = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        rows.append(
            [
                f"{row[i]:f}:{i}" + (f":{labels[i]}" if labels and i < len(labels) else "")
                for i in top
            ]
        )
    out = np.empty((len(rows), len(rows[0]) if rows else 0), dtype=object)
    for r, row_items in enumerate(rows):
        out[r, :] = [s.encode() for s in row_items]
    return out if scores.ndim > 1 else out[0]
