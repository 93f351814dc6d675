"""Issue 44, point 6: a request within every limit must not take memory it never gives back.

Found: one ``/v1/intent`` call of 256 texts of 16 KB (a 4 MiB body) added 1,512 MiB to edged
that stayed; two callers took a daemon run as its unit from 595 to 2,469 MiB, past the unit's
``MemoryHigh=2G``. The tokenizer read each text whole before truncating it (the rest kept as
overflow), the encoder ran 64 rows of 256 tokens at once (attention is rows x heads x tokens^2),
and ONNX Runtime's arena kept its largest run for good. Now a text is tokenized from its head,
the encoder's calls are bounded in tokens, and a heavy run gives its memory back. A real edged,
run as its unit runs it; its RSS (with its children) read from /proc.
"""

from __future__ import annotations

import random
import string
import threading
import time

from bench.idle_unload import tree_rss
from edged.client import Client
from tests.conftest import Daemon

# The 4 MiB body above max_json_bytes' 2 MiB (issue 44, point 7): allowed here, as a user may.
CONFIG = """
[server]
max_json_bytes = 16777216
[models]
load = ["intent", "text-embedding", "text-encoder", "intent-classifier"]
"""


def texts(count: int, size: int) -> list[str]:
    rng = random.Random(44)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(999)]
    return [" ".join(rng.choices(words, k=size // 5))[:size] for _ in range(count)]


def test_long_texts_take_no_memory_that_stays(make_daemon: type[Daemon]) -> None:
    daemon = make_daemon(config=CONFIG).start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    daemon.client.task("intent", {"texts": ["turn on the lights"]})  # warm
    start = tree_rss(pid)
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    big = texts(256, 16384)
    slow = Client(str(daemon.socket), timeout=300)  # two 4 MiB calls on a loaded 2-CPU runner
    try:
        answers = []
        callers = [
            threading.Thread(target=lambda: answers.append(slow.task("intent", {"texts": big})))
            for _ in range(2)
        ]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(300)
    finally:
        done.set()
        sampler.join()
    after = tree_rss(pid)
    mib = 1 << 20
    print(f"RSS {start / mib:.0f} MiB, peak {peak[0] / mib:.0f}, after {after / mib:.0f}")
    assert len(answers) == 2 and answers[0]["intents"] == answers[1]["intents"]
    assert len(answers[0]["intents"]) == 256
    assert peak[0] - start < 1024 * mib  # was +1,874 MiB with two callers
    # was 248 -> 2,212 MiB with one caller; +18 % until the heap's thresholds were fixed
    # (edged/common/heap.py). Issue 44's goal, back within 10 %, holds on a quiet machine (+3 %,
    # docs/BENCHMARKS.md); beside a CPU burner on 2 CPUs the heap kept +3 to +10 %, so the bound
    # here leaves room for a loaded runner and still catches what one call's tensors would leave
    # (their peak is +600 MiB).
    assert after < start * 1.15, (start / mib, after / mib)
