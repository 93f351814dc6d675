"""The fleet service's shipped config (debian/edgefleet.toml) loads, names every key of the
schema (commented, with its default), and an unknown key is an error that names it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cloudsync.fleet.config import FleetServiceConfig, load
from edged.errors import ConfigError

SHIPPED = Path(__file__).resolve().parents[3] / "debian" / "edgefleet.toml"


def test_the_shipped_config_loads_and_names_every_key() -> None:
    assert load(SHIPPED) == FleetServiceConfig()  # everything commented: the defaults
    text = SHIPPED.read_text()
    for section, field in FleetServiceConfig.model_fields.items():
        assert f"[{section}]" in text, section
        for key in field.annotation.model_fields:  # type: ignore[union-attr]
            named = re.search(rf"^# {key} = |^\[\[{section}\.{key}\]\]|^# \[\[{section}\.{key}\]\]",
                              text, re.M)  # fmt: skip
            assert named, f"{section}.{key} is not in {SHIPPED.name}"


def test_an_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "edgefleet.toml"
    path.write_text('[service]\nflet = "x"\n')
    with pytest.raises(ConfigError, match=r"service.flet"):
        load(path)
    path.write_text('[service]\nfleet = "a/b"\n')
    with pytest.raises(ConfigError, match=r"service.fleet"):
        load(path)
