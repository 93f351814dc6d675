"""The knowledge store: text chunks and their embeddings in Milvus (Milvus Lite by default).

One collection per namespace (``kb_<namespace>``), each with the same schema:

| field | type | what |
| --- | --- | --- |
| `id` | VARCHAR(64), primary | sha256 of the chunk's text (a re-ingest upserts, not copies) |
| `vector` | FLOAT_VECTOR(dim) | the chunk's embedding (L2-normalised, cosine = inner product) |
| `text` | VARCHAR(8192) | the chunk |
| `source` | VARCHAR(1024) | where it came from (a file name, a URL) |
| `metadata` | JSON | anything else, filterable (`metadata["lang"] == "en"`) |
| `created_at` | INT64 | seconds since the epoch, at (re-)ingest |

Index: FLAT (exact search) by default, inner product over L2-normalised vectors (the store
normalises what it is given, so scores are cosine similarities): recall 1.0 by construction.
Measured with milvus-lite 3.2.2 (docs/BENCHMARKS.md): 11 ms a search at 10k rows, 173 ms at
100k; the time is milvus-lite's per-row Python work on every search (dedup by key, tombstones),
so HNSW is no faster at 10k and gave recall@10 0.64 on random vectors; `index = "HNSW"` is for
a Milvus server, measured on its data. Every write is flushed: Milvus Lite searches rows still
in a growing segment by brute force at about 300 ms per query on 10k rows (30x slower). The
same code serves a Milvus server or cluster: pass its URI (and token) instead of a file path.

Milvus Lite's limits: one process per file (edged owns it; nothing else may open it while edged
runs); after reopening a file a collection must be loaded before it is searched (done here);
on a full disk a collection does not load (so writes that would come near it are refused:
``_check_room``). The client is synchronous: the daemon calls it
from its thread pool.

No other local user can reach a Milvus Lite store (issue 21, item 2). pymilvus would start
Milvus Lite 3 (``MilvusClient(uri="x.db")``) as a gRPC server on 127.0.0.1 with no
authentication: any local uid could list the collections, read a private passage, drop them.
So the store never hands pymilvus a file: ``LocalMilvus`` opens Milvus Lite 3 in this process
(the same engine and the same gRPC servicer), serves it on a Unix socket in a directory of its
own (``<file>.run/milvus.sock``, the directory 0700 and the socket 0600, owned by edged's uid),
and pymilvus talks to ``unix:<socket>``: no TCP listener at all, and no other uid can connect.
The Milvus Lite directory itself is 0700 (made so at every open, also for a store made before
this change), so its files cannot be read by others whatever their own mode. A Milvus
server by URI (``http(s)://``, ``tcp://``, ``unix:``) is used as it is, with its token.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edged.common.errors import InsufficientStorage, InvalidRequest, NotFound

NAMESPACE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}\Z")
MAX_TEXT = 8192
MAX_SOURCE = 1024
PREFIX = "kb_"
SOCKET = "milvus.sock"
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
MAX_MESSAGE = 256 << 20  # Milvus Lite's own server's limit, and Milvus standalone's


def content_id(text: str) -> str:
    """A chunk's id: the sha256 of its text (dedupe by content)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def normalised(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Rows of ``dim`` values scaled to unit length (inner product = cosine similarity)."""
    if vectors.ndim == 1:
        vectors = vectors.reshape(1, -1)
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise InvalidRequest(f"vectors must have {dim} values, got shape {list(vectors.shape)}")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    if not np.all(np.isfinite(vectors)) or np.any(norms == 0):
        raise InvalidRequest("a vector is zero or not finite")
    return vectors / norms


@dataclass(frozen=True)
class Chunk:
    text: str
    vector: Sequence[float] | np.ndarray
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return content_id(self.text)


@dataclass(frozen=True)
class Hit:
    id: str
    score: float  # cosine similarity, 1 is identical
    text: str
    source: str
    metadata: dict[str, Any]
    created_at: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def is_server(uri: str) -> bool:
    """A Milvus server's URI (``http://host:19530``, ``unix:/run/milvus.sock``), not a file."""
    return "://" in uri or uri.startswith("unix:")


def private_dir(path: Path, strict: bool = False) -> Path:
    """``path`` as a directory with mode 0700, made if missing. ``strict``: it must also be a
    directory itself (not a link to one) owned by this uid, or it is refused."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat() if strict else path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"{path} must be a directory")
    if strict and info.st_uid != os.geteuid():
        raise RuntimeError(f"{path} must be owned by uid {os.geteuid()}, not {info.st_uid}")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)
    return path


class _NotImplementedQuiet(logging.Filter):
    """grpc's synchronous server (here only Milvus Lite's, never edged's API) logs a method its
    servicer lacks at ERROR with a traceback, for each call: pymilvus asks for AllocTimestamp,
    which Milvus Lite does not implement, and gets UNIMPLEMENTED as it expects."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, NotImplementedError)


logging.getLogger("grpc._server").addFilter(_NotImplementedQuiet())


class LocalMilvus:
    """Milvus Lite 3 (``data``, a directory) in this process, served on a private Unix socket.

    What pymilvus does with a ``.db`` URI (milvus_lite.server_manager), less the TCP port: the
    engine (``MilvusLite``, which takes the directory's lock: one process per store) and its
    gRPC servicer, on a socket in ``<data>.run/`` (0700; a 0700 directory from ``mkdtemp``
    when that path is too long for a socket). Every step that could be reached by another uid
    is closed first: the data directory and the socket's are 0700 before anything is in them,
    and the socket is 0600 before the server starts."""

    def __init__(self, data: Path, workers: int = 4) -> None:
        from concurrent import futures

        import grpc
        from milvus_lite import MilvusLite
        from milvus_lite.adapter.grpc.servicer import MilvusServicer
        from pymilvus.grpc_gen import milvus_pb2_grpc

        self.db = MilvusLite(str(private_dir(data)))
        self.temporary = False
        try:
            self.run = data.with_name(data.name + ".run")
            if len(os.fsencode(self.run / SOCKET)) > MAX_SOCKET_PATH:
                self.run, self.temporary = Path(tempfile.mkdtemp(prefix="edged-kb-")), True
            else:
                private_dir(self.run, strict=True)
            self.socket = self.run / SOCKET
            with contextlib.suppress(FileNotFoundError):
                self.socket.unlink()  # a stale one: the lock says no live process serves it
            self.server = grpc.server(
                futures.ThreadPoolExecutor(workers, thread_name_prefix="milvus-lite"),
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE),
                    ("grpc.max_send_message_length", MAX_MESSAGE),
                    # pymilvus pings every 10 s, idle or not; gRPC's defaults answer that
                    # with GOAWAY too_many_pings (as Milvus Lite's own server did), and the
                    # next call after an idle spell reconnects: 21-27 ms instead of 3-7.
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
                    ("grpc.http2.max_ping_strikes", 0),
                ],
            )
            milvus_pb2_grpc.add_MilvusServiceServicer_to_server(
                MilvusServicer(self.db), self.server
            )
            if not self.server.add_insecure_port(f"unix:{self.socket}"):
                raise RuntimeError(f"cannot listen on {self.socket}")
            self.socket.chmod(0o600)
            self.server.start()
        except BaseException:
            self.db.close()
            if self.temporary:
                shutil.rmtree(self.run, ignore_errors=True)
            raise
        self.uri = f"unix:{self.socket}"
        # stopped at exit too if nobody closes it (as milvus_lite.server_manager does, atexit)
        self._stop = weakref.finalize(
            self, LocalMilvus._shutdown, self.server, self.db, self.run, self.temporary
        )

    @staticmethod
    def _shutdown(server: Any, db: Any, run: Path, temporary: bool) -> None:
        try:
            server.stop(grace=2).wait(5)  # removes the socket
        finally:
            db.close()  # releases the lock
            if temporary:
                shutil.rmtree(run, ignore_errors=True)

    def close(self) -> None:
        self._stop()


class KnowledgeStore:
    """Namespaces of chunks over one Milvus client."""

    def __init__(
        self, uri: str, dim: int, token: str = "", index: str = "FLAT", min_free: int = 0
    ) -> None:
        from pymilvus import MilvusClient  # imported here: it takes a second, most runs need none

        self.local: LocalMilvus | None = None
        # a Milvus Lite file: its disk is ours to watch (a server watches its own)
        self.disk = None if is_server(uri) else Path(uri).resolve().parent
        self.min_free = min_free
        if self.disk is None:
            self.client = MilvusClient(uri=uri, token=token)
        else:
            self.disk.mkdir(parents=True, exist_ok=True)
            self.local = LocalMilvus(Path(uri).resolve())
            try:
                self.client = MilvusClient(uri=self.local.uri)
            except BaseException:
                self.local.close()
                raise
        self.dim = dim
        self.index = index
        self.loaded: set[str] = set()

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self.local is not None:
                self.local.close()

    # ---- collections -----------------------------------------------------------------------

    @staticmethod
    def collection(namespace: str) -> str:
        if not NAMESPACE.match(namespace):
            raise InvalidRequest(
                f"namespace '{namespace}': a letter, then letters, digits or _, at most 63"
            )
        return PREFIX + namespace

    def namespaces(self) -> list[str]:
        return sorted(
            name[len(PREFIX) :]
            for name in self.client.list_collections()
            if name.startswith(PREFIX)
        )

    def ensure(self, namespace: str) -> str:
        """The namespace's collection, created (schema, index) or loaded as needed."""
        name = self.collection(namespace)
        if name in self.loaded:
            return name
        if not self.client.has_collection(name):
            self._create(name)
        self.client.load_collection(name)  # needed after reopening a Milvus Lite file
        self.loaded.add(name)
        return name

    def _create(self, name: str) -> None:
        from pymilvus import DataType

        schema = self.client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self.dim)
        schema.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT)
        schema.add_field("source", DataType.VARCHAR, max_length=MAX_SOURCE)
        schema.add_field("metadata", DataType.JSON)
        schema.add_field("created_at", DataType.INT64)
        index = self.client.prepare_index_params()
        params = {"M": 16, "efConstruction": 200} if self.index == "HNSW" else {}
        index.add_index("vector", index_type=self.index, metric_type="IP", params=params)
        self.client.create_collection(name, schema=schema, index_params=index)

    def _existing(self, namespace: str) -> str:
        name = self.collection(namespace)
        if name not in self.loaded and not self.client.has_collection(name):
            raise NotFound(f"no knowledge namespace '{namespace}'")
        return self.ensure(namespace)

    # ---- data ------------------------------------------------------------------------------

    def upsert(self, namespace: str, chunks: Iterable[Chunk]) -> int:
        """Add or replace chunks (the same text is the same row); the number written."""
        name = self.ensure(namespace)
        now = int(time.time())
        rows = []
        for chunk in chunks:
            if len(chunk.text.encode("utf-8")) > MAX_TEXT:
                raise InvalidRequest(f"a chunk is over {MAX_TEXT} bytes; chunk the text first")
            vector = normalised(np.asarray(chunk.vector, dtype=np.float32).ravel(), self.dim)[0]
            rows.append(
                {
                    "id": chunk.id,
                    "vector": vector.tolist(),
                    "text": chunk.text,
                    "source": chunk.source[:MAX_SOURCE],
                    "metadata": json.loads(json.dumps(chunk.metadata)),  # JSON-safe or error
                    "created_at": now,
                }
            )
        if not rows:
            return 0
        self._check_room(rows)
        result = self.client.upsert(name, rows)
        self.client.flush(name)  # sealed: searched through the index, not by brute force
        return int(result.get("upsert_count", len(rows)))

    def _check_room(self, rows: list[dict[str, Any]]) -> None:
        """Refuse a write that would leave less than ``min_free`` bytes on the disk. Milvus Lite
        must not meet a full disk. Measured with milvus-lite 3.2.2: a flush that meets ENOSPC
        raises though its batch may be kept; while the disk is full the collection does not
        load (loading rebuilds an index file and writes it), and once a reopen on a full disk
        left a truncated index file that later loads refused; with room again, it loaded in
        three runs out of three."""
        if self.disk is None:
            return
        # a row lands in the write-ahead log, a data file and the index: three copies, about
        size = 3 * sum(self.dim * 4 + len(r["text"]) + len(r["source"]) + 256 for r in rows)
        free = shutil.disk_usage(self.disk).free
        if free - size < self.min_free:
            raise InsufficientStorage(
                f"the knowledge store's disk ({self.disk}) has {free >> 20} MiB free; writing"
                f" {len(rows)} chunks needs about {size >> 20} MiB and {self.min_free >> 20} MiB"
                " must stay free (knowledge.min_free_mb): nothing was written"
            )

    def search(
        self,
        namespace: str,
        vectors: Sequence[Sequence[float]] | np.ndarray,
        k: int = 10,
        where: str = "",
    ) -> list[list[Hit]]:
        """The ``k`` nearest chunks of each vector, best first; ``where`` is a Milvus filter
        expression over the fields (``source == "faq.md"``, ``metadata["lang"] == "en"``)."""
        name = self._existing(namespace)
        if not 1 <= k <= 1000:
            raise InvalidRequest("k must be 1 to 1000")
        queries = normalised(np.asarray(vectors, dtype=np.float32), self.dim).tolist()
        found = self.client.search(
            name,
            queries,
            limit=k,
            filter=where,
            output_fields=["text", "source", "metadata", "created_at"],
        )
        return [
            [
                Hit(
                    id=hit["id"],
                    score=float(hit["distance"]),
                    text=hit["entity"]["text"],
                    source=hit["entity"]["source"],
                    metadata=hit["entity"]["metadata"] or {},
                    created_at=int(hit["entity"]["created_at"]),
                )
                for hit in hits
            ]
            for hits in found
        ]

    def matching(
        self, namespace: str, ids: Sequence[str] | None = None, source: str | None = None
    ) -> list[tuple[str, dict[str, Any]]]:
        """The chunks a delete by id or by source would remove: (id, metadata) each."""
        name = self._existing(namespace)
        if ids:
            rows = self.client.get(name, ids=list(ids), output_fields=["metadata"])
        elif source is not None:
            rows = self.client.query(
                name, filter=f"source == {json.dumps(source)}", output_fields=["metadata"]
            )
        else:
            raise InvalidRequest("say which chunks to delete: ids or a source")
        return [(str(row["id"]), row.get("metadata") or {}) for row in rows]

    def delete(
        self, namespace: str, ids: Sequence[str] | None = None, source: str | None = None
    ) -> int:
        """Remove chunks by id or by source; the number removed."""
        name = self._existing(namespace)
        if ids:
            result = self.client.delete(name, ids=list(ids))
        elif source is not None:
            result = self.client.delete(name, filter=f"source == {json.dumps(source)}")
        else:
            raise InvalidRequest("say which chunks to delete: ids or a source")
        self.client.flush(name)
        return int(result.get("delete_count", 0)) if isinstance(result, dict) else len(result)

    def stats(self, namespace: str) -> dict[str, Any]:
        name = self._existing(namespace)
        rows = self.client.get_collection_stats(name).get("row_count", 0)
        return {"namespace": namespace, "chunks": int(rows), "dim": self.dim, "index": self.index}
