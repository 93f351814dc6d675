"""edgefleet as a client of the fleet service (``--service URL``): the same commands, answered
by the service's HTTP API (docs/fleet-api.json) instead of the broker."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TOKEN_ENV = "EDGEFLEET_TOKEN"


class ServiceError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


class ServiceClient:
    def __init__(self, url: str, token: str, ca_file: str | None = None,
                 timeout: float = 10.0) -> None:  # fmt: skip
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout
        self.context = None
        if self.url.startswith("https://"):
            self.context = ssl.create_default_context(cafile=ca_file)
            self.context.minimum_version = ssl.TLSVersion.TLSv1_3

    @classmethod
    def from_args(cls, url: str, token_file: str | None, ca_file: str | None,
                  timeout: float) -> ServiceClient:  # fmt: skip
        """The token from ``token_file``, else $EDGEFLEET_TOKEN."""
        token = Path(token_file).read_text().strip() if token_file else os.environ.get(TOKEN_ENV)
        if not token:
            raise ServiceError(0, f"a token: --token-file or ${TOKEN_ENV}")
        return cls(url, token, ca_file, timeout)

    def call(self, method: str, path: str, body: Any = None, **query: Any) -> Any:
        params = {k: v for k, v in query.items() if v not in (None, "")}
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            url,
            data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout,
                                        context=self.context) as reply:  # fmt: skip
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                message = exc.reason
            raise ServiceError(exc.code, str(message)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServiceError(0, f"cannot reach the service at {self.url}: {exc}") from None

    def nodes(self, page: int = 1000, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every node (the pages one after another), filtered as the API filters."""
        after = ""
        while True:
            got = self.call("GET", "/v1/nodes", limit=page, after=after, **filters)
            yield from got["nodes"]
            if got["next"] is None:
                return
            after = got["next"]


def nodes_text(rows: list[dict[str, Any]], now_ms: int) -> str:
    lines = [f"{'NODE':20} {'STATE':8} {'HEARTBEAT':>10}  {'MODELS':30} LABELS"]
    for r in rows:
        seen = r.get("last_seen_ms")
        age = "-" if not seen else f"{max(0, now_ms - seen) / 1000:.0f}s ago"
        models = ", ".join(f"{m['name']}:{m['version']}" for m in r.get("models", [])) or "-"
        labels = ",".join(f"{k}={v}" for k, v in sorted(r.get("labels", {}).items())) or "-"
        lines.append(f"{r['node']:20} {r['state']:8} {age:>10}  {models:30} {labels}")
    return "\n".join(lines)
