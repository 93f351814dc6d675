"""Issue 44, point 13: the access log wrote one info line per 4xx answer, without a rate (one
fuzz run: 41,802 lines). Now 4xx lines are written up to a burst of 20 and 5 a second, the
others at debug and counted in the next line written; a real daemon at the default level."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

from edged.client import ClientError
from tests.conftest import Daemon

MORE = re.compile(r"\((\d+) more 4xx not written at info since the last\)")


def access_lines(daemon: Daemon) -> list[str]:
    return [line for line in daemon.logs().splitlines() if "no-such-model/infer ->" in line]


def test_a_flood_of_bad_requests_writes_a_bounded_number_of_lines(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config='[log]\nformat = "text"\n').start()
    try:
        started = time.monotonic()
        for _ in range(1000):
            try:
                daemon.client.call("POST", "/v2/models/no-such-model/infer", {"inputs": []})
            except ClientError as exc:
                assert exc.status in (400, 404)
        took = time.monotonic() - started
        lines = access_lines(daemon)
        assert 20 <= len(lines) <= 20 + 5 * took + 5, (len(lines), took)
        time.sleep(1.0)  # tokens again: the next line says how many were not written
        with contextlib.suppress(ClientError):
            daemon.client.call("POST", "/v2/models/no-such-model/infer", {"inputs": []})
        written = access_lines(daemon)
        assert MORE.search(written[-1]), written[-1]
        untold = sum(int(m.group(1)) for line in written if (m := MORE.search(line)))
        assert len(written) + untold == 1001  # every one accounted for
    finally:
        assert daemon.stop() == 0
