"""System shared memory's rules without a daemon (edged.oip.shm): who may read a file by
its mode, what an input's parameters may say, regions by (uid, name), bounds checked against
the region and the file before anything is read. Files in a temporary directory stand in for
/dev/shm (the same kind of file: regular, on a tmpfs or not). The sealed memfds edged makes
(read in place): the caller cannot shrink, grow or further seal them; a read is a view."""

from __future__ import annotations

import fcntl
import mmap
import os
import re
from pathlib import Path

import pytest

from edged.common.errors import InvalidRequest
from edged.oip.shm import Regions, Use, may, use_of
from edged.server.access import Peer

ALICE = Peer(pid=os.getpid(), uid=1000, gid=1000, groups=frozenset({44}))
BOB = Peer(pid=os.getpid(), uid=1001, gid=1001)


class Info:
    def __init__(self, uid: int, gid: int, mode: int) -> None:
        self.st_uid, self.st_gid, self.st_mode = uid, gid, mode


@pytest.mark.parametrize(
    ("owner", "group", "mode", "read", "write"),
    [
        (1000, 1, 0o600, True, True),  # the owner's bits
        (1000, 1, 0o400, True, False),
        (1000, 1, 0o066, False, False),  # the owner's bits only, even where others' allow
        (2, 44, 0o640, True, False),  # a supplementary group's bits
        (2, 1000, 0o660, True, True),  # the primary group's
        (2, 3, 0o604, True, False),  # others'
        (2, 3, 0o660, False, False),
    ],
)
def test_the_files_mode_decides_for_the_caller(
    owner: int, group: int, mode: int, read: bool, write: bool
) -> None:
    info = Info(owner, group, mode)
    assert may(ALICE.uid, ALICE.gids, info, write=False) is read  # type: ignore[arg-type]
    assert may(ALICE.uid, ALICE.gids, info, write=True) is write  # type: ignore[arg-type]
    assert may(0, frozenset(), Info(5, 5, 0o000), write=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"shared_memory_region": 5, "shared_memory_byte_size": 4}, "must be a region's name"),
        ({"shared_memory_region": "a/b", "shared_memory_byte_size": 4}, "region's name"),
        ({"shared_memory_region": "r"}, "shared_memory_byte_size must be an integer >= 0"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": True}, "byte_size must be"),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 4, "shared_memory_offset": -1},
            "shared_memory_offset must be an integer >= 0",
        ),
    ],
)
def test_bad_parameters_name_the_tensor_and_the_field(params: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidRequest, match=f"input 'x': .*{says}"):
        use_of("input 'x'", params)


def test_parameters_without_a_region_are_no_use() -> None:
    assert use_of("input 'x'", {"binary_data_size": 4}) is None
    assert use_of(
        "input 'x'",
        {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": 2},
    ) == Use("r", 8, 2)


def test_regions_are_per_uid_and_checked_against_region_and_file(tmp_path: Path) -> None:
    data = bytes(range(64))
    (tmp_path / "k").write_bytes(data)
    os.chmod(tmp_path / "k", 0o666)
    regions = Regions(max_regions=2, root=tmp_path)
    regions.register(ALICE, "r", "/k", 16, 32)
    regions.register(BOB, "r", "/k", 0, 8)  # the same name, another uid: its own region
    with pytest.raises(InvalidRequest, match="2 regions are registered"):
        regions.register(ALICE, "s", "/k", 0, 8)
    assert bytes(regions.read(ALICE, Use("r", 4, 2), limit=100)) == data[18:22]
    assert bytes(regions.read(BOB, Use("r", 8), limit=100)) == data[:8]
    with pytest.raises(InvalidRequest, match="offset 30 \\+ 4 bytes is past its 32 bytes"):
        regions.read(ALICE, Use("r", 4, 30), limit=100)
    with pytest.raises(InvalidRequest, match="more than 3 for a request"):
        regions.read(ALICE, Use("r", 4), limit=3)
    regions.write(ALICE, Use("r", 2, 0), b"\xff\xfe")
    assert (tmp_path / "k").read_bytes()[16:18] == b"\xff\xfe"
    with pytest.raises(InvalidRequest, match="the output is 3 bytes, the request gave 2"):
        regions.write(ALICE, Use("r", 2), b"abc")
    os.truncate(tmp_path / "k", 20)
    with pytest.raises(InvalidRequest, match="smaller than registered"):
        regions.read(ALICE, Use("r", 8), limit=100)
    assert [r["name"] for r in regions.status(BOB, None)] == ["r"]
    regions.unregister(BOB, None)
    with pytest.raises(InvalidRequest, match="no shared-memory region 'r'"):
        regions.read(BOB, Use("r", 1), limit=100)
    assert regions.status(ALICE, "r") == [{"name": "r", "key": "/k", "offset": 16, "byte_size": 32}]
    regions.close()
    assert regions.status(ALICE, None) == []


def test_what_a_key_may_not_be(tmp_path: Path) -> None:
    (tmp_path / "k").write_bytes(b"x" * 8)
    os.chmod(tmp_path / "k", 0o600)
    os.chown(tmp_path / "k", 0, 0)
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "k", tmp_path / "link")
    regions = Regions(root=tmp_path)
    for key, says in (
        ("/../k", "one path component"),
        ("/", "one path component"),
        ("/link", "a link is refused"),
        ("/fifo", "not a shared-memory file"),
        ("/none", "no such shared-memory file"),
        (5, "one path component"),
    ):
        with pytest.raises(InvalidRequest, match=says):
            regions.register(ALICE, "r", key, 0, 1)
    if os.geteuid() == 0:  # root's 0600 file: edged (root here) opens it, Alice may not read
        with pytest.raises(InvalidRequest, match="its mode does not let uid 1000 gid 1000"):
            regions.register(ALICE, "r", "/k", 0, 1)
    with pytest.raises(InvalidRequest, match="past the end of /k \\(8 bytes\\)"):
        regions.register(Peer(1, 0, 0), "r", "/k", 4, 5)
    with pytest.raises(InvalidRequest, match="for local callers"):
        regions.register(None, "r", "/k", 0, 1)
    with pytest.raises(InvalidRequest, match="off here"):
        Regions(max_regions=0, root=tmp_path).register(ALICE, "r", "/k", 0, 1)


def test_a_sealed_memfd_is_read_in_place_and_cannot_shrink_or_grow() -> None:
    regions = Regions(max_regions=4, per_uid=2)
    fd = regions.create(ALICE, "frame", 64, limit=64)
    mine = mmap.mmap(fd, 64)  # what the caller maps
    try:
        for size in (32, 128):  # the caller can neither shrink nor grow it
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):  # nor add a seal (F_SEAL_WRITE would stop edged)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        mine[:8] = bytes(range(8))
        view = regions.read(ALICE, Use("frame", 4, 2), limit=64)
        assert bytes(view) == bytes([2, 3, 4, 5])
        mine[2] = 99  # a view of the mapping, not a copy
        assert view[0] == 99
        regions.write(ALICE, Use("frame", 3, 60), b"abc")
        assert mine[60:63] == b"abc"
        assert regions.status(ALICE, "frame") == [
            {"name": "frame", "key": "memfd:frame", "offset": 0, "byte_size": 64}
        ]
        assert not regions.copies(ALICE) and not regions.copies(BOB)
        with pytest.raises(InvalidRequest, match="offset 62 \\+ 4 bytes is past its 64 bytes"):
            regions.read(ALICE, Use("frame", 4, 62), limit=64)
        with pytest.raises(InvalidRequest, match="more than 3 for a request"):
            regions.read(ALICE, Use("frame", 4), limit=3)
        regions.unregister(ALICE, "frame")  # a view held: the mapping stays until it goes
        assert bytes(view) == bytes([99, 3, 4, 5])
        with pytest.raises(InvalidRequest, match="no shared-memory region 'frame'"):
            regions.read(ALICE, Use("frame", 1), limit=64)
        del view
    finally:
        mine.close()
        os.close(fd)


@pytest.mark.parametrize(
    ("name", "size", "says"),
    [
        ("f", 0, "byte_size: an integer from 1 to 64"),
        ("f", 65, "byte_size: an integer from 1 to 64"),
        ("f", True, "byte_size: an integer"),
        ("f", "8", "byte_size: an integer"),
        ("f", None, "byte_size: an integer"),
        ("../f", 8, "region name"),
        (7, 8, "region name"),
        ("x" * 129, 8, "region name"),
    ],
)
def test_a_memfds_name_and_size_are_checked_before_it_is_made(
    name: object, size: object, says: str
) -> None:
    regions = Regions()
    with pytest.raises(InvalidRequest, match=says):
        regions.create(ALICE, name, size, limit=64)
    assert regions.regions == {}


def test_memfds_count_against_the_quotas_and_files_make_reads_copy(tmp_path: Path) -> None:
    (tmp_path / "k").write_bytes(b"x" * 8)
    os.chmod(tmp_path / "k", 0o666)
    regions = Regions(max_regions=3, per_uid=2, root=tmp_path)
    fds = [regions.create(ALICE, "a", 8, 8), regions.create(ALICE, "b", 8, 8)]
    with pytest.raises(InvalidRequest, match="uid 1000 has 2 shared-memory regions"):
        regions.create(ALICE, "c", 8, 8)
    with pytest.raises(InvalidRequest, match="region 'a' is registered already"):
        regions.create(ALICE, "a", 8, 8)
    regions.register(BOB, "f", "/k", 0, 8)
    with pytest.raises(InvalidRequest, match="3 regions are registered"):
        regions.create(BOB, "g", 8, 8)
    assert regions.copies(BOB) and not regions.copies(ALICE)
    with pytest.raises(InvalidRequest, match="for local callers"):
        regions.create(None, "a", 8, 8)
    regions.close()
    for fd in fds:
        os.close(fd)


def test_the_bytes_of_sealed_regions_one_uid_holds_are_bounded(tmp_path: Path) -> None:
    (tmp_path / "k").write_bytes(b"x" * 64)
    os.chmod(tmp_path / "k", 0o666)
    regions = Regions(root=tmp_path)
    fds = [regions.create(ALICE, "a", 40, 64, per_uid=64)]
    with pytest.raises(
        InvalidRequest,
        match=re.escape(
            "uid 1000 holds 40 bytes of sealed regions; 32 more would pass 64"
            " (server.shm_memfd_mb_per_uid)"
        ),
    ):
        regions.create(ALICE, "b", 32, 64, per_uid=64)
    fds.append(regions.create(ALICE, "b", 24, 64, per_uid=64))  # up to the bound
    fds.append(regions.create(BOB, "a", 64, 64, per_uid=64))  # another uid: its own
    regions.register(ALICE, "f", "/k", 0, 64)  # a file of the caller's own: not counted
    regions.unregister(ALICE, "a")
    fds.append(regions.create(ALICE, "c", 40, 64, per_uid=64))
    regions.close()
    for fd in fds:
        os.close(fd)
