"""Privacy as a property of the data: which model calls make a request private.

A request is private when its caller says so (the ``private`` parameter). It also becomes
private as soon as it reaches a private model: one named in ``routing.private_models``, one
whose config.pbtxt says ``privacy: private``, or a pipeline that calls one of those (at any
depth). From then on everything the request derives is private: every later step of a
pipeline, an escalation, a hedge, a fallback (``RouteContext.make_private`` never goes back).
This module decides; the router only reads the answer.
"""

from __future__ import annotations

from collections.abc import Iterable

from edged.models.repository import ModelManager

PRIVATE = "private"  # the value of config.pbtxt's ``privacy`` parameter that marks a model
# ... and the value for a model whose inputs stay unless the request says ``private: false``
DEFAULT_PRIVATE = "default-private"


class Privacy:
    """Which models keep their inputs (and whatever is derived from them) on the device."""

    def __init__(self, manager: ModelManager, private_models: Iterable[str] = ()) -> None:
        self.manager = manager
        self.private_models = frozenset(private_models)

    def configure(self, private_models: Iterable[str]) -> None:
        """New ``routing.private_models`` (SIGHUP, an admin change)."""
        self.private_models = frozenset(private_models)

    def why(self, name: str, released: bool = False) -> str | None:
        """Why a call of ``name`` is private, or None: the model or a step it calls
        (transitively) is private by the operator's list or its own config, or is
        ``default-private`` and the request did not say ``private: false`` (``released``)."""
        return self._why(name, (), released)

    def _why(self, name: str, chain: tuple[str, ...], released: bool) -> str | None:
        if name in chain:  # a cycle: the repository refuses to load it; nothing more to find
            return None
        via = f" (a step of {' -> '.join(chain)})" if chain else ""
        if name in self.private_models:
            return f"model '{name}' is private (routing.private_models){via}"
        entry = self.manager.entries.get(name)
        if entry is None:
            return None
        configs = [entry.config, *(mv.config for mv in entry.versions.values())]
        privacy = {c.parameters.get("privacy") for c in configs if c is not None}
        if PRIVATE in privacy:
            return f"model '{name}' is private (privacy: private in its config.pbtxt){via}"
        if DEFAULT_PRIVATE in privacy and not released:
            return (
                f"model '{name}' keeps its inputs on the device unless the request says"
                f" private: false (privacy: default-private in its config.pbtxt){via}"
            )
        for step in entry.dependencies():
            found = self._why(step, (*chain, name), released)
            if found:
                return found
        return None
