"""cloudsync: keep this device in its fleet over MQTT (docs/PROTOCOL.md).

Config: --config FILE, else /etc/edged/cloudsync.toml when it exists, else embedded defaults.
It connects to the fleet's broker (MQTT 5, TLS 1.3, the node's certificate), announces the node
(retained status, with a retained offline last will), sends a heartbeat every 10 s, and delivers
the outbox (records that programs hand to its local API socket) without losing any. It starts
and works without a network and catches up when the broker can be reached. SIGTERM or SIGINT:
a retained offline status, then exit 0.

A new device with only the fleet's claim credential ([enrol]) first makes its key and asks the
fleet for its certificate (docs/PROTOCOL.md, "Enrolment"); a refusal exits 1.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sqlite3
import sys
import threading
from pathlib import Path

from cloudsync import __version__
from cloudsync.agent import config as config_module
from cloudsync.agent import enrol
from cloudsync.agent.local_api import LocalServer
from cloudsync.agent.outbox import OutboxError
from cloudsync.agent.session import Agent, node_name
from cloudsync.protocol.enrol import EnrolError
from edged.common.errors import ConfigError
from edged.common.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloudsync", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"cloudsync {__version__}")
    parser.add_argument("--config", type=Path, help="TOML config file")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_module.load(args.config)
    except ConfigError as exc:
        print(f"cloudsync: {exc}", file=sys.stderr)
        return 1
    level = args.log_level or config.log_level
    node = node_name(config.node.name)
    setup_logging(level, config.log_format, node, "cloudsync")
    enrol.settle(config)  # a renewal cut short by a power cut: the pair that goes together
    if enrol.needed(config):  # no certificate yet: the fleet's, with the claim credential
        stopping = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopping.set())
        try:
            if not enrol.enrol(config, node, stopping):
                return 0  # stopped while it waited
        except (EnrolError, OSError, ValueError) as exc:
            print(f"cloudsync: cannot enrol: {exc}", file=sys.stderr)
            return 1
    try:
        agent = Agent(config)
    except (OutboxError, sqlite3.Error, OSError) as exc:  # the outbox, nonces, trust dir
        print(f"cloudsync: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        local = LocalServer(
            config.local.socket,
            config.local.socket_mode,
            agent.outbox,
            agent.status,
            agent.metrics.render,
            config.local.read_timeout_s,
            config.local.max_connections,
        )
    except OSError as exc:
        print(
            f"cloudsync: cannot serve the local API on {config.local.socket}: {exc}",
            file=sys.stderr,
        )
        return 1
    local.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    logging.getLogger("cloudsync").info(
        "node %s of fleet %s; local API on %s; broker %s:%s",
        agent.node,
        config.node.fleet,
        config.local.socket,
        config.mqtt.host,
        config.mqtt.port,
    )
    try:
        agent.run()
    finally:
        local.shutdown()
        local.server_close()
        config.local.socket.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
