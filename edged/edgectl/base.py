"""What edgectl's command groups share: the exit codes, reading an input file, a plain-text
table, and the request parameters that the global flags ask for."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from edged.client import ClientError
from edged.common.terminal import UsageError

# what each means is in edgectl --help (the docstring of edged/edgectl/parser.py)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_REJECTED, EXIT_NOT_READY = range(6)


def exit_code(error: ClientError) -> int:
    """The exit code that tells what failed."""
    if error.status == 0:
        return EXIT_UNREACHABLE
    if error.status == 503:
        return EXIT_NOT_READY
    if 400 <= error.status < 500:
        return EXIT_REJECTED
    return EXIT_FAILED


def read_input(path: str) -> bytes:
    """The bytes of a file, or of stdin for ``-``; UsageError when the file cannot be read."""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """Rows under a header, in columns as wide as their widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]
    ]
    return "\n".join(lines)


def request_params(args: argparse.Namespace) -> dict[str, Any]:
    """Request parameters from the global flags: the scheduler's (--priority, --timeout-ms)
    and the router's (--route, --private, --explain)."""
    params: dict[str, Any] = {}
    if args.priority:
        params["priority"] = args.priority
    if args.timeout_ms:
        params["timeout"] = round(args.timeout_ms * 1000)
    if args.route != "auto":
        params["route"] = args.route
    if args.private:
        params["private"] = True
    if args.explain:
        params["explain"] = True
    return params
