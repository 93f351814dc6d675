"""The knowledge service: ingest, search and ask over the store, with the daemon's own embeddings.

Texts are chunked (``edged.knowledge.text``), embedded by the local embedding model through the
router (as any other model call: batched by the scheduler) and upserted a batch at a time, so a
crash in the middle of a long ingest leaves whole batches behind and a re-ingest (same text,
same ids) completes it. Questions are embedded the same way and searched. The store is
synchronous and owned by this process (Milvus Lite: one process per file), so its calls run in
the daemon's thread pool, one at a time. It is opened at first use: pymilvus takes a second to
import and most devices that never ask the knowledge base need not pay it.

Private data is private to its owner, the uid that put it there (``edged.request.CALLER``, from
SO_PEERCRED), not to everyone who may call edged: a namespace in ``private_namespaces`` belongs
to the uid whose ingest made it (kept in ``<store>.owners.json``; one made before owners were
kept is edged's own), and only that uid may ingest into it, search it, ask it, delete from it
or see its figures; a document ingested ``private`` in a shared namespace carries its owner, is
found only by that uid's searches and asks, and only that uid deletes it. Root and edged's own
uid are every namespace's owners (they read the files anyway).

Embedding calls are private: what is being indexed stays on the device, whatever the routing
rules say of the embedding model. ``ask`` answers from the best passage when it is close enough
to the question (``answer_threshold``), else sends the question and the top passages to the
answer model, unless one of them is private; then the device answers with what it has, and
says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edged.common.atomic import write_atomic
from edged.common.errors import (
    EdgedError,
    Forbidden,
    InsufficientStorage,
    InvalidRequest,
    Unavailable,
)
from edged.knowledge.store import Chunk, KnowledgeStore
from edged.knowledge.text import chunk_markdown, chunk_text
from edged.request import CALLER

log = logging.getLogger(__name__)

T = TypeVar("T")
Embed = Callable[[list[str]], Awaitable[np.ndarray]]
# (question, passages) -> (the answer, where it ran, why): the daemon's answer model call
Answer = Callable[[str, list[str]], Awaitable[tuple[str, str, str]]]
WRITE_BATCH = 512  # chunks per upsert: what a crash in the middle of an ingest can lose
MAX_DOCUMENTS = 1000  # per ingest request
MAX_DOCUMENT_CHARS = 2_000_000
# Chunks per ingest request, counted once the text is chunked and before any is embedded: each
# is embedded before the answer, about 25 ms here (2,048: under a minute). A document of
# 2,000,000 characters, 4,800 chunks, ran over 300 s with nothing to stop it (issue 44);
# edgectl kb ingest sends files in requests of 200,000 characters.
MAX_INGEST_CHUNKS = 2048
MAX_K = 1000  # the store's largest search
FORMATS = ("text", "markdown")
# pymilvus error codes of a filter that does not parse or names no field: Milvus Lite 3's
# ILLEGAL_ARGUMENT and ILLEGAL_RANGE, a Milvus server's ParameterInvalid (2.4 and later)
FILTER_ERRORS = {5, 6, 1100}


@dataclass
class AskSettings:
    threshold: float = 0.6
    answer_model: str | None = None
    passages: int = 4
    private_namespaces: list[str] = field(default_factory=list)
    timeout_s: float = 30.0  # the ask's deadline when the request sets none


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
        chunk_size: int = 500,
        overlap: int = 80,
        min_free_mb: int = 256,
        embed_batch: int = 8,
        answer: Answer | None = None,
        ask: AskSettings | None = None,
        owners_file: Path | None = None,
    ) -> None:
        self.uri = str(uri)
        # who owns each private namespace (uid); a remote store keeps them where edged says
        if owners_file is None and "://" not in self.uri:
            owners_file = Path(f"{self.uri}.owners.json")
        self.owners_file = owners_file
        self.owners: dict[str, int] = {}
        if owners_file is not None and owners_file.is_file():
            kept = json.loads(owners_file.read_text())
            self.owners = {str(k): int(v) for k, v in kept.items()}
        self.dim_of = dim  # the embedding model's, asked at first use (it may still be loading)
        self.dim = 0
        self.embed = embed
        self.answer = answer
        self.ask_settings = ask or AskSettings()
        self.executor = executor
        self.token = token
        self.index = index
        self.chunk_size = chunk_size
        self.overlap = overlap
        self.min_free = min_free_mb << 20
        self.embed_batch = embed_batch
        self._store: KnowledgeStore | None = None
        self._lock = threading.Lock()  # the store's calls, one at a time

    async def _call(self, fn: Callable[[KnowledgeStore], T], where: str = "") -> T:
        """``fn(store)`` in the thread pool; ``where``: the caller's filter expression, whose
        syntax errors are the caller's (400), not the store's (503)."""
        if not self.dim:
            self.dim = self.dim_of()

        def run() -> T:
            with self._lock:
                if self._store is None:
                    self._store = KnowledgeStore(
                        self.uri, self.dim, self.token, self.index, self.min_free
                    )
                return fn(self._store)

        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, run)
        except EdgedError:
            raise
        except Exception as exc:  # pymilvus' errors: the store's own words, and the log
            if where and getattr(exc, "code", None) in FILTER_ERRORS:
                first = str(getattr(exc, "message", exc)).splitlines()[0][:200]
                raise InvalidRequest(
                    f"'filter' is not a valid filter expression: {first}"
                ) from None
            if "No space left" in str(exc) or "Errno 28" in str(exc):
                raise InsufficientStorage(f"the knowledge store's disk is full: {exc}") from exc
            log.exception("knowledge store call failed")
            raise Unavailable(f"the knowledge store failed: {exc}") from exc

    async def close(self) -> None:
        if self._store is not None:
            await self._call(lambda store: store.close())
            self._store = None

    async def _vectors(self, texts: list[str]) -> np.ndarray:
        step = self.embed_batch
        parts = [await self.embed(texts[i : i + step]) for i in range(0, len(texts), step)]
        return np.concatenate(parts)

    def _pieces(self, doc: Any, owner: int) -> list[tuple[str, str, dict[str, Any]]]:
        """One document as (chunk, source, metadata) rows, or InvalidRequest."""
        if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
            raise InvalidRequest("each document needs 'text' (a string)")
        if len(doc["text"]) > MAX_DOCUMENT_CHARS:
            raise InvalidRequest(f"a document is over {MAX_DOCUMENT_CHARS} characters")
        source = doc.get("source", "")
        metadata = doc.get("metadata", {})
        if not isinstance(source, str) or not isinstance(metadata, dict):
            raise InvalidRequest("'source' must be a string and 'metadata' an object")
        # "private" and "owner" are edged's to set (the document's "private")
        metadata = {k: v for k, v in metadata.items() if k not in ("private", "owner")}
        kind = doc.get("format", "markdown" if source.endswith((".md", ".markdown")) else "text")
        if kind not in FORMATS:
            raise InvalidRequest(f"'format' must be one of {', '.join(FORMATS)}")
        private = doc.get("private", False)
        if not isinstance(private, bool):
            raise InvalidRequest("'private' must be true or false")
        if private:
            metadata = {**metadata, "private": True, "owner": owner}
        sizes = self.chunk_size, self.overlap
        if kind == "text":
            return [(p, source, metadata) for p in chunk_text(doc["text"], *sizes)]
        return [
            (piece, source, {**metadata, "section": section} if section else metadata)
            for piece, section in chunk_markdown(doc["text"], *sizes)
        ]

    async def ingest(self, namespace: str, documents: Any) -> dict[str, Any]:
        """Chunk, embed and upsert ``[{text, source, metadata, format, private}]``, a batch at
        a time; a re-ingest of the same text writes the same rows (ids are content hashes)."""
        self.store_namespace(namespace)
        if not isinstance(documents, list) or not documents:
            raise InvalidRequest("'documents' must be a non-empty list of {text, source}")
        if len(documents) > MAX_DOCUMENTS:
            raise InvalidRequest(f"at most {MAX_DOCUMENTS} documents per request")
        await self.check_owner(namespace, claim=True)
        owner = self.caller()
        # chunking is CPU work, up to MAX_DOCUMENTS x MAX_DOCUMENT_CHARS: in the thread pool,
        # not on the event loop (health checks, other requests)
        pending = await asyncio.get_running_loop().run_in_executor(
            self.executor,
            lambda: [piece for doc in documents for piece in self._pieces(doc, owner)],
        )
        if not pending:
            raise InvalidRequest("the documents hold no text")
        if len(pending) > MAX_INGEST_CHUNKS:
            raise InvalidRequest(
                f"the documents make {len(pending)} chunks; at most {MAX_INGEST_CHUNKS} per"
                " request: send them in parts (edgectl kb ingest does)"
            )
        written = 0
        for i in range(0, len(pending), WRITE_BATCH):
            batch = pending[i : i + WRITE_BATCH]
            vectors = await self._vectors([p[0] for p in batch])
            chunks = [Chunk(t, v, s, m) for (t, s, m), v in zip(batch, vectors)]
            written += await self._call(
                partial(KnowledgeStore.upsert, namespace=namespace, chunks=chunks)
            )
        return {"namespace": namespace, "documents": len(documents), "chunks": written}

    @staticmethod
    def caller() -> int:
        """The uid of this request's caller (edged's own for its own calls)."""
        uid = CALLER.get()
        return os.getuid() if uid is None else uid

    @staticmethod
    def sees_all(uid: int) -> bool:
        return uid in (0, os.getuid())

    async def check_owner(self, namespace: str, claim: bool = False) -> None:
        """Forbidden unless the caller owns ``namespace`` (a private one); ``claim``: an
        ingest, which makes a new private namespace its caller's."""
        if namespace not in self.ask_settings.private_namespaces:
            return
        uid = self.caller()
        owner = self.owners.get(namespace)
        if owner is None:
            existing = namespace in await self.namespaces()
            owner = os.getuid() if existing or not claim else uid  # made before owners: edged's
            self.owners[namespace] = owner
            if self.owners_file is not None:
                write_atomic(self.owners_file, json.dumps(self.owners).encode(), 0o600)
        if owner != uid and not self.sees_all(uid):
            raise Forbidden(
                f"namespace '{namespace}' is private to its owner (uid {owner});"
                f" uid {uid} may not use it"
            )

    def visible(self, metadata: dict[str, Any], uid: int) -> bool:
        """May ``uid`` see a chunk: not private, or its own (one ingested before owners were
        kept: edged's)."""
        if not metadata.get("private") or self.sees_all(uid):
            return True
        return metadata.get("owner", os.getuid()) == uid

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
        self.store_namespace(namespace)
        await self.check_owner(namespace)
        uid = self.caller()
        vectors = await self._vectors([query])
        # another uid's private chunks are not this caller's hits: asked for more until k are
        # left (the store's nearest are the same ones, and more after them)
        limit = k
        while True:
            search = partial(
                KnowledgeStore.search, namespace=namespace, vectors=vectors, k=limit, where=where
            )
            (found,) = await self._call(search, where)
            hits = [h for h in found if self.visible(h.metadata, uid)]
            if len(hits) >= k or len(found) < limit or limit >= MAX_K:
                break
            limit = min(MAX_K, limit * 4)
        return {"namespace": namespace, "query": query, "hits": [h.as_dict() for h in hits[:k]]}

    async def ask(
        self,
        namespace: str,
        question: Any,
        threshold: float | None = None,
        where: str = "",
        private: bool = False,
    ) -> dict[str, Any]:
        """Answer from the best passage when it scores ``threshold`` or more; else from the
        answer model with the top passages, unless the question or one of them is private."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("'question' must be a non-empty string")
        settings = self.ask_settings
        threshold = settings.threshold if threshold is None else threshold
        found = await self.search(namespace, question, settings.passages, where)
        hits: list[dict[str, Any]] = found["hits"]
        reply: dict[str, Any] = {"namespace": namespace, "question": question, "passages": hits}
        best = hits[0] if hits else None

        def from_passage(reason: str) -> dict[str, Any]:
            """The device's answer: the best passage (none when nothing matched)."""
            return {
                **reply,
                "answer": best["text"] if best else None,
                "answered_by": "passage" if best else "none",
                "route": "local",
                "sources": [best["source"]] if best else [],
                "reason": reason,
            }

        if best is None:
            short = "no passage matches"
        elif best["score"] >= threshold:
            return from_passage(f"the best passage scores {best['score']:.3f} >= {threshold}")
        else:
            short = f"the best passage scores {best['score']:.3f} < {threshold}"
        private_hits = [h for h in hits if self._private(namespace, h)]
        if private or private_hits:
            why = (
                "the question is private"
                if private
                else f"{len(private_hits)} of the passages are private"
            )
            return from_passage(
                f"{short}, and {why}: nothing was sent to the answer model; this is the closest"
                " the device knows"
            )
        if self.answer is None or settings.answer_model is None:
            return from_passage(f"{short}, and no answer model is set (knowledge.answer_model)")
        try:
            answer, route, how = await self.answer(question, [h["text"] for h in hits])
        except EdgedError as exc:
            return from_passage(f"{short}, and the answer model failed: {exc.message}")
        return {
            **reply,
            "answer": answer,
            "answered_by": settings.answer_model,
            "route": route,
            "sources": sorted({h["source"] for h in hits}),
            "reason": f"{short}: asked {settings.answer_model} with {len(hits)} passages"
            f" ({route}: {how})",
        }

    def _private(self, namespace: str, hit: dict[str, Any]) -> bool:
        return namespace in self.ask_settings.private_namespaces or bool(
            hit["metadata"].get("private")
        )

    async def delete(self, namespace: str, doc: Any) -> dict[str, Any]:
        ids, source = doc.get("ids"), doc.get("source")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise InvalidRequest("'ids' must be a list of strings")
        if source is not None and not isinstance(source, str):
            raise InvalidRequest("'source' must be a string")
        self.store_namespace(namespace)
        await self.check_owner(namespace)
        uid = self.caller()
        if not self.sees_all(uid):  # another uid's private chunks are not this caller's to remove
            found = await self._call(lambda store: store.matching(namespace, ids, source))
            theirs = [i for i, metadata in found if not self.visible(metadata, uid)]
            if theirs:
                raise Forbidden(
                    f"{len(theirs)} of those chunks are another uid's private"
                    f" ones; uid {uid} may not delete them"
                )
        removed = await self._call(lambda store: store.delete(namespace, ids, source))
        return {"namespace": namespace, "deleted": removed}

    async def stats(self, namespace: str) -> dict[str, Any]:
        self.store_namespace(namespace)
        await self.check_owner(namespace)
        return await self._call(lambda store: store.stats(namespace))

    async def namespaces(self) -> list[str]:
        return await self._call(lambda store: store.namespaces())
