"""Debian's Prometheus and Alertmanager for the tests, each over a work directory of its own,
listening on loopback only (Alertmanager's cluster gossip off), started and stopped by PID;
and a webhook receiver (Alertmanager's routing pages it) on a loopback port."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bench.peer import free_port
from tests.mosquitto import Stoppable, wait_listening

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"


def need(binary: str, package: str) -> None:
    if not Path(binary).exists():
        pytest.skip(f"{binary} is not installed (Debian's {package}: make .stamps/apt-test)")


def launch(server: Prometheus | Alertmanager, command: list[str], timeout: float) -> None:
    """``command`` started for ``server``, its output in its log, until it listens on its
    port (killed, and RuntimeError with its log, if it does not)."""
    with server.log.open("ab") as log:
        server.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_listening(server.proc, server.port, Path(command[0]).name, server.logs, timeout)
    except RuntimeError:
        server.kill()
        raise


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


@dataclass
class Prometheus(Stoppable):
    """``prometheus`` scraping the fleet service's ``/v1/fleet/metrics`` every ``interval_s``
    as the docs say (bearer token, ``honor_labels``), with ``rules`` loaded."""

    workdir: Path
    target: str  # host:port of the fleet service
    token: str
    interval_s: float = 1.0
    rules: list[Path] = field(default_factory=list)
    shards: int = 1  # scrape targets, each a shard of the fleet's series
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.log = self.workdir / "prometheus.log"
        interval = f"{int(self.interval_s * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(r) for r in self.rules],
            "scrape_configs": [
                {
                    "job_name": "edgefleet",
                    "metrics_path": "/v1/fleet/metrics",
                    "honor_labels": True,
                    "authorization": {"credentials": self.token},
                    "static_configs": [
                        {
                            "targets": [self.target],
                            "labels": {"__param_shard": str(i), "__param_shards": str(self.shards)},
                        }
                        for i in range(self.shards)
                    ],
                }
            ],
        }
        self.config = self.workdir / "prometheus.yml"
        self.config.write_text(json.dumps(config))  # YAML takes JSON

    def start(self, timeout: float = 30.0) -> Prometheus:
        need(PROMETHEUS, "prometheus")
        launch(
            self,
            [
                PROMETHEUS,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            timeout,
        )
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now: [{"metric": labels, "value": [t, "v"]}]."""
        found = get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert found["status"] == "success", found
        return list(found["data"]["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(get_json(f"{self.url}/api/v1/targets")["data"]["activeTargets"])


class Pages:
    """A webhook receiver: what Alertmanager's routing sends (each notification's JSON)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        pages = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                pages.received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, status: str | None = None) -> list[dict[str, Any]]:
        """Every alert of every notification (with ``status``: firing or resolved)."""
        return [
            a for n in self.received for a in n["alerts"] if status is None or a["status"] == status
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Alertmanager(Stoppable):
    """``prometheus-alertmanager`` routing every alert to ``webhook`` at once (no grouping
    wait), clustering off."""

    workdir: Path
    webhook: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.log = self.workdir / "alertmanager.log"
        config = {
            "route": {
                "receiver": "hook",
                "group_by": ["alertname", "instance"],
                "group_wait": "0s",
                "group_interval": "1s",
                "repeat_interval": "1h",
            },
            "receivers": [
                {"name": "hook", "webhook_configs": [{"url": self.webhook, "send_resolved": True}]}
            ],
        }
        self.config = self.workdir / "alertmanager.yml"
        self.config.write_text(json.dumps(config))

    def start(self, timeout: float = 30.0) -> Alertmanager:
        need(ALERTMANAGER, "prometheus-alertmanager")
        launch(
            self,
            [
                ALERTMANAGER,
                f"--config.file={self.config}",
                f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
            ],
            timeout,
        )
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alerts(self, active: bool = True) -> list[dict[str, Any]]:
        """Its API v2's alerts (active ones, or with ``active=False`` the rest too)."""
        query = "" if active else "?active=true&silenced=true&inhibited=true&unprocessed=true"
        return list(get_json(f"{self.url}/api/v2/alerts{query}"))
