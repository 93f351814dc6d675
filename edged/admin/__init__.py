"""Operator controls while serving, a module per concern: the routing overrides
(``admin.routing``), model versions (``admin.versions``), cloud A/B (``admin.cloud_ab``), the
egress ledger (``admin.egress_log``), drain (``admin.drain``), what they keep
(``admin.kept``); ``Admin`` puts them together over one kept state.

``edgectl`` calls them on the socket (``/v1/admin/...``), and so does cloudsync when a signed
fleet command asks. What they change outlives a restart: it is kept in
``{state_dir}/admin.json`` (written atomically), beside the config file rather than in it, so
that the operator's file stays theirs and a package upgrade never sees it changed.

- **Routing overrides**: a JSON merge patch (RFC 7396) over the config file's ``[routing]``
  keys: a key set replaces the file's value (``rules`` as a whole list), ``null`` takes the
  override away. The merged settings are validated whole before anything changes, so a bad patch
  is refused with the key it names and the policy in force stays. A reload re-reads the file and
  lays the overrides over it again.
- **Model versions**: install a staged version (checked, moved in, smoke-tested, then serving:
  ``edged.models.install``; a model new to the repository comes with its config.pbtxt),
  activate one on disk, roll back to the one before, remove a model. The active
  version of each model is kept, so a restart serves it (never a version that was staged and not
  yet activated), with the versions activated before it.
- **Cloud A/B**: a share of a model's cloud calls go to a second version on the cloud server
  (over the config's ``b_cloud_name``/``b_share``); the metrics say how each arm does.
- **Drain**: the local tier takes no new work (the path decision sees it as unavailable, with the
  operator's reason); what can go to the cloud goes there, the rest is answered 503. Drain waits
  for the local work in flight to finish (up to a timeout) and says how much is left; ``resume``
  ends it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from edged.admin.cloud_ab import CloudSplits
from edged.admin.drain import Drain
from edged.admin.egress_log import EgressLog
from edged.admin.kept import ADMIN_FILE, Kept
from edged.admin.routing import RoutingOverrides
from edged.admin.versions import Versions
from edged.common.egress import Ledger
from edged.config import RoutingConfig
from edged.models import install
from edged.models.repository import ModelManager
from edged.routing.router import Router

__all__ = ["ADMIN_FILE", "Admin"]


class Admin:
    """The operator's controls, each part given only what it uses, over one kept state."""

    def __init__(
        self,
        path: Path,
        router: Router,
        manager: ModelManager,
        reload: Callable[[], Awaitable[str | None]],
        keep_versions: int = 3,
        ready: Callable[[], bool] = lambda: True,
        staging: Path | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        """``path``: admin.json; ``router`` gets the settings; ``reload`` re-reads the config
        (the error, or None); ``keep_versions``: version directories kept on disk per model;
        ``ready``: whether the first load is done; ``staging``: where installs are taken from
        (default: ``staging`` beside ``path``, in the state directory); ``ledger``: the egress
        ledger ``GET /v1/admin/egress`` reads."""
        self.kept = Kept(path)
        self.staging = staging if staging is not None else path.with_name(install.STAGING)
        self.routing = RoutingOverrides(self.kept, router)
        self.versions = Versions(self.kept, manager, self.staging, keep_versions, ready)
        self.cloud_ab = CloudSplits(self.kept, router, manager)
        self.egress = EgressLog(ledger)
        self.drain = Drain(self.kept, router, manager)
        self._reload = reload
        if self.kept.restore():  # what a previous run kept holds again, in this order
            self.routing.configure(self.routing.base)
            self.versions.restore()
            self.cloud_ab.restore()
            self.drain.restore()

    def configure(self, base: RoutingConfig) -> None:
        """A reload's ``[routing]``, with the operator's overrides laid over it."""
        self.routing.configure(base)

    async def reload(self) -> dict[str, Any]:
        """POST /v1/admin/reload: as SIGHUP, answered when done."""
        error = await self._reload()
        return {"reloaded": error is None, "error": error}
