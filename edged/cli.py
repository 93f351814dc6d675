"""The ``edged`` command: run the daemon, or check a config file."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import functools
import json
import logging
import socket
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from edged import __version__
from edged import config as config_module
from edged.common import heap, logs
from edged.common.errors import ConfigError, EdgedError
from edged.common.settings import renamed

DESCRIPTION = """\
edged serves inference on this device over a Unix socket (Open Inference Protocol REST).

Config: --config FILE, else /etc/edged/edged.toml when it exists, else embedded defaults.
Flags override the file. Under systemd: Type=notify, watchdog and socket activation work.
Signals: SIGTERM drains in-flight requests and exits 0; SIGHUP re-reads the config file (the
flags still override it) and polls the model repository (new, changed and removed models);
SIGABRT (systemd's watchdog) writes every thread's stack to stderr before edged dies.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (shared by serve and validate-config)."""
    parser = argparse.ArgumentParser(
        prog="edged", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"edged {__version__}")
    parser.add_argument("--config", type=Path, help="TOML config file")
    parser.add_argument("--socket", type=Path, help="Unix socket path (server.socket)")
    parser.add_argument("--state-dir", type=Path, help="state directory (state_dir)")
    parser.add_argument("--models", type=Path, help="model repository (models.repository)")
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="log.level"
    )
    parser.add_argument(
        "command",
        nargs="?",
        default="serve",
        choices=["serve", "validate-config"],
        help="serve (default) or validate-config: check the config, print it, exit 0 or 1",
    )
    return parser


def effective_config(args: argparse.Namespace) -> config_module.Config:
    """The config file (or defaults) with the command-line overrides applied."""
    config = config_module.load(args.config)
    if args.socket:
        config.server.socket = args.socket.absolute()
    if args.state_dir:
        config.state_dir = args.state_dir.absolute()
    if args.models:
        config.models.repository = args.models.absolute()
    if args.log_level:
        config.log.level = args.log_level
    return config


def warn_renamed(config: config_module.Config) -> config_module.Config:
    """``config``, each key it gave by an old name logged (at start and on SIGHUP)."""
    for note in renamed(config):
        logging.getLogger("edged").warning("config: %s", note)
    return config


def reread(args: argparse.Namespace) -> config_module.Config:
    """The config again (SIGHUP)."""
    return warn_renamed(effective_config(args))


def run_loop(main: Coroutine[Any, Any, int], server: config_module.ServerConfig) -> int:
    """``main`` on the event loop ``server.event_loop`` names (uvloop where installed)."""
    if server.event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            logging.getLogger("edged").info(
                "server.event_loop: uvloop is not installed here; the standard event loop serves"
            )
        else:
            return int(uvloop.run(main))
    return asyncio.run(main)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edged`` console script."""
    heap.fix_thresholds()  # before the daemon's imports allocate (edged/common/heap.py)
    args = build_parser().parse_args(argv)
    try:
        config = effective_config(args)
    except ConfigError as exc:
        print(f"edged: invalid configuration:\n{exc.message}", file=sys.stderr)
        return 1
    if args.command == "validate-config":
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        for note in renamed(config):
            print(f"edged: config: {note}", file=sys.stderr)
        print("edged: configuration is valid", file=sys.stderr)
        return 0
    logs.setup_logging(config.log.level, config.log.format, socket.gethostname(), "edged")
    warn_renamed(config)
    from edged.app import Daemon  # heavy imports (onnxruntime) only when serving

    faulthandler.enable()  # a hang killed by the watchdog leaves its stacks in the journal

    try:
        return run_loop(Daemon(config, functools.partial(reread, args)).run(), config.server)
    except EdgedError as exc:
        logging.getLogger("edged").error("%s", exc.message)
        return 1


if __name__ == "__main__":
    sys.exit(main())
