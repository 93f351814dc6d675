"""A small synchronous client for edged's Unix socket (standard library only).

from edged.client import Client
client = Client("/run/edged/edged.sock")
client.embed(["hello", "hi there"])
"""

from __future__ import annotations

import contextlib
import http.client
import json
import mmap
import os
import socket
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from edged.common.digits import whole
from edged.oip.tensors import HEADER_LENGTH, encode_tensors, from_binary, from_json

DEFAULT_SOCKET = "/run/edged/edged.sock"


def default_socket() -> str:
    """$EDGED_SOCKET, else the packaged default."""
    return os.environ.get("EDGED_SOCKET", DEFAULT_SOCKET)


class ClientError(Exception):
    """The daemon answered with an error status (``status``) or could not be reached (0).

    ``retry_after`` (seconds) comes with 429 and 503: when trying again makes sense."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        """Connect to the Unix socket instead of TCP."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


class SharedRegion:
    """A sealed shared-memory region edged made for this process (``Client.shared_region``):
    write tensors into ``array(...)`` and name the region in an input instead of sending data
    (``input(...)``, or tritonclient's ``set_shared_memory(region.name, size)``); edged reads
    them in place, with no copy. ``infer`` calls a model over the region socket itself (no
    HTTP: the cheapest call). Do not write a part of it while a call that reads that part
    runs. ``close()`` unregisters and unmaps it; it also goes when this process exits."""

    def __init__(
        self, client: Client, name: str, byte_size: int, fd: int, sock: socket.socket, path: str
    ) -> None:
        self.client, self.name, self.byte_size = client, name, byte_size
        self.sock, self.path = sock, path
        try:
            self.buffer = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)

    def array(self, shape: Iterable[int], dtype: Any = np.uint8, offset: int = 0) -> np.ndarray:
        """A numpy view of the region from ``offset``: what is written there, edged reads."""
        shape = tuple(shape)
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self.buffer, dtype, count, offset).reshape(shape)

    def input(
        self, name: str, datatype: str, shape: Iterable[int], byte_size: int, offset: int = 0
    ) -> dict[str, Any]:
        """An OIP input (for ``infer`` or ``Client.infer_json``) read from this region."""
        return {
            "name": name,
            "datatype": datatype,
            "shape": list(shape),
            **self._at(byte_size, offset),
        }

    def output(self, name: str, byte_size: int, offset: int = 0) -> dict[str, Any]:
        """A requested output written into this region."""
        return {"name": name, **self._at(byte_size, offset)}

    def _at(self, byte_size: int, offset: int) -> dict[str, Any]:
        return {
            "parameters": {
                "shared_memory_region": self.name,
                "shared_memory_byte_size": byte_size,
                "shared_memory_offset": offset,
            }
        }

    def infer(
        self, model: str, doc: Mapping[str, Any], version: str | None = None
    ) -> dict[str, Any]:
        """An OIP request document (inputs from regions, or small ones as JSON data: the
        message is at most 64 KiB) for ``model``, sent over the region socket; the OIP answer.
        ClientError with edged's status and reason if refused."""
        message = {**doc, "model": model, **({"model_version": version} if version else {})}
        data = json.dumps(message).encode()
        try:
            try:
                self.sock.send(data)
            except (BrokenPipeError, ConnectionResetError):  # closed while idle: not sent
                self.sock.close()
                self.sock = region_connection(self.path, self.client.timeout)
                self.sock.send(data)
            reply: dict[str, Any] = json.loads(self.sock.recv(1 << 17))
        except OSError as exc:
            raise ClientError(0, f"the region socket: {exc}") from None
        if "error" in reply:
            raise ClientError(int(reply.get("status", 0)), str(reply["error"]))
        return reply

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(ClientError):
            self.client.call("POST", f"/v2/systemsharedmemory/region/{self.name}/unregister")
        with contextlib.suppress(BufferError):  # a view still held: unmapped when it goes
            self.buffer.close()

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def region_connection(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def region_socket(rest_socket: str) -> str:
    """The region socket beside a REST socket (edged's default: <name>-shm.sock)."""
    head, _, tail = rest_socket.rpartition("/")
    stem, dot, suffix = tail.rpartition(".")
    stem, suffix = (stem, suffix) if dot else (tail, "sock")
    return f"{head}/{stem}-shm.{suffix}" if head else f"{stem}-shm.{suffix}"


class Client:
    """Calls edged over its Unix socket; one connection per call."""

    def __init__(self, socket_path: str | None = None, timeout: float = 120.0) -> None:
        self.socket_path = socket_path or default_socket()
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """One HTTP exchange: (status, headers, body). Raises ClientError(0, …) if unreachable."""
        with self._exchange(method, path, body, headers) as response:
            return response.status, dict(response.getheaders()), response.read()

    @contextlib.contextmanager
    def _exchange(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Iterator[http.client.HTTPResponse]:
        """The response of one request, to read while the connection is open; socket errors,
        here or while reading, are ClientError(0, …)."""
        conn = UnixHTTPConnection(self.socket_path, self.timeout)
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            yield conn.getresponse()
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ClientError(
                0, f"cannot reach edged at {self.socket_path}: {exc.strerror}; is it running?"
            ) from None
        except PermissionError:
            raise ClientError(
                0, f"no permission to use {self.socket_path}; join the socket's group (edged)"
            ) from None
        except OSError as exc:
            raise ClientError(0, f"talking to edged at {self.socket_path} failed: {exc}") from None
        finally:
            conn.close()

    def call(self, method: str, path: str, doc: Any = None, raw: bytes | None = None) -> Any:
        """A JSON call: raises ClientError with the daemon's message on an error status."""
        headers = {}
        body = raw
        if doc is not None:
            body = json.dumps(doc).encode()
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            headers["Content-Type"] = "application/octet-stream"
        status, reply_headers, payload = self.request(method, path, body, headers)
        _raise_for_status(status, payload, reply_headers)
        return json.loads(payload) if payload else None

    # ---- Open Inference Protocol -----------------------------------------------------------

    def live(self) -> bool:
        """GET /v2/health/live."""
        return self.request("GET", "/v2/health/live")[0] == 200

    def ready(self) -> bool:
        """GET /v2/health/ready."""
        return self.request("GET", "/v2/health/ready")[0] == 200

    def server_metadata(self) -> dict[str, Any]:
        """GET /v2."""
        return dict(self.call("GET", "/v2"))

    def status(self) -> dict[str, Any]:
        """GET /v1/status: readiness, in-flight requests, every model's state."""
        return dict(self.call("GET", "/v1/status"))

    def events(self, after: int = 0, limit: int = 1000) -> dict[str, Any]:
        """GET /v1/events: the daemon's events after id ``after`` (``epoch``, ``events``,
        ``last``, ``missed``)."""
        return dict(self.call("GET", f"/v1/events?after={after}&limit={limit}"))

    def capabilities(self) -> list[dict[str, Any]]:
        """Task types, the models that serve each, and on which tier (local, cloud)."""
        return list(self.call("GET", "/v1/capabilities"))

    def metrics(self) -> str:
        """GET /metrics: Prometheus' text format."""
        status, headers, payload = self.request("GET", "/metrics")
        _raise_for_status(status, payload, headers)
        return payload.decode()

    # ---- operator controls (/v1/admin) -----------------------------------------------------

    def routing(self) -> dict[str, Any]:
        """The routing settings in force and the operator's overrides."""
        return dict(self.call("GET", "/v1/admin/routing"))

    def set_routing(self, patch: dict[str, Any]) -> dict[str, Any]:
        """Override [routing] settings (a merge patch: None removes an override)."""
        return dict(self.call("PATCH", "/v1/admin/routing", patch))

    def reset_routing(self) -> dict[str, Any]:
        """Remove every override: the config file's settings again."""
        return dict(self.call("DELETE", "/v1/admin/routing"))

    def reload(self) -> dict[str, Any]:
        """Re-read the config and poll the repository (as SIGHUP), answered when done."""
        return dict(self.call("POST", "/v1/admin/reload"))

    def drain(self, reason: str = "", timeout_s: float = 30.0) -> dict[str, Any]:
        """No new local work; waits up to ``timeout_s`` for the local work in flight."""
        doc = {"reason": reason, "timeout_s": timeout_s}
        return dict(self.call("POST", "/v1/admin/drain", doc))

    def resume(self) -> dict[str, Any]:
        """The local tier takes work again."""
        return dict(self.call("POST", "/v1/admin/resume"))

    def egress(self, **filters: Any) -> dict[str, Any]:
        """The egress ledger's entries (GET /v1/admin/egress: after, limit, request_id, model,
        uid, kind, since_ms, until_ms; None values left out)."""
        query = urllib.parse.urlencode({k: v for k, v in filters.items() if v is not None})
        return dict(self.call("GET", f"/v1/admin/egress?{query}"))

    def verify_egress(self, checkpoints: Iterable[str] = ()) -> dict[str, Any]:
        """The egress ledger's chain walked, with the fleet's checkpoints (``SEQ:SHA256``)."""
        query = urllib.parse.urlencode([("checkpoint", c) for c in checkpoints])
        return dict(self.call("GET", f"/v1/admin/egress/verify?{query}"))

    def model_versions(self, model: str) -> dict[str, Any]:
        """The active version of a model, those activated before, those on disk."""
        return dict(self.call("GET", f"/v1/admin/models/{model}"))

    def install(
        self,
        model: str,
        version: int,
        source: str,
        files: list[dict[str, Any]],
        smoke: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Install a staged version directory: checked, moved in, smoke-tested, then active."""
        doc = {"version": version, "source": source, "files": files, "smoke": smoke or []}
        return dict(self.call("POST", f"/v1/admin/models/{model}/install", doc))

    def remove_model(self, model: str) -> dict[str, Any]:
        """Remove a model: it stops serving and its directory goes (409 while a pipeline calls
        it)."""
        return dict(self.call("DELETE", f"/v1/admin/models/{model}"))

    def activate(self, model: str, version: int | None = None) -> dict[str, Any]:
        """Make a version on disk the active one (None: the one before: a rollback)."""
        doc = {} if version is None else {"version": version}
        return dict(self.call("POST", f"/v1/admin/models/{model}/activate", doc))

    def set_ab(self, model: str, b_cloud_name: str | None, b_share: float) -> dict[str, Any]:
        """Cloud A/B: ``b_share`` of the model's cloud calls to ``b_cloud_name`` (0: none)."""
        doc = {"b_cloud_name": b_cloud_name, "b_share": b_share}
        return dict(self.call("PUT", f"/v1/admin/cloud/{model}/ab", doc))

    def score_ab(
        self, model: str, scores: dict[str, float], tier: str | None = None
    ) -> dict[str, Any]:
        """An operator's scores (request id: 0 to 1) of answers an A/B test waits for."""
        doc: dict[str, Any] = {"scores": [{"request_id": k, "score": v} for k, v in scores.items()]}
        if tier is not None:
            doc["tier"] = tier
        return dict(self.call("POST", f"/v1/admin/cloud/{model}/ab/scores", doc))

    # ---- knowledge base --------------------------------------------------------------------

    def kb_ingest(self, namespace: str, documents: list[dict[str, Any]]) -> dict[str, Any]:
        """Chunk, embed and store ``[{text, source, metadata}]`` in ``namespace``."""
        return dict(self.call("POST", f"/v1/kb/{namespace}/ingest", {"documents": documents}))

    def kb_search(
        self, namespace: str, query: str, k: int = 5, where: str = ""
    ) -> list[dict[str, Any]]:
        """The ``k`` chunks nearest in meaning to ``query``: score, text, source, metadata."""
        body = {"query": query, "k": k, "filter": where}
        return list(self.call("POST", f"/v1/kb/{namespace}/search", body)["hits"])

    def kb_ask(
        self, namespace: str, question: str, threshold: float | None = None, private: bool = False
    ) -> dict[str, Any]:
        """The answer to ``question``: from the best passage on the device when it is close
        enough, else from the answer model with the top passages (never a private one)."""
        body: dict[str, Any] = {"question": question}
        if threshold is not None:
            body["threshold"] = threshold
        query = "?private=true" if private else ""
        return dict(self.call("POST", f"/v1/kb/{namespace}/ask{query}", body))

    def kb_stats(self, namespace: str | None = None) -> dict[str, Any]:
        """A namespace's figures, or the list of namespaces."""
        return dict(self.call("GET", f"/v1/kb/{namespace}/stats" if namespace else "/v1/kb"))

    def kb_delete(
        self, namespace: str, ids: list[str] | None = None, source: str | None = None
    ) -> int:
        body = {"ids": ids} if ids else {"source": source}
        return int(self.call("POST", f"/v1/kb/{namespace}/delete", body)["deleted"])

    def model_metadata(self, model: str, version: str | None = None) -> dict[str, Any]:
        """GET /v2/models/{m}[/versions/{v}]."""
        return dict(self.call("GET", _model_path(model, version)))

    def model_config(self, model: str) -> dict[str, Any]:
        """GET /v2/models/{m}/config."""
        return dict(self.call("GET", f"/v2/models/{model}/config"))

    def repository_index(self) -> list[dict[str, Any]]:
        """POST /v2/repository/index."""
        return list(self.call("POST", "/v2/repository/index", {}))

    def load(self, model: str) -> None:
        """POST /v2/repository/models/{m}/load."""
        self.call("POST", f"/v2/repository/models/{model}/load", {})

    def unload(self, model: str) -> None:
        """POST /v2/repository/models/{m}/unload."""
        self.call("POST", f"/v2/repository/models/{model}/unload", {})

    def shared_region(
        self, name: str, byte_size: int, socket_path: str | None = None
    ) -> SharedRegion:
        """A sealed memfd of ``byte_size`` bytes that edged makes, registers as this uid's
        region ``name`` and reads with no copy (the region socket, ``socket_path``: by default
        beside this client's socket). ClientError with edged's status and reason if refused."""
        path = socket_path or region_socket(self.socket_path)
        try:
            sock = region_connection(path, self.timeout)
        except OSError as exc:
            raise ClientError(0, f"the region socket {path}: {exc}") from None
        try:
            sock.send(json.dumps({"name": name, "byte_size": byte_size}).encode())
            message, fds, _, _ = socket.recv_fds(sock, 65536, 1)
            reply: dict[str, Any] = json.loads(message) if message else {"error": "no answer"}
            if not fds:
                raise ClientError(int(reply.get("status", 0)), str(reply.get("error")))
        except OSError as exc:
            sock.close()
            raise ClientError(0, f"the region socket {path}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        return SharedRegion(self, name, byte_size, fds[0], sock, path)

    def infer_json(self, model: str, doc: Any, version: str | None = None) -> dict[str, Any]:
        """Send an OIP request document as it is; the JSON response."""
        return dict(self.call("POST", _model_path(model, version) + "/infer", doc))

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        version: str | None = None,
        binary: bool = True,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """Run a model on numpy inputs; tensors travel as binary data unless ``binary=False``."""
        return self.infer_answer(model, inputs, version, binary, parameters)[0]

    def infer_answer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        version: str | None = None,
        binary: bool = True,
        parameters: Mapping[str, Any] | None = None,
        request_id: str | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Like ``infer``, with the answer's parameters: ``route``, ``reason``, ``predicted_ms``,
        ``actual_ms`` (and ``route_trace`` when ``parameters`` has ``explain: true``)."""
        entries, chunks = encode_tensors(inputs, dict.fromkeys(inputs, binary))
        doc: dict[str, Any] = {"inputs": entries, "parameters": dict(parameters or {})}
        if request_id is not None:
            doc["id"] = request_id
        if binary:
            doc["parameters"]["binary_data_output"] = True
        header = json.dumps(doc).encode()
        headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
        if binary:
            headers[HEADER_LENGTH] = str(len(header))
        status, reply_headers, payload = self.request(
            "POST", _model_path(model, version) + "/infer", header + b"".join(chunks), headers
        )
        _raise_for_status(status, payload, reply_headers)
        return decode_response(payload, reply_headers)

    # ---- task API --------------------------------------------------------------------------

    # Every task call takes query parameters: the model's own (threshold, ...), the scheduler's
    # ``priority`` (1 = most urgent) and ``timeout`` (microseconds), and the router's ``route``
    # (auto, local, cloud, hedged), ``private`` (never to the cloud) and ``explain`` (the whole
    # decision trace in the answer).

    def task(
        self, name: str, doc: Any = None, raw: bytes | None = None, **params: Any
    ) -> dict[str, Any]:
        """The whole answer of ``POST /v1/{name}``, with ``route`` and ``reason``."""
        return dict(self.call("POST", f"/v1/{name}" + _query(params), doc, raw))

    def run_task(self, doc: dict[str, Any], **params: Any) -> dict[str, Any]:
        """``POST /v1/tasks``: a template, free text or a graph, with its inputs (text, or
        ``{"base64": ...}`` for bytes); ``"run": False`` gives the plan only."""
        return dict(self.call("POST", "/v1/tasks" + _query(params), doc))

    def stream_task(self, doc: dict[str, Any], **params: Any) -> Iterator[dict[str, Any]]:
        """``POST /v1/tasks?stream=true``: each node's ``started`` and ``finished`` event as it
        happens, then the ``answer`` (or ``error``) event."""
        path = "/v1/tasks" + _query({**params, "stream": True})
        body = json.dumps(doc).encode()
        with self._exchange("POST", path, body, {"Content-Type": "application/json"}) as response:
            if response.status != 200:
                _raise_for_status(response.status, response.read(), dict(response.getheaders()))
            for line in iter(response.readline, b""):
                yield json.loads(line)

    def listen(
        self, audio: Iterable[bytes], model: str = "wake-word", **params: Any
    ) -> Iterator[dict[str, Any]]:
        """``POST /v2/models/{model}/stream``: ``audio`` (16 kHz mono 16-bit little-endian
        PCM, in chunks as it is captured) sent from a thread while the answers are read; each
        response's document as it comes, then ``{"event": "end"}`` (or ``{"event": "error"}``).
        """
        path = f"/v2/models/{model}/stream" + _query(params)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise ClientError(0, f"cannot reach edged at {self.socket_path}: {exc}") from None
        # a live stream may hear nothing for long: no timeout while reading (edged ends the
        # stream itself when the audio stops)
        sock.settimeout(None)

        def upload() -> None:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
                "Content-Type: application/octet-stream\r\n\r\n"
            )
            try:
                sock.sendall(head.encode())
                for chunk in audio:
                    if chunk:
                        sock.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                sock.sendall(b"0\r\n\r\n")
            except OSError:  # refused before the end: the answer says why
                pass
            except Exception:  # the audio source failed: end the upload, so the reader ends too
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=upload, name="edgectl-listen", daemon=True)
        sender.start()
        try:
            response = http.client.HTTPResponse(sock, method="POST")
            response.begin()
            if response.status != 200:
                _raise_for_status(response.status, response.read(), dict(response.getheaders()))
            for line in iter(response.readline, b""):
                yield json.loads(line)
        except OSError as exc:
            raise ClientError(0, f"the stream to edged broke: {exc}") from None
        finally:
            sock.close()

    def embed(self, texts: list[str], model: str = "text-embedding", **params: Any) -> np.ndarray:
        """Sentence embeddings, one row per text (``model``: text-embedding or its -int8)."""
        reply = self.task("embed", {"texts": texts, "model": model}, **params)
        return np.asarray(reply["embeddings"], dtype=np.float32)

    def intent(self, texts: list[str], **params: Any) -> list[dict[str, Any]]:
        """The intent of each text with its probability."""
        return list(self.task("intent", {"texts": texts}, **params)["intents"])

    def ocr(self, image: bytes, **params: Any) -> list[dict[str, Any]]:
        """Lines of text in an encoded image: text, score, box."""
        return list(self.task("ocr", raw=image, **params)["lines"])

    def vad(self, wav: bytes, **params: Any) -> list[dict[str, float]]:
        """Speech segments of a WAV file, in seconds."""
        return list(self.task("vad", raw=wav, **params)["segments"])


def _raise_for_status(status: int, payload: bytes, headers: Mapping[str, str]) -> None:
    """ClientError with the daemon's {"error"} message for an error status."""
    if status < 400:
        return
    try:
        message = json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError):
        message = payload.decode("utf-8", "replace") or http.client.responses.get(status, "")
    retry = headers.get("Retry-After")
    seconds = whole(retry, 9)
    raise ClientError(status, message, None if seconds is None else float(seconds))


def _query(params: Mapping[str, Any]) -> str:
    def text(value: Any) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return ("?" + "&".join(f"{k}={text(v)}" for k, v in params.items())) if params else ""


def _model_path(model: str, version: str | None) -> str:
    return f"/v2/models/{model}" + (f"/versions/{version}" if version else "")


def decode_outputs(payload: bytes, headers: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Outputs of an OIP REST response (JSON or binary tensor data) as numpy arrays."""
    return decode_response(payload, headers)[0]


def decode_response(
    payload: bytes, headers: Mapping[str, str]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Outputs of an OIP REST response as numpy arrays, and the response's parameters."""
    length = next((v for k, v in headers.items() if k.lower() == HEADER_LENGTH.lower()), None)
    split = int(length) if length is not None else len(payload)
    doc = json.loads(payload[:split])
    binary = payload[split:]
    offset = 0
    outputs: dict[str, np.ndarray] = {}
    for out in doc["outputs"]:
        name, datatype, shape = out["name"], out["datatype"], out["shape"]
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is None:
            outputs[name] = from_json(name, datatype, shape, out["data"])
        else:
            outputs[name] = from_binary(name, datatype, shape, binary[offset : offset + size])
            offset += size
    return outputs, dict(doc.get("parameters") or {})
