"""Model delivery: from the desired state the fleet publishes to a new version serving on edged.

The operator publishes, retained, on ``.../desired/models``::

    {"models": [{"manifest": {"signed": {...}, "signatures": [...]},
                 "urls": {"model.onnx": "https://cdn.example/m/7/model.onnx?md5=...&expires=..."}}]}

For each entry the delivery thread, in order, reporting each step as an event:

1. **verifies** the manifest (``cloudsync.manifest``: a threshold of the fleet's keys, not
   expired), checks it targets this node, and that its version is not below the highest one
   this node ever accepted for the model (the floor, kept in the outbox's state: TUF's rollback
   attack). A version already active, or one that already failed here, is left alone;
2. **downloads** each file from its signed, expiring URL into ``{staging_dir}/{model}-{version}``
   as ``{path}.part``: a restart resumes with a Range request from what is on disk (the bytes
   not fetched again are counted), a server that sends more than the listed length is cut off
   (endless data), the SHA-256 must match, and only then is the file renamed to its name. The
   free space is checked before it starts;
3. asks edged to **install** it (``POST /v1/admin/models/{m}/install``): edged checks the files
   again, moves the directory in, smoke-tests the version and switches to it, or keeps the old
   one serving and says why;
4. **watches its health** for ``health_window_s``: when its error rate (edged's metrics since
   the switch) is over ``max_error_rate`` with at least ``health_min_requests`` calls, it asks
   edged to roll back to the version before, and reports it.

Nothing here blocks the MQTT thread: a new desired state replaces the one waiting.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cloudsync import metrics
from cloudsync.config import DeliveryConfig
from cloudsync.manifest import FileEntry, Manifest, ManifestError, verify
from cloudsync.outbox import Item, Outbox
from edged.client import Client, ClientError
from edged.link import backoff_delay
from edged.models.install import sha256_of

log = logging.getLogger("cloudsync.delivery")
CHUNK = 1 << 16
EDGED_RETRY_S = 5.0  # edged not up yet (it starts beside cloudsync): asked again this soon
STATE = "delivery/"  # outbox state key per model: {"floor": V, "failed": V}


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


def fetch(
    url: str, dest: Path, entry: FileEntry, context: ssl.SSLContext | None, timeout: float
) -> Counters:
    """One file to ``dest``, resumed from ``dest.part``; checked before it takes its name."""
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
            response = urllib.request.urlopen(request, timeout=timeout, context=context)
        except urllib.error.HTTPError as exc:
            why = "the signed URL expired or is not valid" if exc.code in (403, 410) else exc.reason
            raise DeliveryError(
                f"{entry.path}: the server answered {exc.code}: {why}", retry=exc.code >= 500
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise DeliveryError(f"{entry.path}: cannot download: {reason}") from None
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
            except (OSError, TimeoutError) as exc:
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    raise DeliveryError(
                        f"{entry.path}: no space left on the staging disk"
                    ) from None
                raise DeliveryError(f"{entry.path}: the download broke off: {exc}") from None
            finally:
                f.flush()
                os.fsync(f.fileno())
        if written < entry.length:
            raise DeliveryError(f"{entry.path}: {written} of {entry.length} bytes; to resume")
    if digest.hexdigest() != entry.sha256:
        part.unlink()
        raise DeliveryError(f"{entry.path}: its SHA-256 is not the manifest's: corrupted", False)
    os.replace(part, dest)
    return counters


class Delivery:
    def __init__(
        self,
        config: DeliveryConfig,
        fleet: str,
        node: str,
        anchors: Callable[[], dict[str, Ed25519PublicKey]],
        outbox: Outbox,
        edged: Callable[[float], Client],
        edged_timeout_s: float = 2.0,
    ) -> None:
        self.config = config
        self.fleet, self.node = fleet, node
        self.anchors = anchors
        self.outbox = outbox
        self.edged = edged  # a client of edged with the given timeout
        self.quick = edged_timeout_s  # for the calls that only ask
        self.pending: list[dict[str, Any]] | None = None
        self.wake = threading.Condition()
        self.stopping = False
        self.on_rollback: Callable[[str], None] | None = None  # a version was rolled back
        self.context = self._tls()

    def _tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(
            cafile=str(self.config.ca_file) if self.config.ca_file else None
        )
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    # ---- the thread ------------------------------------------------------------------------

    def desired(self, body: Any) -> None:
        """A desired state from the broker (MQTT thread): it replaces the one waiting."""
        entries = body.get("models") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            self.report("refused", why="the desired state has no 'models' list")
            return
        with self.wake:
            self.pending = entries
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()

    def run(self) -> None:
        retry_at: float | None = None
        current: list[dict[str, Any]] = []
        while True:
            with self.wake:
                timeout = None if retry_at is None else max(0.0, retry_at - time.monotonic())
                if self.pending is None and not self.stopping:
                    self.wake.wait(timeout)
                if self.stopping:
                    return
                if self.pending is not None:
                    current, self.pending = self.pending, None
                elif retry_at is None or time.monotonic() < retry_at:
                    continue
            retry_at = None
            for entry in current:
                try:
                    outcome = self.apply(entry)
                except Exception as exc:  # a bug or the disk (permissions): said, tried again
                    log.exception("delivery: an entry failed")
                    self.report("failed", why=f"{type(exc).__name__}: {exc}")
                    outcome = False
                if outcome is not True:
                    delay = self.config.retry_s if outcome is False else outcome
                    retry_at = min(retry_at or math.inf, time.monotonic() + delay)

    # ---- one model -------------------------------------------------------------------------

    def state(self, model: str) -> dict[str, Any]:
        return dict(json.loads(self.outbox.get_state(STATE + model) or "{}"))

    def report(
        self,
        step: str,
        manifest: Manifest | None = None,
        state: dict[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        """A step, as an event (a failure as an alert), with the model's new ``state`` stored
        in the same transaction."""
        doc = {"step": step, **fields}
        if manifest is not None:
            doc = {"model": manifest.model, "version": manifest.version, **doc}
        bad = step in ("refused", "failed", "rolled-back")
        if step == "rolled-back" and self.on_rollback is not None:
            self.on_rollback(str(doc["model"]))
        log.log(logging.WARNING if bad else logging.INFO, "delivery: %s", json.dumps(doc))
        item = Item("events", {"delivery": doc}, "alert" if bad else "event")
        extra = None
        if state is not None:
            extra = {STATE + str(doc["model"]): json.dumps(state)}
        self.outbox.put_many([item], state=extra)

    def apply(self, entry: Any) -> bool | float:
        """One desired model: True when done with it, False to try again after ``retry_s``, or
        the seconds after which to try again."""
        try:
            if not isinstance(entry, dict) or not isinstance(entry.get("urls"), dict):
                raise ManifestError('each entry is {"manifest": {...}, "urls": {...}}')
            manifest = verify(entry.get("manifest"), self.anchors(), self.config.threshold)
        except ManifestError as exc:
            self.report("refused", why=str(exc))
            return True
        why_not = manifest.for_node(self.fleet, self.node, platform.machine())
        if why_not:
            log.info("delivery: %s %d is not for this node: %s", manifest.model,
                     manifest.version, why_not)  # fmt: skip
            return True
        state = self.state(manifest.model)
        floor = int(state.get("floor", 0))
        if state.get("failed") == manifest.version:
            return True  # reported when it failed; a new version is needed
        try:
            versions = self.edged(self.quick).model_versions(manifest.model)
        except ClientError as exc:
            if exc.status == 404:  # edged serves and has no such model
                why = f"edged has no model '{manifest.model}' (a new model needs its directory"
                self.report("refused", manifest, why=why + " and config.pbtxt first)")
                return True
            log.warning("delivery: edged cannot say %s's versions yet: %s", manifest.model, exc)
            return min(EDGED_RETRY_S, self.config.retry_s)
        active = versions.get("active")
        if active == manifest.version or (
            active is None and [manifest.version] == versions.get("serving")
        ):
            if floor < manifest.version:
                self.report("active", manifest, {**state, "floor": manifest.version})
            return True  # (a desired version below the floor that is active: a rollback's)
        if manifest.version < floor:
            why = f"version {manifest.version} is below {floor}, already accepted here (rollback)"
            self.report("refused", manifest, why=why)
            return True
        if floor < manifest.version:  # accepted: nothing older is taken from now on
            state = {**state, "floor": manifest.version}
            self.report("accepted", manifest, state, bytes=manifest.size, signed_by=manifest.kids)
        if manifest.version in versions.get("on_disk", []):
            # moved in before an install was cut short (edged stopped): edged checks it there
            self.report("downloaded", manifest, bytes=0, resumed_bytes=manifest.size)
            return self.install(manifest, self.staged(manifest))
        try:
            staged, counters = self.download(manifest, entry["urls"])
        except DeliveryError as exc:
            self.report("failed", manifest, stage="download", why=str(exc))
            return not exc.retry  # a refusal or corruption: not again until a new state
        self.report(
            "downloaded", manifest, bytes=counters.downloaded, resumed_bytes=counters.resumed
        )
        if self.pending is not None:  # a newer desired state came meanwhile: it decides
            self.report("superseded", manifest)
            return True
        return self.install(manifest, staged)

    def rolled_back(self, model: str, version: int, by: str) -> None:
        """An operator's rollback: this version is not installed again from the same state."""
        state = {**self.state(model), "failed": version}
        self.report("rolled-back", None, state, model=model, version=version, why=by)

    def staged(self, manifest: Manifest) -> Path:
        return self.config.staging_dir / f"{manifest.model}-{manifest.version}"

    def download(self, manifest: Manifest, urls: dict[str, Any]) -> tuple[Path, Counters]:
        staged = self.staged(manifest)
        missing = [f.path for f in manifest.files if not isinstance(urls.get(f.path), str)]
        if missing:
            raise DeliveryError(f"no URL for {', '.join(missing)}")
        staged.mkdir(parents=True, exist_ok=True)
        for old in self.config.staging_dir.iterdir():  # older stagings of this model
            if old != staged and old.name.startswith(f"{manifest.model}-"):
                shutil.rmtree(old, ignore_errors=True)
        need = manifest.size - sum(_on_disk(staged / f.path) for f in manifest.files)
        free = shutil.disk_usage(staged).free
        if need + (self.config.min_free_mb << 20) > free:
            raise DeliveryError(
                f"needs {need / 2**20:.1f} MiB more and {self.config.min_free_mb} MiB spare;"
                f" {free / 2**20:.1f} MiB free on {self.config.staging_dir}"
            )
        total = Counters()
        for file in manifest.files:
            for attempt in range(self.config.attempts):
                try:
                    got = fetch(
                        urls[file.path], staged / file.path, file, self.context,
                        self.config.timeout_s,
                    )  # fmt: skip
                except DeliveryError as exc:
                    if attempt + 1 == self.config.attempts or not exc.retry:
                        raise
                    pause = backoff_delay(attempt, 1.0, 30.0)
                    log.warning("delivery: %s; again in %.1f s", exc, pause)
                    time.sleep(pause)
                    continue
                total.downloaded += got.downloaded
                total.resumed += got.resumed if attempt == 0 else 0
                break
        return staged, total

    def install(self, manifest: Manifest, staged: Path) -> bool:
        files = [{"path": f.path, "sha256": f.sha256, "length": f.length} for f in manifest.files]
        client = self.edged(self.config.install_timeout_s)
        try:
            before = metrics.parse(client.metrics(), time.time())
            done = client.install(
                manifest.model, manifest.version, str(staged), files, manifest.smoke
            )
        except ClientError as exc:
            if exc.status == 0 or (exc.status >= 500 and exc.status != 503):
                self.report("failed", manifest, stage="install", why=exc.message)
                return False  # edged away or broken: tried again later
            state = {**self.state(manifest.model), "failed": manifest.version}
            self.report("failed", manifest, state, stage="install", why=exc.message)
            return True
        self.report(
            "active",
            manifest,
            previous=done.get("previous"),
            removed=done.get("removed"),
            seconds=done.get("seconds"),
        )
        self.watch(manifest, before, done.get("previous"))
        return True

    def watch(self, manifest: Manifest, before: metrics.Snapshot, previous: int | None) -> None:
        """The new version's failure rate over the health window, against the version before's
        (its figures in this run of edged until the switch): a rollback when it is worse by
        more than ``max_error_rate``. Failures are errors, timeouts, and rejected inputs (a new
        version that refuses what the old one took is broken too)."""
        baseline = 0.0
        old = metrics.row_of(metrics.telemetry(before, None), manifest.model, previous or 0)
        if old is not None and old["requests"]:
            baseline = metrics.failure_rate(old)
        deadline = time.monotonic() + self.config.health_window_s
        client = self.edged(self.quick)
        while time.monotonic() < deadline and not self.stopping:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            try:
                now = metrics.parse(client.metrics(), time.time())
            except ClientError:
                continue
            row = metrics.row_of(metrics.telemetry(now, before), manifest.model, manifest.version)
            if row is None or row["requests"] < self.config.health_min_requests:
                continue
            rate = metrics.failure_rate(row)
            if rate - baseline <= self.config.max_error_rate:
                continue
            why = (
                f"{rate:.1%} of {row['requests']} calls failed (version {previous}:"
                f" {baseline:.1%}); more than {self.config.max_error_rate:.1%} worse"
            )
            try:
                back = client.activate(manifest.model)
            except ClientError as exc:
                self.report("failed", manifest, stage="rollback", why=exc.message)
                return
            state = {**self.state(manifest.model), "failed": manifest.version}
            self.report("rolled-back", manifest, state, why=why, active=back.get("active"))
            return


def _on_disk(path: Path) -> int:
    for candidate in (path, path.with_name(path.name + ".part")):
        if candidate.exists():
            return candidate.stat().st_size
    return 0
