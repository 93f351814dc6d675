"""edgectl top against a real edged: one frame for scripts, and the live view in a real terminal
(tmux) that counts requests as they are served, says when edged is away, and quits on q."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, Daemon, linked_repository, skip_or_fail, wait_for
from tests.integration.edged.test_edgectl import edgectl


class Terminal:
    """A 160x50 tmux pane on a tmux server of its own (``-L``), killed at the end."""

    def __init__(self, workdir: Path) -> None:
        self.server = f"edged-top-{uuid.uuid4().hex[:8]}"
        self.exit_file = workdir / "exit-code"
        self.stty_file = workdir / "stty"

    def tmux(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.server, *args], capture_output=True, text=True, timeout=10
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    def run(self, *command: str) -> None:
        """Run a command in the pane; its exit code and the terminal's modes afterwards (stty:
        whether it was restored) land in files."""
        line = (
            f"{shlex.join(command)}; code=$?; stty -a > {shlex.quote(str(self.stty_file))};"
            f" echo $code > {shlex.quote(str(self.exit_file))}.tmp;"
            f" mv {shlex.quote(str(self.exit_file))}.tmp {shlex.quote(str(self.exit_file))}"
        )
        self.tmux("new-session", "-d", "-x", "160", "-y", "50", "-c", str(ROOT), line)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p")

    def exit_code(self) -> int | None:
        return int(self.exit_file.read_text()) if self.exit_file.exists() else None

    def close(self) -> None:
        """Kill the server, and remove its socket, which tmux leaves behind."""
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True, timeout=10)
        sockets = Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}"
        (sockets / self.server).unlink(missing_ok=True)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    if shutil.which("tmux") is None:
        skip_or_fail("tmux is not installed: the live view is tested in a real terminal")
    term = Terminal(tmp_path)
    try:
        yield term
    finally:
        term.close()


def top_command(socket: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "edged.edgectl",
        "--socket",
        str(socket),
        "top",
        "--interval",
        "0.5",
    ]


def model_row(screen: str, model: str) -> list[str] | None:
    """MODEL VER STATE QUEUE REQ/S REQS ERR% P50ms P95ms [REASON] of one model, as shown."""
    for line in screen.splitlines():
        cells = line.replace("│", " ").split()
        if cells[:1] == [model]:
            return cells
    return None


def quit_and_check(terminal: Terminal) -> None:
    """q ends the view at once with 0, and the terminal's modes are back (echo, line editing)."""
    terminal.tmux("send-keys", "q")
    wait_for(lambda: terminal.exit_code() is not None, 10, "edgectl top to exit after q")
    assert terminal.exit_code() == 0
    modes = terminal.stty_file.read_text().split()
    assert "icanon" in modes and "echo" in modes, modes


def test_once_prints_every_model_and_its_state(daemon: Daemon) -> None:
    out = edgectl(daemon.socket, "top", "--once", "--no-color")
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode()
    assert "READY" in text and "no cloud tier" in text and "Routes" in text
    for model in daemon.client.status()["models"]:
        cells = model_row(text, model["name"])
        assert cells is not None, f"{model['name']} is missing from\n{text}"
        assert cells[1:3] == [model.get("version", "-"), model["state"]], text
    assert "\x1b[" not in text  # no colour codes in a pipe


def test_once_without_edged_fails_like_the_other_commands(tmp_path: Path) -> None:
    out = edgectl(tmp_path / "absent.sock", "top", "--once")
    assert out.returncode == 3  # edged cannot be reached
    assert b"edgectl: cannot reach edged at" in out.stderr and not out.stdout


def test_the_live_view_counts_requests_as_they_are_served(
    daemon: Daemon, terminal: Terminal
) -> None:
    terminal.run(*top_command(daemon.socket))
    wait_for(lambda: model_row(terminal.screen(), "intent"), 30, "the intent row")
    before = int(model_row(terminal.screen(), "intent")[5])  # type: ignore[index]
    client = daemon.client
    for text in ("turn on the lights", "what is the GPU temperature", "hello"):
        client.intent([text])

    def total() -> int:
        cells = model_row(terminal.screen(), "intent")
        return int(cells[5]) if cells else -1

    wait_for(lambda: total() >= before + 3, 20, "the intent row to count 3 more requests")

    def rate_while_serving() -> bool:
        client.intent(["and another one"])  # requests keep coming, so every frame has some
        cells = model_row(terminal.screen(), "intent")
        return cells is not None and cells[4] not in ("-", "0")

    wait_for(rate_while_serving, 20, "a request rate on the intent row")
    screen = terminal.screen()
    assert "READY" in screen and "local" in screen, screen  # header, and the routes taken
    quit_and_check(terminal)


def test_the_live_view_waits_for_edged_and_recovers(
    make_daemon: Callable[..., Daemon], terminal: Terminal, tmp_path: Path
) -> None:
    later = make_daemon(models=linked_repository(tmp_path / "models", ["intent-classifier"]))
    terminal.run(*top_command(later.socket))
    wait_for(lambda: "cannot reach edged" in terminal.screen(), 20, "the view to say edged is away")
    assert terminal.exit_code() is None  # still running, still trying
    later.start()

    def served() -> bool:
        cells = model_row(terminal.screen(), "intent-classifier")
        return cells is not None and cells[2] == "READY"

    wait_for(served, 30, "the view to show the model once edged answers")
    quit_and_check(terminal)
