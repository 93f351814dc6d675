"""Model delivery's state: per model, the floor (the highest version accepted here: nothing
older is installed, TUF's rollback attack) and the last version that failed, in a JSON file of
its own, written whole and fsynced before the event that reports it."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

from cloudsync.agent.outbox import Outbox
from edged.common.atomic import write_atomic

log = logging.getLogger("cloudsync.delivery")
STATE = "delivery/"  # an older cloudsync's outbox state key per model, read once (migration)
STATE_FILE = "delivery.json"  # beside the outbox's file unless [delivery] state_file says


NUMBERS = ("floor", "failed", "removed", "handed", "handed_at")  # a state's keys: ints >= 0


class StateError(Exception):
    """The delivery state file cannot be read or is not what cloudsync writes: without its
    floors a rollback could pass, so deliveries stop until it is repaired or removed."""


class DeliveryState:
    """Per model ``{"floor": V, "failed": V, "removed": V}``: the highest version accepted here
    (no version below it is installed), the last version that failed or was rolled back (not
    installed again from the same desired state), and the version of the model's last removal
    (no version up to it is installed); for a package (``package:edged``) also ``handed``, the
    release with edged-updater, and ``handed_at`` (seconds since the epoch). A JSON file of
    its own, written whole and fsynced (``write_atomic``) before the event that reports it; a
    floor never goes down. Created from an older cloudsync's outbox state keys when it does not
    exist yet."""

    def __init__(self, path: Path, outbox: Outbox) -> None:
        self.path = path
        self.outbox = outbox
        self.lock = threading.RLock()  # the delivery thread, and the command worker's rollback

    def get(self, model: str) -> dict[str, int]:
        """The model's state ({} when none); StateError when the file cannot be trusted."""
        return dict(self._load().get(model, {}))

    def set(self, model: str, state: dict[str, int]) -> None:
        """The keys of the model's state that change (``floor``, ``failed``, ``removed``),
        merged into what is on disk under the lock (the delivery thread and a command's
        rollback both write), on disk before this returns; the floor only goes up."""
        with self.lock:
            doc = self._load()
            merged = {**doc.get(model, {}), **state}
            floor = max(int(doc.get(model, {}).get("floor", 0)), int(state.get("floor", 0)))
            doc[model] = {**merged, "floor": floor} if floor else merged
            write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True) + "\n")

    def _load(self) -> dict[str, dict[str, int]]:
        with self.lock:
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                return self._migrate()
            except OSError as exc:
                raise StateError(
                    f"the delivery state file {self.path} cannot be read ({exc.strerror})"
                ) from None
            try:
                doc = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise StateError(f"the delivery state file {self.path} is not JSON") from None
            if not _state_doc(doc):
                raise StateError(
                    f"the delivery state file {self.path} does not hold"
                    ' {model: {"floor": V, "failed": V}}'
                )
            return dict(doc)

    def _migrate(self) -> dict[str, dict[str, int]]:
        """The outbox's ``delivery/{model}`` state keys (where an older cloudsync kept them),
        written to the file once; {} (no file yet) when there are none."""
        doc: dict[str, dict[str, int]] = {}
        for key, value in self.outbox.states(STATE).items():
            with contextlib.suppress(ValueError, TypeError):
                state = json.loads(value)
                if _state_doc({key: state}):
                    doc[key[len(STATE) :]] = state
        if doc:
            write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
            log.info(
                "delivery: the state of %d model(s) moved from the outbox to %s",
                len(doc),
                self.path,
            )
        return doc


def _state_doc(doc: Any) -> bool:
    def version(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    return isinstance(doc, dict) and all(
        isinstance(state, dict) and all(version(state[k]) for k in NUMBERS if k in state)
        for state in doc.values()
    )
