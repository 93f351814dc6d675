"""edged-updater: installs a signed .deb of the software and goes back to the one before by
itself when the new one does not come up healthy, across a crash or a power cut at any point.

It runs as root, on its own (``edged-updater.service``, hardened, no network): cloudsync stays
unprivileged, and nothing it hands over is trusted. ``apply MANIFEST DEB``:

1. **checks** the package manifest (``cloudsync.protocol.manifest``, ``"type": "package"``)
   against the fleet's keys and threshold as cloudsync's config names them (``trust_dir``,
   ``[delivery] threshold``; then the trust documents the node took, replayed from there:
   ``cloudsync.protocol.trust``), its version against the floor (the
   highest this updater installed), and the .deb (copied into its own store first, so that no
   one changes it after the check: length, SHA-256, its control file's Package and Version);
2. keeps the **package installed now** for the way back: a copy it has (``keep``), or none (it
   refuses: an update without a way back is not started);
3. **installs** (``dpkg -i``), restarts the services (``--restart``), and **checks health**
   until a deadline: edged ready, every model that served before serving again, cloudsync
   connected again if it was;
4. **commits**, or **rolls back** (``dpkg -i`` of the kept package, the services restarted).

Each phase is written to a journal (``{store}/journal.json``, whole and fsynced) before it
starts, and ``recover`` (the unit runs it at every boot) finishes what a crash left: an
install or a rollback cut short is rolled back (again), a health check is taken up until its
deadline. So after a crash at any point, either version N or N+1 is installed and running,
never neither. The outcome is ``{store}/result.json`` (and ``status``).

``apply-spool`` is the same update from what cloudsync left in the update spool
(``cloudsync.protocol.spool``: ``request.json`` and the .deb its manifest names, read as
untrusted files of edged's user); ``edged-updater.path`` starts the unit when a request is
there. The request is taken (removed) whatever it holds, and every outcome, a refusal too, is
written back as ``result.json`` for cloudsync to report. A release rolled back here is never
installed again (``floor.json``: ``failed``), and after a commit only the packages of N and
N+1 are kept.

``EDGED_UPDATER_CRASH=<point>`` makes it SIGKILL itself at that point (a test's power cut:
``staged``, ``installing``, ``installed``, ``checking``, ``rolling-back``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cloudsync.agent import config
from cloudsync.protocol import manifest as manifests
from cloudsync.protocol import spool
from cloudsync.protocol.commands import load_anchors, load_scopes
from cloudsync.protocol.trust import TRUST_FILE, Trust, TrustError, TrustState
from edged.client import Client, ClientError
from edged.common.atomic import write_atomic
from edged.common.errors import ConfigError

log = logging.getLogger("edged-updater")
PACKAGE = spool.PACKAGE
MAX_FAILED = 100  # the releases that were rolled back here, remembered (never again)
POINTS = ("staged", "installing", "installed", "checking", "rolling-back")


class UpdateError(Exception):
    """An update that is refused before anything changes; the message says why."""


@dataclass
class Settings:
    store: Path = Path("/var/lib/edged-updater")
    trust_dir: Path = Path("/etc/edged/trust")
    trust_file: Path = Path("/var/lib/edged") / TRUST_FILE  # what cloudsync took
    threshold: int = 1
    socket: Path = Path("/run/edged/edged.sock")
    cloudsync_socket: Path = Path("/run/edged/cloudsync.sock")
    restart: tuple[str, ...] = ("systemctl", "try-restart", "edged.service", "cloudsync.service")
    health_s: float = 180.0
    spool: Path | None = Path("/var/lib/edged/updates")  # cloudsync's requests, the results


def crash_point(name: str) -> None:
    """A test's power cut: SIGKILL at this point when ``EDGED_UPDATER_CRASH`` names it."""
    if os.environ.get("EDGED_UPDATER_CRASH") == name:
        log.warning("EDGED_UPDATER_CRASH=%s: killed here", name)
        os.kill(os.getpid(), signal.SIGKILL)


class Updater:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = settings.store
        self.packages = self.store / "packages"
        self.journal = self.store / "journal.json"

    # ---- what is kept ---------------------------------------------------------------------

    def _prepare(self) -> None:
        self.packages.mkdir(parents=True, exist_ok=True)
        os.chmod(self.store, 0o700)

    def read(self, path: Path) -> dict[str, Any]:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def write(self, path: Path, doc: dict[str, Any]) -> None:
        write_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")

    def phase(self, journal: dict[str, Any], phase: str, **more: Any) -> dict[str, Any]:
        """The journal's next phase, on disk before it starts."""
        journal = {**journal, **more, "phase": phase, "at": time.time()}
        self.write(self.journal, journal)
        log.info("update %s -> %s: %s", journal.get("from"), journal.get("to"), phase)
        return journal

    def finish(self, journal: dict[str, Any], outcome: str, why: str = "") -> dict[str, Any]:
        result = {k: journal.get(k) for k in ("from", "to", "version")}
        result.update(outcome=outcome, why=why, at=time.time())
        self.write(self.store / "result.json", result)
        floor = self.read(self.store / "floor.json")
        if outcome == "committed":  # nothing below it again; the packages but N and N+1 go
            floor["version"] = journal["version"]
            self.prune(journal["from"], journal["to"])
        elif outcome == "rolled-back":  # not this release again: a new one is needed
            floor["failed"] = [*floor.get("failed", []), journal["version"]][-MAX_FAILED:]
        self.write(self.store / "floor.json", floor)
        self.tell(result)
        self.journal.unlink(missing_ok=True)
        log.warning(
            "update %s -> %s: %s%s",
            result["from"],
            result["to"],
            outcome,
            f" ({why})" if why else "",
        )
        return result

    def tell(self, result: dict[str, Any]) -> None:
        """The outcome into the spool too, for cloudsync to report (when there is a spool)."""
        if self.settings.spool is None or not self.settings.spool.is_dir():
            return
        try:
            fd = spool.open_spool(self.settings.spool)
        except spool.SpoolError as exc:
            log.error("the result is not put in the spool: %s", exc)
            return
        try:
            spool.write_file(fd, spool.RESULT, json.dumps(result).encode())
        except (OSError, spool.SpoolError) as exc:  # the update's outcome stands regardless
            log.error("the result is not put in the spool: %s", exc)
        finally:
            os.close(fd)

    def prune(self, *keep: str) -> None:
        """The kept packages but ``keep``'s (each is a way back only to its own version)."""
        names = {self.kept(v).name for v in keep}
        for path in self.packages.glob("*.deb"):
            if path.name not in names:
                path.unlink()

    # ---- dpkg -----------------------------------------------------------------------------

    installed = staticmethod(spool.installed)

    @staticmethod
    def control(deb: Path) -> tuple[str, str]:
        done = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Package", "Version"],
            capture_output=True,
            text=True,
            check=False,
        )
        fields = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
        return fields.get("Package", ""), fields.get("Version", "")

    @staticmethod
    def dpkg_install(deb: Path) -> None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        done = subprocess.run(
            ["dpkg", "--force-confold", "--force-downgrade", "-i", str(deb)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"dpkg -i {deb.name}: {done.stderr.strip()[-500:]}")

    def kept(self, version: str) -> Path:
        return self.packages / f"{PACKAGE}_{version}.deb"

    def keep(self, deb: Path) -> Path:
        """Keep ``deb`` (the package installed now) as the way back."""
        package, version = self.control(deb)
        if package != PACKAGE or version != self.installed():
            raise UpdateError(
                f"{deb} is {package} {version}; {PACKAGE} {self.installed() or '(none)'} is"
                " installed: only the installed version's package is kept"
            )
        self._prepare()
        target = self.kept(version)
        shutil.copyfile(deb, target.with_suffix(".part"))
        os.replace(target.with_suffix(".part"), target)
        return target

    # ---- health -----------------------------------------------------------------------------

    def restart(self) -> None:
        done = subprocess.run(
            list(self.settings.restart), capture_output=True, text=True, check=False, timeout=120
        )
        if done.returncode != 0:
            log.error("restart: %s", done.stderr.strip()[-300:])

    def serving(self) -> dict[str, Any]:
        """What serves now: edged's ready models, and whether cloudsync is connected."""
        found: dict[str, Any] = {"models": [], "cloudsync": False}
        try:
            index = Client(str(self.settings.socket), timeout=5).repository_index()
            found["models"] = sorted(m["name"] for m in index if m.get("state") == "READY")
        except (ClientError, OSError):
            pass
        try:
            status = Client(str(self.settings.cloudsync_socket), timeout=5).call(
                "GET", "/v1/status"
            )
            found["cloudsync"] = bool(status.get("connected"))
        except (ClientError, OSError, AttributeError):
            pass
        return found

    def healthy(self, before: dict[str, Any], deadline: float) -> str:
        """ "" once edged is ready with every model that served before (and cloudsync connected
        again if it was), or why not at the deadline (wall-clock: it outlives a reboot)."""
        why = "edged never answered"
        while True:
            try:
                if Client(str(self.settings.socket), timeout=5).ready():
                    now = self.serving()
                    missing = sorted(set(before.get("models", [])) - set(now["models"]))
                    if missing:
                        why = f"models not serving: {', '.join(missing)}"
                    elif before.get("cloudsync") and not now["cloudsync"]:
                        why = "cloudsync not connected again"
                    else:
                        return ""
                else:
                    why = "edged not ready"
            except (ClientError, OSError) as exc:
                why = f"edged does not answer ({type(exc).__name__})"
            if time.time() >= deadline:
                return why
            time.sleep(1.0)

    # ---- the update ---------------------------------------------------------------------------

    def anchors(self) -> Trust:
        """The keys in force: the provisioned ones, then each trust document taken after."""
        where = self.settings.trust_dir
        provisioned = Trust(0, load_anchors(where), load_scopes(where), self.settings.threshold)
        state = TrustState(self.settings.trust_file, provisioned)
        if state.error:
            raise UpdateError(state.error)
        return state.current

    def check_manifest(self, doc: Any) -> manifests.Manifest:
        """The package manifest, verified against the keys in force, its release against the
        floor and the releases rolled back here."""
        trust = self.anchors()
        try:
            found = manifests.verify(doc, trust.signing, trust.threshold)
        except manifests.ManifestError as exc:
            raise UpdateError(f"the manifest: {exc}") from None
        if found.kind != "package" or found.model != PACKAGE:
            raise UpdateError(f"not a manifest of the {PACKAGE} package")
        floor = self.read(self.store / "floor.json")
        if found.version <= int(floor.get("version", 0)):
            raise UpdateError(
                f"version {found.version} is not above {floor['version']}, installed here"
            )
        if found.version in floor.get("failed", []):
            raise UpdateError(f"version {found.version} was rolled back here: a new one is needed")
        return found

    def stage(self, doc: Any, deb: Callable[[str, int], IO[bytes]]) -> dict[str, Any]:
        """Check the manifest and the .deb (``deb(name, length)`` opens the file the manifest
        names; copied in first); the journal's first phase."""
        found = self.check_manifest(doc)
        self._prepare()
        entry = found.files[0]
        copy = self.packages / f"{PACKAGE}_{found.deb_version}.deb"
        part = copy.with_suffix(".part")
        try:
            src = deb(entry.path, entry.length)
        except (OSError, spool.SpoolError) as exc:
            raise UpdateError(f"the package {entry.path}: {exc}") from None
        with src, part.open("wb") as dst:
            digest, size = hashlib.sha256(), 0
            while chunk := src.read(1 << 20):
                size += len(chunk)
                if size > entry.length:
                    break
                digest.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        if size != entry.length or digest.hexdigest() != entry.sha256:
            part.unlink()
            raise UpdateError(f"{entry.path} is not the file the manifest lists (length, SHA-256)")
        current = self.installed()
        why = ""
        if self.control(part) != (PACKAGE, found.deb_version):
            why = f"{entry.path} is not {PACKAGE} {found.deb_version}"
        elif not current:
            why = f"{PACKAGE} is not installed and configured: nothing to update"
        elif current == found.deb_version:
            why = f"{PACKAGE} {current} is installed already"
        elif not self.kept(current).is_file():
            why = f"no copy of {PACKAGE} {current} to go back to: `edged-updater keep` its .deb"
        if why:
            part.unlink()
            raise UpdateError(why)
        os.replace(part, copy)
        journal = {
            "from": current,
            "to": found.deb_version,
            "version": found.version,
            "before": self.serving(),
        }
        return self.phase(journal, "staged")

    def apply(self, manifest: Any, deb: Callable[[str, int], IO[bytes]]) -> dict[str, Any]:
        """An update from a manifest (its JSON) and the opener of its .deb (``stage``)."""
        if self.read(self.journal):
            raise UpdateError("an update is under way: `edged-updater recover` finishes it")
        journal = self.stage(manifest, deb)
        crash_point("staged")
        return self.install(journal)

    def apply_files(self, manifest_file: Path, deb: Path) -> dict[str, Any]:
        try:
            doc = json.loads(manifest_file.read_bytes())
        except (OSError, ValueError, RecursionError) as exc:
            raise UpdateError(f"the manifest: {exc}") from None
        return self.apply(doc, lambda _name, _length: deb.open("rb"))

    def apply_spool(self) -> dict[str, Any] | None:
        """The request cloudsync left in the spool, if any (None): taken (removed) whatever it
        holds, and answered there (``result.json``), a refusal too."""
        if self.settings.spool is None:
            raise UpdateError("no spool: --spool or cloudsync's [delivery] spool_dir")
        where = self.settings.spool
        try:
            request = spool.take(where, spool.REQUEST, spool.MAX_REQUEST)  # taken: the path
        except spool.SpoolError as exc:  # unit does not start again for it
            return self.refuse({}, str(exc))
        if request is None:
            return None
        manifest = request.get("manifest")
        try:
            return self.apply(manifest, lambda name, length: spool.open_in(where, name, length))
        except (UpdateError, TrustError) as exc:
            return self.refuse(manifest, str(exc))

    def refuse(self, manifest: Any, why: str) -> dict[str, Any]:
        """A spool request refused before anything changed: said in the spool's result."""
        signed = manifest.get("signed") if isinstance(manifest, dict) else None
        version = signed.get("version") if isinstance(signed, dict) else None
        result = {
            "version": version if isinstance(version, int) else None,
            "outcome": "refused",
            "why": why,
            "at": time.time(),
        }
        log.error("the request in the spool is refused: %s", why)
        self.tell(result)
        return result

    def install(self, journal: dict[str, Any]) -> dict[str, Any]:
        journal = self.phase(journal, "installing")
        crash_point("installing")
        try:
            self.dpkg_install(self.kept(journal["to"]))
        except RuntimeError as exc:
            return self.roll_back(journal, str(exc))
        crash_point("installed")
        deadline = time.time() + self.settings.health_s
        journal = self.phase(journal, "checking", deadline=deadline)
        return self.check(journal)

    def check(self, journal: dict[str, Any]) -> dict[str, Any]:
        self.restart()
        crash_point("checking")
        why = self.healthy(journal.get("before", {}), float(journal["deadline"]))
        if self.installed() != journal["to"]:
            why = why or f"{PACKAGE} {journal['to']} is not the version installed"
        if why:
            return self.roll_back(journal, why)
        return self.finish(journal, "committed")

    def roll_back(self, journal: dict[str, Any], why: str) -> dict[str, Any]:
        journal = self.phase(journal, "rolling-back", why=why)
        crash_point("rolling-back")
        try:
            self.dpkg_install(self.kept(journal["from"]))
        except RuntimeError as exc:  # dpkg cut short before: its own recovery, then again
            log.error("rollback: %s; dpkg --configure -a, then again", exc)
            subprocess.run(["dpkg", "--configure", "-a"], capture_output=True, check=False)
            self.dpkg_install(self.kept(journal["from"]))  # failing, the journal stays
        self.restart()
        self.healthy(journal.get("before", {}), time.time() + self.settings.health_s)
        return self.finish(journal, "rolled-back", why)

    def recover(self) -> dict[str, Any] | None:
        """Finish what a crash left (at every boot): None when nothing was under way."""
        journal = self.read(self.journal)
        phase = journal.get("phase")
        if not phase:
            return None
        log.warning(
            "update %s -> %s was cut short at '%s'", journal.get("from"), journal.get("to"), phase
        )
        if phase == "staged":
            return self.finish(journal, "abandoned", "cut short before it changed anything")
        if phase == "checking":
            return self.check(journal)
        # installing or rolling-back: dpkg may have stopped half way; back to the version before
        return self.roll_back(journal, str(journal.get("why") or f"cut short while {phase}"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edged-updater",
        description="Install a signed edged package, check its health, and go back to the one"
        " before by itself if it is not healthy (also after a crash: recover).",
    )
    parser.add_argument(
        "action",
        choices=["apply", "apply-spool", "recover", "keep", "status"],
        help="apply: an update from files; apply-spool: the one cloudsync left"
        " in the spool (edged-updater.path starts it); recover: finish what a"
        " crash left (at boot); keep: the installed version's .deb as the way"
        " back; status",
    )
    parser.add_argument("files", nargs="*", help="apply: MANIFEST DEB; keep: DEB")
    parser.add_argument("--store", type=Path, default=Settings.store)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="cloudsync's config, whose"
        " trust_dir, delivery threshold and trust file (beside the outbox) the"
        " updater uses (default /etc/edged/cloudsync.toml)",
    )
    parser.add_argument(
        "--spool",
        type=Path,
        default=None,
        help="where cloudsync leaves"
        " requests and finds results (default: its [delivery] spool_dir)",
    )
    parser.add_argument("--socket", type=Path, default=Settings.socket)
    parser.add_argument(
        "--restart",
        default=" ".join(Settings.restart),
        help="the command that restarts the services after dpkg",
    )
    parser.add_argument(
        "--health-s",
        type=float,
        default=Settings.health_s,
        help="how long the new version has to come up healthy",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="edged-updater: %(message)s")
    try:  # the same keys and threshold as cloudsync's for manifests: never fewer for root
        fleet = config.load(args.config)
    except ConfigError as exc:  # an unreadable config: no update
        print(f"edged-updater: {exc.message}", file=sys.stderr)
        return 2
    settings = Settings(
        args.store,
        fleet.commands.trust_dir,
        fleet.outbox.path.with_name(TRUST_FILE),
        fleet.delivery.threshold,
        args.socket,
        args.socket.with_name("cloudsync.sock"),
        tuple(args.restart.split()),
        args.health_s,
        args.spool or fleet.delivery.spool_dir,
    )
    updater = Updater(settings)
    try:
        if args.action == "apply":
            if len(args.files) != 2:
                parser.error("apply MANIFEST DEB")
            result: Any = updater.apply_files(Path(args.files[0]), Path(args.files[1]))
        elif args.action == "apply-spool":
            result = updater.apply_spool() or {"outcome": "nothing in the spool"}
        elif args.action == "keep":
            if len(args.files) != 1:
                parser.error("keep DEB")
            result = {"kept": str(updater.keep(Path(args.files[0])))}
        elif args.action == "recover":
            result = updater.recover() or {"outcome": "nothing under way"}
        else:
            result = {
                "installed": updater.installed(),
                "journal": updater.read(updater.journal),
                "last": updater.read(updater.store / "result.json"),
            }
    except (UpdateError, TrustError) as exc:
        print(f"edged-updater: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # dpkg failed even for the way back: recover tries again
        print(f"edged-updater: {exc}; `edged-updater recover` tries again", file=sys.stderr)
        return 3
    print(json.dumps(result, indent=1))
    outcome = result.get("outcome") if isinstance(result, dict) else None
    return {"rolled-back": 1, "refused": 2}.get(str(outcome), 0)


if __name__ == "__main__":
    sys.exit(main())
