"""Text into chunks: plain text by size with overlap, Markdown by section first.

A chunk is what one embedding stands for, so it should hold one idea: about 500 characters
(~120 word pieces; MiniLM was trained on up to 128 and truncates at 256), cut at a paragraph,
sentence or word boundary near the size, with an overlap so that a sentence cut in two is whole
in one of the chunks. Markdown is split at its headings before that: a chunk never spans two
sections, and each carries its heading path (``Install > From source``) in its metadata and at
its head, so that a question about a section finds it even when the words are only in the
title.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")  # [text](url) -> text; images keep their alt
EMPHASIS = re.compile(r"(\*\*|__|\*|`)(?=\S)(.+?)(?<=\S)\1")


def chunk_text(text: str, size: int = 500, overlap: int = 80) -> list[str]:
    """Split ``text`` into chunks of about ``size`` characters that overlap by ``overlap``,
    cut at paragraph, then sentence, then word boundaries where one is near."""
    if size <= overlap:
        raise ValueError("chunk size must be larger than the overlap")
    text = re.sub(r"[ \t]+", " ", text.replace("\r\n", "\n")).strip()
    chunks: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            window = text[start + size // 2 : end]
            for boundary in ("\n\n", ". ", "\n", " "):
                cut = window.rfind(boundary)
                if cut >= 0:
                    end = start + size // 2 + cut + len(boundary)
                    break
        piece = text[start:end].strip()
        if piece:
            chunks.append(piece)
        if end >= len(text):
            break
        start = max(end - overlap, start + 1)
        while start < end and not text[start - 1].isspace():  # start on a word
            start += 1
    return chunks


@dataclass(frozen=True)
class Section:
    path: str  # "Title > Section > Subsection", "" before the first heading
    text: str


def markdown_sections(text: str) -> list[Section]:
    """Markdown as sections, each under its heading path, with links and emphasis reduced to
    their words (code blocks are kept as they are, headings inside them are not headings)."""
    sections: list[Section] = []
    path: list[tuple[int, str]] = []
    lines: list[str] = []
    fenced = False

    def close() -> None:
        body = "\n".join(lines).strip()
        if body:
            sections.append(Section(" > ".join(title for _, title in path), body))
        lines.clear()

    for line in text.replace("\r\n", "\n").split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            lines.append(line)
            continue
        heading = None if fenced else HEADING.match(line)
        if heading is None:
            lines.append(line if fenced else EMPHASIS.sub(r"\2", LINK.sub(r"\1", line)))
            continue
        close()
        level = len(heading.group(1))
        path = [(lvl, title) for lvl, title in path if lvl < level]
        path.append((level, EMPHASIS.sub(r"\2", LINK.sub(r"\1", heading.group(2)))))
    close()
    if not sections and path:  # headings only: the titles are the text
        sections.append(Section(" > ".join(t for _, t in path), " > ".join(t for _, t in path)))
    return sections


def chunk_markdown(text: str, size: int = 500, overlap: int = 80) -> list[tuple[str, str]]:
    """(chunk, section path) pairs: each section chunked on its own, its path at the head of
    each of its chunks."""
    out: list[tuple[str, str]] = []
    for section in markdown_sections(text):
        head = f"{section.path}\n" if section.path and section.path != section.text else ""
        for piece in chunk_text(section.text, max(size - len(head), overlap + 50), overlap):
            out.append((head + piece, section.path))
    return out


def split_for_requests(text: str, limit: int) -> list[str]:
    """``text`` in pieces of at most ``limit`` characters for separate ingest requests, cut
    before a Markdown heading, else at a blank line, else at a line or word end near the limit
    (chunks never span a cut; a Markdown section cut in two keeps its heading only in the
    first piece)."""
    pieces: list[str] = []
    while len(text) > limit:
        window = text[limit // 2 : limit]
        for boundary in ("\n#", "\n\n", "\n", " "):
            cut = window.rfind(boundary)
            if cut >= 0:
                cut += limit // 2 + 1
                break
        else:
            cut = limit
        pieces.append(text[:cut])
        text = text[cut:]
    return [*pieces, text] if text else pieces
