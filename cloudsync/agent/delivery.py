"""Model delivery: from the desired state the fleet publishes to a new version serving on edged.

The operator publishes, retained, on ``.../desired/models``::

    {"models": [{"manifest": {"signed": {...}, "signatures": [...]},
                 "urls": {"model.onnx": "https://cdn.example/m/7/model.onnx?md5=...&expires=..."}}]}

For each entry the delivery thread, in order, reporting each step as an event:

1. **verifies** the manifest (``cloudsync.protocol.manifest``: a threshold of the fleet's
   distinct keys, not expired), checks it targets this node, and that its version is not below
   the floor: the highest of the versions this node ever accepted for the model (kept in a
   state file of its own, ``[delivery] state_file``, not in the outbox: an outbox recreated
   must not lower it),
   edged's active version and the highest version edged has on disk (TUF's rollback attack).
   A version already active, or one that already failed here, is left alone. Each URL must be
   ``https://`` (plain ``http://`` only to a loopback host, and only with
   ``allow_http_loopback``): ``file://`` and the rest are refused before anything is written;
2. **downloads** each file from its signed, expiring URL into ``{staging_dir}/{model}-{version}``
   as ``{path}.part``, over TLS 1.3 and following no redirect: a restart resumes with a Range
   request from what is on disk (the bytes not fetched again are counted), a server that sends
   more than the listed length is cut off (endless data), the SHA-256 must match, and only then
   is the file renamed to its name. The free space is checked before it starts;
3. asks edged to **install** it (``POST /v1/admin/models/{m}/install``): edged checks the files
   again, moves the directory in, smoke-tests the version and switches to it, or keeps the old
   one serving and says why. A ``config.pbtxt`` among the files is the version's own
   configuration; a model edged does not have is new, and its version must carry one;
   A version edged refused at its load because its files are no longer the ones installed
   (``damaged`` in edged's answer: bytes flipped, a file cut short by a power cut; edged serves
   the version before meanwhile) is reported ``damaged``, downloaded again and installed over
   itself;
4. **watches its health** for ``health_window_s``: when its error rate (edged's metrics since
   the switch) is over ``max_error_rate`` with at least ``health_min_requests`` calls, it asks
   edged to roll back to the version before, and reports it.

A removal (``"remove": true`` in the manifest, no files) asks edged to remove the model
(``DELETE /v1/admin/models/{m}``) and reports ``removed``; its version becomes the floor, so
that no older manifest installs the model again; a newer version on the node refuses it.

Nothing here blocks the MQTT thread: a new desired state replaces the one waiting.

What a report says may reach whoever serves the files, so a download's failure is reported as a
category ("cannot connect to the download server", "TLS handshake failed", "the server answered
404"), never with the addresses, ports or OS errors behind it (those go to the local log), and
every text in a report that may come from outside goes through ``printable``.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import re
import shutil
import ssl
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cloudsync.agent.config import DeliveryConfig
from cloudsync.agent.delivery_state import STATE_FILE, DeliveryState, StateError
from cloudsync.agent.download import Counters, DeliveryError, check_url, fetch
from cloudsync.agent.outbox import Item, Outbox
from cloudsync.protocol import spool, telemetry
from cloudsync.protocol.envelope import printable
from cloudsync.protocol.manifest import Manifest, ManifestError, is_key, key_of, verify
from cloudsync.protocol.trust import refuse_revoked
from edged.client import Client, ClientError
from edged.common.atomic import write_atomic
from edged.common.backoff import backoff_delay

log = logging.getLogger("cloudsync.delivery")
MAX_DESIRED = 256  # models in one desired state
EDGED_RETRY_S = 5.0  # edged not up yet (it starts beside cloudsync): asked again this soon
UPDATER_POLL_S = 5.0  # a package handed to edged-updater: its result looked for this often


def claimed(entry: Any) -> dict[str, Any]:
    """The model and version a manifest that did not verify says it is (``{}`` when it says
    nothing usable): a refusal names them, so that the rollout that sent it stops at once
    instead of waiting for an activation that cannot come. Nothing unverified is acted on."""
    doc = entry.get("manifest") if isinstance(entry, dict) else None
    signed = doc.get("signed") if isinstance(doc, dict) else None
    if not isinstance(signed, dict):
        return {}
    key, version = key_of(signed.get("kind"), signed.get("model")), signed.get("version")
    if not is_key(key) or type(version) is not int or not 0 < version < 2**63:
        return {}
    return {"model": key, "version": version, "unverified": True}


class Delivery:
    """The delivery thread of one node (``run``), fed desired states by the MQTT thread."""

    def __init__(
        self,
        config: DeliveryConfig,
        fleet: str,
        node: str,
        anchors: Callable[[], dict[str, Ed25519PublicKey]],
        outbox: Outbox,
        edged: Callable[[float], Client],
        edged_timeout_s: float = 2.0,
        threshold: Callable[[], int] | None = None,
        revoked: Callable[[], Collection[str]] = frozenset,
        on_rollback: Callable[[str], None] | None = None,
    ) -> None:
        """``threshold``: the signatures a manifest needs (default: ``config.threshold``);
        ``revoked``: certificate fingerprints whose download servers are refused;
        ``on_rollback``: told the model whose version was rolled back."""
        self.config = config
        self.threshold = threshold or (lambda: config.threshold)
        self.revoked = revoked
        self.fleet, self.node = fleet, node
        self.anchors = anchors
        self.outbox = outbox
        self.edged = edged  # a client of edged with the given timeout
        self.quick = edged_timeout_s  # for the calls that only ask
        self.pending: list[dict[str, Any]] | None = None
        self.current: list[dict[str, Any]] = []  # the desired state being applied
        self.wake = threading.Condition()
        self.stopping = False
        self.on_rollback = on_rollback
        self.context = self._tls()
        path = config.state_file or Path(outbox.path).with_name(STATE_FILE)
        self.states = DeliveryState(path, outbox)

    def _tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(
            cafile=str(self.config.ca_file) if self.config.ca_file else None
        )
        context.minimum_version = ssl.TLSVersion.TLSv1_3  # as every other link of the device
        return refuse_revoked(context, self.revoked)

    # ---- the thread ------------------------------------------------------------------------

    def desired(self, body: Any) -> None:
        """A desired state from the broker (MQTT thread): it replaces the one waiting."""
        entries = body.get("models") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            self.report("refused", why="the desired state has no 'models' list")
            return
        if len(entries) > MAX_DESIRED:  # one report, not one alert per junk entry
            self.report("refused", why=f"{len(entries)} models: at most {MAX_DESIRED}")
            return
        with self.wake:
            self.pending = entries
            self.wake.notify()

    def poke(self) -> None:
        """The desired state being applied, applied again now (edged refused a version as
        damaged on disk: this fetches it again)."""
        with self.wake:
            if self.pending is None and self.current:
                self.pending = self.current
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()

    def run(self) -> None:
        """Until ``stop``: each desired state, entry by entry, and again after a failure. When
        it fails itself (a report the disk cannot take) the agent starts it again, and the
        desired state it was on is tried again at once."""
        current = self.current
        retry_at: float | None = time.monotonic() if current else None
        while True:
            with self.wake:
                timeout = None if retry_at is None else max(0.0, retry_at - time.monotonic())
                if self.pending is None and not self.stopping:
                    self.wake.wait(timeout)
                if self.stopping:
                    return
                if self.pending is not None:
                    current, self.pending = self.pending, None
                    self.current = current
                elif retry_at is None or time.monotonic() < retry_at:
                    continue
            retry_at = None
            for entry in current:
                try:
                    outcome = self.apply(entry)
                except Exception as exc:  # a bug or the disk (permissions): said, tried again
                    log.exception("delivery: an entry failed")
                    # the detail (paths, errno) stays in the local log above
                    self.report("failed", why=f"{type(exc).__name__} on the node (see its log)")
                    outcome = False
                if outcome is not True:
                    delay = self.config.retry_s if outcome is False else outcome
                    retry_at = min(retry_at or math.inf, time.monotonic() + delay)

    # ---- one model -------------------------------------------------------------------------

    def state(self, model: str) -> dict[str, Any]:
        """The model's stored state (``DeliveryState``); StateError when it cannot be read."""
        return dict(self.states.get(model))

    def report(
        self,
        step: str,
        manifest: Manifest | None = None,
        state: dict[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        """A step, as an event (a failure as an alert); the model's new ``state`` is on disk
        first (a floor is never below what was reported). Every text is ``printable``: it may
        quote what came from outside."""
        doc = _printable({"step": step, **fields})
        if manifest is not None:
            doc = {"model": manifest.key, "version": manifest.version, **doc}
        if state is not None:
            self.states.set(str(doc["model"]), state)
        bad = step in ("refused", "failed", "rolled-back")
        if step == "rolled-back" and self.on_rollback is not None:
            self.on_rollback(str(doc["model"]))
        log.log(logging.WARNING if bad else logging.INFO, "delivery: %s", json.dumps(doc))
        self.outbox.put_many([Item("events", {"delivery": doc}, "alert" if bad else "event")])

    def apply(self, entry: Any) -> bool | float:
        """One desired model: True when done with it, False to try again after ``retry_s``, or
        the seconds after which to try again."""
        try:
            if not isinstance(entry, dict) or not isinstance(entry.get("urls"), dict):
                raise ManifestError('each entry is {"manifest": {...}, "urls": {...}}')
            manifest = verify(entry.get("manifest"), self.anchors(), self.threshold())
        except ManifestError as exc:
            self.report("refused", why=str(exc), **claimed(entry))
            return True
        why_not = manifest.for_node(self.fleet, self.node, platform.machine())
        if why_not:
            log.info(
                "delivery: %s %d is not for this node: %s", manifest.key, manifest.version, why_not
            )
            return True
        try:
            state = self.state(manifest.key)
        except StateError as exc:  # fail closed: without the floor a rollback could pass
            log.error("delivery: %s", exc)
            why = f"{exc}: no delivery until it is repaired or removed (removed: the floor"
            self.report("refused", manifest, why=why + " is edged's highest version)")
            return False  # asked again after retry_s: a repaired file is taken then
        if manifest.kind == "package":  # the software itself: edged-updater's (root) work
            return self.package(manifest, entry)
        stored = int(state.get("floor", 0))
        if state.get("failed") == manifest.version and not manifest.remove:
            return True  # reported when it failed; a new version is needed
        try:
            versions = self.edged(self.quick).model_versions(manifest.model)
        except ClientError as exc:
            if exc.status != 404:
                log.warning("delivery: edged cannot say %s's versions yet: %s", manifest.model, exc)
                return min(EDGED_RETRY_S, self.config.retry_s)
            versions = {}  # edged serves and has no such model: a new one, or one removed
        # the floor: what was accepted here, and what edged has (the state file may be new)
        floor = max([stored, *_versions(versions)])
        if manifest.remove:
            return self.remove(manifest, versions, stored, floor)
        if manifest.version <= int(state.get("removed", 0)):
            why = f"the model was removed at version {state['removed']}: a version above it"
            self.report("refused", manifest, why=why + " installs it again")
            return True
        if not versions and not manifest.configured:
            why = f"edged has no model '{manifest.model}': a new model's version carries its"
            self.report("refused", manifest, why=why + " config.pbtxt among its files")
            return True
        active = versions.get("active")
        damaged = versions.get("damaged", {}).get(str(manifest.version))
        if damaged:  # its files on the node are not those installed: fetched again below
            self.report("damaged", manifest, why=f"on the node: {damaged}")
        elif active == manifest.version or (
            active is None and [manifest.version] == versions.get("serving")
        ):
            if stored < manifest.version:
                self.report("active", manifest, {"floor": manifest.version})
            return True  # (a desired version below the floor that is active: a rollback's)
        if manifest.version < floor:
            self.report("refused", manifest, why=_below(manifest, floor))
            return True
        try:  # before anything is written: a URL that is refused is refused as a whole
            self.check_urls(manifest, entry["urls"])
        except DeliveryError as exc:
            self.report("refused", manifest, why=str(exc))
            return True
        if stored < manifest.version:  # accepted: nothing older is taken from now on
            accepted = {"floor": manifest.version}
            self.report(
                "accepted", manifest, accepted, bytes=manifest.size, signed_by=manifest.kids
            )
        if manifest.version in versions.get("on_disk", []) and not damaged:
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

    # ---- a package of the software ---------------------------------------------------------

    def package(self, manifest: Manifest, entry: dict[str, Any]) -> bool | float:
        """A package (``cloudsync.protocol.spool``): downloaded into the spool and handed to
        edged-updater, whose result comes back there; reported as a model's steps: accepted,
        downloaded, handed-over, then active (committed), rolled-back or failed."""
        self.config.spool_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        answered = self.answered(manifest)
        if answered is not None:
            return answered
        state = self.state(manifest.key)
        stored = int(state.get("floor", 0))
        request = self.config.spool_dir / spool.REQUEST
        handed = int(state.get("handed", 0))
        if handed:  # a release is with edged-updater: its answer decides (dpkg may be busy)
            waited = time.time() - int(state.get("handed_at", 0))
            if waited < self.config.package_timeout_s:
                return UPDATER_POLL_S
            request.unlink(missing_ok=True)
            why = f"edged-updater did not answer in {waited:.0f} s (is edged-updater.path enabled?)"
            self.report(
                "failed",
                None,
                {"failed": handed, "handed": 0},
                model=manifest.key,
                version=handed,
                stage="update",
                why=why,
            )
            state = self.state(manifest.key)
        installed = spool.installed(manifest.model)
        if installed == manifest.deb_version:  # (installed by other means)
            if stored < manifest.version:
                self.report("active", manifest, {"floor": manifest.version}, deb_version=installed)
            return True
        if state.get("failed") == manifest.version:
            return True  # reported when it failed; a new release is needed
        if not installed:  # not from its package, or dpkg half way (an update by hand)
            why = f"{manifest.model} is not installed and configured here (dpkg): no update"
            self.report("refused", manifest, why=why)
            return True  # (again at the next desired state, or start: an update restarts it)
        if manifest.version < stored:
            self.report("refused", manifest, why=_below(manifest, stored))
            return True
        try:
            self.check_urls(manifest, entry["urls"])
        except DeliveryError as exc:
            self.report("refused", manifest, why=str(exc))
            return True
        if stored < manifest.version:
            self.report(
                "accepted",
                manifest,
                {"floor": manifest.version},
                bytes=manifest.size,
                signed_by=manifest.kids,
                deb_version=manifest.deb_version,
            )
        name = manifest.files[0].path
        for old in self.config.spool_dir.iterdir():  # an older release's package
            if old.name.endswith((".deb", ".deb.part")) and old.name not in (name, name + ".part"):
                old.unlink()
        try:
            _, counters = self.download(manifest, entry["urls"], self.config.spool_dir)
        except DeliveryError as exc:
            self.report("failed", manifest, stage="download", why=str(exc))
            return not exc.retry
        self.report(
            "downloaded", manifest, bytes=counters.downloaded, resumed_bytes=counters.resumed
        )
        if self.pending is not None:
            self.report("superseded", manifest)
            return True
        with_updater = {"handed": manifest.version, "handed_at": int(time.time())}
        self.states.set(manifest.key, with_updater)  # before the request: a restart waits
        write_atomic(request, json.dumps({"manifest": entry["manifest"]}), 0o644)
        self.report("handed-over", manifest, deb_version=manifest.deb_version)
        return UPDATER_POLL_S

    def answered(self, manifest: Manifest) -> bool | None:
        """edged-updater's result in the spool, reported (and removed): for this release, what
        to do now (True: done; False: again later); None when it is not this release's."""
        where = self.config.spool_dir
        try:
            result = spool.take(where, spool.RESULT, spool.MAX_RESULT)
        except spool.SpoolError as exc:
            result = {"outcome": "refused", "why": f"edged-updater's {exc}"}
        if result is None:
            return None
        outcome = str(result.get("outcome"))
        version = result.get("version")
        if isinstance(version, bool) or not isinstance(version, int):  # a request refused
            version = manifest.version if outcome == "refused" else None  # before it was read
        change: dict[str, int] = {"handed": 0}
        if version is not None and outcome == "committed":
            change["floor"] = version
        elif version is not None and outcome != "abandoned":
            change["failed"] = version
        step = spool.STEPS.get(outcome, "failed")
        fields = {
            "stage": "update",
            "outcome": outcome,
            "why": str(result.get("why", "")),
            "deb_version": str(result.get("to", "")),
        }
        if version != manifest.version:  # an update not asked for here (`edged-updater apply`)
            self.report(
                step,
                None,
                change if version else None,
                model=manifest.key,
                version=version,
                **fields,
            )
            return None
        self.report(step, manifest, change, **fields)
        if outcome == "committed":
            (where / manifest.files[0].path).unlink(missing_ok=True)
            return True
        return outcome != "abandoned"  # cut short before anything changed: handed over again

    def remove(self, manifest: Manifest, versions: dict[str, Any], stored: int, floor: int) -> bool:
        """A removal: refused where a newer version is (the floor), else the model goes from
        edged and the floor is the removal's version (nothing up to it installs again)."""
        if manifest.version < floor:
            self.report("refused", manifest, why=_below(manifest, floor))
            return True
        removed: list[int] = []
        if versions:
            try:
                removed = self.edged(self.config.install_timeout_s).remove_model(manifest.model)[
                    "removed"
                ]
            except ClientError as exc:
                if exc.status != 404:  # edged away, or a pipeline calls it (409): again later
                    self.report("failed", manifest, stage="remove", why=exc.message)
                    return False  # (the pipeline's removal may come later in the same state)
        elif stored >= manifest.version:
            return True  # removed before (or never here): reported then
        state = {"floor": manifest.version, "removed": manifest.version}
        self.report("removed", manifest, state, versions=removed)
        return True

    def rolled_back(self, model: str, version: int, by: str) -> None:
        """An operator's rollback: this version is not installed again from the same state."""
        try:
            self.report(
                "rolled-back", None, {"failed": version}, model=model, version=version, why=by
            )
        except StateError as exc:  # the rollback happened: said, without the state
            log.error("delivery: %s", exc)
            self.report("rolled-back", None, None, model=model, version=version, why=by)

    def staged(self, manifest: Manifest) -> Path:
        return self.config.staging_dir / f"{manifest.model}-{manifest.version}"

    def check_urls(self, manifest: Manifest, urls: dict[str, Any]) -> None:
        """DeliveryError (not retried) when a file has no URL or one that is refused."""
        missing = [f.path for f in manifest.files if not isinstance(urls.get(f.path), str)]
        if missing:
            raise DeliveryError(f"no URL for {', '.join(missing)}", retry=False)
        for file in manifest.files:
            try:
                check_url(urls[file.path], self.config.allow_http_loopback)
            except DeliveryError as exc:
                raise DeliveryError(f"{file.path}: {exc}", retry=False) from None

    def download(
        self, manifest: Manifest, urls: dict[str, Any], into: Path | None = None
    ) -> tuple[Path, Counters]:
        """Each file into ``into``, by default the model's staging directory (resumed,
        checked); there, older stagings of this model (``{model}-{digits}``, no other
        model's) go first."""
        self.check_urls(manifest, urls)
        staged = into or self.staged(manifest)
        staged.mkdir(parents=True, exist_ok=True)
        older = re.compile(re.escape(manifest.model) + r"-[0-9]+")
        for old in self.config.staging_dir.iterdir() if into is None else ():
            if old != staged and older.fullmatch(old.name) and not old.is_symlink():
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
                        urls[file.path],
                        staged / file.path,
                        file,
                        self.context,
                        self.config.timeout_s,
                        self.config.allow_http_loopback,
                    )
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
        if self.state(manifest.model).get("failed") == manifest.version:
            return True  # rolled back by an operator meanwhile (the commands thread)
        files = [{"path": f.path, "sha256": f.sha256, "length": f.length} for f in manifest.files]
        client = self.edged(self.config.install_timeout_s)
        try:
            before = telemetry.parse(client.metrics(), time.time())
            done = client.install(
                manifest.model, manifest.version, str(staged), files, manifest.smoke
            )
        except ClientError as exc:
            if exc.status == 0 or (exc.status >= 500 and exc.status != 503):
                self.report("failed", manifest, stage="install", why=exc.message)
                return False  # edged away or broken: tried again later
            why = exc.message
            if "installs only from there" in why:  # edged's words (edged.models.install)
                why += (
                    f"; cloudsync's [delivery] staging_dir ({self.config.staging_dir}) must be"
                    " edged's own staging directory, {state_dir}/staging"
                )
            state = {"failed": manifest.version}
            self.report("failed", manifest, state, stage="install", why=why)
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

    def watch(self, manifest: Manifest, before: telemetry.Snapshot, previous: int | None) -> None:
        """The new version's failure rate over the health window, against the version before's
        (its figures in this run of edged until the switch): a rollback when it is worse by
        more than ``max_error_rate``. Failures are errors, timeouts, and rejected inputs (a new
        version that refuses what the old one took is broken too)."""
        baseline = 0.0
        old = telemetry.row_of(telemetry.telemetry(before, None), manifest.model, previous or 0)
        if old is not None and old["requests"]:
            baseline = telemetry.failure_rate(old)
        deadline = time.monotonic() + self.config.health_window_s
        client = self.edged(self.quick)
        while time.monotonic() < deadline and not self.stopping:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            try:
                now = telemetry.parse(client.metrics(), time.time())
            except ClientError:
                continue
            row = telemetry.row_of(
                telemetry.telemetry(now, before), manifest.model, manifest.version
            )
            if row is None or row["requests"] < self.config.health_min_requests:
                continue
            rate = telemetry.failure_rate(row)
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
            state = {"failed": manifest.version}
            self.report("rolled-back", manifest, state, why=why, active=back.get("active"))
            return


def _below(manifest: Manifest, floor: int) -> str:
    return (
        f"version {manifest.version} is below {floor}, already accepted or installed here"
        " (rollback)"
    )


def _on_disk(path: Path) -> int:
    for candidate in (path, path.with_name(path.name + ".part")):
        if candidate.exists():
            return candidate.stat().st_size
    return 0


def _versions(doc: dict[str, Any]) -> list[int]:
    """edged's versions of a model (``model_versions``): the active one, those serving, those on
    disk."""
    found = [doc.get("active"), *doc.get("serving", []), *doc.get("on_disk", [])]
    return [v for v in found if isinstance(v, int) and not isinstance(v, bool)]


def _printable(value: Any) -> Any:
    """``value`` with each text in it (nested too) ``printable``."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k), 100): _printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable(v) for v in value]
    return value
