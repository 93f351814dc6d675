"""What edgefleet's two modes share: exit codes, failures, the files' signed URLs."""

from __future__ import annotations

import argparse
import base64
import hashlib
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_TIMEOUT = range(5)


class Failure(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def pairs(items: list[str]) -> dict[str, str]:
    """``k=v`` arguments (labels, selectors, ``--url path=URL``) as a dict of text."""
    return dict(item.partition("=")[::2] for item in items)


def secure_link_url(base: str, uri: str, secret: str, lifetime_s: float = 3600.0) -> str:
    """A signed, expiring URL in the form nginx's secure_link checks (``secure_link_md5
    "$secure_link_expires$uri SECRET"``), as CDNs sign theirs."""
    expires = int(time.time() + lifetime_s)
    digest = hashlib.md5(f"{expires}{uri} {secret}".encode(), usedforsecurity=False).digest()
    token = base64.urlsafe_b64encode(digest).decode().rstrip("=")
    return f"{base.rstrip('/')}{uri}?md5={token}&expires={expires}"


def desired_urls(args: argparse.Namespace, doc: dict[str, Any]) -> dict[str, str]:
    """The signed URLs of a manifest's files: given (--url path=URL), or made for a CDN that
    checks nginx-style secure links (--cdn, --cdn-prefix, --secure-link-secret-file)."""
    urls = pairs(args.url)
    if args.cdn:
        secret = Path(args.secure_link_secret_file).read_text().strip()
        for row in doc["signed"]["files"]:
            uri = f"{args.cdn_prefix.rstrip('/')}/{row['path']}"
            urls.setdefault(row["path"], secure_link_url(args.cdn, uri, secret, args.url_lifetime))
    missing = [r["path"] for r in doc["signed"]["files"] if r["path"] not in urls]
    if missing:
        raise Failure(f"no URL for {', '.join(missing)} (--url or --cdn)", EXIT_USAGE)
    return urls
