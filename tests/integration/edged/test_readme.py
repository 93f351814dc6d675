"""The README's quick start, run as written (issue 31): every command of its "Try it" block,
against a daemon serving the default models as ``make run`` starts it (its socket in place of
``run/edged.sock``), from the checkout, with the sample files the repository keeps
(``samples/``): each exits 0 and prints what the README says it does."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import Daemon

ROOT = Path(__file__).resolve().parents[3]


def block_after(text: str, marker: str) -> list[str]:
    """The commands of the first ```sh block after ``marker``, continuation lines joined."""
    start = text.index(marker)
    body = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert body is not None, marker
    joined = body.group(1).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip()]


def test_the_quick_start_runs_as_written(daemon: Daemon) -> None:
    commands = block_after((ROOT / "README.md").read_text(), "Try it from another shell:")
    assert len(commands) >= 6 and all("run/edged.sock" in c for c in commands)
    outputs = []
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command.replace("run/edged.sock", str(daemon.socket))],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        outputs.append(done.stdout)
    said = dict(zip([c.split("edged.sock")[-1].split()[0] for c in commands], outputs))
    assert outputs[0].strip() == "200"  # ready
    assert '"intent"' in outputs[1]
    assert "ready" in said["status"]
    assert "cosine similarity" in said["embed"]
    assert "Total: $1,234.50" in said["ocr"] and "INVOICE" in said["ocr"], said["ocr"]
    (segment,) = re.findall(r"([\d.]+) s -> +([\d.]+) s", said["vad"])  # speech: 0.65-1.89 s
    assert abs(float(segment[0]) - 0.65) < 0.15 and abs(float(segment[1]) - 1.89) < 0.15
