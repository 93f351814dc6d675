"""A version's files against the list an install keeps (edged.models.files), and what edged does
with a version whose files no longer match: refused at its load with the reason, the version
before serving meanwhile, installed again over itself (real ONNX graphs, ONNX Runtime)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest

from edged.common.errors import InvalidRequest, Unavailable
from edged.common.names import DAMAGED
from edged.models import install
from edged.models.files import RECORD, damage, record
from edged.models.repository import State
from tests.modelfiles import add_model
from tests.unit.edged.test_repository import manager_for, run, unload_when_idle


def rows(directory: Path) -> list[dict[str, Any]]:
    """The manifest's list of the files in ``directory`` (what an install checks and keeps)."""
    return [
        {
            "path": p.name,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "length": p.stat().st_size,
        }
        for p in sorted(directory.iterdir())
        if not p.name.startswith(RECORD)
    ]


def installed(repo: Path, name: str, version: int) -> Path:
    directory = repo / name / str(version)
    record(directory, rows(directory))
    return directory


def flip(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_damage_names_the_file_and_what_is_wrong(tmp_path: Path) -> None:
    add_model(tmp_path, "m", {1: 2.0})
    version = tmp_path / "m" / "1"
    assert damage(version) == ""  # no list: placed by hand, loaded as it is
    installed(tmp_path, "m", 1)
    assert damage(version) == ""
    (version / f"{RECORD}.x1y2.tmp").write_text("{")  # left by a kill while it was written
    assert damage(version) == ""
    onnx = version / "model.onnx"
    whole = onnx.read_bytes()
    size = len(whole)
    flip(onnx)
    assert damage(version) == "file 'model.onnx': its SHA-256 is not the one listed"
    flip(onnx)
    with onnx.open("r+b") as f:
        f.truncate(size // 2)
    assert damage(version) == f"file 'model.onnx' has {size // 2} bytes, {size} listed"
    onnx.unlink()
    assert damage(version) == "file 'model.onnx': no such file in the version directory"
    onnx.write_bytes(whole)
    assert damage(version) == ""
    (version / "extra.bin").write_bytes(b"x")
    assert damage(version) == "'extra.bin' is not in the file list"
    (version / RECORD).write_text("not json")
    assert damage(version) == f"its list of files ({RECORD}) is damaged"


def test_a_damaged_version_is_refused_and_the_one_before_serves(tmp_path: Path) -> None:
    add_model(tmp_path, "m", {1: 2.0, 2: 3.0})
    flip(installed(tmp_path, "m", 2) / "model.onnx")

    async def scenario() -> None:
        manager = manager_for(tmp_path)
        await manager.load_all()
        entry = manager.entry("m")
        assert entry.ready_versions == [1]
        assert await run(manager, "m") == (1, 2.0)
        refused = entry.versions[2]
        assert refused.state is State.UNAVAILABLE
        assert refused.damaged == "file 'model.onnx': its SHA-256 is not the one listed"
        assert refused.reason == f"damaged on disk, not loaded: {refused.damaged}"
        with pytest.raises(Unavailable, match="damaged on disk"):
            await run(manager, "m", 2)
        await manager.close()

    asyncio.run(scenario())


def test_the_fallback_is_only_for_damage_and_only_to_a_version_that_loads(tmp_path: Path) -> None:
    """A version that fails otherwise (a broken file with no list) leaves the model unavailable
    as Triton does; when every earlier version is damaged too, nothing serves."""
    add_model(tmp_path, "broken", {1: 2.0, 2: 3.0})
    (tmp_path / "broken" / "2" / "model.onnx").write_bytes(b"not onnx")
    add_model(tmp_path, "all", {1: 2.0, 2: 3.0})
    flip(installed(tmp_path, "all", 1) / "model.onnx")
    flip(installed(tmp_path, "all", 2) / "model.onnx")

    async def scenario() -> None:
        manager = manager_for(tmp_path)
        await manager.load_all()
        assert manager.entry("broken").ready_versions == []
        assert 1 not in manager.entry("broken").versions
        assert manager.entry("all").ready_versions == []
        assert "damaged on disk" in manager.reason("all")
        await manager.close()

    asyncio.run(scenario())


def test_a_version_damaged_while_unloaded_idle_is_refused_at_its_wake(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    add_model(tmp_path, "m", {1: 2.0})
    onnx = installed(tmp_path, "m", 1) / "model.onnx"

    async def scenario() -> None:
        manager = manager_for(tmp_path, idle_unload_s=0.05)
        await manager.load_all()
        assert await run(manager, "m") == (1, 2.0)
        assert await unload_when_idle(manager) == [("m", 1)]
        flip(onnx)
        with pytest.raises(Unavailable, match="SHA-256 is not the one listed"):
            await run(manager, "m")
        assert manager.entry("m").versions[1].damaged
        await manager.close()

    asyncio.run(scenario())
    event = [r for r in caplog.records if getattr(r, "reason", None) == DAMAGED]
    assert event and getattr(event[0], "model", None) == "m"  # the event cloudsync acts on


def test_an_install_replaces_a_damaged_version_on_disk_and_no_other(tmp_path: Path) -> None:
    repo, staging = tmp_path / "models", tmp_path / "staging"
    add_model(repo, "m", {1: 2.0})
    add_model(tmp_path / "new", "m", {1: 5.0})
    target = installed(repo, "m", 1)

    def staged() -> Path:
        source = staging / "m-1"
        source.mkdir(parents=True)
        (source / "model.onnx").write_bytes((tmp_path / "new/m/1/model.onnx").read_bytes())
        return source

    staging.mkdir(mode=0o700)
    with pytest.raises(InvalidRequest, match="on disk already"):
        install.stage(staging, str(staged()), rows(staging / "m-1"), target)
    flip(target / "model.onnx")
    install.stage(staging, str(staging / "m-1"), rows(staging / "m-1"), target)
    assert damage(target) == ""
    assert sorted(p.name for p in target.iterdir()) == [RECORD, "model.onnx"]
    assert (target / "model.onnx").read_bytes() == (tmp_path / "new/m/1/model.onnx").read_bytes()
