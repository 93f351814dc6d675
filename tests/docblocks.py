"""The shell blocks of README.md and docs/ as data (issue 31): each fenced ``sh`` or ``console``
block, its commands (continuation lines joined) and, for a console block, the output the docs
show after each command; and the catalogue that says how the tests run each block, or why a
block is not run here. ``tests/unit/test_docs.py`` keeps the catalogue whole (a new block must
be put in it) and parses every command with its program's own argument parser;
``tests/integration/test_doc_blocks.py`` runs the blocks against real daemons.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# a "# " line of a console block is root's prompt when it starts with one of these, else a
# comment
ROOT_PROMPT = {"apt", "chgrp", "curl", "edged-updater", "edgefleet", "install", "systemctl"}
PROGRAMS = {"edgectl", "edgefleet", "cloudsync", "edged-updater"}


@dataclass
class Command:
    text: str  # as a shell reads it: continuation lines joined
    line: int = 0  # in its file
    root: bool = False  # shown with root's prompt
    shown: list[str] = field(default_factory=list)  # the output shown after it

    def argv(self) -> list[str]:
        """Its words, the trailing comment left out (``$(...)`` stays one word)."""
        lexer = shlex.shlex(self.text, posix=True, punctuation_chars=False)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        return list(lexer)


@dataclass
class Block:
    path: str
    line: int
    lang: str
    commands: list[Command]

    @property
    def key(self) -> str:
        """The block's name in the catalogue: its file and its first command's first five
        words (stable when lines move)."""
        return f"{self.path}: {' '.join(self.commands[0].argv()[:5])}"


def _complete(text: str) -> bool:
    """Whether a shell would run ``text`` as it is (no ``\\`` at its end, no quote open)."""
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # No closing quotation
        return False
    return True


def _join(lines: list[str]) -> str:
    """Lines of one command as a shell reads them: ``\\`` and its line end are a space, a
    line end inside quotes stays."""
    text = lines[0]
    for line in lines[1:]:
        if text.endswith("\\"):
            text = text[:-1].rstrip() + " " + line.strip()
        else:
            text += "\n" + line
    return text


def _commands(lang: str, body: list[tuple[int, str]]) -> list[Command]:
    commands: list[Command] = []
    pending: list[str] = []  # a command's lines until it is complete
    first, root = 0, False
    for number, raw in body:
        text = raw.strip()
        if pending:
            pending.append(text)
        elif lang == "sh" and text and not text.startswith("#"):
            pending, first, root = [text], number, False
        elif lang == "console" and (
            text.startswith("$ ")
            or (text.startswith("# ") and text[2:].split(" ", 1)[0] in ROOT_PROMPT)
        ):
            pending, first, root = [text[2:]], number, text.startswith("#")
        elif commands and text and not text.startswith("# "):
            commands[-1].shown.append(re.sub(r"\s{2,}# .*$", "", text))  # less its comment
            continue
        else:
            continue
        if _complete(_join(pending)):
            commands.append(Command(_join(pending), first, root))
            pending = []
    assert not pending, f"an unfinished command at line {first}"
    return commands


def blocks(path: str) -> list[Block]:
    """Every ``sh`` and ``console`` block of ``path`` (relative to the repository)."""
    return parse(path, (ROOT / path).read_text())


def parse(path: str, text: str) -> list[Block]:
    """Every ``sh`` and ``console`` block of the Markdown ``text`` of ``path``."""
    found: list[Block] = []
    lines = text.splitlines()
    fence = re.compile(r"^(\s*)```(\w*)\s*$")
    i = 0
    while i < len(lines):
        opening = fence.match(lines[i])
        if not opening:
            i += 1
            continue
        j = i + 1
        while not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        if opening.group(2) in ("sh", "console"):
            body = [(n + 1, lines[n]) for n in range(i + 1, j)]
            commands = _commands(opening.group(2), body)
            if commands:  # a console block of output only (a benchmark's table) runs nothing
                found.append(Block(path, i + 1, opening.group(2), commands))
        i = j + 1
    return found


def every_block() -> list[Block]:
    return [block for path in DOCS for block in blocks(path)]


_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


def pattern(shown: str) -> re.Pattern[str]:
    """A line the docs show as a pattern of the real output, modulo numbers (any number where
    they show one), spacing (table columns) and ``...`` (anything; with the word it ends, as
    in an abbreviated hash ``31aa...``)."""
    out = []
    for part in re.split(r"(\w*\.\.\.|\s+|-?\d+(?:[.,]\d+)*)", shown):
        if part.endswith("..."):
            out.append(".*")
        elif part and part.isspace():
            out.append(r"\s+")
        elif part and _NUMBER.fullmatch(part):
            out.append(r"-?\d+(?:[.,]\d+)*")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def unshown(shown: list[str], output: str) -> list[str]:
    """The lines of ``shown`` that ``output`` does not have, in order (empty: all there)."""
    missing, at = [], 0
    lines = output.splitlines()
    for line in shown:
        regex = pattern(line)
        for k in range(at, len(lines)):
            if regex.search(lines[k]):
                at = k + 1
                break
        else:
            missing.append(line)
    return missing


# ---- the catalogue: every block is run by tests/integration/test_doc_blocks.py but these ----

PACKAGING = (
    "root, apt and minutes: make packaging (tests/packaging/test_deb.py, in make test) builds"
    " the package, runs lintian and installs, upgrades and purges it in a Debian 12 tree"
)
NOT_RUN: dict[str, str] = {
    "README.md: make run": (
        "make test is this run; make run's daemon is the one the other blocks run against,"
        " started as make run starts it (python -m edged, the default models, its own socket)"
    ),
    "README.md: .venv/bin/pytest tests/hostile": (
        "make test runs tests/hostile; bench/hostile.py is a benchmark, run by hand (its"
        " figures: docs/BENCHMARKS.md)"
    ),
    "README.md: make deb": PACKAGING,
    "README.md: make deb-arm64": (
        "qemu-user-static and 6 to 12 minutes, and the other targets 2 to 3 minutes each: not"
        " in make test (docs/BENCHMARKS.md, arm64 under qemu; tests/packaging/test_deb_arm64.py,"
        " tests/field/test_targets.py)"
    ),
    "README.md: make lint": (
        "make test runs lint, unit, integration and packaging; the benches and make mutation"
        " are run by hand (docs/BENCHMARKS.md and docs/TESTING.md have their figures)"
    ),
    "docs/OPERATIONS.md: make deb": PACKAGING,
    "docs/TESTING.md: make mutation": (
        "mutation testing takes about 25 minutes and is run by hand, not in make test"
        " (docs/TESTING.md has its figures)"
    ),
    "docs/OPERATIONS.md: sudo systemctl enable --now cloudsync": (
        "root and systemd as PID 1: tests/packaging/test_deb.py starts the installed units"
    ),
    "docs/OPERATIONS.md: edgefleet manifest --model edged --version": (
        "an edged package installed by dpkg as root: tests/packaging/test_updater.py runs"
        " edged-updater keep, apply and recover in a Debian 12 tree; README.md's block of the"
        " same manifest runs"
    ),
    "docs/OPERATIONS.md: sudo apt install git make": "on a Jetson (JetPack 6), with a network",
    "docs/OPERATIONS.md: apt install ./edged_*.deb mosquitto": (
        "root, apt and systemd as PID 1; README.md's fleet service block runs the same"
        " commands (token, keygen, serve) against this run's broker"
    ),
}
# single commands of blocks that run, not run (the start of the command as the docs show it)
NOT_RUN_COMMANDS: dict[str, str] = {
    "edged-updater keep": "root and dpkg: tests/packaging/test_updater.py",
    "edged-updater apply": "root and dpkg: tests/packaging/test_updater.py",
}
