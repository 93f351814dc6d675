"""A real PostgreSQL server (Debian's ``postgresql``) for the tests: a new cluster in a work
directory (``initdb``, trust auth on loopback only), started on a free port and stopped by PID.
PostgreSQL refuses to run as root: as root the server runs as the ``postgres`` user."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peer import free_port
from tests.mosquitto import wait_listening

BIN = Path("/usr/lib/postgresql")


def binaries() -> Path | None:
    """The newest installed PostgreSQL's bin directory."""
    found = sorted(BIN.glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    return found[-1].parent if found else None


@dataclass
class Postgres:
    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> str | None:
        if binaries() is None:
            return "PostgreSQL is not installed (make test installs Debian's postgresql)"
        return None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.data = self.workdir / "data"
        self.log = self.workdir / "postgres.log"
        self.user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None

    def _as_server(self) -> None:
        if self.user is not None:
            os.setgid(self.user.pw_gid)
            os.setuid(self.user.pw_uid)

    def start(self, timeout: float = 30.0) -> Postgres:
        bin_dir = binaries()
        assert bin_dir is not None
        if not self.data.exists():
            self.workdir.mkdir(parents=True, exist_ok=True)
            if self.user is not None:
                shutil.chown(self.workdir, self.user.pw_uid, self.user.pw_gid)
                self.workdir.chmod(0o755)
                for parent in self.workdir.parents:  # the server must reach its directory
                    if parent.stat().st_mode & 0o001 == 0:
                        parent.chmod(parent.stat().st_mode | 0o001)
            subprocess.run(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ],
                check=True,
                capture_output=True,
                preexec_fn=self._as_server,
            )
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(bin_dir / "postgres"),
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.workdir),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "fsync=off",
                    "-c",
                    "max_connections=200",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=self._as_server,
            )
        wait_listening(self.proc, self.port, "postgres", self.logs, timeout)
        deadline = time.monotonic() + timeout
        while self.psql("SELECT 1").returncode != 0:  # listening before it takes queries
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres does not answer: {self.logs()}")
            time.sleep(0.2)
        return self

    def psql(self, sql: str, database: str = "postgres") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "psql",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                database,
                "-Atc",
                sql,
            ],
            capture_output=True,
            text=True,
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        done = self.psql(f'CREATE DATABASE "{name}"')
        assert done.returncode == 0, done.stderr
        return self.url(name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)  # fast shutdown
            self.proc.wait(30)

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def fleet_store(kind: str, tmp_path: Path, cluster: Postgres | None) -> Any:
    """A new, empty fleet store: a SQLite file in ``tmp_path``, or a new database on
    ``cluster``."""
    import uuid

    from cloudsync.fleet.store import Store

    if kind == "sqlite":
        return Store(str(tmp_path / "fleet.db"))
    assert cluster is not None
    return Store(cluster.create_database(f"t{uuid.uuid4().hex[:12]}"))
