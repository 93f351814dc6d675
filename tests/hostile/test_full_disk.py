"""State files on a full disk (a real 64 KiB tmpfs, mounted by the test; root only): a write
that cannot complete leaves the old file whole and no temporary file behind."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.atomic import write_atomic
from tests.conftest import skip_or_fail


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        skip_or_fail("mounting a tmpfs needs root (make test runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def fill(directory: Path) -> None:
    """Fill the disk to the last byte."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_state_file_on_a_full_disk_keeps_its_old_content(small_disk: Path) -> None:
    state = small_disk / "admin.json"
    write_atomic(state, '{"old": true}')
    assert state.read_text() == '{"old": true}' and oct(state.stat().st_mode)[-3:] == "600"
    fill(small_disk)
    with pytest.raises(OSError) as caught:
        write_atomic(state, '{"new": true}' + " " * 8192)
    assert caught.value.errno == errno.ENOSPC
    assert state.read_text() == '{"old": true}'
    assert sorted(p.name for p in small_disk.iterdir()) == ["admin.json", "filler"]
    (small_disk / "filler").unlink()  # space again: the next write goes through
    write_atomic(state, '{"new": true}')
    assert state.read_text() == '{"new": true}'
