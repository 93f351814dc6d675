"""Issue 21, item 3: Markdown lines that made the chunker's regexes backtrack (a 1.5 KB heading
line took seconds, a 4 KB one a minute and a half, on the daemon's event loop).

What must hold: chunking is linear in its input on any line (timed in a child process, so that
a regression fails in seconds instead of hanging the run: the regex engine cannot be
interrupted), it gives what the backtracking regexes gave on ordinary text (they are kept here
as the reference, run on short inputs only), its chunks cover their text as
``edged.knowledge.text`` says, and a daemon answers its health check while it ingests such
lines."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edged.client import Client, ClientError
from edged.knowledge import text
from tests.conftest import Daemon, require_models

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
Parts = Sequence[tuple[str, float]]

# Lines of about n characters: each part once (share 0) or repeated over its share of n
FAMILIES: dict[str, Parts] = {
    "heading, then blanks": [("# a", 0), (" ", 1), ("b", 0)],  # cubic before
    "heading, then tabs and blanks": [("###### a", 0), ("\t ", 1), ("#b", 0)],
    "heading of words, not closed": [("# ", 0), ("a ", 1)],
    "heading of blank-separated hashes": [("# a", 0), (" #", 1), ("b", 0)],
    "hashes, then words": [("#", 0.5), (" ", 0), ("a ", 0.5)],
    "heading of emphasis and link openers": [("## ", 0), ("*a [b](", 1)],
    "emphasis openers": [("*a ", 1)],
    "strong openers": [("**a ", 1)],
    "underscore openers": [("__a ", 1)],
    "stars": [("*", 1)],
    "underscores": [("_", 1)],
    "brackets": [("[", 1)],
    "brackets, one close": [("[", 1), ("]", 0)],
    "link openers": [("[a](", 1)],
    "image openers": [("![a](", 1)],
    "backtick openers": [("`a ", 1)],
    "backticks": [("`", 1)],
    "a mixture": [("*a [b](c _`d ![e] ** __ ", 1)],
    "a heading of a mixture": [("## ", 0), ("*a [b](c _`d ![e] ** __ # ", 1)],
}
# sizes and what each may take, far below what a quadratic regex needs (seconds at 64 KB,
# hours at 1 MiB) or a cubic one (seconds at 1.5 KB)
BOUNDS = {1536: 0.2, 4096: 0.2, 65536: 0.5, MIB: 2.0}
CHILD_DEADLINE_S = 30.0
# In a child: chunk each document of stdin's [documents, repeats], print the best time of each
TIMER = """
import json, sys, time
from edged.knowledge.text import chunk_markdown
documents, repeats = json.load(sys.stdin)
for document in documents:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        chunk_markdown(document)
        best = min(best, time.perf_counter() - start)
    print(best, flush=True)
"""


def build(parts: Parts, n: int) -> str:
    return "".join(
        unit if share == 0 else (unit * (int(n * share) // len(unit) + 1))[: int(n * share)]
        for unit, share in parts
    )


def chunking_times(documents: list[str], repeats: int = 1) -> list[float]:
    """Seconds ``chunk_markdown`` takes on each document (the best of ``repeats``), timed in a
    child process that is killed after CHILD_DEADLINE_S."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", TIMER],
            input=json.dumps([documents, repeats]),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=CHILD_DEADLINE_S,
            check=True,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        timed = out.split()
        pytest.fail(
            f"chunking did not finish in {CHILD_DEADLINE_S} s: the document of"
            f" {len(documents[len(timed)])} characters was still running (the ones before it"
            f" took {timed} s)"
        )
    return [float(line) for line in done.stdout.split()]


@pytest.mark.parametrize("family", FAMILIES)
def test_pathological_lines_chunk_in_bounded_time(family: str) -> None:
    documents = [build(FAMILIES[family], n) for n in BOUNDS]
    times = chunking_times(documents)
    slow = {
        len(doc): round(took, 3)
        for doc, took, bound in zip(documents, times, BOUNDS.values())
        if took >= bound
    }
    assert not slow, f"{family}: characters -> seconds over {BOUNDS}: {slow}"


@pytest.mark.parametrize(
    "family",
    [
        "heading, then blanks",
        "emphasis openers",
        "link openers",
        "brackets, one close",
        "a mixture",
    ],
)
def test_a_pathological_line_four_times_as_long_takes_about_four_times_as_long(
    family: str,
) -> None:
    n = 128 << 10
    single, quad = chunking_times(
        [build(FAMILIES[family], n), build(FAMILIES[family], 4 * n)], repeats=3
    )
    # 4x when linear, 16x when quadratic: 8x lies between with room for a busy machine's noise;
    # under 40 ms the scheduler's noise is larger than that
    assert quad < 8 * single or quad < 0.04, (family, single, quad)


MARKUP = "#*_[]()`!~\n -\t"
CHARACTERS = st.sampled_from([*MARKUP, *"abcxyz", "\xa0", "\r"])
markdownish = st.text(alphabet=CHARACTERS, max_size=2000)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix=st.sampled_from(["", "# ", "###### ", "####### ", "- ", "```"]),
    unit=st.text(alphabet=st.sampled_from([*MARKUP, "a"]), min_size=1, max_size=8),
)
def test_any_repeated_line_chunks_in_linear_time(prefix: str, unit: str) -> None:
    n = 64 << 10
    parts = [(prefix, 0.0), (unit, 1.0)]
    single, quad = chunking_times([build(parts, n), build(parts, 4 * n)], repeats=3)
    assert quad < 8 * single or quad < 0.04, (prefix, unit, single, quad)  # as above


# The reference: the regexes text.py had (super-linear, so on short inputs only)
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
EMPHASIS = re.compile(r"(\*\*|__|\*|`)(?=\S)(.+?)(?<=\S)\1")


def reference_inline(line: str) -> str:
    return EMPHASIS.sub(r"\2", LINK.sub(r"\1", line))


def reference_sections(document: str) -> list[tuple[str, str]]:
    sections: list[tuple[str, str]] = []
    path: list[tuple[int, str]] = []
    lines: list[str] = []
    fenced = False

    def close() -> None:
        body = "\n".join(lines).strip()
        if body:
            sections.append((" > ".join(title for _, title in path), body))
        lines.clear()

    for line in document.replace("\r\n", "\n").split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            lines.append(line)
            continue
        heading = None if fenced else HEADING.match(line)
        if heading is None:
            lines.append(line if fenced else reference_inline(line))
            continue
        close()
        level = len(heading.group(1))
        path = [(lvl, title) for lvl, title in path if lvl < level]
        path.append((level, reference_inline(heading.group(2))))
    close()
    if not sections and path:
        sections.append((" > ".join(t for _, t in path), " > ".join(t for _, t in path)))
    return sections


@settings(max_examples=400, deadline=None)
@given(line=st.text(alphabet=CHARACTERS, max_size=300).map(lambda s: s.replace("\n", "")))
def test_lines_read_as_the_regexes_read_them(line: str) -> None:
    heading = HEADING.match(line)
    assert text.parse_heading(line) == (
        (len(heading.group(1)), heading.group(2)) if heading else None
    )
    assert text.reduce_inline(line) == reference_inline(line)
    assert text.is_fence(line) == bool(FENCE.match(line))


@settings(max_examples=400, deadline=None)
@given(document=st.text(alphabet=CHARACTERS, max_size=text.MAX_TITLE))
def test_documents_split_into_the_sections_the_regexes_gave(document: str) -> None:
    assert [(s.path, s.text) for s in text.markdown_sections(document)] == reference_sections(
        document
    )


def assert_covered(source: str, chunks: list[str], size: int, overlap: int) -> None:
    """What text.py says of chunk_text: spans of the normalized text, in order, each starting
    inside the one before or right after it, by at most ``overlap``, ending at its end; the
    chunks are those spans stripped, the blank ones left out."""
    norm = text.normalize(source)
    spans = text.text_spans(norm, size, overlap)
    if not norm:
        assert spans == [] and chunks == []
        return
    assert spans[0][0] == 0 and spans[-1][1] == len(norm)
    assert all(0 < end - start <= size for start, end in spans)
    for (start, end), (after, _) in itertools.pairwise(spans):
        assert start < after <= end and end - after <= overlap
    pieces = [norm[start:end].strip() for start, end in spans]
    assert chunks == [piece for piece in pieces if piece]
    # so the chunks, less their overlaps, are the text: each character not blank is in one
    covered = bytearray(len(norm))
    for start, end in spans:
        covered[start:end] = b"\1" * (end - start)
    assert all(covered[i] or norm[i].isspace() for i in range(len(norm)))


sizes = st.integers(min_value=1, max_value=600).flatmap(
    lambda size: st.tuples(st.just(size), st.integers(min_value=0, max_value=size - 1))
)


@settings(max_examples=300, deadline=None)
@given(source=markdownish, size_overlap=sizes)
def test_text_chunks_cover_their_text(source: str, size_overlap: tuple[int, int]) -> None:
    size, overlap = size_overlap
    assert_covered(source, text.chunk_text(source, size, overlap), size, overlap)


@settings(max_examples=300, deadline=None)
@given(document=markdownish, size_overlap=sizes)
def test_markdown_chunks_cover_their_sections(document: str, size_overlap: tuple[int, int]) -> None:
    """chunk_markdown: each section's text chunked as chunk_text does (its size less the path),
    in document order, each chunk after the path; paths of short titles."""
    size, overlap = size_overlap
    pairs = iter(text.chunk_markdown(document, size, overlap))
    for section in text.markdown_sections(document):
        head = f"{section.path}\n" if section.path and section.path != section.text else ""
        body = max(size - len(head), overlap + 50)
        chunks = text.chunk_text(section.text, body, overlap)
        assert_covered(section.text, chunks, body, overlap)
        assert [next(pairs) for _ in chunks] == [(head + c, section.path) for c in chunks]
        assert section.text.strip() == section.text != ""
    assert next(pairs, None) is None


def test_a_long_title_is_cut_in_the_path_and_whole_in_its_section() -> None:
    title = " ".join(f"word{i}" for i in range(2000))  # 17 KB
    body = "A sentence of the section. " * 4000  # 108 KB
    document = f"# Guide\n\n## {title}\n\n{body}"
    pairs = text.chunk_markdown(document)
    path = pairs[0][1]
    assert path.startswith("Guide > word0 word1") and path.endswith("…")
    assert len(path) <= len("Guide > ") + text.MAX_TITLE + 1
    assert {p for _, p in pairs} == {path}
    assert pairs[0][0].startswith(f"{path}\n{title[:100]}")  # the whole title: the first words
    assert all(f"word{i}" in " ".join(c for c, _ in pairs) for i in (0, 999, 1999))
    # the path is in every chunk and its metadata: cut, it keeps them linear in the document
    # (3.6 times its 125 KB here; the whole title in each was 135 MB, in 4,000 chunks)
    assert sum(len(c) + len(p) for c, p in pairs) < 5 * len(document)


def test_ordinary_markdown_chunks_as_before() -> None:
    document = (
        "Intro with a [link](https://example.com) and an ![image](i.png).\n\n"
        "# Install *now*\n\nRun `make run`, see **the README** and __notes__.\n\n"
        "## From source ##\n\n```sh\n# not a heading\nmake *test*\n```\n\n"
        "### C#\n\nIt is *C*, not *C *\n\n# Use\n\n" + "Ask the daemon. " * 60
    )
    sections = [(s.path, s.text) for s in text.markdown_sections(document)]
    assert sections == reference_sections(document)
    assert sections[:4] == [
        ("", "Intro with a link and an image."),
        ("Install now", "Run make run, see the README and notes."),
        ("Install now > From source", "```sh\n# not a heading\nmake *test*\n```"),
        ("Install now > From source > C", "It is C, not *C *"),
    ]
    assert text.chunk_markdown(document, 300, 40)[-1][1] == "Use"


def test_requests_are_cut_before_headings() -> None:
    """split_for_requests no longer copies the rest of the text at each cut; the cuts are the
    same."""
    document = "\n\n".join(f"# Part {i}\n\n" + "word " * 300 for i in range(2000))  # 3 MB
    pieces = text.split_for_requests(document, 4000)
    assert len(pieces) == 1000
    assert "".join(pieces) == document and all(len(p) <= 4000 for p in pieces)
    assert all(p.startswith("# Part") for p in pieces)


def test_a_daemon_stays_ready_while_it_ingests_pathological_markdown(
    make_daemon: type[Daemon],
) -> None:
    require_models()
    daemon = make_daemon(config='[models]\nload = ["text-embedding"]\n').start()
    documents = [
        {"source": f"hostile-{i}.md", "text": build(parts, 4096)}
        for i, parts in enumerate(FAMILIES.values())
    ]
    documents.append({"source": "blanks.md", "text": build(FAMILIES["heading, then blanks"], MIB)})
    outcome: dict[str, Any] = {}

    def ingest() -> None:
        try:
            body = {"documents": documents}
            outcome["reply"] = daemon.client.call("POST", "/v1/kb/hostile/ingest", body)
        except Exception as exc:  # reported below, in the test's thread
            outcome["error"] = exc

    probe = Client(str(daemon.socket), timeout=5)
    worker = threading.Thread(target=ingest, daemon=True)
    worker.start()
    waits: list[float] = []
    while worker.is_alive() or not waits:
        start = time.monotonic()
        try:
            assert probe.ready(), "the daemon stopped being ready during the ingest"
        except ClientError as exc:  # its event loop blocked (the regexes held it, and the GIL)
            pytest.fail(f"/v2/health/ready did not answer during the ingest: {exc.message}")
        waits.append(time.monotonic() - start)
        time.sleep(0.05)
    worker.join()
    assert "error" not in outcome, outcome
    assert outcome["reply"]["documents"] == len(documents) and outcome["reply"]["chunks"] > 0
    assert max(waits) < 1.0, f"/v2/health/ready took up to {max(waits):.2f} s during the ingest"
    assert daemon.stop() == 0
