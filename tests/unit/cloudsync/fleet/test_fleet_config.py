"""The fleet service's shipped config (debian/edgefleet.toml) loads, names every key of the
schema (commented, with its default), and an unknown key is an error that names it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cloudsync.fleet.config import FleetServiceConfig, load
from edged.common.errors import ConfigError

SHIPPED = Path(__file__).resolve().parents[4] / "debian" / "edgefleet.toml"


def test_the_shipped_config_loads_and_names_every_key() -> None:
    assert load(SHIPPED) == FleetServiceConfig()  # everything commented: the defaults
    text = SHIPPED.read_text()
    for section, field in FleetServiceConfig.model_fields.items():
        assert f"[{section}]" in text, section
        for key in field.annotation.model_fields:  # type: ignore[union-attr]
            named = re.search(
                rf"^# {key} = |^\[\[{section}\.{key}\]\]|^# \[\[{section}\.{key}\]\]", text, re.M
            )
            assert named, f"{section}.{key} is not in {SHIPPED.name}"


def test_an_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "edgefleet.toml"
    path.write_text('[service]\nflet = "x"\n')
    with pytest.raises(ConfigError, match=r"service.flet"):
        load(path)
    path.write_text('[service]\nfleet = "a/b"\n')
    with pytest.raises(ConfigError, match=r"service.fleet"):
        load(path)


def test_the_brokers_acl_needs_its_rules_and_is_not_them(tmp_path: Path) -> None:
    path = tmp_path / "edgefleet.toml"
    for text, why in (
        ('acl_file = "/a"', "both or neither"),
        ('acl_base = "/a"', "both or neither"),
        ('acl_file = "/a"\nacl_base = "/a"', "not acl_base itself"),
    ):
        path.write_text(f"[enrolment]\n{text}\n")
        with pytest.raises(ConfigError, match=why):
            load(path)


@pytest.mark.parametrize(
    "bad",
    [
        ("trust/fleet-1.pub", b"not a key"),
        ("trust/deploy-1.commands", b"\xff\xfe rollback"),
        ("deploy.key", b"-----BEGIN PRIVATE KEY-----\ngarbage\n"),
    ],
)
def test_a_bad_key_file_is_a_start_error_that_names_it(
    tmp_path: Path, bad: tuple[str, bytes]
) -> None:
    import subprocess
    import sys

    (tmp_path / "trust").mkdir()
    name, content = bad
    (tmp_path / name).write_bytes(content)
    deploy = f'deploy_key = "{tmp_path / name}"' if name == "deploy.key" else ""
    config = tmp_path / "edgefleet.toml"
    config.write_text(
        f'[service]\nstate_dir = "{tmp_path / "state"}"\n'
        f'trust_dir = "{tmp_path / "trust"}"\n{deploy}\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "cloudsync.fleet.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "edgefleet: cannot start" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
