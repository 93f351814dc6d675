"""Issue 44, point 13: ``edgectl`` and ``edgefleet`` piped into ``head`` ended in a
BrokenPipeError traceback. Their entry points (``edged.common.terminal.reader_may_go``) now end
quietly with 141, as a shell reports a tool whose reader went. A real pipe into the real
``head``; the command writes far more than the pipe holds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

# The tool's real entry point, its command swapped for one that writes 13 MB.
LOUD = """
import sys
import {module} as tool
def run(argv):
    for i in range(200_000):
        print(f"line {{i}}: " + "x" * 60)
    return 0
tool.run = run
sys.exit(tool.main([]))
"""


@pytest.mark.parametrize("module", ["edged.edgectl.parser", "cloudsync.fleet.cli"])
def test_a_reader_that_goes_gets_no_traceback(module: str) -> None:
    code = LOUD.format(module=module)
    shell = f"{sys.executable} -c '{code}' | head -n 2; echo \"status ${{PIPESTATUS[0]}}\" >&2"
    done = subprocess.run(
        ["bash", "-c", shell], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.stdout.splitlines() == ["line 0: " + "x" * 60, "line 1: " + "x" * 60]
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.stderr.strip() == "status 141"
