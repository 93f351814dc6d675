"""What the README and docs/ say about the code is what the code does (issue 31): the lists they
keep of commands and subcommands are the code's own, and every command their shell blocks show
is one its program takes (tests/docblocks.py; the integration test runs them)."""

from __future__ import annotations

import re
from pathlib import Path

from cloudsync.agent.cli import build_parser as cloudsync_parser
from cloudsync.fleet.cli import build_parser
from cloudsync.protocol.commands import COMMANDS
from cloudsync.updater import build_parser as updater_parser
from edged.edgectl.parser import build_parser as edgectl_parser
from tests.docblocks import (
    NOT_RUN,
    NOT_RUN_COMMANDS,
    Command,
    every_block,
    parse,
    pattern,
    unshown,
)

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
    rows = [line for line in text.splitlines() if line.startswith("| `cloudsync/fleet/cli.py`")]
    row = next(line for line in rows if "`edgefleet` (" in line)  # not the long modules' table
    listed = set(re.findall(r"[a-z]+", row.split("`edgefleet` (", 1)[1].split(")", 1)[0]))
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) <= listed, set(commands) - listed


# ---- every shell block of the docs: in the catalogue, and each command parses ----------------


def test_every_shell_block_is_run_or_says_why_not() -> None:
    """tests/integration/test_doc_blocks.py runs every block but those in NOT_RUN, each with
    its reason; a block added to the docs runs unless it is put there."""
    found = every_block()
    keys = [block.key for block in found]
    assert len(keys) == len(set(keys)), "two blocks with the same first command"
    assert set(NOT_RUN) <= set(keys), set(NOT_RUN) - set(keys)  # none stale
    assert all(len(why) > 30 for why in NOT_RUN.values())
    commands = [c.text for b in found for c in b.commands]
    assert all(any(c.startswith(start) for c in commands) for start in NOT_RUN_COMMANDS)
    assert len(found) >= 30 and {b.path for b in found} >= {"README.md", "docs/API.md"}


PARSERS = {
    "edgectl": edgectl_parser,
    "edgefleet": build_parser,
    "cloudsync": cloudsync_parser,
    "edged-updater": updater_parser,
}


def test_every_command_of_our_programs_in_the_docs_parses() -> None:
    """Each edgectl, edgefleet, cloudsync and edged-updater command the docs show, run or not,
    is one its program's parser takes: no option or subcommand the code does not have."""
    parsed = 0
    for block in every_block():
        for command in block.commands:
            argv = [w for w in command.argv() if w != "&"]
            if argv and argv[0] == "sudo":
                argv = argv[1:]
            program = argv[0].rsplit("/", 1)[-1] if argv else ""
            if program not in PARSERS:
                continue
            try:
                PARSERS[program]().parse_args(argv[1:])
            except SystemExit as exc:
                raise AssertionError(f"{block.path}:{command.line}: {command.text}") from exc
            parsed += 1
    assert parsed >= 60, parsed


def test_the_block_parser_joins_lines_and_reads_prompts_outputs_and_comments() -> None:
    text = """Some prose.

  ```console
  $ edgectl a 'x
    y' \\
      --b 1
  out 1
  # a comment, not output
  out 2     # what it means
  # edged-updater status
  $ edgectl c
  last
  ```

```sh
# a comment
make x   # trailing
curl -d '{
"a": 1
}' url
```

```console
a console block of output only
```
"""
    (console, sh) = parse("t.md", text)
    assert [(c.text, c.root, c.shown) for c in console.commands] == [
        ("edgectl a 'x\ny' --b 1", False, ["out 1", "out 2"]),
        ("edged-updater status", True, []),
        ("edgectl c", False, ["last"]),
    ]
    assert [c.text for c in sh.commands] == ["make x   # trailing", "curl -d '{\n\"a\": 1\n}' url"]
    assert console.key == "t.md: edgectl a x\ny --b 1"  # its first five words
    assert Command("edgefleet x --k v # the comment's words").argv() == [
        "edgefleet",
        "x",
        "--k",
        "v",
    ]


def test_a_shown_line_matches_modulo_numbers_spacing_and_ellipses() -> None:
    assert pattern("jetson-17   online   3s ago  0  intent, ...").search(
        "jetson-17 online      12s ago     4  intent, ocr, vad"
    )
    assert not pattern("1 event(s)").search("one event(s)")
    assert pattern("seq 1 to 4,183, head 31aa...").search("seq 1 to 17, head 9f00c1")
    assert pattern("ok: -0.5 ms").search("ok: 12 ms") and not pattern("a.b").search("axb")
    assert unshown(["a 1", "b 2", "c"], "a 7\nnoise\nb 8\n") == ["c"]
    assert unshown(["b", "a"], "a\nb\n") == ["a"]  # in order
