"""The ``logs`` command's journal source (issue 48; cloudsync.agent.journal) on real journal
files: systemd-journal-remote (Debian's package) writes them from the journal's export format,
trusted fields included (the unit, the PID, the command line), which no client of a running
journald can set. What is read back is what an operator gets: the units the config allows and
systemd's lines about them, since a time, at a level and above, capped in bytes; nothing of an
entry but its time, unit, process, level, message and edged's request fields; a private entry
without its message. Every bad argument is refused, naming it (a fuzzer holds that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudsync.agent.config import Config
from cloudsync.agent.handlers import Handlers
from cloudsync.agent.journal import WITHHELD
from cloudsync.protocol.envelope import canonical
from tests.journal_files import BOOT, JOURNAL, KEYS, NOW_US, REQUEST_KEYS, SECRET, entry, write


@pytest.fixture(scope="module")
def journal_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("journal")
    write(directory, JOURNAL)
    return directory


def handlers(directory: Path) -> Handlers:
    config = Config()
    config.commands.journal_dir = directory
    return Handlers("n1", config, cast(Any, None), dict, cast(Any, None), cast(Any, None))


def test_edgeds_lines_and_systemds_about_it_since_an_hour_at_a_level(journal_dir: Path) -> None:
    got = handlers(journal_dir).logs({"source": "journal", "level": "info"})
    assert got["source"] == "journal" and got["units"] == ["edged.service"]
    rows = got["lines"]
    assert [r["message"] for r in rows] == [  # oldest first; no ssh, no cloudsync, no debug
        "edged 0.1.0 starting",
        "config error: server.bogus: not a key",
        "edged.service: Main process exited, code=exited, status=78",
        "intent slow",
        WITHHELD,
    ]
    assert rows[2] == {
        "ts": rows[2]["ts"],
        "unit": "edged.service",
        "identifier": "systemd",
        "pid": 1,
        "level": "warning",
        "message": "edged.service: Main process exited, code=exited, status=78",
    }
    assert abs(rows[2]["ts"] - (NOW_US // 1000 - 50_000)) <= 1
    assert rows[1]["level"] == "error" and rows[1]["request_id"] == "r-1"
    assert (rows[3]["model"], rows[3]["route"]) == ("intent", "local")
    # nothing else of an entry leaves: not its command line, host, boot or other fields
    for row in rows:
        assert set(row) <= KEYS | REQUEST_KEYS, row
    text = canonical(got).decode()
    for kept in (SECRET, "jetson-17", BOOT, "patient 42", "r-2", "NODE"):
        assert kept not in text


def test_units_level_contains_and_since_narrow_it(journal_dir: Path) -> None:
    h = handlers(journal_dir)
    both = h.logs({"source": "journal", "units": ["cloudsync.service", "edged.service"]})
    assert both["units"] == ["cloudsync.service", "edged.service"]
    assert both["lines"][-1]["message"] == "connected to the broker"
    errors = h.logs({"source": "journal", "level": "error", "since_s": 3 * 3600})
    assert [r["message"] for r in errors["lines"]] == [
        "an error two hours ago",
        "config error: server.bogus: not a key",
    ]
    found = h.logs({"source": "journal", "contains": "slow", "lines": 5})
    assert [r["message"] for r in found["lines"]] == ["intent slow"]
    debug = h.logs({"source": "journal", "level": "debug", "lines": 1})
    assert [r["message"] for r in debug["lines"]] == ["a debug line"]


def test_the_answer_is_capped_in_bytes_keeping_the_newest(tmp_path: Path) -> None:
    write(
        tmp_path, [entry(100 - i, "edged.service", 6, f"{i:03d} " + "x" * 400) for i in range(60)]
    )
    got = handlers(tmp_path).logs({"source": "journal", "lines": 1000, "max_bytes": 4096})
    assert len(canonical(got["lines"])) <= 4096
    kept = [int(r["message"][:3]) for r in got["lines"]]
    assert kept == list(range(60 - len(kept), 60)) and len(kept) >= 5
    assert got["left_out"] == 60 - len(kept)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"units": ["ssh.service"]}, "'units': 'ssh.service' is not one this device sends"),
        ({"units": "edged.service"}, "'units' must be a list of unit names"),
        ({"units": []}, "'units' must be a list of unit names"),
        ({"since_s": 0}, "'since_s' must be 1 to 2678400"),
        ({"since_s": True}, "'since_s' must be 1 to"),
        ({"max_bytes": 10**9}, "'max_bytes' must be 1024 to"),
        ({"lines": 0}, "'lines' must be 1 to 1000"),
        ({"level": "loud"}, "'level' must be one of"),
        ({"path": "/etc/shadow"}, "'path' is not an argument of logs from journal"),
    ],
)
def test_a_bad_argument_is_refused_naming_it(
    journal_dir: Path, args: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValueError) as caught:
        handlers(journal_dir).logs({"source": "journal", **args})
    assert str(caught.value).startswith(says), caught.value


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.dictionaries(
        st.sampled_from(["units", "since_s", "max_bytes", "lines", "level", "contains", "x"]),
        VALUES,
    )
)
def test_any_arguments_give_an_answer_or_a_refusal_naming_one(
    journal_dir: Path, args: dict[str, Any]
) -> None:
    try:
        got = handlers(journal_dir).logs({"source": "journal", **args})
    except ValueError as exc:
        assert str(exc).startswith("'"), exc  # it names the argument
        return
    assert len(canonical(got)) < 65536 and set(got) <= {"source", "units", "lines", "left_out"}


def test_without_systemd_python_the_command_says_so(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device whose Python has no systemd-python (an optional import): a refusal that says
    why, not a crash of the command worker."""
    import importlib

    real = importlib.import_module

    def missing(name: str, *rest: Any) -> Any:
        if name == "systemd.journal":
            raise ImportError(name)
        return real(name, *rest)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(RuntimeError, match="cannot read its journal \\(no systemd-python\\)"):
        handlers(journal_dir).logs({"source": "journal"})
