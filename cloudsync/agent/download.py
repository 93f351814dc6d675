"""Downloads for model delivery: one file from its signed, expiring URL, resumed, bounded and
checked (``fetch``), over https only (plain http to a loopback host only with
``allow_http_loopback``), TLS 1.3, no redirects; a failure reported as a category that can go
to the fleet (``category``), its detail only in the local log."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import ipaddress
import logging
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cloudsync.protocol.envelope import printable
from cloudsync.protocol.manifest import FileEntry
from edged.common.digest import sha256_of

log = logging.getLogger("cloudsync.delivery")
CHUNK = 1 << 16
REDIRECT = "a redirect (not followed)"


class DeliveryError(Exception):
    """A step that failed; the message says why (and it is reported). ``retry``: whether
    trying again soon may mend it (a broken connection) or not (a refusal, corruption)."""

    def __init__(self, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry


@dataclass
class Counters:
    downloaded: int = 0  # bytes fetched
    resumed: int = 0  # bytes already on disk, not fetched again


def check_url(url: str, allow_http_loopback: bool = False) -> None:
    """DeliveryError (not retried) unless ``url`` is https, or plain http to a loopback host
    with ``allow_http_loopback``: no file, ftp, data or other scheme."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        _ = parts.port  # one that is not a number raises here
    except ValueError:
        raise DeliveryError("the URL is not valid", retry=False) from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        shown = printable(scheme, 20) if scheme else "(none)"
        raise DeliveryError(f"URL scheme '{shown}' refused: https only", retry=False)
    if not host or any(c.isspace() or ord(c) < 32 for c in url):
        raise DeliveryError("the URL is not valid", retry=False)
    if scheme == "http" and not allow_http_loopback:
        raise DeliveryError("plain http refused: https only", retry=False)
    if scheme == "http" and not _loopback(host):
        raise DeliveryError(
            "plain http to a host that is not loopback refused: https only", retry=False
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def opener(context: ssl.SSLContext, allow_http: bool) -> urllib.request.OpenerDirector:
    """urllib with https (``context``) and, when allowed, http only: no file, ftp or data
    handler, and no redirect handler (a 3xx is an HTTPError, not followed)."""
    director = urllib.request.OpenerDirector()
    handlers: list[urllib.request.BaseHandler] = [
        urllib.request.ProxyHandler(),  # the environment's, as urlopen does
        urllib.request.UnknownHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
        urllib.request.HTTPSHandler(context=context),
    ]
    if allow_http:
        handlers.append(urllib.request.HTTPHandler())
    for handler in handlers:
        director.add_handler(handler)
    return director


def category(exc: BaseException, reading: bool = False) -> tuple[str, bool]:
    """What failed in a download, in words that can go to the fleet (no address, port or OS
    error: the local log has those), and whether trying again may mend it."""
    if isinstance(exc, urllib.error.HTTPError):
        if 300 <= exc.code < 400:
            return REDIRECT, False
        if exc.code in (403, 410):
            return f"the server answered {exc.code}: the signed URL expired or is not valid", False
        return f"the server answered {exc.code}", exc.code >= 500
    if isinstance(exc, urllib.error.URLError):
        if not isinstance(exc.reason, BaseException):  # a proxy's tunnel, say
            return "cannot connect to the download server", True
        exc = exc.reason
    if isinstance(exc, TimeoutError):
        return "the download timed out", True
    if isinstance(exc, ssl.SSLCertVerificationError):  # a ValueError too: before those
        return "TLS handshake failed: the server's certificate does not verify", True
    if isinstance(exc, ssl.SSLError) and not reading:
        return "TLS handshake failed", True
    if isinstance(exc, (ValueError, http.client.InvalidURL)):
        return "the URL is not valid", False
    if isinstance(exc, (OSError, http.client.HTTPException)) and reading:
        return "the download broke off", True
    if isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError)):
        return "the download server closed the connection", True
    if isinstance(exc, http.client.HTTPException):
        return "the download server's answer is not HTTP", True
    return "cannot connect to the download server", True


def _failed(entry: FileEntry, exc: BaseException, reading: bool = False) -> DeliveryError:
    """The DeliveryError to report for ``exc``; its detail only in the local log."""
    what, retry = category(exc, reading)
    if isinstance(exc, urllib.error.HTTPError):
        location = exc.headers.get("Location") if exc.headers else None
        detail = f"HTTP {exc.code} {exc.reason}" + (f", Location: {location}" if location else "")
        exc.close()
    else:
        cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        detail = f"{type(cause).__name__}: {cause}"
    log.warning("delivery: %s: %s (%s)", entry.path, what, printable(detail, 300))
    return DeliveryError(f"{entry.path}: {what}", retry)


def fetch(
    url: str,
    dest: Path,
    entry: FileEntry,
    context: ssl.SSLContext,
    timeout: float,
    allow_http_loopback: bool = False,
) -> Counters:
    """One file to ``dest``, resumed from ``dest.part``; checked before it takes its name."""
    check_url(url, allow_http_loopback)
    counters = Counters()
    if dest.exists():
        if dest.stat().st_size == entry.length and sha256_of(dest).hexdigest() == entry.sha256:
            counters.resumed = entry.length
            return counters
        dest.unlink()
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    offset = part.stat().st_size if part.exists() else 0
    if offset > entry.length:
        offset = 0
    digest = sha256_of(part, offset) if offset else hashlib.sha256()
    counters.resumed = offset
    if offset < entry.length:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        request = urllib.request.Request(url, headers=headers)
        try:
            response = opener(context, allow_http_loopback).open(request, timeout=timeout)
        except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError: an OSError
            raise _failed(entry, exc) from None
        with response, part.open("r+b" if part.exists() else "wb") as f:
            if offset and response.status != 206:  # the server ignored the range: start again
                offset, digest, counters.resumed = 0, hashlib.sha256(), 0
            f.seek(offset)
            f.truncate()
            written = offset
            try:
                while chunk := response.read(CHUNK):
                    if written + len(chunk) > entry.length:
                        raise DeliveryError(
                            f"{entry.path}: the server sends more than the {entry.length} bytes"
                            " the manifest lists (endless data): cut off",
                            retry=False,
                        )
                    f.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    counters.downloaded += len(chunk)
            except (OSError, http.client.HTTPException) as exc:
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    raise DeliveryError(
                        f"{entry.path}: no space left on the staging disk"
                    ) from None
                raise _failed(entry, exc, reading=True) from None
            finally:
                with contextlib.suppress(OSError):  # a full disk: the error above is the one
                    f.flush()
                    os.fsync(f.fileno())
        if written < entry.length:
            raise DeliveryError(f"{entry.path}: {written} of {entry.length} bytes; to resume")
    if digest.hexdigest() != entry.sha256:
        part.unlink()
        raise DeliveryError(f"{entry.path}: its SHA-256 is not the manifest's: corrupted", False)
    os.replace(part, dest)
    return counters
