#!/usr/bin/env python3
"""The knowledge store's transport before and after issue 21, item 2, in one process.

Before, pymilvus started Milvus Lite 3 for a ``.db`` URI as a gRPC server on 127.0.0.1 (any
local user could reach it); now ``KnowledgeStore`` serves the same engine to its client on a
private Unix socket (``LocalMilvus``). This opens one store (dim 384, FLAT, the default), adds a
second gRPC server over the very same engine on loopback TCP exactly as
``milvus_lite.server_manager`` builds it (ten workers, 256 MiB messages), and points a second
pymilvus client at it. At each size of ``--sizes`` (rows upserted 5,000 at a time, as the
store does them), ``--queries`` single-vector searches (k=10) go through ``KnowledgeStore.search``
on both clients, interleaved query by query (the order alternating), so a shared machine's
noise falls on both alike. Recall@10 against numpy's exact top 10 for each.

    .venv/bin/python bench/knowledge_listener.py [--sizes 10000,100000] [--queries 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent import futures
from importlib.metadata import version
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edged.common.stats import percentile  # noqa: E402
from edged.knowledge.store import MAX_MESSAGE, Chunk, KnowledgeStore  # noqa: E402

DIM = 384
K = 10
BATCH = 5000
TCP = "TCP 127.0.0.1 (before)"
UNIX = "Unix socket, 0600 in 0700 (after)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000", help="store sizes, in rows")
    parser.add_argument("--queries", type=int, default=300, help="searches timed per size")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    import grpc
    from milvus_lite.adapter.grpc.servicer import MilvusServicer
    from pymilvus import MilvusClient
    from pymilvus.grpc_gen import milvus_pb2_grpc

    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="bench-kb-listener-"))
    store = KnowledgeStore(str(work / "kb.db"), DIM)
    assert store.local is not None
    tcp = grpc.server(
        futures.ThreadPoolExecutor(10),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ],
    )
    milvus_pb2_grpc.add_MilvusServiceServicer_to_server(MilvusServicer(store.local.db), tcp)
    port = tcp.add_insecure_port("127.0.0.1:0")
    tcp.start()
    clients = {TCP: MilvusClient(uri=f"http://127.0.0.1:{port}"), UNIX: store.client}
    print(f"\n{args.queries} searches per size (k={K}), dim {DIM}, FLAT, interleaved\n")
    print("| rows | transport | p50 ms | p99 ms | recall@10 |")
    print("| --- | --- | --- | --- | --- |")
    rows = np.zeros((0, DIM), np.float32)
    try:
        for size in sizes:
            new = rng.standard_normal((size - len(rows), DIM)).astype(np.float32)
            new /= np.linalg.norm(new, axis=1, keepdims=True)
            for first in range(0, len(new), BATCH):
                part = new[first : first + BATCH]
                base = len(rows) + first
                store.upsert("bench", [Chunk(f"row {base + i}", v) for i, v in enumerate(part)])
            rows = np.vstack([rows, new])
            time.sleep(3)  # Milvus Lite's compaction and index builds after the flushes
            queries = rng.standard_normal((args.queries, DIM)).astype(np.float32)
            queries /= np.linalg.norm(queries, axis=1, keepdims=True)
            times: dict[str, list[float]] = {name: [] for name in clients}
            found: dict[str, int] = dict.fromkeys(clients, 0)
            for n, query in enumerate(queries):
                truth = set(np.argsort(-(rows @ query))[:K].tolist())
                for name in list(clients)[:: 1 if n % 2 else -1]:
                    store.client = clients[name]
                    begin = time.perf_counter()
                    (hits,) = store.search("bench", [query], k=K)
                    times[name].append(time.perf_counter() - begin)
                    found[name] += len(truth & {int(h.text.split()[1]) for h in hits})
            for name, samples in times.items():
                ordered = sorted(samples)
                p50 = statistics.median(ordered) * 1000
                p99 = (percentile(ordered, 0.99) or 0.0) * 1000
                share = found[name] / (K * len(queries))
                print(f"| {size:,} | {name} | {p50:.2f} | {p99:.1f} | {share:.3f} |", flush=True)
    finally:
        store.client = clients[UNIX]
        clients[TCP].close()
        tcp.stop(0)
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    versions = {name: version(name) for name in ("pymilvus", "milvus-lite", "grpcio", "numpy")}
    print(json.dumps({"python": sys.version.split()[0], **versions, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
