"""Which model calls make a request private (edged/privacy.py, issue 45: it had no unit test),
over a fake repository: the operator's list, a config's ``privacy`` (the model's or one of
its versions'), ``default-private`` unless the request releases it, through a pipeline's steps
at any depth with the chain named, and a cycle that ends the search instead of the process."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from edged.models.repository import ModelManager
from edged.privacy import DEFAULT_PRIVATE, PRIVATE, Privacy


@dataclass
class Entry:
    privacy: str | None = None  # the model-level config.pbtxt's
    version_privacy: dict[str, str | None] = field(default_factory=dict)  # each version's
    steps: list[str] = field(default_factory=list)  # the models a pipeline calls

    @property
    def config(self) -> Any:
        return SimpleNamespace(parameters={"privacy": self.privacy} if self.privacy else {})

    @property
    def versions(self) -> dict[str, Any]:
        return {
            v: SimpleNamespace(config=SimpleNamespace(parameters={"privacy": p} if p else {}))
            for v, p in self.version_privacy.items()
        }

    def dependencies(self) -> list[str]:
        return self.steps


def privacy(entries: dict[str, Entry], private_models: tuple[str, ...] = ()) -> Privacy:
    return Privacy(cast(ModelManager, SimpleNamespace(entries=entries)), private_models)


def test_the_operators_list_and_a_configs_word() -> None:
    p = privacy(
        {
            "open": Entry(),
            "own": Entry(PRIVATE),
            "v2-only": Entry(None, {"2": PRIVATE}),
            "listed": Entry(),
        },
        ("listed",),
    )
    assert p.why("open") is None
    assert p.why("own") == "model 'own' is private (privacy: private in its config.pbtxt)"
    assert p.why("v2-only") == "model 'v2-only' is private (privacy: private in its config.pbtxt)"
    assert p.why("listed") == "model 'listed' is private (routing.private_models)"
    assert p.why("ghost") is None  # not in the repository: nothing says it is private
    assert p.why("ghost-listed") is None
    p.configure(["ghost-listed"])  # the list replaced (SIGHUP, an admin change)
    assert p.why("ghost-listed") == "model 'ghost-listed' is private (routing.private_models)"
    assert p.why("listed") is None


def test_default_private_holds_unless_the_request_releases_it() -> None:
    p = privacy({"camera": Entry(DEFAULT_PRIVATE), "own": Entry(PRIVATE)})
    assert p.why("camera") == (
        "model 'camera' keeps its inputs on the device unless the request says private: false"
        " (privacy: default-private in its config.pbtxt)"
    )
    assert p.why("camera", released=True) is None
    assert p.why("own", released=True) is not None  # private is not released by the caller


def test_a_private_step_makes_its_pipeline_private_and_the_chain_is_named() -> None:
    p = privacy(
        {
            "report": Entry(steps=["ocr", "summary"]),
            "ocr": Entry(steps=["detector"]),
            "detector": Entry(PRIVATE),
            "summary": Entry(),
            "chat": Entry(steps=["summary"]),
        },
        ("summary-listed",),
    )
    assert p.why("report") == (
        "model 'detector' is private (privacy: private in its config.pbtxt)"
        " (a step of report -> ocr)"
    )
    assert p.why("chat") is None


def test_a_cycle_of_steps_ends_the_search() -> None:
    p = privacy({"a": Entry(steps=["b"]), "b": Entry(steps=["a", "c"]), "c": Entry(PRIVATE)})
    assert p.why("a") == (
        "model 'c' is private (privacy: private in its config.pbtxt) (a step of a -> b)"
    )
    q = privacy({"a": Entry(steps=["b"]), "b": Entry(steps=["a"])})
    assert q.why("a") is None
