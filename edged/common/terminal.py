"""What the command-line tools (edgectl, edgefleet) share: the usage error, ``name=value``
arguments, and a quiet end when the reader of their output goes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went (head)


def reader_may_go(main: Callable[[], int]) -> int:
    """``main``'s exit code, or EXIT_PIPE when the reader of its output closed the pipe
    (``edgectl egress list | head``): the rest was not wanted, so no traceback is printed, for
    the write or for the flush at exit."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # stdout is dead: the interpreter's own flush at exit would raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE


class UsageError(Exception):
    """The command line cannot be carried out as given (exit code 2)."""


def key_values(items: list[str]) -> dict[str, Any]:
    """``name=value`` arguments as a mapping: JSON values (50, true, null, [...]) as such, any
    other value as text."""
    out: dict[str, Any] = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not name or not equals:
            raise UsageError(f"'{item}' is not name=value")
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out
