"""What the operator's controls keep across restarts: ``{state_dir}/admin.json``.

One file beside the config file rather than in it, so that the operator's file stays theirs and
a package upgrade never sees it changed: the routing overrides, the drain, each model's
activated versions and the cloud A/B splits. Written whole and fsynced (edged.common.atomic)
*before* a change is applied: when it cannot be kept (a full disk), the change is refused (507)
and nothing changes, in force or on disk."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from edged.common.atomic import write_atomic
from edged.common.errors import InsufficientStorage

log = logging.getLogger("edged.admin")

ADMIN_FILE = "admin.json"


class Kept:
    """The kept state, read at start (``restore``) and written by each change (``save``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.overrides: dict[str, Any] = {}  # [routing] keys laid over the file's
        self.drained: dict[str, Any] | None = None  # {"reason", "since"} while drained
        self.history: dict[str, list[int]] = {}  # per model, the versions activated, oldest first
        self.splits: dict[str, dict[str, Any]] = {}  # model (or model@tier) -> its cloud A/B

    def restore(self) -> bool:
        """Read admin.json (False: none, or not the shape edged writes: logged, and the
        controls start without it)."""
        try:
            kept = json.loads(self.path.read_text())
            overrides, drained = kept.get("routing_overrides", {}), kept.get("drained")
            history = kept.get("models", {})
            splits = kept.get("cloud_ab", {})
            if (
                not isinstance(overrides, dict)
                or not isinstance(drained, (dict, type(None)))
                or not isinstance(history, dict)
                or not isinstance(splits, dict)
                or not all(
                    isinstance(v, list) and v and all(isinstance(i, int) for i in v)
                    for v in history.values()
                )
            ):
                raise ValueError("not the shape edged writes")
        except FileNotFoundError:
            return False
        except (OSError, ValueError, AttributeError) as exc:
            log.error("admin: cannot read %s (%s); starting without its overrides", self.path, exc)
            return False
        self.overrides, self.drained, self.history, self.splits = (
            overrides,
            drained,
            history,
            splits,
        )
        return True

    def save(self, **change: Any) -> None:
        """Keep the state with ``change`` (routing_overrides, drained, models, cloud_ab) laid
        over it; InsufficientStorage (507) when it cannot be written. The caller applies the
        change (and sets its attribute) only after this returns."""
        state = {
            "routing_overrides": self.overrides,
            "drained": self.drained,
            "models": self.history,
            "cloud_ab": self.splits,
            **change,
        }
        try:
            write_atomic(self.path, json.dumps(state, indent=1))
        except OSError as exc:
            raise InsufficientStorage(
                f"not applied: it cannot be kept in {self.path} ({exc.strerror})"
            ) from None
