"""The knowledge service: ingest and search over the store, with the daemon's own embeddings.

Texts are chunked (``chunk_text``), embedded by the local embedding model through the router
(as any other model call: batched by the scheduler, private by default: see below), and
upserted; questions are embedded the same way and searched. The store is synchronous and
owned by this process (Milvus Lite: one process per file), so its calls run in the daemon's
thread pool, one at a time. It is opened at first use: pymilvus takes a second to import and
most devices that never ask the knowledge base need not pay it.

Embedding calls are marked private: what is being indexed stays on the device, whatever the
routing rules say of the embedding model.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edged.errors import InvalidRequest
from edged.knowledge.store import Chunk, KnowledgeStore, chunk_text
from edged.protocol.tensors import encode_utf8

T = TypeVar("T")
Embed = Callable[[list[str]], Awaitable[np.ndarray]]
BATCH = 64  # texts per embedding call
MAX_DOCUMENTS = 1000  # per ingest request
MAX_DOCUMENT_CHARS = 2_000_000


def text_tensor(texts: list[str]) -> np.ndarray:
    array = np.empty(len(texts), dtype=object)
    array[:] = [encode_utf8("texts", t) for t in texts]
    return array


class KnowledgeService:
    """Namespaces of chunks with the local embeddings, over one store."""

    def __init__(
        self,
        uri: str | Path,
        embed: Embed,
        dim: Callable[[], int],
        executor: Executor,
        token: str = "",
        index: str = "FLAT",
        chunk_size: int = 800,
        overlap: int = 120,
    ) -> None:
        self.uri = str(uri)
        self.dim_of = dim  # the embedding model's, asked at first use (it may still be loading)
        self.dim = 0
        self.embed = embed
        self.executor = executor
        self.token = token
        self.index = index
        self.chunk_size = chunk_size
        self.overlap = overlap
        self._store: KnowledgeStore | None = None
        self._lock = threading.Lock()  # the store's calls, one at a time

    async def _call(self, fn: Callable[[KnowledgeStore], T]) -> T:
        if not self.dim:
            self.dim = self.dim_of()

        def run() -> T:
            with self._lock:
                if self._store is None:
                    self._store = KnowledgeStore(self.uri, self.dim, self.token, self.index)
                return fn(self._store)

        return await asyncio.get_running_loop().run_in_executor(self.executor, run)

    async def close(self) -> None:
        if self._store is not None:
            await self._call(lambda store: store.close())
            self._store = None

    async def _vectors(self, texts: list[str]) -> np.ndarray:
        parts = [await self.embed(texts[i : i + BATCH]) for i in range(0, len(texts), BATCH)]
        return np.concatenate(parts)

    async def ingest(self, namespace: str, documents: Any) -> dict[str, Any]:
        """Chunk, embed and upsert ``[{text, source, metadata}]``; a re-ingest of the same text
        writes the same rows (ids are content hashes)."""
        if not isinstance(documents, list) or not documents:
            raise InvalidRequest("'documents' must be a non-empty list of {text, source}")
        if len(documents) > MAX_DOCUMENTS:
            raise InvalidRequest(f"at most {MAX_DOCUMENTS} documents per request")
        pending: list[tuple[str, str, dict[str, Any]]] = []
        for doc in documents:
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise InvalidRequest("each document needs 'text' (a string)")
            if len(doc["text"]) > MAX_DOCUMENT_CHARS:
                raise InvalidRequest(f"a document is over {MAX_DOCUMENT_CHARS} characters")
            source = doc.get("source", "")
            metadata = doc.get("metadata", {})
            if not isinstance(source, str) or not isinstance(metadata, dict):
                raise InvalidRequest("'source' must be a string and 'metadata' an object")
            for piece in chunk_text(doc["text"], self.chunk_size, self.overlap):
                pending.append((piece, source, metadata))
        self.store_namespace(namespace)
        if not pending:
            raise InvalidRequest("the documents hold no text")
        vectors = await self._vectors([p[0] for p in pending])
        chunks = [Chunk(t, v, s, m) for (t, s, m), v in zip(pending, vectors)]
        written = await self._call(lambda store: store.upsert(namespace, chunks))
        return {"namespace": namespace, "documents": len(documents), "chunks": written}

    @staticmethod
    def store_namespace(namespace: str) -> None:
        KnowledgeStore.collection(namespace)  # InvalidRequest for a bad name, before any work

    async def search(
        self, namespace: str, query: Any, k: int = 5, where: str = ""
    ) -> dict[str, Any]:
        if not isinstance(query, str) or not query.strip():
            raise InvalidRequest("'query' must be a non-empty string")
        if not isinstance(where, str):
            raise InvalidRequest("'filter' must be a Milvus filter expression (a string)")
        vectors = await self._vectors([query])
        (hits,) = await self._call(lambda store: store.search(namespace, vectors, k, where))
        return {"namespace": namespace, "query": query, "hits": [h.as_dict() for h in hits]}

    async def delete(self, namespace: str, doc: Any) -> dict[str, Any]:
        ids, source = doc.get("ids"), doc.get("source")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise InvalidRequest("'ids' must be a list of strings")
        if source is not None and not isinstance(source, str):
            raise InvalidRequest("'source' must be a string")
        removed = await self._call(lambda store: store.delete(namespace, ids, source))
        return {"namespace": namespace, "deleted": removed}

    async def stats(self, namespace: str) -> dict[str, Any]:
        return await self._call(lambda store: store.stats(namespace))

    async def namespaces(self) -> list[str]:
        return await self._call(lambda store: store.namespaces())
