#!/usr/bin/env python3
"""The fleet service (``edgefleet serve``, issue 24) under a simulated fleet: the figures of
docs/BENCHMARKS.md. Everything runs on this machine, on loopback: a real Mosquitto (TLS 1.3,
client certificates, ACLs, persistence: tests/mosquitto.py), the service as its own process
(tests/fleetservice.py; SQLite in its state directory unless said otherwise), N simulated nodes
speaking the real protocol (bench/fleetsim.py), and for ``--only postgres`` a real PostgreSQL
(tests/postgres.py). Each is started here and stopped by its PID, whatever happens.

Four parts (``--only`` one or more of them; all four by default), and a fifth on request:

- **ingest**: for each ``--nodes`` N (heartbeat every 10 s, telemetry every 60 s), once every
  node is connected and the service counts all of them online, a ``--warmup-s`` pause, then a
  ``--window-s`` window: /metrics before and after (the ingest lag histogram's buckets
  differenced over the window, so its p50/p99 are bucket upper bounds; its sum/count give the
  exact mean), heartbeats written per second, the writer's busy share (the batch histogram's
  sum), the most messages seen waiting for the writer (``edgefleet_ingest_queue``, sampled),
  and each process's CPU from /proc/<pid>/stat (utime + stime over the window, % of one CPU):
  the service, the simulator's workers, mosquitto (PostgreSQL's server processes), this script,
  and the whole machine's from /proc/stat. Also the service's RSS, the database's bytes per
  node (SQLite: the file and its WAL as they are, no VACUUM; PostgreSQL: pg_database_size), and
  a second lag figure that does not rely on the service: this script reads every node's
  ``heartbeat_ts`` from the database twice a second and notes each new heartbeat's age when it
  is first seen there (an upper bound of its age when written, within the 0.5 s poll).
  ``--stress 1 0.5`` runs it again at ``--stress-nodes`` (5,000) with those heartbeat
  intervals: the same message rate as a 10x or 20x larger fleet at 10 s, on fewer
  connections, to find where this machine tops out and what is saturated then;
- **rollout**: a rollout of a new version over ``--rollout-nodes`` nodes, stages [0.1, 1.0],
  ``--soak-s``, max_unavailable the default (a tenth), each simulated install ``--install-delay-s``:
  from POST /v1/rollouts to ``done``, the stages as polled and as the rollout's log says;
- **resume**: ``--resume-runs`` rollouts over ``--resume-nodes`` nodes, each SIGKILLed once
  while its second stage is being delivered (FleetService.kill() then .start()): the time
  from the kill to the service healthy again (process, database, broker), to its API
  listening, and to the rollout's next progress (a node's state, the stage, or a new line in its
  log: the state in the database at the kill compared with the API's answers, polled every
  0.05 s);
- **nodes**: ``edgefleet nodes`` for ``--list-nodes`` nodes in both modes, the direct MQTT one
  (the broker's retained statuses, ``--wait 0``) and through the service (``--service URL``,
  a viewer's token), ``--list-runs`` times each: wall time, rows, exit code. When the ingest
  part runs the same N on SQLite, that fleet is listed after its window;
- **postgres** (only when named): the ingest part on PostgreSQL at ``--postgres-nodes``
  (10,000), its server processes' CPU beside the others'.

    .venv/bin/python bench/fleet_service.py [--nodes 2000 5000 10000] [--window-s 60]
        [--stress 1 0.5] [--only ingest|rollout|resume|nodes|postgres] [--keep]

Medians: the ingest window is cut into ``--slice-s`` slices (10 s); the CPU figures and the
writer's busy share are the median of the slices (a neighbour's burst on a shared machine moves
one slice, not the figure), the rates and the lag quantiles are over the whole window, and the
CPU of processes not started here is shown beside ours; the rollout is one run unless
``--rollout-runs``; resume and nodes print each run and their median. The service runs with
its own defaults for ``reconcile_s`` (30) and ``lease_s`` (15), not the tests' 5 and 3
(``--reconcile-s``, ``--lease-s``).
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from bench.fleetsim import SimConfig, Simulator  # noqa: E402
from cloudsync.protocol import manifest  # noqa: E402
from tests.fleetservice import TOKENS, FleetService  # noqa: E402
from tests.mosquitto import Broker, edgefleet_command, make_pki  # noqa: E402
from tests.postgres import Postgres  # noqa: E402

MODEL = "intent-classifier"
FLEET = "f1"
LAG_OK_S = 2.0  # the question: the largest N whose ingest lag p99 is under this
DONE = ("done", "aborted")
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
PARTS = ["ingest", "rollout", "resume", "nodes"]
PROBE_S = 0.5  # the database reader's poll
QUEUE_S = 2.0  # /metrics during the window, for the writer's queue

COMMANDS: list[str] = []  # what was started, for the report


def note(text: str) -> None:
    """Progress, on stderr as it happens."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def command(text: str) -> None:
    if text not in COMMANDS:
        COMMANDS.append(text)
    note(f"$ {text}")


# ---- processes: CPU and memory from /proc ---------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (0 when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of proc(5)


def proc_rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def descendants(root: int) -> list[int]:
    """``root`` and every process under it (PostgreSQL's backends)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def machine_cpu_s() -> dict[str, float]:
    """CPU seconds of the whole machine, every CPU summed (/proc/stat): busy (all but idle and
    iowait), of it interrupts (irq, softirq: loopback's packets are softirq work that no
    process is charged for) and steal (the hypervisor's)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    # user nice system idle iowait irq softirq steal
    return {
        "busy": (sum(v) - v[3] - v[4]) / TICK,
        "irq": (v[5] + v[6]) / TICK,
        "steal": v[7] / TICK,
    }


def every_process() -> dict[int, tuple[str, float]]:
    """pid: (name, utime + stime seconds) of every process now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            head, _, tail = text.rpartition(")")
            fields = tail.split()
            found[int(entry.name)] = (
                head.partition("(")[2],
                (int(fields[11]) + int(fields[12])) / TICK,
            )
    return found


Roles = dict[str, Callable[[], list[int]]]


@dataclass
class Snapshot:
    t: float
    cpu: dict[str, float]
    machine: dict[str, float]
    metrics: dict[str, float]
    sent: dict[str, float]
    procs: dict[int, tuple[str, float]]
    ours: set[int]


def snapshot(roles: Roles, service: FleetService, sim: Simulator) -> Snapshot:
    stats = sim.stats()
    pids = {role: find() for role, find in roles.items()}
    return Snapshot(
        time.monotonic(),
        {role: sum(proc_cpu_s(p) for p in found) for role, found in pids.items()},
        machine_cpu_s(),
        metrics(service),
        {k: float(stats.get(k, 0)) for k in ("heartbeats", "telemetry")},
        every_process(),
        {p for found in pids.values() for p in found},
    )


def strangers(a: Snapshot, b: Snapshot) -> list[tuple[str, float]]:
    """The CPU seconds of processes not started here, by name, most first (those that ended
    within the interval are not seen)."""
    ours = a.ours | b.ours
    used: dict[str, float] = {}
    for pid, (name, cpu) in b.procs.items():
        if pid in ours:
            continue
        if name.startswith("kworker"):  # its name is the work it does now
            name = "kworker"
        used[name] = used.get(name, 0.0) + cpu - a.procs.get(pid, (name, 0.0))[1]
    return sorted(((n, c) for n, c in used.items() if c > 0), key=lambda x: -x[1])


def percent(seconds: float, wall: float) -> float:
    return 100.0 * seconds / wall if wall > 0 else 0.0


# ---- the service's /metrics -----------------------------------------------------------------


def metrics(service: FleetService) -> dict[str, float]:
    """Every sample of /metrics, by its name with labels (``x_bucket{le="0.5"}``)."""
    with urllib.request.urlopen(service.url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def buckets(
    before: dict[str, float], after: dict[str, float], name: str
) -> list[tuple[float, float]]:
    """(upper bound, count in the window) of histogram ``name``'s cumulative buckets."""
    prefix = f'{name}_bucket{{le="'
    found = []
    for key, value in after.items():
        if key.startswith(prefix):
            bound = key[len(prefix) : -2]
            found.append(
                (math.inf if bound == "+Inf" else float(bound), value - before.get(key, 0))
            )
    return sorted(found)


def bucket_quantile(cumulative: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket that holds quantile ``q`` (inf: above the last bound)."""
    if not cumulative or cumulative[-1][1] <= 0:
        return math.nan
    want = q * cumulative[-1][1]
    return next(bound for bound, count in cumulative if count >= want)


def histogram_delta(
    before: dict[str, float], after: dict[str, float], name: str
) -> tuple[float, float]:
    """(count, sum) of histogram ``name`` over the window."""
    return (
        after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0),
        after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0),
    )


def le(bound: float, finite: list[float]) -> str:
    if math.isnan(bound):
        return "-"
    if math.isinf(bound):
        return f"> {finite[-1]:g}"
    return f"≤ {bound:g}"


# ---- a fleet: broker, service, simulated nodes ----------------------------------------------


FLEET_KEY = Ed25519PrivateKey.generate()  # signs the manifests (the fleet's key)


def entry(version: int) -> dict[str, Any]:
    """A deployment entry of version ``version``, signed by the fleet's key."""
    files = [{"path": "model.onnx", "sha256": f"{version:x}" * 64, "length": 10}]
    doc = manifest.sign(manifest.make(MODEL, version, files), {"fleet-1": FLEET_KEY})
    return {"manifest": doc, "urls": {"model.onnx": f"https://cdn.example/m/{version}"}}


def keys(directory: Path) -> str:
    """The deploy key and the fleet's trust directory: the lines of [service] naming them."""
    directory.mkdir(parents=True, exist_ok=True)
    key = directory / "deploy-1.key"
    key.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    trust = directory / "trust"
    trust.mkdir(exist_ok=True)
    (trust / "fleet-1.pub").write_bytes(
        FLEET_KEY.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return f'deploy_key = "{key}"\ntrust_dir = "{trust}"'


@dataclass
class Fleet:
    n: int
    broker: Broker
    service: FleetService
    sim: Simulator
    pg: Postgres | None
    empty_db: int = 0  # PostgreSQL: the database's bytes before any node (its catalog)
    connect_s: float = 0.0  # the simulator's start to every node connected
    seen_s: float = 0.0  # the simulator's start to the service counting every node online

    @property
    def sqlite(self) -> Path | None:
        return None if self.service.database else self.service.workdir / "state" / "fleet.db"

    def roles(self) -> Roles:
        broker, service, sim, pg = self.broker, self.service, self.sim, self.pg
        roles: Roles = {
            "service": lambda: [service.proc.pid] if service.proc else [],
            "simulator": lambda: [p.pid for p in sim.procs],
            "mosquitto": lambda: [broker.proc.pid] if broker.proc else [],
        }
        if pg is not None and pg.proc is not None:
            postmaster = pg.proc.pid
            roles["postgres"] = lambda: descendants(postmaster)
        roles["this script"] = lambda: [os.getpid()]
        return roles

    def db_bytes(self) -> tuple[int, int]:
        """(database, of which WAL) bytes on disk now (SQLite: the file and its WAL)."""
        if self.sqlite is not None:
            wal = Path(f"{self.sqlite}-wal")
            wal_bytes = wal.stat().st_size if wal.exists() else 0
            return self.sqlite.stat().st_size + wal_bytes, wal_bytes
        assert self.pg is not None
        done = self.pg.psql("SELECT pg_database_size(current_database())", self.db_name)
        return int(done.stdout.strip() or 0), 0

    @property
    def db_name(self) -> str:
        return self.service.database.rsplit("/", 1)[-1]

    def online(self) -> int:
        status, page = self.service.call("GET", "/v1/nodes?limit=1", role="viewer")
        return int(page["counts"].get("online", 0)) if status == 200 else -1


def tune(service: FleetService, reconcile_s: float, lease_s: float) -> None:
    """The service's own defaults instead of the tests' (reconcile_s 5, lease_s 3)."""
    text = service.config.read_text()
    for key, value in (("reconcile_s", reconcile_s), ("lease_s", lease_s)):
        text, found = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value:g}", text)
        if found != 1:
            raise RuntimeError(f"{service.config}: no single {key} line to set")
    service.config.write_text(text)


def stop_sim(sim: Simulator) -> None:
    try:
        sim.close()
    finally:
        for proc in sim.procs:  # whatever did not stop
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)


def stop_service(service: FleetService) -> None:
    try:
        service.stop()
    except Exception as exc:  # it did not stop in time: killed below
        note(f"the service did not stop on SIGTERM ({exc!r}): SIGKILL")
    service.kill()


@contextlib.contextmanager
def fleet(
    args: argparse.Namespace,
    work: Path,
    pki: Path,
    n: int,
    *,
    pg: Postgres | None = None,
    more: str = "",
    heartbeat_s: float | None = None,
) -> Iterator[Fleet]:
    """A broker, the service and ``n`` simulated nodes, every node counted online; all of it
    stopped when the block ends."""
    broker: Broker | None = None
    service: FleetService | None = None
    sim: Simulator | None = None
    heartbeat_s = heartbeat_s or args.heartbeat_s
    try:
        broker = Broker(work / "mosquitto", pki)
        command(f"mosquitto -c {broker.config}")
        broker.start()
        name = "fleet_" + "".join(c if c.isalnum() else "_" for c in work.name)
        database = pg.create_database(name) if pg is not None else ""
        service = FleetService(work / "service", broker, fleet=FLEET, database=database, more=more)
        tune(service, args.reconcile_s, args.lease_s)
        command(f"{sys.executable} -m cloudsync.fleet.cli serve --config {service.config}")
        service.start(timeout=60)
        config = SimConfig(
            nodes=n,
            fleet=FLEET,
            port=broker.port,
            pki=pki,
            heartbeat_s=heartbeat_s,
            telemetry_s=args.telemetry_s,
            install_delay_s=args.install_delay_s,
            models={MODEL: 1},
            seed=args.seed,
        )
        sim = Simulator(config)
        made = Fleet(n, broker, service, sim, pg)
        made.empty_db = made.db_bytes()[0] if pg is not None else 0
        command(
            f"{sys.executable} bench/fleetsim.py --nodes {n} --port {broker.port} --pki {pki}"
            f" --heartbeat-s {heartbeat_s:g} --telemetry-s {args.telemetry_s:g}"
            f" --install-delay-s {args.install_delay_s:g}   (as Simulator(SimConfig(...)):"
            f" {config.workers()} worker processes)"
        )
        started = time.monotonic()
        sim.start()
        if not sim.wait_connected(timeout=60 + n / 50):
            raise RuntimeError(f"not every node connected: {sim.stats()}")
        made.connect_s = connect_s = time.monotonic() - started
        deadline = time.monotonic() + 60 + n / 100
        while made.online() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service counts {made.online()} of {n} nodes online")
            time.sleep(0.5)
        made.seen_s = time.monotonic() - started
        note(
            f"{n} nodes connected in {connect_s:.1f} s, all online at the service after"
            f" {made.seen_s:.1f} s"
        )
        yield made
    finally:
        if sim is not None:
            stop_sim(sim)
        if service is not None:
            stop_service(service)
        if broker is not None:
            broker.kill()


# ---- 1. ingest ------------------------------------------------------------------------------


class DbProbe:
    """Every node's ``heartbeat_ts`` read from the database every PROBE_S: a heartbeat's age
    when this reader first sees it (an upper bound of its age when written)."""

    def __init__(self, query: Callable[[], list[tuple[str, int]]]) -> None:
        self.query = query
        self.seen: dict[str, int] = {}
        self.ages: list[float] = []
        self.primed = False

    def poll(self) -> None:
        rows = self.query()
        now = time.time() * 1000
        for node, ts in rows:
            if self.seen.get(node) != ts:
                if self.primed and node in self.seen:
                    self.ages.append((now - ts) / 1000)
                self.seen[node] = ts
        self.primed = True


def db_probe(f: Fleet) -> tuple[DbProbe, Callable[[], None]]:
    """A probe and what closes its connection."""
    sql = "SELECT node, heartbeat_ts FROM nodes"
    if f.sqlite is not None:
        conn = sqlite3.connect(f.sqlite, timeout=10, check_same_thread=False)
        conn.execute("PRAGMA query_only = 1")
        return DbProbe(lambda: conn.execute(sql).fetchall()), conn.close
    import psycopg

    pgconn = psycopg.connect(f.service.database, autocommit=True)
    return DbProbe(lambda: [(r[0], int(r[1])) for r in pgconn.execute(sql).fetchall()]), (
        pgconn.close
    )


def quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def between(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    """The figures of the interval from snapshot ``a`` to ``b``."""
    wall = b.t - a.t
    lag = "edgefleet_ingest_lag_seconds"
    cumulative = buckets(a.metrics, b.metrics, lag)
    count, total = histogram_delta(a.metrics, b.metrics, lag)
    _, batch_s = histogram_delta(a.metrics, b.metrics, "edgefleet_ingest_batch_seconds")
    written = {
        kind: b.metrics.get(f'edgefleet_messages_total{{kind="{kind}"}}', 0)
        - a.metrics.get(f'edgefleet_messages_total{{kind="{kind}"}}', 0)
        for kind in ("heartbeat", "telemetry", "status", "events", "desired-models")
    }
    busy = b.machine["busy"] - a.machine["busy"]
    ours = sum(b.cpu.values()) - sum(a.cpu.values())
    return {
        "wall_s": wall,
        "sent_hb_s": (b.sent["heartbeats"] - a.sent["heartbeats"]) / wall,
        "hb_s": written["heartbeat"] / wall,
        "msgs_s": sum(written.values()) / wall,
        "cumulative": cumulative,
        "lag_n": count,
        "lag_mean": total / count if count else math.nan,
        "p99": bucket_quantile(cumulative, 0.99),
        "writer_busy": percent(batch_s, wall),
        "cpu": {role: percent(b.cpu[role] - a.cpu[role], wall) for role in b.cpu},
        "machine": percent(busy, wall),
        "others": max(0.0, percent(busy - ours, wall)),  # below 0: the two clocks' ticks
        "irq": percent(b.machine["irq"] - a.machine["irq"], wall),
        "steal": percent(b.machine["steal"] - a.machine["steal"], wall),
        "strangers": [(n, percent(c, wall)) for n, c in strangers(a, b)[:3]],
    }


def measure_ingest(args: argparse.Namespace, f: Fleet, database: str) -> dict[str, Any]:
    note(f"warm-up {args.warmup_s:g} s")
    time.sleep(args.warmup_s)
    roles = f.roles()
    probe, close = db_probe(f)
    try:
        probe.poll()
        snaps = [snapshot(roles, f.service, f.sim)]
        queue_max, next_queue = 0.0, 0.0
        end = snaps[0].t + args.window_s
        next_slice = snaps[0].t + args.slice_s
        note(f"window {args.window_s:g} s")
        while (now := time.monotonic()) < end:
            if now >= next_slice and end - now > args.slice_s / 2:
                snaps.append(snapshot(roles, f.service, f.sim))
                next_slice += args.slice_s
            if now >= next_queue:
                queue_max = max(queue_max, metrics(f.service).get("edgefleet_ingest_queue", 0))
                next_queue = now + QUEUE_S
            probe.poll()
            time.sleep(max(0.0, min(PROBE_S - (time.monotonic() - now), end - time.monotonic())))
        snaps.append(snapshot(roles, f.service, f.sim))
        probe.poll()
    finally:
        close()
    whole = between(snaps[0], snaps[-1])
    slices = [between(a, b) for a, b in itertools.pairwise(snaps)]
    cumulative = whole.pop("cumulative")
    finite = [b for b, _ in cumulative if not math.isinf(b)]
    db, wal = f.db_bytes()
    return {
        **whole,
        "database": database,
        "n": f.n,
        "connect_s": f.connect_s,
        "seen_s": f.seen_s,
        "lag_p50": le(bucket_quantile(cumulative, 0.5), finite),
        "lag_p99": le(whole["p99"], finite),
        "lag_ok": whole["p99"] <= LAG_OK_S,  # the bucket bound: p99 ≤ 2 s, none in (2, 5]
        "slices": len(slices),
        "slices_over": sum(1 for s in slices if s["p99"] > LAG_OK_S),
        "probe_p50": quantile(probe.ages, 0.5),
        "probe_p99": quantile(probe.ages, 0.99),
        "probe_n": len(probe.ages),
        "queue_max": queue_max,
        # the medians of the slices: a neighbour's burst on the shared CPUs moves one slice
        "med_writer_busy": median([s["writer_busy"] for s in slices]),
        "med_cpu": {role: median([s["cpu"][role] for s in slices]) for role in whole["cpu"]},
        "med_machine": median([s["machine"] for s in slices]),
        "med_others": median([s["others"] for s in slices]),
        "max_others": max(s["others"] for s in slices),
        "rss_mb": proc_rss_bytes(f.service.proc.pid) / 2**20 if f.service.proc else 0.0,
        "sim_rss_mb": sum(proc_rss_bytes(p.pid) for p in f.sim.procs) / 2**20,
        "db_bytes": db - f.empty_db,
        "wal_bytes": wal,
    }


def run_ingest(
    args: argparse.Namespace,
    work: Path,
    pki: Path,
    sizes: list[int],
    pg: Postgres | None,
    results: dict[str, Any],
    heartbeat_s: float | None = None,
) -> None:
    database = "postgresql" if pg is not None else "sqlite"
    heartbeat_s = heartbeat_s or args.heartbeat_s
    for n in sizes:
        note(f"ingest: {n} nodes, {database}, heartbeat {heartbeat_s:g} s")
        where = work / f"ingest-{database}-{n}-{heartbeat_s:g}s"
        try:
            with fleet(args, where, pki, n, pg=pg, heartbeat_s=heartbeat_s) as f:
                row = measure_ingest(args, f, database)
                row["heartbeat_s"] = heartbeat_s
                results["ingest"].append(row)
                note(f"ingest {n}: {json.dumps(row, default=str)}")
                if (
                    "nodes" in args.parts
                    and pg is None
                    and n == args.list_nodes
                    and heartbeat_s == args.heartbeat_s
                    and not results["nodes"]
                ):
                    results["nodes"] = list_nodes(args, f)
        except Exception as exc:  # the next size still runs; the report says what failed
            note(f"ingest {n} ({database}) failed: {exc!r}")
            results["failed"].append(f"ingest {n} nodes ({database}): {exc}")


# ---- 2. a rollout ---------------------------------------------------------------------------


def stamp_s(line: str, wall0: float) -> float:
    """The seconds after ``wall0`` of a rollout log line's stamp (whole seconds, UTC)."""
    stamp = line.split(" ", 1)[0]
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")) - wall0


def run_rollout(args: argparse.Namespace, work: Path, pki: Path, results: dict[str, Any]) -> None:
    n = args.rollout_nodes
    note(f"rollout: {n} nodes")
    with fleet(args, work / "rollout", pki, n, more=keys(work / "rollout-keys")) as f:
        for run in range(args.rollout_runs):
            ident, version = f"bench-{run + 1}", 2 + run
            body = {"id": ident, **entry(version), "stages": [0.1, 1.0], "soak_s": args.soak_s}
            command(
                f"POST {f.service.url}/v1/rollouts (id {ident}, version {version}, stages"
                f" [0.1, 1.0], soak_s {args.soak_s:g}, max_unavailable default)"
            )
            wall0, t0 = time.time(), time.monotonic()
            status, made = f.service.call("POST", "/v1/rollouts", body, role="operator")
            if status != 201:
                raise RuntimeError(f"POST /v1/rollouts: {status} {made}")
            answered = time.monotonic() - t0
            seen: dict[str, float] = {}
            record: dict[str, Any] = {}
            deadline = t0 + args.soak_s + 120 + n / 10
            while time.monotonic() < deadline:
                status, record = f.service.call("GET", f"/v1/rollouts/{ident}", role="viewer")
                t = time.monotonic() - t0
                if status == 200:
                    key = f"{record['state']} stage {record['stage'] + 1} {record['phase']}"
                    seen.setdefault(key, t)
                    if record["state"] in DONE:
                        break
                time.sleep(0.25)
            else:
                raise RuntimeError(f"rollout {ident} did not end: {record}")
            installs = [i for i in f.sim.installs() if i["version"] == version and i["ok"]]
            per_node: dict[str, int] = {}
            for i in installs:
                per_node[i["node"]] = per_node.get(i["node"], 0) + 1
            firsts = sorted(i["ts"] for i in installs)
            results["rollout"].append(
                {
                    "n": n,
                    "id": ident,
                    "state": record["state"],
                    "answered_s": answered,
                    "seen": seen,
                    "log": [(stamp_s(line, wall0), line) for line in record["log"]],
                    "stage_sizes": record["stage_sizes"],
                    "max_unavailable": record["max_unavailable"],
                    "nodes": record["nodes"],
                    "installed": len(per_node),
                    "twice": sum(1 for c in per_node.values() if c > 1),
                    "install_span_s": (firsts[-1] - firsts[0]) / 1000 if len(firsts) > 1 else 0.0,
                    "total_s": max(seen.values()),
                }
            )
            note(f"rollout {ident}: {record['state']} after {max(seen.values()):.1f} s")


# ---- 3. resume after SIGKILL ----------------------------------------------------------------


def signature(
    state: str, stage: int, phase: str, log: list[str], counts: dict[str, int]
) -> tuple[Any, ...]:
    return state, stage, phase, log[-1] if log else "", tuple(sorted(counts.items()))


def db_signature(path: Path, ident: str) -> tuple[Any, ...]:
    """The rollout as the database holds it (the service is dead: nothing changes it)."""
    conn = sqlite3.connect(path, timeout=10)
    try:
        doc = json.loads(
            conn.execute("SELECT doc FROM rollouts WHERE id = ?", (ident,)).fetchone()[0]
        )
        counts = dict(
            conn.execute(
                "SELECT state, COUNT(*) FROM rollout_nodes WHERE rollout = ? GROUP BY state",
                (ident,),
            ).fetchall()
        )
    finally:
        conn.close()
    return signature(doc["state"], doc["stage"], doc["phase"], doc["log"], counts)


def api_signature(record: dict[str, Any]) -> tuple[Any, ...]:
    return signature(
        record["state"], record["stage"], record["phase"], record["log"], record["nodes"]
    )


def moved(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """What changed between two signatures, in words."""
    said = []
    for name, a, b in zip(("state", "stage", "phase"), before[:3], after[:3], strict=True):
        if a != b:
            said.append(f"{name} {a}→{b}")
    one, two = dict(before[4]), dict(after[4])
    for state in sorted(set(one) | set(two)):
        if one.get(state, 0) != two.get(state, 0):
            said.append(f"{state} {one.get(state, 0)}→{two.get(state, 0)}")
    if before[3] != after[3]:
        said.append(f"log: {after[3].split(' ', 1)[-1][:60]}")
    return ", ".join(said)


def listening_after(port: int, since: float, stop: threading.Event, out: list[float]) -> None:
    """When ``port`` first accepts a connection (a thread beside FleetService.start)."""
    while not stop.is_set():
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            out.append(time.monotonic() - since)
            return
        except OSError:
            time.sleep(0.02)


def wait_record(
    f: Fleet, ident: str, ok: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status, record = f.service.call("GET", f"/v1/rollouts/{ident}", role="viewer")
        if status == 200 and ok(record):
            return record
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollout {ident}: waited {timeout:g} s: {record}")
        time.sleep(0.1)


def run_resume(args: argparse.Namespace, work: Path, pki: Path, results: dict[str, Any]) -> None:
    n = args.resume_nodes
    note(f"resume: {n} nodes, {args.resume_runs} SIGKILLs")
    chance = random.Random(args.seed)
    with fleet(args, work / "resume", pki, n, more=keys(work / "resume-keys")) as f:
        assert f.sqlite is not None
        for run in range(args.resume_runs):
            ident, version = f"resume-{run + 1}", 2 + run
            body = {"id": ident, **entry(version), "stages": [0.1, 1.0], "soak_s": 2}
            status, made = f.service.call("POST", "/v1/rollouts", body, role="operator")
            if status != 201:
                raise RuntimeError(f"POST /v1/rollouts: {status} {made}")
            _, first = f.service.call("GET", f"/v1/rollouts/{ident}", role="viewer")
            canary = first["stage_sizes"][0]

            # the second stage under way: some of its nodes active already, most not yet
            def under_way(r: dict[str, Any], canary: int = canary) -> bool:
                active = r["nodes"].get("active", 0)
                return bool(r["stage"] == 1 and r["phase"] == "deliver" and active > canary)

            wait_record(f, ident, under_way, 120)
            time.sleep(chance.uniform(0.0, 1.0))
            stop, heard = threading.Event(), list[float]()
            t_kill = time.monotonic()
            f.service.kill()
            before = db_signature(f.sqlite, ident)
            watcher = threading.Thread(
                target=listening_after, args=(f.service.port, t_kill, stop, heard), daemon=True
            )
            watcher.start()
            try:
                f.service.start(timeout=60)
            finally:
                stop.set()
                watcher.join(5)
            healthy = time.monotonic() - t_kill

            def changed(r: dict[str, Any], before: tuple[Any, ...] = before) -> bool:
                return api_signature(r) != before

            record = wait_record(f, ident, changed, 120)
            progress = time.monotonic() - t_kill
            what = moved(before, api_signature(record))
            done = wait_record(f, ident, lambda r: r["state"] in DONE, 300)
            row = {
                "run": run + 1,
                "n": n,
                "at": dict(before[4]),
                "listening_s": heard[0] if heard else math.nan,
                "healthy_s": healthy,
                "progress_s": progress,
                "what": what,
                "done_after_s": time.monotonic() - t_kill,
                "state": done["state"],
                "nodes": done["nodes"],
            }
            results["resume"].append(row)
            note(f"resume {run + 1}: healthy {healthy:.2f} s, progress {progress:.2f} s ({what})")


# ---- 4. edgefleet nodes ---------------------------------------------------------------------


def list_nodes(args: argparse.Namespace, f: Fleet) -> list[dict[str, Any]]:
    direct = edgefleet_command(f.broker, "--json", "nodes", "--wait", "0", fleet=FLEET)
    service = [
        sys.executable,
        "-m",
        "cloudsync.fleet.cli",
        "--json",
        "--service",
        f.service.url,
        "nodes",
    ]
    env = {**os.environ, "EDGEFLEET_TOKEN": TOKENS["viewer"]}
    rows = []
    for mode, cmd in (("direct MQTT", direct), ("service", service)):
        command(" ".join(cmd) + ("   (EDGEFLEET_TOKEN: a viewer's)" if mode == "service" else ""))
        for run in range(args.list_runs):
            started = time.monotonic()
            try:
                done = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT
                )
            except subprocess.TimeoutExpired:
                rows.append(
                    {
                        "mode": mode,
                        "run": run + 1,
                        "wall_s": math.nan,
                        "rows": 0,
                        "rc": "timeout",
                        "partial": False,
                    }
                )
                continue
            wall = time.monotonic() - started
            try:
                listed = len(json.loads(done.stdout)) if done.stdout.strip() else 0
            except ValueError:
                listed = 0
            rows.append(
                {
                    "mode": mode,
                    "run": run + 1,
                    "wall_s": wall,
                    "rows": listed,
                    "rc": done.returncode,
                    "partial": "partial list" in done.stderr,
                    "stderr": done.stderr.strip()[-200:],
                }
            )
            note(f"nodes ({mode}) run {run + 1}: {wall:.2f} s, {listed} rows, rc {done.returncode}")
    return rows


def run_nodes(args: argparse.Namespace, work: Path, pki: Path, results: dict[str, Any]) -> None:
    note(f"nodes: {args.list_nodes} nodes")
    with fleet(args, work / "nodes", pki, args.list_nodes) as f:
        time.sleep(args.heartbeat_s)  # a heartbeat of every node written
        results["nodes"] = list_nodes(args, f)


# ---- the report -----------------------------------------------------------------------------


def table(head: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:,.2f}" if abs(v) < 10 else f"{v:,.1f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.machine(),
    )
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    try:
        version = subprocess.run(
            ["mosquitto", "-h"], capture_output=True, text=True, timeout=5
        ).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        version = "mosquitto"
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB; Python {platform.python_version()},"
        f" SQLite {sqlite3.sqlite_version}, {version}; load average at the start"
        f" {os.getloadavg()[0]:.2f}"
    )


def ingest_key(r: dict[str, Any]) -> list[str]:
    return [r["database"], f"{r['n']:,}", f"{r['heartbeat_s']:g}"]


def report(args: argparse.Namespace, results: dict[str, Any], wall: float) -> str:
    out = [
        f"# edgefleet serve: benchmark ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Machine: {machine()}.",
        "",
        f"Run: `{' '.join([sys.executable, *sys.argv])}` ({wall / 60:.1f} min in all).",
        "",
        "Commands started (each stopped by its PID at the end):",
        "",
    ]
    out += [f"    $ {c}" for c in COMMANDS]
    out.append("")
    ingest = results["ingest"]
    if ingest:
        out += [
            f"## Ingest capacity of one replica (heartbeat {args.heartbeat_s:g} s, telemetry"
            f" {args.telemetry_s:g} s; warm-up {args.warmup_s:g} s, window"
            f" {args.window_s:g} s)",
            "",
        ]
        head = [
            "database",
            "nodes",
            "heartbeat s",
            "all connected s",
            "heartbeats/s sent",
            "heartbeats/s written",
            "lag mean s",
            "lag p50 s",
            "lag p99 s",
            f"slices with p99 > {LAG_OK_S:g} s",
            "DB-read age p50 / p99 s",
            "writer queue max",
            "writer busy %",
            "service CPU % (whole window)",
            "CPU % per 1k nodes",
            "CPU % per 1k msgs/s",
            "service RSS MB",
            "DB bytes/node: file + WAL (file)",
            "of it WAL MB",
        ]
        rows = []
        for r in ingest:
            cpu = r["med_cpu"]["service"]
            rows.append(
                [
                    *ingest_key(r),
                    r["connect_s"],
                    r["sent_hb_s"],
                    r["hb_s"],
                    r["lag_mean"],
                    r["lag_p50"],
                    r["lag_p99"],
                    f"{r['slices_over']} of {r['slices']}",
                    f"{r['probe_p50']:.2f} / {r['probe_p99']:.2f}",
                    f"{r['queue_max']:,.0f}",
                    r["med_writer_busy"],
                    f"{cpu:.1f} ({r['cpu']['service']:.1f})",
                    cpu / (r["n"] / 1000),
                    cpu / (r["msgs_s"] / 1000),
                    r["rss_mb"],
                    f"{r['db_bytes'] / r['n']:,.0f}"
                    f" ({(r['db_bytes'] - r['wal_bytes']) / r['n']:,.0f})",
                    r["wal_bytes"] / 2**20,
                ]
            )
        out.append(table(head, rows))
        out += [
            "",
            f"The same windows: who used the 2 CPUs (% of one CPU, the median of the"
            f" window's {args.slice_s:g} s slices; the machine's 200 % is both CPUs busy;"
            " 'others': processes not started here, the median and the busiest slice)",
            "",
        ]
        order = ["service", "simulator", "mosquitto", "postgres", "this script"]
        roles = sorted({role for r in ingest for role in r["cpu"]}, key=order.index)
        head = [
            "database",
            "nodes",
            "heartbeat s",
            *[f"{role} %" for role in roles],
            "machine busy % of 200",
            "others % (max)",
            "whole window: irq+softirq %, steal %, other processes %",
            "simulator RSS MB",
        ]
        rows = [
            [
                *ingest_key(r),
                *[r["med_cpu"].get(role, math.nan) for role in roles],
                r["med_machine"],
                f"{r['med_others']:.1f} ({r['max_others']:.1f})",
                f"{r['irq']:.1f}, {r['steal']:.1f}, "
                + (", ".join(f"{n} {c:.1f}" for n, c in r["strangers"]) or "-"),
                r["sim_rss_mb"],
            ]
            for r in ingest
        ]
        out.append(table(head, rows))
        plain = [
            r for r in ingest if r["database"] == "sqlite" and r["heartbeat_s"] == args.heartbeat_s
        ]
        fine = [r["n"] for r in plain if r["lag_ok"]]
        rates = [r["hb_s"] for r in ingest if r["lag_ok"] and r["database"] == "sqlite"]
        out += [
            "",
            f"Lag p50/p99 are the upper bounds of the histogram's buckets (0.05, 0.1,"
            " 0.25, 0.5, 1, 2, 5, 10, 30, 60 s) over the whole window (and per slice); the"
            " mean is exact. Rates are over the whole window; CPU and the writer's busy"
            " share are the median of the slices (the whole window's in brackets). The"
            " histogram stamps a heartbeat when the service's MQTT thread receives it, not"
            " when its batch is written; 'DB-read age' is the age this script sees a"
            f" heartbeat first in the database ({PROBE_S:g} s polls: an upper bound)."
            " Database bytes per node: SQLite's file and its WAL as they are after the"
            " window (steady state, no VACUUM; the WAL keeps its high-water size between"
            " checkpoints), PostgreSQL's pg_database_size less the empty database's (its"
            " catalog), divided by the nodes.",
        ]
        if plain:
            out += [
                "",
                f"Largest N (SQLite, heartbeat {args.heartbeat_s:g} s) with lag p99 ≤"
                f" {LAG_OK_S:g} s: {max(fine):,}"
                if fine
                else "Largest N (SQLite) with"
                f" lag p99 ≤ {LAG_OK_S:g} s: none of {[r['n'] for r in plain]}",
            ]
        if rates:
            out += [
                "",
                f"Most heartbeats written per second (SQLite) with lag p99 ≤"
                f" {LAG_OK_S:g} s: {max(rates):,.0f} (a fleet of"
                f" {max(rates) * args.heartbeat_s:,.0f} nodes at one heartbeat per"
                f" {args.heartbeat_s:g} s)",
            ]
    for r in results["rollout"]:
        title = (
            f"## A rollout over {r['n']:,} nodes (stages [0.1, 1.0] = {r['stage_sizes']} nodes,"
            f" soak {args.soak_s:g} s, {r['max_unavailable']} at a time, install"
            f" {args.install_delay_s:g} s): {r['state']} in {r['total_s']:.1f} s"
        )
        out += ["", title, ""]
        rows = [["POST answered (rollout created)", r["answered_s"], ""]]
        rows += [[k, v, ""] for k, v in r["seen"].items()]
        rows += [["log", t, line] for t, line in r["log"]]
        out.append(table(["step", "s after POST", "rollout log (its stamps: whole seconds)"], rows))
        out += [
            "",
            f"Steps polled every 0.25 s ('running stage 1 deliver': first seen). Nodes"
            f" at the end: {r['nodes']}; {r['installed']} nodes installed the version"
            f" ({r['twice']} twice); first to last install {r['install_span_s']:.1f} s.",
        ]
    resume = results["resume"]
    if resume:
        out += [
            "",
            f"## Resume after SIGKILL ({resume[0]['n']:,} nodes, stages [0.1, 1.0], soak"
            " 2 s; killed while the second stage is delivered)",
            "",
        ]
        rows = [
            [
                r["run"],
                ", ".join(f"{k} {v}" for k, v in sorted(r["at"].items())),
                r["listening_s"],
                r["healthy_s"],
                r["progress_s"],
                r["what"],
                r["done_after_s"],
                r["state"],
            ]
            for r in resume
        ]
        rows.append(
            [
                "**median**",
                "",
                median([r["listening_s"] for r in resume]),
                median([r["healthy_s"] for r in resume]),
                median([r["progress_s"] for r in resume]),
                "",
                median([r["done_after_s"] for r in resume]),
                "",
            ]
        )
        out.append(
            table(
                [
                    "run",
                    "nodes at the kill",
                    "API listening s",
                    "healthy s (process + database + broker)",
                    "next progress s",
                    "what moved first",
                    "rollout done s",
                    "end",
                ],
                rows,
            )
        )
        out += [
            "",
            "All times from the SIGKILL. Healthy: FleetService.start() returned"
            " (/healthz 200: database and broker). Next progress: the first API answer whose"
            " node counts, stage, phase or last log line differ from the database at the"
            " kill (0.05 s polls).",
        ]
    nodes = results["nodes"]
    if nodes:
        out += ["", f"## `edgefleet nodes` for {args.list_nodes:,} simulated nodes", ""]
        rows = [
            [
                r["mode"],
                r["run"],
                r["wall_s"],
                f"{r['rows']:,}",
                r["rc"],
                "yes" if r["partial"] else "no",
            ]
            for r in nodes
        ]
        for mode in ("direct MQTT", "service"):
            mine = [r for r in nodes if r["mode"] == mode]
            rows.append(
                [
                    f"**{mode}: median**",
                    "",
                    median([r["wall_s"] for r in mine]),
                    f"{statistics.median([r['rows'] for r in mine]):,.0f}",
                    "",
                    "",
                ]
            )
        out.append(table(["mode", "run", "wall s", "rows", "exit", "partial list"], rows))
    if results["failed"]:
        out += ["", "## Not measured", ""] + [f"- {f}" for f in results["failed"]]
    return "\n".join(out)


# ---- the command line -----------------------------------------------------------------------


def sizes(text: str) -> list[int]:
    return [int(p.replace("_", "")) for p in text.split(",") if p.strip()]


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--nodes",
        nargs="+",
        type=sizes,
        default=[[2000, 5000, 10000]],
        help="ingest: fleet sizes (space or comma separated)",
    )
    p.add_argument("--window-s", type=float, default=60.0, help="ingest: the measured window")
    p.add_argument(
        "--slice-s",
        type=float,
        default=10.0,
        help="ingest: the window's slices (CPU figures: their median)",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=20.0,
        help="ingest: after every node is online, before the window",
    )
    p.add_argument(
        "--only",
        action="append",
        choices=[*PARTS, "postgres"],
        help="only this part (repeat for several; postgres: ingest on PostgreSQL,"
        " not run by default)",
    )
    p.add_argument(
        "--postgres-nodes", nargs="+", type=sizes, default=[[10000]], help="postgres: fleet sizes"
    )
    p.add_argument("--heartbeat-s", type=float, default=10.0)
    p.add_argument(
        "--stress",
        nargs="*",
        type=float,
        default=[],
        help="ingest: again at --stress-nodes with these heartbeat intervals (s)",
    )
    p.add_argument("--stress-nodes", type=int, default=5000)
    p.add_argument("--telemetry-s", type=float, default=60.0)
    p.add_argument("--rollout-nodes", type=int, default=2000)
    p.add_argument("--rollout-runs", type=int, default=1)
    p.add_argument("--soak-s", type=float, default=60.0, help="rollout: the canary's soak")
    p.add_argument("--install-delay-s", type=float, default=1.0, help="a simulated install")
    p.add_argument("--resume-nodes", type=int, default=500)
    p.add_argument("--resume-runs", type=int, default=3)
    p.add_argument("--list-nodes", type=int, default=10000, help="nodes: the fleet listed")
    p.add_argument("--list-runs", type=int, default=3)
    p.add_argument("--reconcile-s", type=float, default=30.0, help="the service's reconcile_s")
    p.add_argument("--lease-s", type=float, default=15.0, help="the service's lease_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, DBs)")
    args = p.parse_args(argv)
    args.nodes = [n for group in args.nodes for n in group]
    args.postgres_nodes = [n for group in args.postgres_nodes for n in group]
    args.parts = args.only or PARTS
    return args


def main(argv: list[str] | None = None) -> int:
    args = options(argv)
    if Broker.available():
        print(Broker.available(), file=sys.stderr)
        return 2

    def stop(signum: int, frame: Any) -> None:  # SIGTERM: the finally blocks still run
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-service-"))
    note(f"work directory {work}")
    results: dict[str, Any] = {"ingest": [], "rollout": [], "resume": [], "nodes": [], "failed": []}
    pg: Postgres | None = None
    try:
        pki = make_pki(work / "pki", [])
        if "ingest" in args.parts:
            run_ingest(args, work, pki, args.nodes, None, results)
            for heartbeat_s in args.stress:
                run_ingest(args, work, pki, [args.stress_nodes], None, results, heartbeat_s)
        if "postgres" in args.parts:
            if Postgres.available():
                results["failed"].append(f"PostgreSQL: {Postgres.available()}")
            else:
                pg = Postgres(work / "postgres")
                command(f"postgres -D {pg.data} -p {pg.port}   (fsync=off, as tests/postgres.py)")
                pg.start()
                run_ingest(args, work, pki, args.postgres_nodes, pg, results)
                pg.stop()
                pg = None
        if "rollout" in args.parts:
            try:
                run_rollout(args, work, pki, results)
            except Exception as exc:
                note(f"rollout failed: {exc!r}")
                results["failed"].append(f"rollout: {exc}")
        if "resume" in args.parts:
            try:
                run_resume(args, work, pki, results)
            except Exception as exc:
                note(f"resume failed: {exc!r}")
                results["failed"].append(f"resume: {exc}")
        if "nodes" in args.parts and not results["nodes"]:
            try:
                run_nodes(args, work, pki, results)
            except Exception as exc:
                note(f"nodes failed: {exc!r}")
                results["failed"].append(f"nodes: {exc}")
    except KeyboardInterrupt:
        results["failed"].append("interrupted")
    finally:
        if pg is not None:
            pg.stop()
        (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
        if args.keep:
            note(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(report(args, results, time.monotonic() - started))
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
