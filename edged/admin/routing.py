"""The routing overrides: a JSON merge patch (RFC 7396) over the config file's ``[routing]``
keys. A key set replaces the file's value (``rules`` as a whole list), ``null`` takes the
override away. The merged settings are validated whole before anything changes, so a bad patch
is refused with the key it names and the policy in force stays. A reload re-reads the file and
lays the overrides over it again."""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from edged.admin.kept import Kept
from edged.common.errors import ConfigError, InvalidRequest
from edged.common.settings import validate
from edged.config import RoutingConfig

log = logging.getLogger("edged.admin")


class Configurable(Protocol):
    """What takes the routing settings (the router)."""

    config: RoutingConfig

    def configure(self, config: RoutingConfig) -> None: ...


def merged(base: RoutingConfig, overrides: dict[str, Any]) -> RoutingConfig:
    """The file's settings with the overrides laid over them, validated whole (ConfigError)."""
    doc = base.model_dump(exclude_unset=False)
    doc.update(overrides)
    return validate(RoutingConfig, doc, "routing")


class RoutingOverrides:
    def __init__(self, kept: Kept, router: Configurable) -> None:
        self.kept, self.router = kept, router
        self.base = router.config  # the config file's [routing]

    def configure(self, base: RoutingConfig) -> None:
        """The file's settings (at start and on reload) with the overrides laid over them."""
        self.base = base
        try:
            self.router.configure(merged(base, self.kept.overrides))
        except ConfigError as exc:
            log.error(
                "admin: the routing overrides no longer fit the config file, so the file's"
                " settings apply alone until they are changed or reset: %s",
                exc.message,
            )
            self.router.configure(base)

    def show(self) -> dict[str, Any]:
        """GET /v1/admin/routing: the settings in force, and which of them are overrides."""
        return {
            "routing": self.router.config.model_dump(mode="json"),
            "overrides": self.kept.overrides,
            "kept_in": str(self.kept.path),
        }

    def patch(self, patch: Any) -> dict[str, Any]:
        """PATCH /v1/admin/routing: a merge patch of the overrides (null removes one)."""
        if not isinstance(patch, dict) or not patch:
            raise InvalidRequest(
                'the body must be a JSON object of [routing] settings, e.g. {"local_threshold_ms":'
                " 50}; null removes an override"
            )
        overrides = {k: v for k, v in {**self.kept.overrides, **patch}.items() if v is not None}
        try:
            settings = merged(self.base, overrides)
        except ConfigError as exc:
            raise InvalidRequest(exc.message) from None
        self.kept.save(routing_overrides=overrides)
        self.kept.overrides = overrides
        self.router.configure(settings)
        log.info("routing overrides now %s", json.dumps(overrides, sort_keys=True))
        return self.show()

    def reset(self) -> dict[str, Any]:
        """DELETE /v1/admin/routing: the config file's settings again."""
        self.kept.save(routing_overrides={})
        self.kept.overrides = {}
        self.router.configure(self.base)
        log.info("routing overrides removed: the config file's settings apply")
        return self.show()
