"""What the README and docs/ say about the code is what the code does (issue 31): the lists they
keep of commands and subcommands are the code's own."""

from __future__ import annotations

import re
from pathlib import Path

from cloudsync.fleet.cli import build_parser
from cloudsync.protocol.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_node_commands_are_the_protocols() -> None:
    text = (ROOT / "README.md").read_text()
    listed = re.search(r"Commands: (`ping`.*?)\s\(docs/PROTOCOL\.md\)", text, re.S)
    assert listed is not None
    names = set(re.findall(r"`([a-z-]+)`", listed.group(1)))
    assert names == {c.strip() for c in COMMANDS.split(",")}
    protocol = (ROOT / "docs" / "PROTOCOL.md").read_text()
    assert all(f"| `{name}` |" in protocol for name in names)


def test_the_architecture_names_every_edgefleet_command() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `cloudsync/fleet/cli.py`"))
    listed = set(re.findall(r"[a-z]+", row.split("`edgefleet` (", 1)[1].split(")", 1)[0]))
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) <= listed, set(commands) - listed
