#!/usr/bin/env python3
"""Knowledge store benchmarks: search latency and recall against numpy, memory, ingest rate.

1. ``KnowledgeStore`` directly (a Milvus Lite file in a temporary directory, dim 384, FLAT, the
   default): the store grows to each size of ``--sizes`` in upserts of 5,000 rows (as the store
   does them: normalised, written, flushed), then ``--queries`` single-vector searches (k=10)
   are timed one by one. Baseline in the same run, interleaved query by query: exact brute
   force in numpy over the same matrix (``vectors @ q``, ``argpartition`` for the top 10). Both
   run twice per query: with numpy's default BLAS threads, and (with threadpoolctl) with BLAS
   on one thread process-wide, the store's too (Milvus Lite 3 is Python and numpy in this
   process); on a small shared machine a threaded BLAS waits for a descheduled thread, which
   costs milliseconds on a product of a fraction of one. The vectors are unit-normalised
   random float32 from numpy with a fixed seed: FLAT search time does not depend on what the
   vectors hold, only on how many there are and their dimension. Recall@10 of the store
   against numpy's exact top 10 on the same queries (FLAT: 1.0 by construction); the upsert
   rate of the store alone (time in ``upsert`` only); and with ``index="HNSW"`` at the first
   size, its recall and latency (random vectors are a hard case for HNSW: measure on real data).
2. Memory: this process's VmRSS before the store is opened, after, and at each size, with the
   numpy copy of the vectors the baseline needs listed apart; the store's size on disk (``du``
   of the Milvus Lite directory).
3. End to end through a real daemon (``edged`` as a subprocess, ``text-embedding`` loaded) on
   real text: the King James Bible as the Debian package ``bible-kjv`` prints it (``bible
   "Gen1:1-Rev22:21"``; skipped with a reason without ``bible``). Its first ``--ingest-bytes``
   are ingested with ``Client.kb_ingest`` in requests of at most 100 KB: chunks/s, characters/s
   and the daemon's RSS (also after one embedding batch of 8 chunks before the ingest, so that
   the model's own buffers show apart from the store). Then 100 ``Client.kb_search`` calls
   (k=10) through the socket, verses of the ingested text as queries; baseline interleaved in
   the same run: ``Client.embed`` of the same query alone, so that the ratio shows what the
   store adds. And how often a hit holds the whole verse.

Sequential calls on a shared machine: medians and p99, ratios measured in the same run.

    .venv/bin/python bench/knowledge.py [--sizes 10000,100000] [--queries 200]
        [--ingest-bytes 300000] [--skip-daemon] [--skip-hnsw]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import rss_mib  # noqa: E402
from edged.client import Client, ClientError  # noqa: E402
from edged.common.stats import percentile  # noqa: E402
from edged.knowledge.store import Chunk, KnowledgeStore  # noqa: E402
from edged.knowledge.text import chunk_text  # noqa: E402

MODELS = ROOT / "models"
DIM = 384
K = 10
BATCH = 5000
SEED = 0
NAMESPACE = "bench"
REQUEST_BYTES = 100_000
SEARCHES = 100  # end-to-end kb_search calls
VERSE = re.compile(r"^\s+\d+ (.*)$")


def cell(value: Any) -> str:
    """Three significant figures, no exponent; integers in full, with thousands separators."""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[[cell(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def ms(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of samples in seconds, in milliseconds."""
    ordered = sorted(samples)
    return statistics.median(ordered) * 1000, (percentile(ordered, 0.99) or 0.0) * 1000


def cpu_seconds(pid: int | str = "self") -> float:
    """User and system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pid: int | str = "self", limit: float = 120.0) -> float:
    """Wait until a process is quiet (under 10% of a CPU over half a second): Milvus Lite
    compacts segments and builds indexes in a background thread after each flush. The seconds
    waited (``limit`` at most)."""
    begin = time.perf_counter()
    while time.perf_counter() - begin < limit:
        used = cpu_seconds(pid)
        time.sleep(0.5)
        if cpu_seconds(pid) - used < 0.05:
            break
    return time.perf_counter() - begin


def du_mib(path: Path) -> float:
    """Disk usage of a tree as ``du`` counts it (allocated blocks), in MiB."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in [".", *files]:
            with contextlib.suppress(FileNotFoundError):  # a file replaced while we walk
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total / 2**20


def unit_rows(rng: np.random.Generator, count: int) -> np.ndarray:
    rows = rng.standard_normal((count, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def numpy_top(vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Indices of the ``K`` best inner products, best first (exact)."""
    scores = vectors @ query
    top = np.argpartition(-scores, K)[:K]
    return top[np.argsort(-scores[top])]


def fill(store: KnowledgeStore, namespace: str, vectors: np.ndarray, start: int, end: int) -> float:
    """Upsert rows ``start:end`` of ``vectors`` in batches; the seconds spent in ``upsert``."""
    spent = 0.0
    for first in range(start, end, BATCH):
        last = min(end, first + BATCH)
        chunks = [Chunk(f"row {i}", vectors[i], "bench") for i in range(first, last)]
        begin = time.perf_counter()
        written = store.upsert(namespace, chunks)
        spent += time.perf_counter() - begin
        if written != last - first:
            raise SystemExit(f"upsert wrote {written} rows of {last - first}")
    return spent


def blas_limiter() -> Callable[[], contextlib.AbstractContextManager[object]] | None:
    """Contexts in which BLAS runs on one thread, process-wide (threadpoolctl); None without
    threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    controller = ThreadpoolController()
    return lambda: controller.limit(limits=1, user_api="blas")


def measure(
    store: KnowledgeStore, matrix: np.ndarray, queries: np.ndarray
) -> tuple[dict[str, list[float]], list[list[int]]]:
    """Each query through the store, then numpy, each with numpy's default BLAS threads and on
    one BLAS thread (process-wide: Milvus Lite's own numpy too), interleaved query by query so
    that the machine's drift hits all alike; the timings (seconds) and the row numbers the
    store found (default threads)."""
    one_thread = blas_limiter()
    samples: dict[str, list[float]] = {}
    found: list[list[int]] = []
    clock = time.perf_counter
    for i, query in enumerate([*queries[:5], *queries]):  # 5 untimed first
        for threads in ("", " (BLAS 1 thread)"):
            if threads and one_thread is None:
                continue
            with one_thread() if threads and one_thread else contextlib.nullcontext():
                start = clock()
                (hits,) = store.search(NAMESPACE, query[None, :], K)
                mid = clock()
                numpy_top(matrix, query)
                end = clock()
            if i >= 5:
                samples.setdefault("store" + threads, []).append(mid - start)
                samples.setdefault("numpy" + threads, []).append(end - mid)
                if not threads:
                    found.append([int(h.text.split()[1]) for h in hits])
    return samples, found


def exact(matrix: np.ndarray, queries: np.ndarray) -> list[np.ndarray]:
    return [numpy_top(matrix, q) for q in queries]


def summary(rows: str, index: str, samples: dict[str, list[float]]) -> list[list[Any]]:
    """A row per way of searching: p50, p99, p50 against numpy's (default, 1 BLAS thread)."""
    base = statistics.median(samples["numpy"]) * 1000
    one = statistics.median(samples.get("numpy (BLAS 1 thread)", [float("nan")])) * 1000
    out: list[list[Any]] = []
    for what, times in samples.items():
        p50, p99 = ms(times)
        name = f"{what.replace('store', 'store ' + index)}"
        out.append([rows, name, p50, p99, p50 / base, p50 / one])
    return out


def recall(found: list[list[int]], truth: list[np.ndarray]) -> float:
    hits = sum(len(set(f) & {int(t) for t in exact}) for f, exact in zip(found, truth))
    return hits / (K * len(truth))


# ---- 1. and 2. the store against numpy, memory ------------------------------------------------


def bench_store(sizes: list[int], count: int, workdir: Path, hnsw: bool) -> None:
    rng = np.random.default_rng(SEED)
    queries = unit_rows(np.random.default_rng(SEED + 1), count)
    # allocated, not touched: its pages count in RSS only as rows are written
    vectors = np.empty((max(sizes), DIM), np.float32)
    memory: list[list[Any]] = [["before opening the store", rss_mib(), 0.0]]
    path = workdir / "flat" / "kb.db"
    begin = time.perf_counter()
    store = KnowledgeStore(str(path), DIM)
    opened = time.perf_counter() - begin
    memory.append(["store opened (pymilvus imported)", rss_mib(), 0.0])
    latency: list[list[Any]] = []
    quality: list[list[Any]] = []
    writes: list[list[Any]] = []
    disk: list[list[Any]] = []
    loaded = 0
    try:
        for size in sizes:
            vectors[loaded:size] = unit_rows(rng, size - loaded)
            spent = fill(store, NAMESPACE, vectors, loaded, size)
            added = size - loaded
            writes.append([f"{loaded:,} -> {size:,}", added, spent, added / spent, settle()])
            loaded = size
            matrix = vectors[:size]
            copy = matrix.nbytes / 2**20
            memory.append([f"{size:,} rows loaded", rss_mib(), copy])
            chunks = store.stats(NAMESPACE)["chunks"]
            if chunks != size:
                print(f"note: the store counts {chunks} rows, {size} were written")
            samples, found = measure(store, matrix, queries)
            latency += summary(f"{size:,}", "FLAT", samples)
            quality.append([f"{size:,}", "FLAT", recall(found, exact(matrix, queries))])
            disk.append([f"{size:,}", "FLAT", du_mib(path), copy])
            memory.append([f"{size:,} rows, {count} searches later", rss_mib(), copy])
    finally:
        store.close()

    if hnsw:
        size = sizes[0]
        matrix = vectors[:size]
        hpath = workdir / "hnsw" / "kb.db"
        hstore = KnowledgeStore(str(hpath), DIM, index="HNSW")
        try:
            spent = fill(hstore, NAMESPACE, matrix, 0, size)
            writes.append([f"0 -> {size:,} (HNSW)", size, spent, size / spent, settle()])
            samples, found = measure(hstore, matrix, queries)
            latency += summary(f"{size:,}", "HNSW", samples)
            quality.append([f"{size:,}", "HNSW (M 16)", recall(found, exact(matrix, queries))])
            disk.append([f"{size:,}", "HNSW (M 16)", du_mib(hpath), matrix.nbytes / 2**20])
            memory.append([f"HNSW store of {size:,} rows added", rss_mib(), matrix.nbytes / 2**20])
        finally:
            hstore.close()

    print(
        f"\n## KnowledgeStore (Milvus Lite) vs numpy brute force: dim {DIM}, k={K},"
        f" {count} single-vector queries, random unit vectors; store opened in"
        f" {opened:.2f} s\n"
    )
    print(
        table(
            latency,
            ["rows", "search", "p50 ms", "p99 ms", "p50 / numpy p50", "p50 / numpy 1-thread p50"],
        )
    )
    print(f"\n### recall@{K} against numpy's exact top {K} (same queries)\n")
    print(table(quality, ["rows", "index", f"recall@{K}"]))
    print(f"\n### upsert rate, store alone (batches of {BATCH:,}, each flushed)\n")
    print(table(writes, ["rows", "written", "seconds", "rows/s", "then busy s"]))
    print(
        "\n(then busy: the background compaction and index builds that follow, waited out"
        " before measuring anything; the process idles at under 10% of a CPU)"
    )
    print("\n### memory: this process's VmRSS (Milvus Lite runs in-process)\n")
    rows = [[what, rss, copy, rss - copy] for what, rss, copy in memory]
    print(table(rows, ["when", "RSS MiB", "numpy copy MiB", "RSS - numpy MiB"]))
    print("\n### on disk (du of the Milvus Lite directory)\n")
    print(table(disk, ["rows", "index", "disk MiB", "raw float32 MiB"]))


# ---- 3. end to end through a daemon -------------------------------------------------------------


def kjv(limit: int) -> tuple[str, list[str]] | str:
    """The first ``limit`` bytes of the KJV (cut at a line end) and its verses; or why not."""
    if shutil.which("bible") is None:
        return "`bible` (Debian package bible-kjv) is not installed"
    done = subprocess.run(
        ["bible", "Gen1:1-Rev22:21"], capture_output=True, check=False, timeout=120
    )
    if done.returncode != 0 or not done.stdout:
        return f"`bible` failed ({done.returncode}): {done.stderr.decode(errors='replace')[:200]}"
    head = done.stdout[:limit].decode("utf-8", errors="ignore")
    text = head[: head.rfind("\n") + 1] if "\n" in head else head
    verses: list[str] = []
    in_verse = False  # a verse runs on over its wrapped lines, up to a blank line
    for line in text.splitlines():
        match = VERSE.match(line)
        if match:
            verses.append(match.group(1).strip())
            in_verse = True
        elif not line.strip():
            in_verse = False
        elif in_verse:
            verses[-1] += " " + line.strip()
    return text, [v for v in verses if len(v) >= 40]


def pieces(text: str, size: int) -> list[str]:
    """``text`` in parts of at most ``size`` bytes, cut at line ends."""
    parts: list[str] = []
    current: list[str] = []
    length = 0
    for line in text.splitlines(keepends=True):
        if current and length + len(line.encode()) > size:
            parts.append("".join(current))
            current, length = [], 0
        current.append(line)
        length += len(line.encode())
    if current:
        parts.append("".join(current))
    return parts


def edged_command() -> list[str]:
    script = Path(sys.executable).with_name("edged")
    return [str(script)] if script.exists() else [sys.executable, "-m", "edged"]


def stop(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM by PID, SIGKILL after 20 s; how it ended."""
    if proc.poll() is not None:
        return f"had exited ({proc.returncode})"
    os.kill(proc.pid, signal.SIGTERM)
    try:
        return f"exited {proc.wait(20)} on SIGTERM"
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        return f"killed after 20 s ({proc.wait(10)})"


def squash(text: str) -> str:
    return " ".join(text.split())


def bench_daemon(ingest_bytes: int, workdir: Path) -> None:
    corpus = kjv(ingest_bytes)
    if isinstance(corpus, str):
        print(f"\n## end to end through edged: skipped, {corpus}")
        return
    text, verses = corpus
    config = workdir / "edged.toml"
    config.write_text('[models]\nload = ["text-embedding"]\n')
    socket = workdir / "edged.sock"
    log = (workdir / "edged.log").open("wb")
    started = time.perf_counter()
    proc = subprocess.Popen(
        [
            *edged_command(),
            "--config",
            str(config),
            "--socket",
            str(socket),
            "--state-dir",
            str(workdir / "state"),
            "--models",
            str(MODELS),
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = Client(str(socket))
    ended = ""
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"edged exited with {proc.returncode}: see its log below")
            if time.monotonic() > deadline:
                raise SystemExit("edged was not ready within 120 s")
            try:
                if socket.exists() and client.ready():
                    break
            except ClientError:
                pass
            time.sleep(0.05)
        ready_s = time.perf_counter() - started
        memory = [["READY (text-embedding loaded)", rss_mib(proc.pid)]]
        try:  # embeds once and opens the store (imports pymilvus): not part of the ingest
            client.kb_search("warmup", "in the beginning")
        except ClientError as exc:
            if exc.status != 404:
                raise
        memory.append(["store opened (a search of an empty namespace)", rss_mib(proc.pid)])
        client.embed(chunk_text(text)[:8])  # the service's embedding batch (knowledge.embed_batch)
        memory.append(["after embedding 8 chunks (no store)", rss_mib(proc.pid)])

        parts = pieces(text, REQUEST_BYTES)
        chunks = 0
        begin = time.perf_counter()
        for part in parts:
            chunks += client.kb_ingest(NAMESPACE, [{"text": part, "source": "kjv.txt"}])["chunks"]
        ingest_s = time.perf_counter() - begin
        busy = settle(proc.pid)
        memory.append([f"after the ingest ({chunks} chunks)", rss_mib(proc.pid)])

        step = max(1, len(verses) // SEARCHES)
        queries = verses[::step][:SEARCHES]
        search: list[float] = []
        embed: list[float] = []
        top1 = top10 = 0
        for query in queries[:5]:  # warm-up
            client.kb_search(NAMESPACE, query, K)
            client.embed([query])
        for query in queries:
            begin = time.perf_counter()
            hits = client.kb_search(NAMESPACE, query, K)
            search.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            client.embed([query])
            embed.append(time.perf_counter() - begin)
            holds = [squash(query) in squash(h["text"]) for h in hits]
            top1 += bool(holds and holds[0])
            top10 += any(holds)
        memory.append(
            [f"after {len(queries) * 2 + 10} more calls (searches, embeds)", rss_mib(proc.pid)]
        )
        disk = du_mib(workdir / "state" / "knowledge.db")
    finally:
        ended = stop(proc)
        log.close()
    if proc.returncode not in (0, -signal.SIGTERM) or "killed" in ended:
        print((workdir / "edged.log").read_text()[-3000:])

    print(
        f"\n## end to end through edged (text-embedding, FLAT, chunks of 500 characters with"
        f" 80 of overlap): KJV, first {len(text.encode()):,} bytes, {len(parts)} ingest"
        f" requests of at most {REQUEST_BYTES // 1000} KB; READY in {ready_s:.1f} s\n"
    )
    print(
        table(
            [[len(text), chunks, ingest_s, chunks / ingest_s, len(text) / ingest_s, busy, disk]],
            [
                "characters",
                "chunks",
                "seconds",
                "chunks/s",
                "characters/s",
                "then busy s",
                "store on disk MiB",
            ],
        )
    )
    s50, s99 = ms(search)
    e50, e99 = ms(embed)
    print(
        f"\n### {len(queries)} queries (verses of the ingested text), sequential, through the"
        f" socket; the top hit holds the verse {top1}/{len(queries)}, one of the top {K}"
        f" {top10}/{len(queries)}\n"
    )
    print(
        table(
            [[f"kb_search (k={K})", s50, s99, s50 / e50], ["embed (1 text)", e50, e99, 1.0]],
            ["call", "p50 ms", "p99 ms", "p50 / embed p50"],
        )
    )
    print(f"\n### the daemon's VmRSS (PID {proc.pid}; {ended})\n")
    print(table(memory, ["when", "RSS MiB"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000", help="store sizes, in rows")
    parser.add_argument("--queries", type=int, default=200, help="searches timed per size")
    parser.add_argument("--ingest-bytes", type=int, default=300_000, help="KJV bytes to ingest")
    parser.add_argument("--skip-daemon", action="store_true")
    parser.add_argument("--skip-hnsw", action="store_true")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    if not sizes or sizes[0] <= K or args.queries < 1:
        parser.error(f"sizes must be more than {K} rows, and --queries at least 1")
    with tempfile.TemporaryDirectory(prefix="edged-bench-knowledge-") as tmp:
        bench_store(sizes, args.queries, Path(tmp), not args.skip_hnsw)
    if not args.skip_daemon:
        with tempfile.TemporaryDirectory(prefix="edged-bench-knowledge-") as tmp:
            bench_daemon(args.ingest_bytes, Path(tmp))
    versions = {}
    for package in ("pymilvus", "milvus-lite", "numpy"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "?"
    print(json.dumps({"python": sys.version.split()[0], **versions, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
