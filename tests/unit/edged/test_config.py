"""The daemon's config: strict, with errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edged import config
from edged.cli import main as edged_main
from edged.common.errors import ConfigError
from edged.common.settings import renamed


def test_defaults_need_no_file() -> None:
    cfg = config.parse({})
    assert cfg.server.socket == Path("/run/edged/edged.sock")
    assert cfg.server.socket_mode == 0o660
    assert cfg.onnxruntime.providers == ["tensorrt", "cuda", "cpu"]


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "edged.toml"
    path.write_text('[server]\nsokcet = "/tmp/x.sock"\n')
    with pytest.raises(ConfigError, match=r"edged.toml: server.sokcet: unknown key"):
        config.load(path)


def test_wrong_type_is_named() -> None:
    with pytest.raises(ConfigError, match=r"server.max_request_bytes: .*greater than 0"):
        config.parse({"server": {"max_request_bytes": 0}})
    with pytest.raises(ConfigError, match=r"onnxruntime.providers.0"):
        config.parse({"onnxruntime": {"providers": ["npu"]}})


def test_socket_mode_accepts_octal_strings() -> None:
    assert config.parse({"server": {"socket_mode": "0600"}}).server.socket_mode == 0o600
    with pytest.raises(ConfigError, match="socket_mode"):
        config.parse({"server": {"socket_mode": "rw-rw----"}})


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server\n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        config.load(path)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        config.load(tmp_path / "absent.toml")


def test_validate_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[log]\nlevel = "debug"\n[server]\nallowed_gids = [0]\n')
    assert edged_main(["--config", str(good), "--socket", "/tmp/s.sock", "validate-config"]) == 0
    out = capsys.readouterr().out
    assert '"level": "debug"' in out and '"/tmp/s.sock"' in out
    bad = tmp_path / "bad.toml"
    bad.write_text("[log]\nlevel = 3\n")
    assert edged_main(["--config", str(bad), "validate-config"]) == 1
    assert "log.level" in capsys.readouterr().err


def test_knowledge_settings_that_cannot_work_are_named() -> None:
    for section, words in [
        ({"chunk_size": 200, "chunk_overlap": 200}, "chunk_overlap must be smaller"),
        ({"answer_url": "https://llm.example/v1"}, "answer_url needs answer_model"),
        ({"answer_url": "llm.example", "answer_model": "m"}, "must be http"),
    ]:
        with pytest.raises(ConfigError, match=f"knowledge.*{words}"):
            config.parse({"knowledge": section})


def test_egress_and_access_log_settings_that_cannot_work_are_named() -> None:
    for section, key, words in [
        ({"egress": {"segment_mb": 16, "max_mb": 20}}, "egress", "at least twice segment_mb"),
        ({"egress": {"segment_mb": 0}}, "egress.segment_mb", "greater than 0"),
        ({"egress": {"fsync_s": 61}}, "egress.fsync_s", "less than or equal to 60"),
        ({"egress": {"enabled": "perhaps"}}, "egress.enabled", "boolean"),
        ({"egress": {"directory": 5}}, "egress.directory", "path"),
        ({"server": {"access_log": "some"}}, "server.access_log", "'none', 'errors' or 'all'"),
    ]:
        with pytest.raises(ConfigError, match=f"{key}.*{words}"):
            config.parse(section)
    kept = config.parse({"egress": {"enabled": False, "segment_mb": 1, "max_mb": 2}})
    assert (kept.egress.enabled, kept.egress.segment_mb, kept.egress.max_mb) == (False, 1, 2)


def test_cloud_tiers_that_cannot_work_are_named() -> None:
    first = {"url": "http://127.0.0.1:8000", "name": "on-demand"}
    spot = {"name": "spot", "url": "http://127.0.0.1:8001", "cost": 0.3}
    parsed = config.parse({"cloud": {**first, "tiers": [spot]}})
    assert [(t.name, t.url, t.cost) for t in parsed.cloud.tiers] == [
        ("spot", "http://127.0.0.1:8001", 0.3)
    ]
    for section, words in [
        ({"tiers": [spot]}, "the first tier is \\[cloud\\] itself, which needs its url"),
        ({**first, "tiers": [{**spot, "name": "on-demand"}]}, "each tier needs a name of its own"),
        ({**first, "tiers": [{"name": "spot"}]}, "tier 'spot' needs a url"),
        ({**first, "tiers": [{**spot, "tiers": [{**spot, "name": "x"}]}]}, "cannot have tiers"),
        ({**first, "tiers": [{**spot, "cost": -1}]}, "tiers.0.cost"),
        ({**first, "name": "On Demand"}, "name: String should match"),
        ({**first, "ab_confidence": 1.0}, "ab_confidence"),
        ({**first, "scale_out_window_s": 0}, "scale_out_window_s"),
    ]:
        with pytest.raises(ConfigError, match=f"cloud.*{words}"):
            config.parse({"cloud": section})


def test_an_old_section_name_is_read_and_noted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[load] (the device load monitor, beside [models] load) is [device] now: a file that
    still says [load] keeps its setting for a release, with a note; both names are refused."""
    cfg = config.parse({"load": {"interval_s": 2.5}})
    assert cfg.device.interval_s == 2.5
    assert renamed(cfg) == [
        "load is now device: rename it (the old name is read in this release only)"
    ]
    assert renamed(config.parse({"device": {"interval_s": 2.5}})) == []
    cfg.state_dir = tmp_path  # an assignment validates again: the note stays, the value too
    assert cfg.device.interval_s == 2.5 and len(renamed(cfg)) == 1
    with pytest.raises(
        ConfigError,
        match=r"^config: load and device: load is the old name of"
        r" device; keep device$",
    ):
        config.parse({"load": {}, "device": {}})
    with pytest.raises(ConfigError, match=r"^config: device.interval_s: .*greater than 0"):
        config.parse({"load": {"interval_s": 0}})
    old = tmp_path / "old.toml"
    old.write_text("[load]\ninterval_s = 3\n")
    assert edged_main(["--config", str(old), "validate-config"]) == 0
    out, err = capsys.readouterr()
    dumped = json.loads(out)
    assert dumped["device"] == {"interval_s": 3.0} and "load" not in dumped
    assert "edged: config: load is now device: rename it" in err
