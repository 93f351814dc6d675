"""Model versions while serving: install a staged version (checked, moved in, smoke-tested, then
serving: ``edged.models.install``; a model new to the repository comes with its config.pbtxt),
activate one on disk, roll back to the one before, remove a model. The active version of each
model is kept, so a restart serves it (never a version that was staged and not yet activated),
with the versions activated before it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edged.admin.kept import Kept
from edged.common.errors import ConfigError, EdgedError, InvalidRequest, NotFound, Unavailable
from edged.models import install
from edged.models.repository import VERSION, ModelManager

log = logging.getLogger("edged.admin")

HISTORY = 10  # activations remembered per model


def version_of(doc: Any, required: bool = True) -> int | None:
    """A body's ``version``: a positive integer (None when not ``required`` and not given)."""
    version = doc.get("version") if isinstance(doc, dict) else None
    if version is None and not required:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidRequest("'version' must be a positive integer")
    return version


class Versions:
    def __init__(
        self,
        kept: Kept,
        manager: ModelManager,
        staging: Path,
        keep_versions: int,
        ready: Callable[[], bool],
    ) -> None:
        """``staging``: where installs are taken from; ``keep_versions``: version directories
        kept on disk per model; ``ready``: whether the first load is done (until then: 503)."""
        self.kept, self.manager, self.staging = kept, manager, staging
        self.keep_versions, self.ready = keep_versions, ready

    def restore(self) -> None:
        """The kept active versions pinned: a restart serves them."""
        self.manager.pinned.update({name: v[-1] for name, v in self.kept.history.items()})

    def _entry(self, name: str) -> Any:
        if not self.ready():
            raise Unavailable("edged is still loading its models")
        return self.manager.entry(name)

    def show(self, name: str) -> dict[str, Any]:
        """GET /v1/admin/models/{m}: the active version, those activated before, those on disk."""
        entry = self._entry(name)
        on_disk = sorted(
            int(d.name) for d in entry.directory.iterdir() if d.is_dir() and VERSION.match(d.name)
        )
        return {
            "model": name,
            "active": self.manager.pinned.get(name),
            "history": self.kept.history.get(name, []),
            "on_disk": on_disk,
            "serving": entry.ready_versions,
            # versions refused at their last load because their files are not those installed
            "damaged": {
                str(v): mv.damaged for v, mv in sorted(entry.versions.items()) if mv.damaged
            },
        }

    def _activated(self, name: str, version: int, before: int | None) -> None:
        history = [v for v in self.kept.history.get(name, []) if v != version]
        if before is not None and not history:
            history = [before]  # what served by version policy until now
        history = [*history, version][-HISTORY:]
        self.kept.save(models={**self.kept.history, name: history})
        self.kept.history[name] = history

    def _pin_current(self, name: str) -> int | None:
        """Keep the version serving now as the active one before anything changes, so that a
        crash in the middle restarts on it (not on a version staged and not yet checked)."""
        entry = self._entry(name)
        current = self.manager.pinned.get(name)
        if current is None and entry.ready_versions:
            current = entry.ready_versions[-1]
        if current is not None and self.kept.history.get(name, [None])[-1] != current:
            self._activated(name, current, None)
        return current

    async def install(self, name: str, doc: Any) -> dict[str, Any]:
        """POST /v1/admin/models/{m}/install {"version", "source", "files", "smoke"}: from a
        directory in the staging directory only (``edged.models.install``). A model the
        repository does not have is new: its version carries its config.pbtxt."""
        version = version_of(doc)
        assert version is not None and isinstance(doc, dict)
        files = doc.get("files")
        if not self.ready():
            raise Unavailable("edged is still loading its models")
        new = None
        if name not in self.manager.entries:
            new = install.new_model_directory(self.manager.repository, name, files)
        source = install.staged_source(self.staging, doc.get("source"))
        started = time.monotonic()
        current = None if new else self._pin_current(name)
        known = None if new else self.manager.entry(name).versions.get(version)
        if version == current and not (known and known.damaged):  # a damaged one: again over it
            raise InvalidRequest(f"version {version} of '{name}' is the active one")
        target = (new or self._entry(name).directory) / str(version)
        # reading and hashing gigabytes: in a thread, the loop goes on serving
        try:
            await asyncio.to_thread(install.stage, self.staging, str(source), files, target)
        except ConfigError as exc:  # the staging directory itself is not edged's
            raise Unavailable(exc.message) from None
        cases = doc.get("smoke", [])

        async def check(v: int) -> None:
            await install.smoke_test(self.manager, name, v, cases)
            if new is not None:  # it passed: the repository finds it from now on
                await asyncio.to_thread(install.publish_config, new, v)

        try:
            before = await self.manager.activate(name, version, check, new)
        except Exception:
            # a bad version leaves nothing behind (only what this install moved in goes, and
            # through the staging directory)
            await asyncio.to_thread(install.discard, self.staging, target)
            if new is not None:
                with contextlib.suppress(OSError):  # a new model's directory, now empty
                    new.rmdir()
            raise
        install.done(self.staging, target)
        self._activated(name, version, before)
        return {
            **self._pruned(name),
            "previous": before,
            "smoke_cases": len(cases) if isinstance(cases, list) else 0,
            "seconds": round(time.monotonic() - started, 3),
        }

    async def activate(self, name: str, doc: Any) -> dict[str, Any]:
        """POST /v1/admin/models/{m}/activate {"version"}: a version on disk serves (no
        version: the one active before, a rollback)."""
        version = version_of(doc, required=False)
        current = self._pin_current(name)
        if version is None:
            earlier = [v for v in self.kept.history.get(name, []) if v != current]
            on_disk = set(self.show(name)["on_disk"])
            earlier = [v for v in earlier if v in on_disk]
            if not earlier:
                raise NotFound(f"model '{name}' has no earlier version on disk to roll back to")
            version = earlier[-1]
        if version == current:
            return {**self.show(name), "previous": current}
        if not (self._entry(name).directory / str(version)).is_dir():
            raise NotFound(f"model '{name}' has no version {version} on disk")

        async def check(v: int) -> None:
            return None

        before = await self.manager.activate(name, version, check)
        self._activated(name, version, before)
        log.warning("model %s: version %d active again (was %s)", name, version, before)
        return {**self.show(name), "previous": before}

    async def remove(self, name: str) -> dict[str, Any]:
        """DELETE /v1/admin/models/{m}: the model stops serving (its requests in flight
        finish), its directory goes, and a tombstone beside it keeps the package from seeding it
        again. Refused (409) while a pipeline that serves calls it."""
        entry = self._entry(name)
        on_disk = self.show(name)["on_disk"]
        history = {m: v for m, v in self.kept.history.items() if m != name}
        self.kept.save(models=history)  # a restart does not pin a model that is gone
        try:
            await self.manager.remove(name)
        except EdgedError:
            self.kept.save()
            raise
        self.kept.history = history
        await asyncio.to_thread(install.remove_model, self.staging, entry.directory)
        return {"model": name, "removed": on_disk}

    def _pruned(self, name: str) -> dict[str, Any]:
        entry = self._entry(name)
        keep = set(self.kept.history.get(name, [])[-2:])
        removed = install.prune(entry.directory, self.keep_versions, keep)
        if removed:
            log.info("model %s: removed versions %s from disk", name, removed)
        return {**self.show(name), "removed": removed}
