"""The egress ledger: what left the device, to where and why, written before it leaves, in an
append-only log whose entries are chained by their hashes, so that an owner can audit privacy
instead of trusting it.

An entry is one JSON line: ``seq`` (1, 2, ...), ``ts`` (ms since the epoch), ``kind`` (what
went: ``cloud-infer``, ``answer-model``, ``telemetry``...), the fields its writer gives
(request id, caller uid, model, step, endpoint, tier, route, reason, the privacy of the inputs,
``bytes``, and ``sha256`` of the exact bytes sent: never the bytes), ``prev`` (the previous
entry's hash) and ``hash``: the SHA-256 of the entry's canonical JSON without ``hash`` (keys
sorted, no spaces, ASCII: anything else escaped, lone surrogates too). The first entry of a
ledger is a ``genesis`` (``prev`` 64 zeros, a random ``ledger`` id). Changing, removing or
inserting an entry anywhere breaks the chain at that point (``verify``); the chain's head
(``checkpoint``: seq and hash) goes out with each heartbeat, so the fleet holds anchors that a
device cannot rewrite later.

Files: ``egress-{first seq:012d}.jsonl`` segments in one directory (``[egress] directory``,
under the state directory), a new one past ``segment_bytes``; past ``max_bytes`` in all the
oldest segments are deleted, after a ``pruned`` entry records them (their names, their last seq
and hash): the oldest segment left then starts where the ``pruned`` entry says the cut was. A
line is written whole by one ``write`` and flushed to the kernel before the bytes it records
are sent (a killed process loses nothing written); ``fsync`` follows every ``fsync_s`` (a power
cut can lose that much). A torn last line (a power cut mid-write) is no entry: ``verify``
reports it and accepts the chain up to it, and the next ``open`` cuts it off and records a
``recovered`` entry saying how many bytes went.

The files alone cannot show that they were replaced: a shorter copy renamed over the segment
edged writes is a chain that verifies. So ``verify`` is given edged's own head where edged runs
(the files must hold it), and the writer checks, before each entry, that the file at its
segment's path is still the one it opened (see ``Ledger.record``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.common.digits import whole

log = logging.getLogger(__name__)
ZERO = "0" * 64
SEGMENT = re.compile(r"^egress-(\d{12})\.jsonl\Z")
SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
MAX_LINE = 64 * 1024  # an entry's bytes at most (its text fields are cut to fit)


def canonical(entry: dict[str, Any]) -> bytes:
    """The bytes an entry's hash is taken over: its JSON without ``hash``, keys sorted."""
    body = {k: v for k, v in entry.items() if k != "hash"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def digest(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def segments(directory: Path) -> list[Path]:
    """The ledger's segment files, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if SEGMENT.match(p.name)]
    return sorted(found, key=lambda p: p.name)


@dataclass
class Checkpoint:
    """The chain's head: its last entry's seq and hash (what a heartbeat carries)."""

    seq: int
    hash: str

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "hash": self.hash}


@dataclass
class Report:
    """What ``verify`` found."""

    ok: bool = True
    entries: int = 0
    first_seq: int = 0
    last: Checkpoint = field(default_factory=lambda: Checkpoint(0, ZERO))
    segments: int = 0
    torn: int = 0  # bytes of a torn last line (no entry)
    pruned_through: int = 0  # entries before first_seq were pruned, as a pruned entry records
    error: str = ""  # the first break: where and what
    anchors: list[str] = field(default_factory=list)  # checkpoints matched ("seq:hash")
    edged_head: Checkpoint | None = None  # the running edged's head it was compared with

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "entries": self.entries,
            "first_seq": self.first_seq,
            "last": self.last.as_dict(),
            "segments": self.segments,
            "torn_bytes": self.torn,
            "pruned_through": self.pruned_through,
            "error": self.error,
            "anchors": self.anchors,
            "edged_head": self.edged_head.as_dict() if self.edged_head else None,
        }


def read_entries(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, the line's bytes without its newline) of a segment; a last line without
    a newline is yielded too (the caller decides it is torn)."""
    with path.open("rb") as f:
        yield from enumerate(f, 1)


def anchors_of(texts: list[str]) -> dict[int, str]:
    """Checkpoints written ``SEQ:SHA256`` (the fleet's), as ``verify`` takes them (ValueError:
    one that is not)."""
    anchors = {}
    for text in texts:
        seq, _, value = text.partition(":")
        number = whole(seq)
        if number is None or not SHA256.match(value):
            raise ValueError(f"a checkpoint is SEQ:SHA256 (the fleet's), not {text[:80]!r}")
        anchors[number] = value
    return anchors


def verify(
    directory: Path, anchors: dict[int, str] | None = None, head: Checkpoint | None = None
) -> Report:
    """Walk every segment in order: each line an entry whose hash is its own, whose ``seq``
    follows and whose ``prev`` is the entry before's hash; the first one after a cut says
    where (a ``pruned`` entry later in the chain records the cut's last seq and hash).
    ``anchors`` (seq: hash, from the fleet's checkpoints): each must be in the chain.
    ``head``: the running edged's own, read before the walk: the chain must hold it, since a
    file replaced or cut short under edged is otherwise a chain that verifies."""
    report = _walk(directory, anchors, head)
    if head is None or not head.seq:
        return report
    report.edged_head = head
    end = report.first_seq + report.entries - 1 if report.entries else 0  # the last whole seq
    if head.seq <= end:  # the walk compared its hash
        return report
    if not report.ok:  # the break is the first thing to show; what it hides, the second
        report.error += f"; the chain verifies up to entry {end}, edged's head is {head.seq}"
        return report
    return _broken(
        report,
        f"the ledger on disk ends at entry {end}, edged's head is"
        f" {head.seq}: the file was replaced or truncated",
    )


def _walk(directory: Path, anchors: dict[int, str] | None, head: Checkpoint | None) -> Report:
    report = Report()
    files = segments(directory)
    report.segments = len(files)
    prev: str | None = None
    seq = 0
    cut: tuple[int, str] | None = None  # (seq, hash) before the oldest entry left
    pruned: list[tuple[int, str]] = []
    wanted = dict(anchors or {})
    for index, path in enumerate(files):
        for number, raw in read_entries(path):
            where = f"{path.name} line {number}"
            if not raw.endswith(b"\n"):
                if index == len(files) - 1:
                    report.torn = len(raw)  # a power cut mid-write: no entry
                    break
                return _broken(report, f"{where}: a line without its end, not in the last file")
            try:
                entry = json.loads(raw)
                if not isinstance(entry, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                return _broken(report, f"{where}: not an entry ({exc})")
            if entry.get("hash") != digest(canonical(entry)):
                return _broken(report, f"{where}: seq {entry.get('seq')}: its hash is not its own")
            if prev is None:  # the oldest entry left
                seq = int(entry.get("seq", 0)) - 1
                prev = entry.get("prev")
                report.first_seq = seq + 1
                if entry.get("kind") != "genesis":
                    cut = (seq, str(prev))
            if entry.get("seq") != seq + 1:
                return _broken(
                    report,
                    f"{where}: seq {entry.get('seq')} after {seq}: an entry"
                    f" is missing or inserted{_noted(entry)}",
                )
            if entry.get("prev") != prev:
                return _broken(
                    report,
                    f"{where}: seq {entry.get('seq')}: prev is not the hash"
                    f" of seq {seq}{_noted(entry)}",
                )
            seq, prev = entry["seq"], entry["hash"]
            if head is not None and seq == head.seq and prev != head.hash:
                return _broken(
                    report,
                    f"{where}: seq {seq} is not edged's (edged's head there"
                    " has another hash): the ledger was rewritten",
                )
            report.entries += 1
            if entry.get("kind") == "pruned":
                pruned.append((int(entry.get("through_seq", 0)), str(entry.get("last_hash"))))
            if seq in wanted:
                if wanted.pop(seq) != prev:
                    return _broken(report, f"{where}: seq {seq} is not the fleet's checkpoint")
                report.anchors.append(f"{seq}:{prev}")
    report.last = Checkpoint(seq, prev or ZERO)
    if cut is not None:
        if cut not in pruned:
            return _broken(
                report,
                f"the oldest entry left (seq {cut[0] + 1}) follows seq"
                f" {cut[0]}, and no pruned entry records that cut",
            )
        report.pruned_through = cut[0]
    early = [s for s in wanted if s <= report.pruned_through]
    late = [s for s in wanted if s > report.pruned_through]
    if late:
        return _broken(report, f"checkpoint seq {min(late)} is not in the ledger")
    report.anchors += [f"{s}: pruned" for s in sorted(early)]
    return report


def _broken(report: Report, why: str) -> Report:
    report.ok, report.error = False, why
    return report


def _noted(entry: dict[str, Any]) -> str:
    """What edged said of a break it saw coming: a ``replaced`` entry opens the segment it went
    on in after the one before changed under it."""
    if entry.get("kind") != "replaced":
        return ""
    by, why = entry.get("by"), entry.get("why")
    return f" ({entry.get('segment')} changed under {by}, which recorded: {why})"


class Ledger:
    """The writer: one per process (the directory's lock file says so)."""

    def __init__(
        self,
        directory: Path,
        segment_bytes: int = 16 << 20,
        max_bytes: int = 256 << 20,
        fsync_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.segment_bytes, self.max_bytes, self.fsync_s = segment_bytes, max_bytes, fsync_s
        self.clock = clock
        self.lock = threading.Lock()
        self.fd = -1
        self.path: Path | None = None
        self.size = 0
        self.ident = (0, 0)  # the open segment's (st_dev, st_ino): the file edged writes
        self.lost = ""  # the segment found changed under edged, logged once ("": none)
        self.pending: dict[str, Any] | None = None  # a replaced entry not yet written
        self.head = Checkpoint(0, ZERO)
        self.dirty = False
        self.failed = ""  # why the last write failed ("": none)
        self.enabled = True  # False: the config turned it off (its last entry says so)
        self.owner = "edged"  # the process that writes it (edged, cloudsync): said in its logs

    # ---- opening ----------------------------------------------------------------------------

    def open(self, note: dict[str, Any] | None = None) -> Checkpoint:
        """Open the ledger (made when new: a genesis entry), its head read from the last
        segment, a torn last line cut off (and recorded); ``note``: an entry to write first
        (e.g. the settings it runs with)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        files = segments(self.directory)
        # Who called what is the writer's alone (admins read it through its API): a ledger of
        # an older edged, 0640 for edged's group, is made the owner's (issue 44).
        os.chmod(self.directory, 0o700)
        for file in files:
            os.chmod(file, 0o600)
        if not files:
            self._start(1)
            self._append({"kind": "genesis", "ledger": secrets.token_hex(16)}, ZERO, 0)
        else:
            while len(files) > 1 and b"\n" not in files[-1].read_bytes():
                files.pop().unlink()  # made by a rotation that wrote nothing whole into it
            torn, unreadable = self._resume(files[-1])
            if torn:
                why = "a torn last line (the process or the power stopped mid-write)"
                self.record("recovered", dropped_bytes=torn, why=why)
            if unreadable:  # the file is kept as it is: verify shows where it broke
                self.record(
                    "unreadable-tail",
                    segment=files[-1].name,
                    bytes=unreadable,
                    why="the segment's last lines are no entries: the chain goes on"
                    " from its last readable entry, in a new segment",
                )
        if note:
            self.record(**note)
        return self.head

    def start(self, enabled: bool, settings: dict[str, Any], owner: str) -> None:
        """Open it with an entry saying so and how it is set; off (by the config only), an
        entry says that, and it is closed. One that cannot be opened (a full disk) is logged:
        ``record`` then refuses, so what it would record is not sent until it can."""
        self.owner = owner
        try:
            if enabled:
                head = self.open({"kind": "started", "by": owner, "settings": settings})
                log.info("egress ledger %s: entry %d", self.directory, head.seq)
                return
            self.open({"kind": "ledger-off", "by": owner, "why": "[egress] enabled = false"})
            self.close()
            self.enabled = False
            log.warning(
                "the egress ledger %s is off ([egress] enabled = false): what leaves is"
                " not recorded from now on (its last entry says so)",
                self.directory,
            )
        except (OSError, ValueError) as exc:
            self.failed = str(exc)
            log.error(
                "the egress ledger %s cannot be opened (%s): nothing it would record is"
                " sent until it can",
                self.directory,
                exc,
            )

    def _resume(self, path: Path) -> tuple[int, int]:
        """The head from a segment's last whole entry, and what was wrong after it: the size
        of a torn tail (cut off), and of whole lines that are no entries (garbage, an edit: the
        file is left as it is, the chain goes on in a new segment from the last entry read)."""
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        torn = len(data) - end
        if torn:
            with path.open("r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
            log.warning("egress ledger %s: cut a torn last line (%d bytes)", path.name, torn)
        good = end
        while good:
            start = data.rfind(b"\n", 0, good - 1) + 1
            try:
                last = json.loads(data[start:good])
                self.head = Checkpoint(int(last["seq"]), str(last["hash"]))
                break
            except (ValueError, KeyError, TypeError):
                good = start
        if good < end:
            log.error(
                "egress ledger %s: its last %d bytes are no entries; going on from seq %d"
                " in a new segment",
                path.name,
                end - good,
                self.head.seq,
            )
            self._start(self.head.seq + 1)
            return torn, end - good
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        self.path, self.size, self.ident = path, end, (st.st_dev, st.st_ino)
        return torn, 0

    def _start(self, first_seq: int) -> None:
        """Go on in a new segment. It is opened before the old one is closed, so that a failure
        leaves the ledger as it was, never with a descriptor that is closed (or reused)."""
        path = self.directory / f"egress-{first_seq:012d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        old, self.fd, self.path = self.fd, fd, path
        st = os.fstat(fd)
        self.size, self.ident = st.st_size, (st.st_dev, st.st_ino)
        if old >= 0:
            try:
                os.fsync(old)
            finally:
                os.close(old)

    # ---- writing ----------------------------------------------------------------------------

    def record(self, kind: str, **fields: Any) -> Checkpoint:
        """One entry, written (to the kernel) before this returns: its seq and hash. OSError
        (a full disk) is raised: what it would record must not be sent.

        Before it, the file at the segment's path must still be the one edged opened (the same
        device and inode, as long as edged wrote it). When it is not (a copy renamed over it,
        renamed away, deleted, cut short or written by another), the file edged holds open is
        one nobody will read: edged logs an error (once; an event for the fleet), leaves what
        is at the path as it is, and goes on in a new segment whose first entry, ``replaced``,
        continues the chain from edged's own head and says what changed. The entries the
        change hid are then missing from the chain on disk, and ``verify`` names the break."""
        with self.lock:
            if self.fd < 0:
                raise OSError("the egress ledger is not open")
            self._follow()
            return self._append({"kind": kind, **fields}, self.head.hash, self.head.seq)

    def _follow(self) -> None:
        """Go on in a new segment if the open one changed under edged (see ``record``); an
        OSError leaves it to the next entry to try again, nothing written to the old file."""
        note = self.pending
        if note is None:
            why = self._changed()
            if not why:
                return
            assert self.path is not None
            name = self.path.name
            if self.lost != name:
                log.error(
                    "egress ledger %s changed under %s: %s; entries from seq %d go to a"
                    " new segment whose first entry records this (verify shows the"
                    " break)",
                    name,
                    self.owner,
                    why,
                    self.head.seq + 1,
                )
                self.lost = name
            note = {
                "kind": "replaced",
                "segment": name,
                "by": self.owner,
                "bytes": self.size,
                "why": why,
            }
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            old = self.fd
            try:
                self._start(self.head.seq + 1)
            finally:
                if self.fd != old:  # the new segment is open (the old one's fsync may fail)
                    self.lost, self.pending = "", note
        self._append(note, self.head.hash, self.head.seq)
        self.pending = None

    def _changed(self) -> str:
        """Why the file at the segment's path is not the one edged writes ("": it is). The
        identity comes from the descriptor when it was opened; one unlinked since (its link
        count 0) is no longer at the path, so one stat of the path tells every case."""
        assert self.path is not None
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return "it is gone from the directory (renamed away or deleted)"
        if (there.st_dev, there.st_ino) != self.ident:
            return f"another file ({there.st_size} bytes) was put in its place"
        if there.st_size != self.size:
            return (
                f"it holds {there.st_size} bytes, edged wrote {self.size} (cut short, or"
                " written by another)"
            )
        return ""

    def _append(self, fields: dict[str, Any], prev: str, seq: int) -> Checkpoint:
        entry = {"seq": seq + 1, "ts": int(self.clock() * 1000), **fields, "prev": prev}
        body = canonical(entry)
        entry["hash"] = digest(body)
        data = body[:-1] + b',"hash":"' + entry["hash"].encode() + b'"}\n'  # one JSON pass
        if len(data) > MAX_LINE:
            raise ValueError(f"an egress entry of {len(data)} bytes (at most {MAX_LINE})")
        try:
            written = os.write(self.fd, data)
            if written != len(data):  # a full disk mid-line: the line is torn, cut it
                raise OSError(f"wrote {written} of {len(data)} bytes")
        except OSError as exc:
            self.failed = str(exc)
            if self.path is not None:
                os.truncate(self.path, self.size)
            raise
        self.failed = ""
        self.size += len(data)
        self.dirty = True
        self.head = Checkpoint(entry["seq"], entry["hash"])
        if self.size >= self.segment_bytes:
            self._rotate()
        return self.head

    def _rotate(self) -> None:
        self._start(self.head.seq + 1)
        files = segments(self.directory)
        total = sum(p.stat().st_size for p in files)
        gone: list[Path] = []
        while total > self.max_bytes and len(files) > 1 + len(gone):
            gone.append(files[len(gone)])
            total -= gone[-1].stat().st_size
        if not gone:
            return
        nxt = files[len(gone)]
        first = json.loads(nxt.open("rb").readline())  # its first entry's prev: the cut
        self._append(
            {
                "kind": "pruned",
                "segments": [p.name for p in gone],
                "through_seq": first["seq"] - 1,
                "last_hash": first["prev"],
                "why": f"over max_bytes ({self.max_bytes})",
            },
            self.head.hash,
            self.head.seq,
        )
        os.fsync(self.fd)  # the record of the cut is on disk before the files go
        for path in gone:
            path.unlink()
        log.info("egress ledger: pruned %s", ", ".join(p.name for p in gone))

    def sync(self) -> None:
        """fsync what was written since the last one (a timer calls it every fsync_s, from a
        thread): on a duplicate of the file's descriptor, outside the lock, so that entries
        are written meanwhile (a rotation may close the original)."""
        with self.lock:
            if self.fd < 0 or not self.dirty:
                return
            fd = os.dup(self.fd)
            self.dirty = False
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.fsync(self.fd)
                os.close(self.fd)
                self.fd = -1

    # ---- reading ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What ``GET /v1/status`` shows (and a heartbeat carries: the head, the fleet's
        checkpoint)."""
        return {
            "enabled": self.enabled,
            "open": self.fd >= 0,
            "head": self.head.as_dict(),
            "directory": str(self.directory),
            "failed": self.failed,
        }

    def entries(
        self,
        after_seq: int = 0,
        limit: int = 100,
        match: Callable[[dict[str, Any]], bool] = lambda e: True,
    ) -> list[dict[str, Any]]:
        """Entries after ``after_seq`` that ``match``, oldest first, at most ``limit``."""
        found: list[dict[str, Any]] = []
        files = segments(self.directory)
        starts = [int(SEGMENT.match(p.name).group(1)) for p in files]  # type: ignore[union-attr]
        begin = max([i for i, s in enumerate(starts) if s <= after_seq + 1] or [0])
        for path in files[begin:]:
            for _, raw in read_entries(path):
                if not raw.endswith(b"\n"):
                    break
                entry = json.loads(raw)
                if entry["seq"] > after_seq and match(entry):
                    found.append(entry)
                    if len(found) >= limit:
                        return found
        return found
