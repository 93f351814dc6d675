"""The real fleet service (``edgefleet serve``) for the tests: a config against a test broker,
the process started, killed and restarted by PID, and calls to its API with a token per role.

It runs as its unit runs it (systemd/edgefleet.service): a user of its own, ``edgefleet-test``
(never root), under the unit's umask (0077) and descriptor limit (tests/asunit.py); its work
directory is that user's. A file the service writes elsewhere (the broker's CRL and ACL) is
given to it with ``writes``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.peer import free_port
from tests import asunit
from tests.mosquitto import OPERATOR, Broker, Stoppable, wait_listening

TOKENS = {role: f"{role}-token-0123456789abcdef" for role in ("viewer", "operator", "admin")}
USER = "edgefleet-test"  # systemd/edgefleet.service's User=edgefleet
UMASK = 0o077  # its UMask=


def tokens_toml() -> str:
    return "".join(
        f'[[api.tokens]]\nname = "{role}-user"\nrole = "{role}"\n'
        f'sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
        for role, token in TOKENS.items()
    )


@dataclass
class FleetService(Stoppable):
    """One ``edgefleet serve`` over a work directory (config, SQLite state, log)."""

    workdir: Path
    broker: Broker
    fleet: str = "f1"
    database: str = ""
    replica: str = "r1"
    more: str = ""  # more lines of [service]
    mqtt: str = ""  # more lines of [mqtt]
    sections: str = ""  # more sections ([alerts], [events]...)
    port: int = 0
    as_unit: bool = True  # False: as root, for a test about root
    proc: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        pki = self.broker.pki
        database = f'database = "{self.database}"' if self.database else ""
        self.config = self.workdir / "edgefleet.toml"
        self.config.write_text(f"""
[service]
fleet = "{self.fleet}"
replica = "{self.replica}"
state_dir = "{self.workdir / "state"}"
{database}
reconcile_s = 5
lease_s = 3
{self.more}
[mqtt]
host = "127.0.0.1"
port = {self.broker.port}
ca_file = "{pki}/ca.pem"
cert_file = "{pki}/{OPERATOR}.pem"
key_file = "{pki}/{OPERATOR}.key"
{self.mqtt}
[api]
port = {self.port}
{tokens_toml()}
[log]
format = "text"
{self.sections}
""")
        self.log = self.workdir / "edgefleet.log"
        self.log.touch()
        self.stop_timeout_s = 20.0
        self.account = asunit.account(USER) if self.as_unit else None
        if self.account is not None:
            self.account.own(self.workdir)
            asunit.reachable(pki)  # its certificate and key (0644 here, as the tests make them)

    def writes(self, *paths: Path) -> None:
        """The service (its user) may write ``paths`` (files it writes atomically: their
        directories too), as the package gives edgefleet the broker's CRL and ACL."""
        for path in paths:
            self.reads(path.parent)
            if path.exists():
                self.reads(path)

    def reads(self, *paths: Path) -> None:
        """``paths`` become the service user's (a secret it reads: the deploy key, 0600), as
        the package makes /etc/edgefleet root:edgefleet."""
        if self.account is None:
            return
        for path in paths:
            asunit.reachable(path)
            os.chown(path, self.account.uid, self.account.gid)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> FleetService:
        command = [
            sys.executable,
            "-m",
            "cloudsync.fleet.cli",
            "serve",
            "--config",
            str(self.config),
        ]
        unit = {**self.account.popen(), "umask": UMASK} if self.account is not None else {}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **unit)
        self.starts.append(time.monotonic())
        try:
            wait_listening(self.proc, self.port, "edgefleet serve", self.logs, timeout)
            deadline = time.monotonic() + timeout
            while self.call("GET", "/healthz")[0] != 200:  # the broker too
                if time.monotonic() > deadline:
                    raise RuntimeError(f"edgefleet serve is not healthy: {self.logs()}")
                time.sleep(0.1)
        except RuntimeError:
            self.kill()
            raise
        return self

    def start_or(self, *undo: Callable[[], object]) -> FleetService:
        """Started; when it cannot start, ``undo`` (what the test started before it, stopped)
        and the error raised."""
        try:
            return self.start()
        except BaseException:
            for stop in undo:
                stop()
            raise

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        role: str | None = "admin",
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        """(status, JSON answer) of one call as ``role`` (None: no token)."""
        headers = {"Content-Type": "application/json"}
        if role is not None:
            headers["Authorization"] = f"Bearer {TOKENS[role]}"
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, _json_or_text(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json_or_text(exc.read())
        except OSError as exc:
            return 0, str(exc)

    def run_edgefleet(self, *args: str, role: str = "operator") -> subprocess.CompletedProcess[str]:
        """The real ``edgefleet --service`` command with ``role``'s token, as a person types it."""
        return subprocess.run(
            [sys.executable, "-m", "cloudsync.fleet.cli", "--service", self.url, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "EDGEFLEET_TOKEN": TOKENS[role]},
        )

    def edgefleet(self, *args: str, role: str = "operator") -> Any:
        """The same command's JSON answer (``--json``, after the command's own arguments)."""
        done = self.run_edgefleet(*args, "--json", role=role)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def counter(self, sample: str) -> float:
        """One sample of the service's own /metrics (``name{labels}`` as Prometheus writes it),
        0 when it has none yet."""
        text = self.call("GET", "/metrics", role=None)[1]
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == sample:
                return float(value)
        return 0.0

    def wait_for(self, what: Any, timeout: float = 30.0, step: float = 0.2) -> Any:
        """Polls ``what()`` until it returns something true; its last answer."""
        deadline = time.monotonic() + timeout
        while True:
            got = what()
            if got or time.monotonic() > deadline:
                return got
            time.sleep(step)


def _json_or_text(data: bytes) -> Any:
    try:
        return json.loads(data or b"null")
    except ValueError:
        return data.decode(errors="replace")
