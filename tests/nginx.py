"""nginx as the model CDN for tests: HTTPS (TLS 1.2+ with the test PKI's server certificate),
signed expiring URLs checked by its secure_link module (403 for a bad signature, 410 once
expired), an optional rate limit so that downloads last long enough to be interrupted, and an
access log of what it sent (URI, status, body bytes, Range) to count the bytes fetched.
Beside it, for what a client must refuse: ``/moved/...`` answers a redirect to ``/...``; the
same files over TLS 1.2 only (``tls12_base``) and over plain HTTP on loopback (``http_base``).
Started and stopped by PID.

And nginx as the API gateway in front of the cloud's inference server (``Gateway``): HTTPS with
TLS 1.3 only and mutual TLS (the fleet CA's device certificates), a bearer token, the path
prefix ``/api/v1/`` taken off on the way to the server's REST port, and gRPC over TLS (HTTP/2)
to its gRPC port with the same checks; its access log says what it saw."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from bench.peer import free_port
from tests.mosquitto import wait_listening

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SECRET = "test-cdn-secret"

# what every nginx here has: in the foreground, its files in its working directory; the
# ``http`` block it opens is closed by the config of its kind (CONFIG, GATEWAY)
COMMON = """
{user}
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log info;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {work}/tmp/body;
    proxy_temp_path {work}/tmp/proxy;
    fastcgi_temp_path {work}/tmp/fastcgi;
    uwsgi_temp_path {work}/tmp/uwsgi;
    scgi_temp_path {work}/tmp/scgi;
"""
CONFIG = """
    log_format served '$uri $status $body_bytes_sent "$http_range"';
    access_log {work}/access.log served;
    types {{ application/octet-stream onnx; }}
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {pki}/broker.pem;
        ssl_certificate_key {pki}/broker.key;
        ssl_protocols TLSv1.2 TLSv1.3;
        location /moved/ {{ rewrite ^/moved(/.*)$ $1 redirect; }}
        {models}
    }}
    server {{
        listen 127.0.0.1:{tls12_port} ssl;
        ssl_certificate {pki}/broker.pem;
        ssl_certificate_key {pki}/broker.key;
        ssl_protocols TLSv1.2;
        {models}
    }}
    server {{
        listen 127.0.0.1:{http_port};
        {models}
    }}
}}
"""
MODELS = """location /models/ {{
            root {root};
            secure_link $arg_md5,$arg_expires;
            secure_link_md5 "$secure_link_expires$uri {secret}";
            if ($secure_link = "") {{ return 403; }}
            if ($secure_link = "0") {{ return 410; }}
            limit_rate {rate};
        }}"""


GATEWAY = """
    log_format seen '$server_port $request_uri $status $ssl_protocol "$ssl_client_s_dn"'
                    ' "$http_authorization"';
    access_log {work}/access.log seen;
    client_max_body_size 64m;
    ssl_certificate {pki}/gateway.pem;
    ssl_certificate_key {pki}/gateway.key;
    ssl_protocols TLSv1.3;
    ssl_client_certificate {pki}/ca.pem;
    ssl_verify_client on;
    server {{
        listen 127.0.0.1:{port} ssl;
        location /api/v1/ {{
            if ($http_authorization != "{token}") {{ return 401; }}
            proxy_pass http://{http_upstream}/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
    server {{
        listen 127.0.0.1:{grpc_port} ssl http2;
        location / {{
            if ($http_authorization != "{token}") {{ return 401; }}
            grpc_pass grpc://{grpc_upstream};
        }}
    }}
}}
"""


N = TypeVar("N", bound="Nginx")


@dataclass
class Nginx:
    """An nginx of the tests, run from ``workdir`` with the config ``text()`` gives."""

    workdir: Path
    pki: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        self.config = self.workdir / "nginx.conf"

    @staticmethod
    def available() -> str | None:
        return None if os.path.exists(NGINX) else "nginx is not installed (make test installs it)"

    def text(self) -> str:
        raise NotImplementedError

    def write_config(self) -> None:
        # as root the workers would be nobody, who cannot read pytest's directories (0700)
        user = "user root;" if os.geteuid() == 0 else ""
        self.config.write_text(COMMON.format(user=user, work=self.workdir) + self.text())

    def start(self: N, timeout: float = 10.0) -> N:
        self.write_config()
        log = (self.workdir / "nginx.out").open("ab")
        self.proc = subprocess.Popen(
            [NGINX, "-c", str(self.config), "-p", str(self.workdir), "-e", "stderr"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_listening(self.proc, self.port, "nginx", self.logs, timeout)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # the master stops its worker
            self.proc.wait(10)

    def logs(self) -> str:
        parts = [self.workdir / "nginx.out", self.workdir / "error.log"]
        return "\n".join(p.read_text(errors="replace") for p in parts if p.exists())


@dataclass
class Cdn(Nginx):
    rate: str = "0"  # bytes a second per connection (nginx syntax: 0 is no limit, 2m...)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tls12_port, self.http_port = free_port(), free_port()
        self.root = self.workdir / "root"
        (self.root / "models").mkdir(parents=True, exist_ok=True)

    def text(self) -> str:
        models = MODELS.format(root=self.root, secret=SECRET, rate=self.rate)
        return CONFIG.format(
            work=self.workdir,
            port=self.port,
            pki=self.pki,
            models=models,
            tls12_port=self.tls12_port,
            http_port=self.http_port,
        )

    @property
    def base(self) -> str:
        return f"https://localhost:{self.port}"

    @property
    def tls12_base(self) -> str:
        """The same files over TLS 1.2 only."""
        return f"https://localhost:{self.tls12_port}"

    @property
    def http_base(self) -> str:
        """The same files over plain HTTP (loopback)."""
        return f"http://127.0.0.1:{self.http_port}"

    def put(self, relative: str, data: bytes) -> str:
        """A file under /models/: its path in URLs."""
        path = self.root / "models" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return f"/models/{relative}"

    def served(self) -> list[tuple[str, int, int, str]]:
        """(uri, status, body bytes, Range header) of each request, in order."""
        log = self.workdir / "access.log"
        rows = []
        for line in log.read_text().splitlines() if log.exists() else []:
            uri, status, sent, rng = line.split(" ", 3)
            rows.append((uri, int(status), int(sent), rng.strip('"')))
        return rows


@dataclass
class Gateway(Nginx):
    """The API gateway: ``https://localhost:{port}/api/v1/...`` to the server's REST port
    (``http_upstream``, host:port), gRPC over TLS on ``grpc_port`` to its gRPC port; TLS 1.3
    only, a device certificate of the fleet CA (``pki``: ca, gateway) and ``token``."""

    http_upstream: str = ""
    grpc_upstream: str = ""
    token: str = ""
    grpc_port: int = field(default_factory=free_port)

    def text(self) -> str:
        return GATEWAY.format(
            work=self.workdir,
            pki=self.pki,
            port=self.port,
            grpc_port=self.grpc_port,
            token=self.token,
            http_upstream=self.http_upstream,
            grpc_upstream=self.grpc_upstream,
        )

    def seen(self) -> list[dict[str, str]]:
        """What reached it, in order: port, URI, status, TLS version, client, token."""
        log = self.workdir / "access.log"
        rows = []
        for line in log.read_text().splitlines() if log.exists() else []:
            port, uri, status, tls, rest = line.split(" ", 4)
            client, token = rest.split('" "')
            rows.append(
                {
                    "port": port,
                    "uri": uri,
                    "status": status,
                    "tls": tls,
                    "client": client.strip('"'),
                    "token": token.strip('"'),
                }
            )
        return rows
