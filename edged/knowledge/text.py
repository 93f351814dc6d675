"""Text into chunks: plain text by size with overlap, Markdown by section first.

A chunk is what one embedding stands for, so it should hold one idea: about 500 characters
(~120 word pieces; MiniLM was trained on up to 128 and truncates at 256), cut at a paragraph,
sentence or word boundary near the size, with an overlap so that a sentence cut in two is whole
in one of the chunks. Markdown is split at its headings before that: a chunk never spans two
sections, and each carries its heading path (``Install > From source``) in its metadata and at
its head, so that a question about a section finds it even when the words are only in the
title. A title longer than ``MAX_TITLE`` characters is cut there in the path (which every chunk
of the section repeats) and its whole text is the first line of its section instead.

What the chunks guarantee. ``chunk_text``: with ``N = normalize(text)`` (CRLF as LF, each run of
spaces and tabs as one space, stripped), ``text_spans(N)`` is a list of spans ``(s, e)`` with
``s_0 = 0``, ``e - s <= size``, ``s_i < s_i+1 <= e_i`` and ``e_i - s_i+1 <= overlap`` (each span
starts inside the one before or right after it: they overlap by at most ``overlap``
characters) and a last ``e = len(N)``; the chunks are ``N[s:e].strip()`` of those spans in
order, all-blank ones left out. So every character of ``N`` is in a span, and every one that is
not blank is in a chunk. ``chunk_markdown``: for each section of ``markdown_sections`` in
document order, the chunks of the section's text so (at a size less its heading path), each
after the path and a newline; a section's text is its lines with links reduced to their text
and emphasis to its words, code fences kept verbatim; a heading line is in no section's text
(only its title is, in the paths), except a long title as said above.

Every function here is linear in its input: Markdown is read a line at a time with string
scans that look at each character a bounded number of times, and the only regexes have no two
unbounded quantifiers over the same characters. The backtracking regexes it had (issue 21) took
seconds on a 1.5 KB heading line, cubic in its length, and blocked the daemon's event loop (a
thread would not have helped: the regex engine holds the GIL while it matches).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

MAX_TITLE = 200  # characters of a heading title kept in the heading path
BLANKS = re.compile(r"[ \t]+")
# Emphasis marks, tried in this order where one opens: **strong**, __strong__, *em*, `code`
MARKS = ("**", "__", "*", "`")


def normalize(text: str) -> str:
    """The text ``chunk_text`` cuts: CRLF as LF, each run of spaces and tabs as one, stripped."""
    return BLANKS.sub(" ", text.replace("\r\n", "\n")).strip()


def text_spans(text: str, size: int = 500, overlap: int = 80) -> list[tuple[int, int]]:
    """The spans of ``text`` (normalized) that ``chunk_text`` cuts: about ``size`` characters
    each, ended at a paragraph, sentence or word boundary where one is in the second half, the
    next started on a word at most ``overlap`` characters before the end of the one before."""
    if size <= overlap:
        raise ValueError("chunk size must be larger than the overlap")
    spans: list[tuple[int, int]] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            for boundary in ("\n\n", ". ", "\n", " "):
                cut = text.rfind(boundary, start + size // 2, end)
                if cut >= 0:
                    end = cut + len(boundary)
                    break
        spans.append((start, end))
        if end >= len(text):
            break
        start = max(end - overlap, start + 1)
        while start < end and not text[start - 1].isspace():  # start on a word
            start += 1
    return spans


def chunk_text(text: str, size: int = 500, overlap: int = 80) -> list[str]:
    """Split ``text`` into chunks of about ``size`` characters that overlap by ``overlap``,
    cut at paragraph, then sentence, then word boundaries where one is near."""
    text = normalize(text)
    pieces = (text[start:end].strip() for start, end in text_spans(text, size, overlap))
    return [piece for piece in pieces if piece]


@dataclass(frozen=True)
class Section:
    path: str  # "Title > Section > Subsection", "" before the first heading
    text: str


def is_fence(line: str) -> bool:
    """A line that opens or closes a code block: ``` or ~~~ after blanks."""
    return line.lstrip().startswith(("```", "~~~"))


def parse_heading(line: str) -> tuple[int, str] | None:
    """``(level, title)`` of an ATX heading line (1 to 6 ``#``, blanks, the title, optional
    closing ``#`` and blanks), else None. The title is the shortest non-empty text after the
    blanks that leaves only blanks, ``#`` and blanks behind: ``# C#`` is ``C``, ``# ##`` is
    ``#``, and ``#`` and two blanks or more is the last blank (as the regex it replaces had it)."""
    level = len(line) - len(line.lstrip("#"))
    if not 1 <= level <= 6:
        return None
    rest = line[level:]
    title = rest.lstrip()
    if len(title) == len(rest):  # no blank after the hashes
        return None
    if not title:
        return (level, rest[-1]) if len(rest) >= 2 else None
    keep = len(title.rstrip().rstrip("#").rstrip())  # less the closing hashes and blanks
    return level, title[: max(1, keep)]


def reduce_links(line: str) -> str:
    """``[text](url)`` as ``text``, an image ``![alt](url)`` as ``alt``: the text is up to the
    first ``]``, which must be followed by ``(``, and the URL up to the first ``)``. Each ``]``
    and ``)`` is looked for once however many ``[`` come before it."""
    if "](" not in line:
        return line
    out: list[str] = []
    done = pos = 0  # line[:done] is in out; the next "[" is looked for from pos
    close = paren = -1  # the first "]" after the last "[" tried, the first ")" after its "]("
    while (bracket := line.find("[", pos)) >= 0:
        if close <= bracket:
            close = line.find("]", bracket + 1)
            if close < 0:
                break  # no "]" after this "[": nor after any later one
        pos = bracket + 1
        if not line.startswith("(", close + 1):
            continue
        if paren < close + 2:
            paren = line.find(")", close + 2)
            if paren < 0:
                break  # no ")" after this "](": nor after any later one
        start = bracket - 1 if bracket > done and line[bracket - 1] == "!" else bracket
        out += (line[done:start], line[bracket + 1 : close])
        done = pos = paren + 1
    return "".join(out) + line[done:] if out else line


@lru_cache(maxsize=16)
def _openers(marks: tuple[str, ...]) -> re.Pattern[str]:
    """Where one of ``marks`` opens an emphasis: the mark before a character that is not blank
    (a fixed string and a one-character lookahead: one pass)."""
    return re.compile("|".join(re.escape(mark) + r"(?=\S)" for mark in marks))


def reduce_emphasis(line: str) -> str:
    """``**strong**``, ``__strong__``, ``*em*`` and ```code``` as their words: from the first
    mark (in ``MARKS`` order where several start at one place) before a character that is not
    blank, to the first same mark after a character that is not blank, one or more characters
    on; left to right, no nesting. Where a mark has no close left, it is not tried again (the
    closes of ``*`` are those of ``**`` too), so each character is looked at a bounded number
    of times."""
    if "*" not in line and "_" not in line and "`" not in line:
        return line
    alive: tuple[str, ...] = MARKS
    closes = dict.fromkeys(MARKS, -1)  # each mark's first close at or after where last looked
    out: list[str] = []
    done = 0  # line[:done] is in out
    found = _openers(alive).search(line)
    while found is not None:
        at = found.start()
        dead: set[str] = set()
        for mark in alive:
            inner = at + len(mark)
            if not line.startswith(mark, at) or inner >= len(line) or line[inner].isspace():
                continue
            if closes[mark] <= inner:  # the first close from inner + 1 on, after no blank
                close = line.find(mark, inner + 1)
                while close > 0 and line[close - 1].isspace():
                    close = line.find(mark, close + 1)
                closes[mark] = close
            if closes[mark] < 0:
                dead.update(("*", "**") if mark == "*" else (mark,))
                continue
            out += (line[done:at], line[inner : closes[mark]])
            done = closes[mark] + len(mark)
            break
        if dead:
            alive = tuple(mark for mark in alive if mark not in dead)
            if not alive:
                break
        found = _openers(alive).search(line, done if done > at else at + 1)
    return "".join(out) + line[done:] if out else line


def reduce_inline(line: str) -> str:
    """A Markdown line (not in a code block) with links and emphasis reduced to their words."""
    return reduce_emphasis(reduce_links(line))


def clip_title(title: str) -> str:
    """A title of at most ``MAX_TITLE`` characters (and an ellipsis), cut at a word if it can."""
    if len(title) <= MAX_TITLE:
        return title
    cut = title.rfind(" ", MAX_TITLE // 2, MAX_TITLE)
    return title[: cut if cut > 0 else MAX_TITLE].rstrip() + "…"


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
        if is_fence(line):
            fenced = not fenced
            lines.append(line)
            continue
        heading = None if fenced else parse_heading(line)
        if heading is None:
            lines.append(line if fenced else reduce_inline(line))
            continue
        close()
        level, title = heading[0], reduce_inline(heading[1])
        path = [(lvl, t) for lvl, t in path if lvl < level]
        path.append((level, clip_title(title)))
        if len(title) > MAX_TITLE:  # its words are in the section, not only cut in the path
            lines.append(title)
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
    start = 0
    while len(text) - start > limit:
        for boundary in ("\n#", "\n\n", "\n", " "):
            cut = text.rfind(boundary, start + limit // 2, start + limit)
            if cut >= 0:
                cut += 1
                break
        else:
            cut = start + limit
        pieces.append(text[start:cut])
        start = cut
    return [*pieces, text[start:]] if start < len(text) else pieces
