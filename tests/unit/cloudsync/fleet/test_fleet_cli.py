"""edgefleet's command line as an operator types it (issue 48): the options of every command
before or after its name, label arguments checked as the service checks them and named, columns
cut to fit, a rollout's progress line, and ``serve --help`` naming every key of the config."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloudsync.fleet.cli import GLOBAL_OPTIONS, build_parser
from cloudsync.fleet.client import label_args, listed, progress
from cloudsync.fleet.common import EXIT_USAGE, Failure
from cloudsync.fleet.config import FleetServiceConfig
from edged.common.settings import Section, section_in

GIVEN = ["--json", "--timeout", "3", "--service", "http://s:1", "--fleet", "f2", "--port", "1"]


@pytest.mark.parametrize(
    "command",
    [["nodes"], ["label", "n1", "a=b"], ["rollout", "status", "r1"], ["enrol", "list"]],
)
def test_the_options_of_every_command_mean_the_same_before_or_after_its_name(
    command: list[str],
) -> None:
    parser = build_parser()
    before = vars(parser.parse_args([*GIVEN, *command]))
    after = vars(parser.parse_args([*command, *GIVEN]))
    assert before == after
    assert (after["json"], after["timeout"], after["service"], after["fleet"]) == (
        True,
        3.0,
        "http://s:1",
        "f2",
    )
    # not given anywhere: the defaults, the same whether the command has the options or not
    plain = vars(parser.parse_args(command))
    assert (plain["json"], plain["timeout"], plain["host"], plain["service"]) == (
        False,
        10.0,
        "localhost",
        None,
    )
    assert {flag.lstrip("-").replace("-", "_") for flag, _ in GLOBAL_OPTIONS} <= set(plain)


def test_rollout_wait_is_off_unlimited_or_bounded() -> None:
    parser = build_parser()
    assert parser.parse_args(["rollout", "status", "r"]).wait is None
    assert parser.parse_args(["rollout", "status", "r", "--wait"]).wait == 0.0
    assert parser.parse_args(["rollout", "status", "r", "--wait", "90"]).wait == 90.0


@pytest.mark.parametrize(
    ("items", "says"),
    [
        (["site"], "--selector 'site': a label as name=value"),
        (["=x"], "--selector: key ''"),
        (["site=a b"], "--selector.site: value 'a b'"),
        (["site=a=b"], "--selector.site: value 'a=b'"),
    ],
)
def test_a_bad_label_argument_is_a_usage_error_naming_the_option(
    items: list[str], says: str
) -> None:
    with pytest.raises(Failure) as caught:
        label_args(items, "--selector")
    assert caught.value.code == EXIT_USAGE and str(caught.value).startswith(says), caught.value


def test_good_label_arguments_are_the_labels() -> None:
    assert label_args(["site=a", "ring=canary-1"], "labels") == {"site": "a", "ring": "canary-1"}
    assert label_args([], "labels") == {}


def test_a_list_is_cut_to_its_column_and_says_how_many_more() -> None:
    models = [f"model-{i}:{i}" for i in range(17)]
    assert listed([], 30) == "-"
    assert listed(models[:2], 30) == "model-0:0, model-1:1"
    assert listed(models, 30) == "model-0:0, model-1:1 +15 more"
    assert listed(["a-very-long-model-name:12"], 10) == "+1 more"


@given(st.lists(st.text(min_size=1, max_size=40), max_size=30), st.integers(10, 200))
def test_a_cut_list_fits_its_column_and_keeps_a_prefix(items: list[str], width: int) -> None:
    text = listed(items, width)
    assert len(text) <= max(width, len(f"+{len(items)} more"))
    if not items or text == ", ".join(items):
        return
    # the first n items whole, then how many are left out
    n = next(n for n in range(len(items), -1, -1) if text.startswith(", ".join(items[:n])))
    rest = len(items) - n
    assert text in (f"{', '.join(items[:n])} +{rest} more", f"+{len(items)} more")


def test_a_rollouts_progress_line_counts_its_nodes() -> None:
    record: dict[str, Any] = {
        "id": "r5",
        "state": "running",
        "stage": 0,
        "stages": [0.5, 1.0],
        "phase": "soak",
        "nodes": {"active": 3, "pending": 3},
    }
    assert progress(record) == (
        "rollout r5: running, stage 1 of 2 (soak) [##########..........] 3/6 active;"
        " 3 active, 3 pending"
    )
    record["nodes"] = {}
    assert progress(record).endswith("[....................] 0/0 active; no nodes yet")


def keys(section: type[Section], where: str = "") -> list[tuple[str, str]]:
    found = []
    for name, info in section.model_fields.items():
        inner, _ = section_in(info.annotation)
        key = info.alias or name
        if inner is not None:
            found += keys(inner, f"{where}.{key}" if where else key)
        else:
            found.append((where, key))
    return found


def test_serve_help_names_every_key_of_the_config_under_its_section() -> None:
    """debian/edgefleet.toml says so; it did not (issue 48)."""
    done = subprocess.run(
        [sys.executable, "-m", "cloudsync.fleet.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    sections: dict[str, list[str]] = {}
    current = ""
    for line in done.stdout.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = line.strip("[]")
        elif line.startswith("  ") and " = " in line and current:
            sections.setdefault(current, []).append(line.split(" = ")[0].strip())
    expected = keys(FleetServiceConfig)
    assert len(expected) > 40
    for section, key in expected:
        assert key in sections.get(section, []), (section, key)
    assert "  offline_after_s = 30.0: an online node without a heartbeat" in done.stdout
    assert "  name = (required): who holds it" in done.stdout
