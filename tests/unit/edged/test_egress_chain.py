"""The egress ledger's chain (edged/egress.py) on real files: written, reopened, rotated and
pruned, and every kind of tampering found by ``verify``: an entry edited, deleted, inserted or
swapped, a segment removed, a checkpoint the chain does not hold; a torn last line (a process
or a power cut mid-write) accepted up to it, and cut off by the next open."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.common.egress import ZERO, Ledger, anchors_of, canonical, digest, segments, verify


def filled(directory: Path, count: int, **knobs: int) -> Ledger:
    ledger = Ledger(directory, **knobs)
    ledger.open()
    for i in range(count):
        ledger.record("cloud-infer", request_id=f"r{i}", bytes=100 + i, sha256=digest(b"%d" % i))
    return ledger


def lines(directory: Path) -> list[tuple[Path, list[bytes]]]:
    return [(p, p.read_bytes().splitlines(keepends=True)) for p in segments(directory)]


def test_a_ledger_chains_its_entries_and_goes_on_after_a_restart(tmp_path: Path) -> None:
    ledger = filled(tmp_path, 5)
    head = ledger.head
    ledger.close()
    again = Ledger(tmp_path)
    assert again.open({"kind": "started", "why": "test"}).seq == head.seq + 1 == 7
    again.record("telemetry", bytes=7, sha256=digest(b"x"))
    again.close()
    report = verify(tmp_path)
    assert report.ok and report.entries == 8 and report.first_seq == 1, report
    assert report.last == again.head and report.torn == 0
    first, *rest = [
        json.loads(raw)
        for raw in tmp_path.joinpath("egress-000000000001.jsonl").read_bytes().splitlines()
    ]
    assert first["kind"] == "genesis" and first["prev"] == ZERO and len(first["ledger"]) == 32
    assert [e["kind"] for e in rest] == ["cloud-infer"] * 5 + ["started", "telemetry"]
    assert rest[0]["request_id"] == "r0" and rest[0]["bytes"] == 100
    for before, entry in zip([first, *rest], rest):
        assert entry["prev"] == before["hash"] and entry["hash"] == digest(canonical(entry))
    assert [e["seq"] for e in again.entries(after_seq=5, limit=2)] == [6, 7]
    assert [e["request_id"] for e in again.entries(match=lambda e: e.get("bytes") == 102)] == ["r2"]


@pytest.mark.parametrize(
    ("tamper", "found"),
    [
        ("edit", "its hash is not its own"),
        ("edit-and-rehash", "prev is not the hash"),
        ("delete", "an entry is missing or inserted"),
        ("insert", "an entry is missing or inserted"),
        ("swap", "an entry is missing or inserted"),
        ("garbage", "not an entry"),
    ],
)
def test_tampering_anywhere_in_the_middle_is_found(tmp_path: Path, tamper: str, found: str) -> None:
    filled(tmp_path, 10).close()
    ((path, rows),) = lines(tmp_path)
    entry = json.loads(rows[5])
    if tamper == "edit":  # what a cover-up would do: say fewer bytes left
        rows[5] = rows[5].replace(b'"bytes":104', b'"bytes":1')
    elif tamper == "edit-and-rehash":  # the same, its own hash made right
        entry["bytes"] = 1
        entry["hash"] = digest(canonical(entry))
        rows[5] = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    elif tamper == "delete":
        del rows[5]
    elif tamper == "insert":
        rows.insert(5, rows[4])
    elif tamper == "swap":
        rows[4], rows[5] = rows[5], rows[4]
    else:
        rows[5] = b"\x00\xffnot json\n"
    path.write_bytes(b"".join(rows))
    report = verify(tmp_path)
    assert not report.ok and found in report.error, report.error
    assert "egress-000000000001.jsonl line" in report.error


def test_a_torn_last_line_is_no_entry_and_the_next_open_cuts_it(tmp_path: Path) -> None:
    """What a SIGKILL or a power cut in the middle of a write leaves: the chain verifies up to
    the last whole entry; edged's next start cuts the torn bytes and records that it did."""
    filled(tmp_path, 4).close()
    ((path, rows),) = lines(tmp_path)
    whole = b"".join(rows)
    path.write_bytes(whole + rows[-1][:37])  # half an entry more
    report = verify(tmp_path)
    assert report.ok and report.torn == 37 and report.entries == 5, report
    ledger = Ledger(tmp_path)
    ledger.open()
    assert path.read_bytes().startswith(whole)
    recovered = ledger.entries(after_seq=5)
    assert [(e["kind"], e["dropped_bytes"]) for e in recovered] == [("recovered", 37)]
    ledger.close()
    assert verify(tmp_path).ok and verify(tmp_path).torn == 0


def test_segments_rotate_and_pruning_is_recorded_and_verifiable(tmp_path: Path) -> None:
    ledger = filled(tmp_path, 200, segment_bytes=4096, max_bytes=12_000)
    ledger.close()
    files = segments(tmp_path)
    assert 2 <= len(files) <= 4 and files[0].name != "egress-000000000001.jsonl"
    assert sum(p.stat().st_size for p in files) <= 12_000 + 4096
    report = verify(tmp_path)
    assert report.ok, report.error
    assert report.first_seq == report.pruned_through + 1 > 1
    assert report.last == ledger.head and report.entries == ledger.head.seq - report.pruned_through
    pruned = ledger.entries(limit=1000, match=lambda e: e["kind"] == "pruned")
    assert pruned and all(e["why"] == "over max_bytes (12000)" for e in pruned)
    # removing the oldest segment left (and so the record of what was cut before it) shows
    files[0].unlink()
    broken = verify(tmp_path)
    assert not broken.ok and "no pruned entry records that cut" in broken.error


def test_checkpoints_the_fleet_holds_must_be_in_the_chain(tmp_path: Path) -> None:
    ledger = filled(tmp_path, 10)
    at_five = ledger.entries(after_seq=4, limit=1)[0]["hash"]
    head = ledger.head
    ledger.close()
    report = verify(tmp_path, {5: at_five, head.seq: head.hash})
    assert report.ok and report.anchors == [f"5:{at_five}", f"{head.seq}:{head.hash}"]
    assert not verify(tmp_path, {5: ZERO}).ok  # a ledger rewritten after the checkpoint
    missing = verify(tmp_path, {50: at_five})
    assert not missing.ok and "checkpoint seq 50 is not in the ledger" in missing.error
    given = [f"5:{at_five}", f"{head.seq}:{head.hash}"]
    assert anchors_of(given) == {5: at_five, head.seq: head.hash}
    for bad in ("5", f"x:{at_five}", f"5:{at_five.upper()}", f"5:{at_five[:-1]}", f"-5:{at_five}"):
        with pytest.raises(ValueError, match="a checkpoint is SEQ:SHA256"):
            anchors_of([bad])


def test_a_full_disk_refuses_the_entry_and_leaves_no_torn_line(tmp_path: Path) -> None:
    """ENOSPC (a full disk, /dev/full): record raises, so the call it would record is not
    made; the file holds whole entries only."""
    ledger = filled(tmp_path, 2)
    head, real = ledger.head, ledger.fd
    ledger.fd = os.open("/dev/full", os.O_WRONLY)
    with pytest.raises(OSError):
        ledger.record("cloud-infer", bytes=5)
    assert ledger.head == head and ledger.failed
    os.close(ledger.fd)
    ledger.fd = real
    ledger.record("cloud-infer", bytes=6)
    ledger.close()
    assert verify(tmp_path).ok and verify(tmp_path).entries == 4


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=200)  # lone surrogates too
KEYS = st.text(min_size=1, max_size=20).filter(
    lambda k: k not in ("seq", "ts", "prev", "hash", "kind")
)
VALUES = st.one_of(
    ANY_TEXT, st.integers(-(2**53), 2**53), st.none(), st.lists(ANY_TEXT, max_size=5)
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(KEYS, VALUES, max_size=8))
def test_any_fields_a_writer_gives_make_entries_that_verify(fields: dict[str, object]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        ledger = Ledger(Path(where))
        ledger.open()
        ledger.record("cloud-infer", **fields)
        ledger.close()
        report = verify(Path(where))
        assert report.ok and report.entries == 2, report.error
        (entry,) = Ledger(Path(where)).entries(after_seq=1)
        assert {k: entry[k] for k in fields} == fields


def test_garbage_at_the_end_is_kept_and_the_chain_goes_on_in_a_new_segment(
    tmp_path: Path,
) -> None:
    """A last line that is no entry (a bit flip, an edit, garbage): the daemon keeps recording
    (a new segment, from the last entry it can read, saying why); verify shows the break."""
    filled(tmp_path, 3).close()
    ((path, rows),) = lines(tmp_path)
    path.write_bytes(b"".join(rows) + b"\xff\xfe garbage\n")
    ledger = Ledger(tmp_path)
    ledger.open()
    ledger.record("cloud-infer", bytes=9)
    ledger.close()
    files = segments(tmp_path)
    assert [p.name for p in files] == ["egress-000000000001.jsonl", "egress-000000000005.jsonl"]
    assert files[0].read_bytes().endswith(b"\xff\xfe garbage\n")  # left as it was
    first = json.loads(files[1].read_bytes().splitlines()[0])
    assert (first["kind"], first["segment"], first["bytes"], first["seq"]) == (
        "unreadable-tail",
        files[0].name,
        11,
        5,
    )
    report = verify(tmp_path)
    assert not report.ok and "egress-000000000001.jsonl line 5: not an entry" in report.error


def test_the_files_are_the_writers_alone(tmp_path: Path) -> None:
    """Issue 44: the ledger was 0640 for edged's group, whose members read who called what
    while the admin API refused them. An older ledger's modes are made the owner's at open."""
    directory = tmp_path / "egress"
    directory.mkdir(mode=0o750)
    old = Ledger(directory)
    old.open()
    old.close()
    for file in segments(directory):
        file.chmod(0o640)
    ledger = Ledger(directory)
    ledger.open()
    ledger.record("cloud-infer", model="m")
    ledger._start(ledger.head.seq + 1)  # a new segment
    ledger.record("cloud-infer", model="m")
    ledger.close()
    assert directory.stat().st_mode & 0o777 == 0o700
    assert {f.stat().st_mode & 0o777 for f in segments(directory)} == {0o600}
    assert len(segments(directory)) == 2
