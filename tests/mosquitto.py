"""A real Mosquitto for the tests: TLS 1.3 only, client certificates required (the certificate's
CN is the MQTT user), ACLs that keep each node under its own topics, and persistence, on
loopback; started, killed and restarted by PID.

The same configuration is the one docs/PROTOCOL.md gives operators (``render_config``).
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.peer import free_port
from cloudsync.agent.session import MAX_PACKET
from tests.pki import issue

OPERATOR = "operator"  # the CN of the operators' certificate: the fleet's whole tree
CLAIM = "enrol+claim"  # the claim certificate's CN: its + keeps the node pattern from it

ACL = f"""\
# Nodes: only their own subtree, whatever the fleet (the certificate's CN is the user, %u);
# what the fleet tells a node (desired states, commands, a renewed certificate) it only reads.
pattern write edge/v1/+/%u/status
pattern write edge/v1/+/%u/heartbeat
pattern write edge/v1/+/%u/telemetry
pattern write edge/v1/+/%u/events
pattern write edge/v1/+/%u/cmd/+/result
pattern write edge/v1/+/%u/renew
pattern read edge/v1/+/%u/#

# Operators (edgefleet): every node of every fleet.
user {OPERATOR}
topic readwrite edge/v1/#

# The claim credential: a new device asks for its certificate, and nothing else (Mosquitto
# never puts a user name with a + into a pattern: the first line gives it nothing).
user {CLAIM}
topic write edge/v1/+/_enrol/+
topic read edge/v1/+/_enrol/+/cert
"""


def render_config(
    port: int,
    pki: Path,
    acl_file: Path,
    data: Path,
    websockets_port: int | None = None,
    user: str = "mosquitto",
    max_packet_size: int | None = MAX_PACKET,
    crl_file: Path | None = None,
    address: str = "127.0.0.1",
) -> str:
    """mosquitto.conf: a TLS 1.3 listener on ``address`` with client certificates, ACLs,
    persistence, and the largest packet a node takes (None: Mosquitto's default, none); run as
    ``user`` (started as root, mosquitto drops to it, and it must own ``data``)."""
    tls = f"""\
cafile {pki}/ca.pem
certfile {pki}/broker.pem
keyfile {pki}/broker.key
require_certificate true
use_identity_as_username true
tls_version tlsv1.3
"""
    if crl_file is not None:  # the fleet service's CRL (edgefleet enrol revoke); SIGHUP reloads
        tls += f"crlfile {crl_file}\n"
    text = f"""\
user {user}
per_listener_settings false
allow_anonymous false
acl_file {acl_file}
persistence true
persistence_location {data}/
autosave_interval 1
max_queued_messages 100000
{f"max_packet_size {max_packet_size}" if max_packet_size else ""}
log_dest stderr
log_type error
log_type warning
log_type notice

listener {port} {address}
{tls}"""
    if websockets_port is not None:
        text += f"\nlistener {websockets_port} 127.0.0.1\nprotocol websockets\n{tls}"
    return text


def make_pki(directory: Path, nodes: list[str]) -> Path:
    """ca, broker (localhost), a certificate per node, the operator's and the claim
    credential's (``claim``), and a rogue one from another CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = issue("fleet CA", None, directory, "ca")
    issue("localhost", ca, directory, "broker", server=True)
    for node in [*nodes, OPERATOR]:
        issue(node, ca, directory, node)
    issue(CLAIM, ca, directory, "claim")
    other = issue("someone else's CA", None, directory, "other-ca")
    issue(nodes[0] if nodes else "rogue", other, directory, "rogue")
    return directory


def wait_listening(
    proc: subprocess.Popen[bytes], port: int, what: str, logs: Callable[[], str], timeout: float
) -> None:
    """Until ``proc`` accepts connections on ``port``; RuntimeError with its logs if it exits
    or does not listen in time (the caller stops it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {logs()}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}: {logs()}")


def edgefleet(
    broker: Broker, *args: str, fleet: str = "f1", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """The real ``edgefleet`` command against ``broker`` as the operator."""
    return subprocess.run(
        edgefleet_command(broker, *args, fleet=fleet),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def edgefleet_command(broker: Broker, *args: str, fleet: str = "f1") -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(broker.port), "--pki", str(broker.pki)]
    return [sys.executable, "-m", "cloudsync.fleet.cli", *common, "--fleet", fleet, *args]


class Stoppable:
    """A process of the tests' own, stopped by PID: ``proc`` and its ``log`` file."""

    proc: subprocess.Popen[bytes] | None
    log: Path
    stop_timeout_s = 10.0

    def stop(self) -> None:
        """SIGTERM (a clean stop), then wait."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(self.stop_timeout_s)

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class Broker(Stoppable):
    """One mosquitto process over a work directory (config, ACL, persistence, log); ``stop``
    lets it save its persistence file, ``kill`` saves nothing beyond the last autosave."""

    workdir: Path
    pki: Path
    port: int = 0
    websockets_port: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    max_packet_size: int | None = MAX_PACKET
    crl_file: Path | None = None

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        acl = self.workdir / "acl"
        acl.write_text(ACL)
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        self.config = self.workdir / "mosquitto.conf"
        self.config.write_text(
            render_config(
                self.port,
                self.pki,
                acl,
                data,
                self.websockets_port,
                getpass.getuser(),
                self.max_packet_size,
                self.crl_file,
            )
        )
        self.log = self.workdir / "mosquitto.log"

    @staticmethod
    def available() -> str | None:
        """Why there is no broker to test with, or None."""
        return None if shutil.which("mosquitto") else "mosquitto is not installed (make test)"

    def reload(self) -> None:
        """SIGHUP: Mosquitto reads its config again (the CRL too)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGHUP)

    def start(self, timeout: float = 10.0) -> Broker:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                ["mosquitto", "-c", str(self.config)], stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_listening(self.proc, self.port, "mosquitto", self.logs, timeout)
        except RuntimeError:
            self.kill()
            raise
        return self


def cloudsync_config(
    broker: Broker,
    workdir: Path,
    fleet: str,
    node: str = "n1",
    edged_socket: Path | None = None,
    more: str = "",
    mqtt: str = "",
) -> str:
    """A cloudsync config for ``node`` against ``broker``, everything under ``workdir``;
    ``mqtt``: more lines of the [mqtt] section, ``more``: more sections."""
    pki = broker.pki
    return f"""
[node]
fleet = "{fleet}"
name = "{node}"
[mqtt]
host = "127.0.0.1"
port = {broker.port}
ca_file = "{pki}/ca.pem"
cert_file = "{pki}/{node}.pem"
key_file = "{pki}/{node}.key"
{mqtt}
[outbox]
path = "{workdir}/outbox.db"
[edged]
socket = "{edged_socket or workdir / "no-edged.sock"}"
[local]
socket = "{workdir}/cloudsync.sock"
[commands]
trust_dir = "{workdir}/trust"
{more}
"""
