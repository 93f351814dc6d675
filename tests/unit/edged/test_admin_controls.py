"""The operator's controls (edged.admin), part by part, over a real admin.json and fakes of
what they steer (a router that records its settings and drain, a model manager with no models,
cloud tiers that record their splits): what is refused names the field and changes nothing, in
force or on disk; what is kept comes back after a restart; a full disk refuses a change (507)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from edged.admin import Admin
from edged.admin.cloud_ab import CloudSplits
from edged.admin.drain import Drain
from edged.admin.egress_log import EgressLog
from edged.admin.kept import Kept
from edged.admin.routing import RoutingOverrides
from edged.admin.versions import version_of
from edged.common.errors import InsufficientStorage, InvalidRequest, NotFound
from edged.config import RoutingConfig


class FakeTier:
    """A cloud tier as the A/B controls see it: its name, catalog, tests and splits."""

    def __init__(self, name: str) -> None:
        self.name, self.catalog, self.tests = name, {"m": {}}, {}
        self.splits: dict[str, tuple[Any, ...]] = {}
        self.on_decided: Any = None

    def set_split(
        self, model: str, b: str | None, share: float, fleet: bool = False, **rule: Any
    ) -> None:
        self.splits[model] = (b, share, fleet, rule)

    def state(self) -> dict[str, Any]:
        return {"ab": {m: {"b": s[0], "share": s[1]} for m, s in self.splits.items() if s[1]}}


class FakeRouter:
    def __init__(self, tiers: list[FakeTier] | None = None) -> None:
        self.config = RoutingConfig()
        self.configured: list[RoutingConfig] = []
        self.drained: str | None = None
        self.clouds = tiers or []
        self.cloud = self.clouds[0] if self.clouds else None

    def configure(self, config: RoutingConfig) -> None:
        self.config = config
        self.configured.append(config)


class FakeManager:
    def __init__(self) -> None:
        self.entries: dict[str, Any] = {}
        self.pinned: dict[str, int] = {}


@pytest.fixture
def kept(tmp_path: Path) -> Kept:
    (tmp_path / "state").mkdir()
    return Kept(tmp_path / "state" / "admin.json")


def test_kept_state_round_trips_and_a_file_of_another_shape_is_left_alone(kept: Kept) -> None:
    assert kept.restore() is False  # none yet
    kept.save(routing_overrides={"local_threshold_ms": 50}, models={"m": [1, 2]})
    again = Kept(kept.path)
    assert again.restore() is True
    assert (again.overrides, again.history, again.drained, again.splits) == (
        {"local_threshold_ms": 50},
        {"m": [1, 2]},
        None,
        {},
    )
    shapes = (
        '{"routing_overrides": []}',
        '{"drained": "yes"}',
        '{"models": {"m": []}}',
        '{"models": {"m": ["1"]}}',
        '{"cloud_ab": 3}',
        "[1]",
        "not json",
        "\udcff",
    )
    for bad in shapes:
        kept.path.write_text(bad, errors="surrogateescape")
        other = Kept(kept.path)
        assert other.restore() is False, bad
        assert (other.overrides, other.history, other.drained, other.splits) == ({}, {}, None, {})


def test_a_change_that_cannot_be_kept_is_refused_and_changes_nothing(kept: Kept) -> None:
    """A write that fails (here: a directory where admin.json goes, which fails as root too; a
    real full disk: tests/hostile/test_full_disk.py)."""
    router = FakeRouter()
    routing = RoutingOverrides(kept, router)
    kept.path.mkdir()
    with pytest.raises(InsufficientStorage) as refused:
        routing.patch({"local_threshold_ms": 50})
    assert refused.value.status == 507 and str(kept.path) in refused.value.message
    assert kept.overrides == {} and router.configured == [] and kept.path.is_dir()
    assert sorted(p.name for p in kept.path.parent.iterdir()) == ["admin.json"]  # no temp left


def test_routing_overrides_patch_merge_validate_whole_and_reset(kept: Kept) -> None:
    router = FakeRouter()
    routing = RoutingOverrides(kept, router)
    base = router.config
    shown = routing.patch({"local_threshold_ms": 50})
    assert shown["overrides"] == {"local_threshold_ms": 50}
    assert router.config.local_threshold_ms == 50 and shown["kept_in"] == str(kept.path)
    assert json.loads(kept.path.read_text())["routing_overrides"] == {"local_threshold_ms": 50}
    for bad, field in (
        ({"local_threshold_ms": "soon"}, "local_threshold_ms"),
        ({"no_such_key": 1}, "no_such_key"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            routing.patch(bad)
        assert field in refused.value.message
        assert router.config.local_threshold_ms == 50 and kept.overrides == {
            "local_threshold_ms": 50
        }
    for empty in ({}, [], "x", None):
        with pytest.raises(InvalidRequest):
            routing.patch(empty)
    assert routing.patch({"local_threshold_ms": None})["overrides"] == {}  # null removes it
    assert router.config == base
    routing.patch({"local_threshold_ms": 75})
    assert routing.reset()["overrides"] == {} and router.config == base
    assert json.loads(kept.path.read_text())["routing_overrides"] == {}


def test_overrides_that_no_longer_fit_a_reloaded_file_leave_the_file_alone_in_force(
    kept: Kept,
) -> None:
    kept.overrides = {"no_longer_a_key": 1}  # kept by an older edged
    router = FakeRouter()
    routing = RoutingOverrides(kept, router)
    fresh = RoutingConfig(local_threshold_ms=20)
    routing.configure(fresh)
    assert router.config == fresh and kept.overrides == {"no_longer_a_key": 1}


def test_drain_checks_its_body_is_kept_and_holds_after_a_restart(kept: Kept) -> None:
    router, manager = FakeRouter(), FakeManager()
    drain = Drain(kept, router, manager)  # type: ignore[arg-type]
    for bad, field in (
        ([], "body"),
        ({"reason": 5}, "reason"),
        ({"reason": "x" * 201}, "reason"),
        ({"timeout_s": True}, "timeout_s"),
        ({"timeout_s": 3601}, "timeout_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"why": "x"}, "body"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            asyncio.run(drain.drain(bad))
        assert field in refused.value.message, (bad, refused.value.message)
    assert router.drained is None and not kept.path.exists()
    done = asyncio.run(drain.drain({"reason": "maintenance", "timeout_s": 0}))
    assert done["drained"] is True and done["local_inflight"] == 0
    assert router.drained == "drained by the operator: maintenance"
    restarted, router2 = Kept(kept.path), FakeRouter()
    assert restarted.restore()
    Drain(restarted, router2, manager).restore()  # type: ignore[arg-type]
    assert router2.drained == "drained by the operator: maintenance"
    assert drain.resume() == {"drained": False} and router.drained is None
    assert json.loads(kept.path.read_text())["drained"] is None


def test_a_split_names_the_field_it_refuses_and_a_good_one_is_kept(kept: Kept) -> None:
    first, second = FakeTier("near"), FakeTier("far")
    router = FakeRouter([first, second])
    splits = CloudSplits(kept, router, FakeManager())  # type: ignore[arg-type]
    assert first.on_decided is not None  # a test's decision comes back here
    for bad, field in (
        ({"b_share": 2}, "b_share"),
        ({"b_share": True}, "b_share"),
        ({"b_share": 0.5}, "b_cloud_name"),
        ({"b_share": 0.5, "b_cloud_name": "x" * 129}, "b_cloud_name"),
        ({"b_share": 0, "decided_by": "me"}, "decided_by"),
        ({"b_share": 0, "latency_ms": -1}, "latency_ms"),
        ({"b_share": 0, "min_confidence": 2}, "min_confidence"),
        ({"b_share": 0, "tier": "nowhere"}, "tier"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            splits.set_split("m", bad)
        assert field in refused.value.message, (bad, refused.value.message)
    assert kept.splits == {} and first.splits == {} and not kept.path.exists()
    with pytest.raises(NotFound):
        splits.set_split("unknown-model", {"b_share": 0.5, "b_cloud_name": "m2"})
    assert splits.set_split("m", {"b_share": 0.25, "b_cloud_name": "m2"}) == {
        "model": "m",
        "ab": {"b": "m2", "share": 0.25},
    }
    far = splits.set_split("m", {"b_share": 0.5, "b_cloud_name": "m3", "tier": "far"})
    assert far["tier"] == "far" and second.splits["m"][:2] == ("m3", 0.5)
    assert json.loads(kept.path.read_text())["cloud_ab"] == {
        "m": {"b_cloud_name": "m2", "b_share": 0.25},
        "m@far": {"b_cloud_name": "m3", "b_share": 0.5, "tier": "far"},
    }
    # a test's decision is kept as the operator's split would be
    first.on_decided("m", "m2", 1.0)
    assert kept.splits["m"] == {"b_cloud_name": "m2", "b_share": 1.0}
    with pytest.raises(NotFound):  # no cloud tier at all
        CloudSplits(kept, FakeRouter(), FakeManager()).tier(None)  # type: ignore[arg-type]


def test_versions_and_egress_refuse_what_is_not_theirs() -> None:
    for bad in ({"version": 0}, {"version": True}, {"version": "2"}, [], None):
        with pytest.raises(InvalidRequest):
            version_of(bad)
    assert version_of({"version": 3}) == 3 and version_of({}, required=False) is None
    with pytest.raises(NotFound):
        asyncio.run(EgressLog(None).entries({}))


def test_admin_restores_each_part_in_order(tmp_path: Path) -> None:
    path = tmp_path / "state" / "admin.json"
    path.parent.mkdir()
    path.write_text(
        json.dumps(
            {
                "routing_overrides": {"local_threshold_ms": 40},
                "drained": {"reason": "why"},
                "models": {"m": [1, 3]},
                "cloud_ab": {},
            }
        )
    )
    router, manager = FakeRouter(), FakeManager()

    async def reload() -> str | None:
        return "no file"

    admin = Admin(path, router, manager, reload)  # type: ignore[arg-type]
    assert router.config.local_threshold_ms == 40 and router.drained == "why"
    assert manager.pinned == {"m": 3} and admin.staging == tmp_path / "state" / "staging"
    assert asyncio.run(admin.reload()) == {"reloaded": False, "error": "no file"}
