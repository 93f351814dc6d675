"""The knowledge store on a real Milvus Lite file: upsert by content, search with filters,
delete, stats, and everything still there after the file is reopened (a restart)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from edged.common.errors import InsufficientStorage, InvalidRequest, NotFound
from edged.knowledge.store import Chunk, KnowledgeStore
from edged.knowledge.text import chunk_markdown, chunk_text, split_for_requests

DIM = 8


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def test_chunks_overlap_and_cut_at_boundaries() -> None:
    text = " ".join(f"Sentence number {i} says something." for i in range(200))
    chunks = chunk_text(text, size=300, overlap=60)
    assert len(chunks) > 10 and all(len(c) <= 300 for c in chunks)
    assert all(c.endswith(".") for c in chunks[:-1])  # cut after a sentence
    for a, b in itertools.pairwise(chunks):
        assert a[-40:].split()[-1] in b  # the overlap carries the end of one into the next
    assert chunk_text("short") == ["short"] and chunk_text("   ") == []


MARKDOWN = (
    """Intro line before any heading.

# Install

Run `make run` and see the [README](README.md) for **more**.

## From source

```sh
# not a heading: inside a code block
make test
```

# Use

"""
    + "Ask the daemon. " * 60
)


def test_markdown_chunks_by_section_with_heading_paths() -> None:
    pieces = chunk_markdown(MARKDOWN, size=300, overlap=40)
    sections = [section for _, section in pieces]
    assert sections[:3] == ["", "Install", "Install > From source"]
    assert set(sections[3:]) == {"Use"} and len(sections) > 4  # a long section: several chunks
    assert pieces[1][0] == "Install\nRun make run and see the README for more."
    assert "# not a heading" in pieces[2][0] and pieces[2][0].startswith("Install > From source")
    assert all(len(text) <= 300 for text, _ in pieces)


def test_long_texts_split_into_requests_at_headings_and_paragraphs() -> None:
    text = "\n\n".join(f"# Part {i}\n\n" + "word " * 300 for i in range(20))
    pieces = split_for_requests(text, 4000)
    assert "".join(pieces) == text and all(len(p) <= 4000 for p in pieces)
    assert all(p.startswith("# Part") for p in pieces)  # cut before a heading
    assert split_for_requests("x" * 10, 4) == ["xxxx", "xxxx", "xx"]  # no boundary: hard cut
    assert split_for_requests("", 4) == []


def test_a_write_that_would_fill_the_disk_is_refused(tmp_path: Path) -> None:
    store = KnowledgeStore(str(tmp_path / "kb.db"), DIM, min_free=1 << 60)  # an exabyte free
    with pytest.raises(InsufficientStorage, match="nothing was written"):
        store.upsert("faq", [Chunk("a chunk", unit(1))])
    store.min_free = 0
    assert store.upsert("faq", [Chunk("a chunk", unit(1))]) == 1


def test_store_search_filter_delete_and_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "kb.db")
    store = KnowledgeStore(path, DIM)
    chunks = [
        Chunk(f"chunk {i}", unit(i), source=f"doc{i % 3}.md", metadata={"n": i}) for i in range(30)
    ]
    assert store.upsert("faq", chunks) == 30
    assert store.upsert("faq", chunks[:5]) == 5  # the same texts: replaced, not added
    assert store.stats("faq")["chunks"] == 30
    (hits,) = store.search("faq", [unit(7)], k=3)
    assert hits[0].text == "chunk 7" and hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert hits[0].source == "doc1.md" and hits[0].metadata == {"n": 7}
    (only,) = store.search("faq", [unit(7)], k=5, where='source == "doc0.md"')
    assert only and all(h.source == "doc0.md" for h in only)
    (numbered,) = store.search("faq", [unit(7)], k=30, where='metadata["n"] >= 25')
    assert sorted(h.metadata["n"] for h in numbered) == [25, 26, 27, 28, 29]
    store.delete("faq", source="doc2.md")
    store.delete("faq", ids=[chunks[0].id])
    store.close()

    reopened = KnowledgeStore(path, DIM)  # a restart: the file is all there is
    assert reopened.namespaces() == ["faq"]
    assert reopened.stats("faq")["chunks"] == 30 - 10 - 1
    (hits,) = reopened.search("faq", [unit(3)], k=1)
    assert hits[0].text == "chunk 3"
    (gone,) = reopened.search("faq", [unit(2)], k=1, where='source == "doc2.md"')
    assert gone == []
    with pytest.raises(NotFound):
        reopened.search("nothing_here", [unit(1)])
    with pytest.raises(InvalidRequest, match="namespace"):
        reopened.ensure("../etc")
    with pytest.raises(InvalidRequest, match="8"):
        reopened.upsert("faq", [Chunk("bad", [0.0, 1.0])])
    with pytest.raises(InvalidRequest, match="zero"):
        reopened.upsert("faq", [Chunk("zero", np.zeros(DIM))])
    reopened.close()


def test_scores_are_cosine_whatever_the_vectors_length(tmp_path: Path) -> None:
    store = KnowledgeStore(str(tmp_path / "kb.db"), DIM)
    store.upsert("n", [Chunk(f"c{i}", unit(i) * (i + 1) * 10) for i in range(5)])
    (hits,) = store.search("n", [unit(3) * 0.01], k=5)
    assert hits[0].text == "c3" and hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert all(-1.0 - 1e-5 <= h.score <= 1.0 + 1e-5 for h in hits)
    store.close()
