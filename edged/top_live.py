"""``edgectl top``'s live loop: read edged's status and metrics, draw a frame with
``edged.top``, wait for a key, again, on the terminal's alternate screen until q or Ctrl-C.

``--once`` draws one frame as text instead (for scripts). rich is imported only here and in
``edged.top``, and only when top runs, so that edgectl's other commands start faster.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import select
import shutil
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from edged.client import Client, ClientError
from edged.common.terminal import UsageError

if TYPE_CHECKING:
    from rich.console import RenderableType

    from edged.top import Scrape


def cmd_top(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """One frame (--once), or the live view until q or Ctrl-C, whose last frame stays printed."""
    if not args.interval > 0:
        raise UsageError("--interval must be more than 0 seconds")
    # a hung edged shows as unreachable within seconds instead of freezing the view (and q)
    reader = Client(client.socket_path, timeout=min(client.timeout, max(5.0, args.interval)))
    host = platform.node()  # edged answers on a Unix socket: it runs on this machine
    if args.once:
        from edged.top import render_frame  # rich only for top: the other commands start faster

        status, scrape = _read(reader)
        return status, _as_text(render_frame(status, scrape, host=host), args.no_color)
    if not sys.stdout.isatty():
        raise UsageError("top needs a terminal; --once prints one frame (for scripts)")
    return _live_view(reader, args.interval, args.no_color, host)


def _read(client: Client) -> tuple[dict[str, Any], Scrape]:
    """edged's status and a scrape of its metrics; ClientError when edged does not answer."""
    from edged.top import Scrape

    status = client.status()
    try:
        scrape = Scrape.parse(client.metrics())
    except ValueError as exc:
        raise ClientError(500, f"edged's /metrics is not Prometheus text: {exc}") from None
    return status, scrape


def _live_view(
    client: Client, interval: float, no_color: bool, host: str
) -> tuple[dict[str, Any], str]:
    """Read, draw, wait for a key, on the terminal's alternate screen; the last status read and
    the last frame as text for the normal screen."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    from edged.top import render_frame, render_unreachable

    console = Console(no_color=no_color, highlight=False)
    hint = Text(f"every {interval:g} s · q quits", style="dim")
    status: dict[str, Any] = {}
    previous: Scrape | None = None
    read_at, epoch = 0.0, None
    frame: RenderableType = Text("")
    with _keys() as pressed, Live(console=console, screen=True, auto_refresh=False) as live:
        try:
            while True:
                try:
                    status, scrape = _read(client)
                    now = time.monotonic()
                    if status.get("epoch") != epoch:  # edged restarted: its counters did too
                        previous = None
                    frame = render_frame(
                        status, scrape, previous, now - read_at if previous else None, host
                    )
                    previous, read_at, epoch = scrape, now, status.get("epoch")
                except ClientError as exc:
                    frame = render_unreachable(exc.message, interval, host)
                live.update(Group(frame, hint), refresh=True)
                if pressed(interval):
                    break
        except KeyboardInterrupt:
            pass
    return status, _as_text(frame, no_color)


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], bool]]:
    """A wait of up to some seconds that says whether q was pressed: the terminal in cbreak mode
    (keys one at a time, not echoed; Ctrl-C still a signal) and restored on the way out."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:  # no keyboard: Ctrl-C (SIGINT) is the way out

        def sleep(seconds: float) -> bool:
            time.sleep(seconds)
            return False

        yield sleep
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def pressed(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([fd], [], [], left)[0] and b"q" in os.read(fd, 64).lower():
                return True
        return False

    try:
        yield pressed
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _as_text(frame: RenderableType, no_color: bool) -> str:
    """A frame as text for stdout: coloured on a terminal (unless --no-color or $NO_COLOR), plain
    in a pipe, which gets 120 columns unless $COLUMNS says otherwise."""
    from rich.console import Console

    terminal = sys.stdout.isatty()
    width = shutil.get_terminal_size().columns if terminal or "COLUMNS" in os.environ else 120
    console = Console(
        file=io.StringIO(), force_terminal=terminal, no_color=no_color, width=width, highlight=False
    )
    with console.capture() as captured:
        console.print(frame)
    return captured.get().rstrip("\n")
