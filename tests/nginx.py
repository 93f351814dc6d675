"""nginx as the model CDN for tests: HTTPS (TLS 1.2+ with the test PKI's server certificate),
signed expiring URLs checked by its secure_link module (403 for a bad signature, 410 once
expired), an optional rate limit so that downloads last long enough to be interrupted, and an
access log of what it sent (URI, status, body bytes, Range) to count the bytes fetched.
Beside it, for what a client must refuse: ``/moved/...`` answers a redirect to ``/...``; the
same files over TLS 1.2 only (``tls12_base``) and over plain HTTP on loopback (``http_base``).
Started and stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.peer import free_port
from tests.mosquitto import wait_listening

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SECRET = "test-cdn-secret"

CONFIG = """
{user}
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log info;
events {{ worker_connections 64; }}
http {{
    log_format served '$uri $status $body_bytes_sent "$http_range"';
    access_log {work}/access.log served;
    client_body_temp_path {work}/tmp/body;
    proxy_temp_path {work}/tmp/proxy;
    fastcgi_temp_path {work}/tmp/fastcgi;
    uwsgi_temp_path {work}/tmp/uwsgi;
    scgi_temp_path {work}/tmp/scgi;
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


@dataclass
class Cdn:
    workdir: Path
    pki: Path
    rate: str = "0"  # bytes a second per connection (nginx syntax: 0 is no limit, 2m...)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.tls12_port, self.http_port = free_port(), free_port()
        self.root = self.workdir / "root"
        (self.root / "models").mkdir(parents=True, exist_ok=True)
        (self.workdir / "tmp").mkdir(exist_ok=True)
        self.config = self.workdir / "nginx.conf"
        self.write_config()

    @staticmethod
    def available() -> str | None:
        return None if os.path.exists(NGINX) else "nginx is not installed (make test installs it)"

    def write_config(self) -> None:
        # as root the workers would be nobody, who cannot read pytest's directories (0700)
        user = "user root;" if os.geteuid() == 0 else ""
        models = MODELS.format(root=self.root, secret=SECRET, rate=self.rate)
        self.config.write_text(
            CONFIG.format(
                user=user,
                work=self.workdir,
                port=self.port,
                pki=self.pki,
                models=models,
                tls12_port=self.tls12_port,
                http_port=self.http_port,
            )
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

    def start(self, timeout: float = 10.0) -> Cdn:
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

    def served(self) -> list[tuple[str, int, int, str]]:
        """(uri, status, body bytes, Range header) of each request, in order."""
        log = self.workdir / "access.log"
        rows = []
        for line in log.read_text().splitlines() if log.exists() else []:
            uri, status, sent, rng = line.split(" ", 3)
            rows.append((uri, int(status), int(sent), rng.strip('"')))
        return rows

    def logs(self) -> str:
        parts = [self.workdir / "nginx.out", self.workdir / "error.log"]
        return "\n".join(p.read_text(errors="replace") for p in parts if p.exists())
