"""What the fleet service makes of what nodes report (issue 25), on a real SQLite file and a
real PostgreSQL: every node's series for Prometheus (the names and labels of edged's and
cloudsync's own /metrics; an offline or stale node's figures end), telemetry added up once
whatever comes twice, device alerts kept by identity (a duplicate or an older change changes
nothing), what goes to Alertmanager, the ECS lines, and what a hostile node cannot do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from cloudsync.fleet.alerting import Alerting
from cloudsync.fleet.exporter import Exposition, NodeSeries, heartbeat_families
from cloudsync.fleet.observe import MAX_NODE_COUNTERS, EventLog, label_name
from cloudsync.fleet.registry import Registry
from cloudsync.fleet.store import Store, dumps
from cloudsync.protocol import telemetry
from cloudsync.protocol.envelope import decode
from tests.fleetmessages import NOW, alert, heartbeat, msg, status

OFFLINE_MS = 30_000


@pytest.fixture
def registry(store: Store) -> Registry:
    return Registry(store, offline_after_s=OFFLINE_MS / 1000)


def metrics_body() -> dict[str, Any]:
    """A telemetry body as cloudsync makes it, from two reads of edged's /metrics."""
    before = telemetry.parse(EDGED_METRICS.format(n=10, slow=1, sum=0.2, ok=9, cloud=4), 1.0, "x")
    now = telemetry.parse(EDGED_METRICS.format(n=30, slow=4, sum=0.9, ok=26, cloud=9), 61.0, "x")
    body = telemetry.telemetry(now, before)
    assert body is not None
    return body


EDGED_METRICS = """
# TYPE edged_inference_requests_total counter
edged_inference_requests_total{{model="m",version="2",outcome="success"}} {ok}
edged_inference_requests_total{{model="m",version="2",outcome="error"}} {slow}
# TYPE edged_inference_request_duration_seconds histogram
edged_inference_request_duration_seconds_bucket{{model="m",version="2",le="0.01"}} {ok}
edged_inference_request_duration_seconds_bucket{{model="m",version="2",le="0.1"}} {n}
edged_inference_request_duration_seconds_bucket{{model="m",version="2",le="+Inf"}} {n}
edged_inference_request_duration_seconds_sum{{model="m",version="2"}} {sum}
edged_inference_request_duration_seconds_count{{model="m",version="2"}} {n}
# TYPE edged_route_decisions_total counter
edged_route_decisions_total{{model="m",route="local",reason="load"}} {n}
# TYPE edged_cloud_requests_total counter
edged_cloud_requests_total{{model="m",cloud_model="m-big",outcome="success"}} {cloud}
edged_cloud_requests_total{{model="m",cloud_model="m-big",outcome="error"}} {slow}
# TYPE edged_cloud_ab_calls_total counter
edged_cloud_ab_calls_total{{model="m",cloud_model="m-big",good="true"}} {cloud}
edged_cloud_ab_calls_total{{model="m",cloud_model="m-big",good="false"}} {slow}
edged_cloud_ab_calls_total{{model="m",cloud_model="m-v2",good="true"}} {ok}
"""


def scrape(store: Store, now: int = NOW + 1000) -> dict[tuple[str, frozenset[Any]], float]:
    """The exposition, parsed as Prometheus would: (sample, labels) -> value."""
    text = NodeSeries(store, "f1", OFFLINE_MS, lambda: now).render().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def at(samples: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset({"instance": "n1", "fleet": "f1", **labels}.items()))]


def test_a_nodes_heartbeat_and_telemetry_are_its_own_series(
    registry: Registry, store: Store
) -> None:
    body = metrics_body()
    row = body["metrics"]["models"][0]
    assert row["buckets"] == {"0.01": 17, "0.1": 20, "+Inf": 20} and row["seconds"] == 0.7
    record = msg("telemetry", "n1", body, ident="t1", priority="telemetry")
    done = registry.ingest([status("n1"), heartbeat("n1"), record, record])  # once
    assert done.counters > 0 and done.poison == 0
    registry.ingest([record])  # and once more later (the outbox sent it again)
    s = scrape(store)
    assert at(s, "edged_local_load_ratio") == 0.93
    assert at(s, "edged_device_cpu_utilization_ratio") == 0.93
    assert at(s, "edged_device_gpu_utilization_ratio") == 0.12
    assert at(s, "edged_device_memory_used_ratio") == 0.75
    assert at(s, "edged_device_temperature_celsius") == 51.5
    assert at(s, "edged_device_throttled") == 0.0
    assert at(s, "edged_device_power_mode_info", mode="15W") == 1.0
    assert at(s, "edged_cloud_link_up") == 1.0
    assert at(s, "edged_cloud_link_rtt_seconds", statistic="ewma") == 0.042
    assert at(s, "edged_cloud_link_rtt_seconds", statistic="p95") == 0.09
    assert at(s, "edged_cloud_breaker_state", state="open") == 1.0
    assert at(s, "edged_cloud_breaker_state", state="closed") == 0.0
    assert at(s, "edged_cloud_breaker_error_ratio") == 0.25
    assert at(s, "edged_cloud_scale_out") == 1.0  # from the heartbeat: behind NAT too
    assert at(s, "edged_requests_in_flight") == 3.0
    assert (
        at(s, "edged_model_version_info", model="intent-classifier", version="2", state="READY")
        == 1.0
    )
    assert at(s, "cloudsync_mqtt_connected") == 1.0
    assert at(s, "cloudsync_edged_up") == 1.0
    assert at(s, "cloudsync_outbox_records", priority="telemetry") == 4.0
    assert at(s, "cloudsync_outbox_dead_letters") == 2.0
    assert at(s, "cloudsync_outbox_oldest_age_seconds") == 12.5
    assert at(s, "cloudsync_outbox_handled_records_total", outcome="acked") == 5.0
    assert at(s, "cloudsync_heartbeats_total") == 1.0
    # telemetry, counted once
    version = {"model": "m", "version": "2"}
    assert at(s, "edged_inference_requests_total", outcome="success", **version) == 17
    assert at(s, "edged_inference_requests_total", outcome="error", **version) == 3
    assert at(s, "edged_inference_request_duration_seconds_bucket", le="0.01", **version) == 17
    assert at(s, "edged_inference_request_duration_seconds_bucket", le="+Inf", **version) == 20
    assert at(s, "edged_inference_request_duration_seconds_count", **version) == 20
    assert at(s, "edged_inference_request_duration_seconds_sum", **version) == pytest.approx(0.7)
    assert at(s, "edged_route_decisions_total", model="m", route="local") == 20
    assert at(s, "edged_cloud_requests_total", model="m", cloud_model="m-big", outcome="error") == 3
    assert (
        at(s, "edged_cloud_requests_total", model="m", cloud_model="m-big", outcome="success") == 5
    )
    # an A/B test's calls per arm, good or not (what the fleet's A/B tests add up)
    assert body["metrics"]["cloud_ab"] == {
        "m": {"m-big": {"calls": 8, "good": 5}, "m-v2": {"calls": 17, "good": 17}}
    }
    assert at(s, "edged_cloud_ab_calls_total", model="m", cloud_model="m-big", good="true") == 5
    assert at(s, "edged_cloud_ab_calls_total", model="m", cloud_model="m-big", good="false") == 3
    assert at(s, "edged_cloud_ab_calls_total", model="m", cloud_model="m-v2", good="true") == 17
    assert at(s, "edged_cloud_ab_calls_total", model="m", cloud_model="m-v2", good="false") == 0
    assert (
        at(s, "edgefleet_node_info", state="online", cloudsync_version="1.2", edged_version="1.3")
        == 1.0
    )
    assert at(s, "edgefleet_node_labels_info", label_site="berlin", label_hw_kind="orin") == 1
    assert ("edged_device_cpu_count", frozenset()) not in s  # not one of edged's gauges
    # a second record adds up
    registry.ingest([msg("telemetry", "n1", body, ident="t2", priority="telemetry")])
    s = scrape(store)
    assert at(s, "edged_inference_requests_total", outcome="success", **version) == 34


def test_an_offline_or_stale_nodes_figures_end(registry: Registry, store: Store) -> None:
    registry.ingest(
        [status("n1"), heartbeat("n1"), msg("telemetry", "n1", metrics_body(), ident="t1")]
    )
    assert at(scrape(store), "edged_local_load_ratio") == 0.93
    stale = scrape(store, NOW + OFFLINE_MS + 5000)  # no heartbeat for offline_after_s
    mine = {name for name, labels in stale if ("instance", "n1") in labels}
    assert mine == {
        "cloudsync_mqtt_connected",
        "edgefleet_node_info",
        "edgefleet_node_labels_info",
        "edgefleet_node_last_heartbeat_timestamp_seconds",
    }
    assert at(stale, "cloudsync_mqtt_connected") == 0.0
    assert (
        at(
            stale,
            "edgefleet_node_info",
            state="stale",
            cloudsync_version="1.2",
            edged_version="1.3",
        )
        == 1.0
    )
    registry.ingest(
        [msg("status", "n1", {"state": "offline", "reason": "connection lost"}, NOW + 500)]
    )
    gone = scrape(store, NOW + 1000)
    assert at(gone, "cloudsync_mqtt_connected") == 0.0
    assert (
        "edged_local_load_ratio",
        frozenset({"instance": "n1", "fleet": "f1"}.items()),
    ) not in gone


def test_alerts_are_kept_by_identity_and_sent_as_prometheus_sends_them(
    registry: Registry, store: Store, tmp_path: Path
) -> None:
    firing = msg("events", "n1", alert("firing", NOW), ident="a1", priority="alert")
    resolved = msg("events", "n1", alert("resolved", NOW + 60_000), ident="a2", priority="alert")
    done = registry.ingest([status("n1"), heartbeat("n1"), firing, firing])
    assert [e.id for e in done.events] == ["a1"]  # the duplicate is not a second event
    assert (
        at(
            scrape(store),
            "cloudsync_alerts_firing",
            alertname="EdgedLocalLoadHigh",
            severity="warning",
        )
        == 1.0
    )
    sender = Alerting(
        store, "f1", ["http://127.0.0.1:1"], 30, lambda: NOW + 1000, "https://fleet.example"
    )
    [sent] = sender.alerts()
    assert sent == {
        "labels": {
            "alertname": "EdgedLocalLoadHigh",
            "severity": "warning",
            "instance": "n1",
            "fleet": "f1",
            "site": "berlin",
            "hw_kind": "orin",
        },
        "annotations": {
            "summary": "Local load above 90% for 5m",
            "description": "busy",
            "value": "0.95",
        },
        "startsAt": "2027-01-15T07:55:00.000Z",
        "endsAt": "2027-01-15T08:02:01.000Z",  # four resend intervals ahead
        "generatorURL": "https://fleet.example/console/nodes/n1",
    }
    assert sender.push() == 0  # nothing listens there: logged, tried again next time
    registry.ingest([resolved, firing])  # the older change after the newer: nothing
    [sent] = sender.alerts()
    assert sent["endsAt"] == "2027-01-15T08:01:00.000Z"  # when the device resolved it
    assert (
        "cloudsync_alerts_firing",
        frozenset(
            {
                "instance": "n1",
                "fleet": "f1",
                "alertname": "EdgedLocalLoadHigh",
                "severity": "warning",
            }.items()
        ),
    ) not in scrape(store)
    later = Alerting(store, "f1", [], 30, lambda: NOW + 60_000 + 16 * 60_000)
    assert later.alerts() == []  # resolved 16 minutes ago: no more sent
    # the same alert with another label set is another alert
    registry.ingest(
        [
            msg(
                "events",
                "n1",
                alert("firing", NOW + 70_000, model="m"),
                ident="a3",
                priority="alert",
            )
        ]
    )
    assert [a["labels"].get("model") for a in sender.alerts()] == [None, "m"] or [
        a["labels"].get("model") for a in sender.alerts()
    ] == ["m", None]


def test_events_are_ecs_lines_once(registry: Registry, tmp_path: Path) -> None:
    path = tmp_path / "events.json"
    log = EventLog(str(path), "f1")
    event = {
        "from": "edged",
        "id": 7,
        "ts": NOW,
        "level": "error",
        "source": "edged.routing.router",
        "message": "cloud call failed",
        "request_id": "req-42",
        "model": "m",
    }
    once = msg("events", "n1", event, ident="edged-e-7", priority="alert")
    step = msg(
        "events", "n1", {"delivery": {"model": "m", "version": 3, "step": "active"}}, ident="d1"
    )
    for batch in ([once, once, step], [once]):
        for e in registry.ingest(batch).events:
            log.write(e)
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["@timestamp"] == "2027-01-15T08:00:00.000Z"
    assert (first["log.level"], first["message"]) == ("error", "cloud call failed")
    assert first["host"] == {"name": "n1"} and first["labels"] == {"fleet": "f1"}
    assert first["http"] == {"request": {"id": "req-42"}}
    assert first["edged"] == {"model": "m"}
    assert first["event"]["id"] == "edged-e-7" and first["event"]["kind"] == "alert"
    assert first["log"]["logger"] == "edged.routing.router"
    assert second["message"] == "m v3: active" and second["event"]["action"] == "delivery active"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"metrics": {"models": [{"model": "m", "outcomes": {"success": -1}}]}}, "outcomes"),
        ({"metrics": {"models": [{"model": "m", "buckets": {"nan": 1}}]}}, "buckets"),
        (
            {"metrics": {"models": [{"model": "m", "buckets": {"+Inf": 1}, "seconds": "x"}]}},
            "seconds",
        ),
        ({"metrics": {"models": "all"}}, "models"),
        ({"metrics": {"routes": {"m": {"local": 1.5}}}}, "routes"),
        ({"metrics": {"cloud": {"m": {"b": {"outcomes": {"error": True}}}}}}, "cloud"),
        ({"metrics": {"cloud_ab": {"m": {"b": {"calls": 1, "good": 2}}}}}, "cloud_ab.good"),
        ({"metrics": {"cloud_ab": {"m": {"b": {"calls": -1}}}}}, "cloud_ab.calls"),
        ({"metrics": {"cloud_ab": {"m": ["b"]}}}, "cloud_ab[]"),
    ],
)
def test_telemetry_that_breaks_the_contract_is_poison_naming_the_field(
    registry: Registry,
    store: Store,
    body: dict[str, Any],
    field: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    done = registry.ingest([msg("telemetry", "n1", body, ident="bad")])
    assert done.poison == 1 and f"telemetry.{field}" in caplog.text
    assert store.query("SELECT COUNT(*) AS n FROM counters")[0]["n"] == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (alert("pending", NOW), "events.alert"),
        ({**alert("firing", NOW), "labels": {"instance": "other"}}, "events.labels"),
        ({**alert("firing", NOW), "labels": {"a b": "c"}}, "events.labels"),
        ({**alert("firing", NOW), "at_ms": -1}, "events.at_ms"),
    ],
)
def test_an_alert_that_breaks_the_contract_is_poison(
    registry: Registry,
    store: Store,
    body: dict[str, Any],
    field: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    done = registry.ingest([msg("events", "n1", body, ident="bad", priority="alert")])
    assert done.poison == 1 and field in caplog.text
    assert store.query("SELECT COUNT(*) AS n FROM alerts")[0]["n"] == 0


def test_a_node_cannot_grow_its_series_without_bound(registry: Registry, store: Store) -> None:
    models = [{"model": f"m{i}", "version": "1", "outcomes": {"success": 1}} for i in range(250)]
    for n in range(12):  # 250 new series a record: the cap stops the growth, counting goes on
        body = {"metrics": {"models": [{**m, "version": str(n)} for m in models]}}
        registry.ingest([msg("telemetry", "n1", body, ident=f"t{n}")])
    held = store.query("SELECT COUNT(*) AS n FROM counters WHERE node = 'n1'")[0]["n"]
    assert MAX_NODE_COUNTERS - 250 < held <= MAX_NODE_COUNTERS
    body = {"metrics": {"models": [{**models[0], "version": "0"}]}}
    registry.ingest([msg("telemetry", "n1", body, ident="again")])
    labels = dumps({"model": "m0", "version": "0", "outcome": "success"})
    value = store.query("SELECT value FROM counters WHERE node = 'n1' AND labels = ?", (labels,))[
        0
    ]["value"]
    assert value == 2.0


def test_a_label_name_is_prometheus_one() -> None:
    assert [label_name(k) for k in ("site", "hw.kind", "a/b-c", "9lives", "x" * 80)] == [
        "site",
        "hw_kind",
        "a_b_c",
        "_9lives",
        "x" * 63,
    ]


def test_the_exposition_is_prometheus_clients_own() -> None:
    """The exporter writes the text format itself (faster at fleet sizes): the same families
    read back exactly as prometheus_client's generate_latest writes them, escapes included."""
    families = list(heartbeat_families(decode(heartbeat("n1").payload).body))
    odd = Metric("x_odd", 'help with \\ and "quotes"\nand a line', "counter")
    odd.samples.append(Sample("x_odd_total", {"v": 'a\\b"c\nd', "w": "é"}, 2.5))
    families.append(odd)

    class Frozen:
        def collect(self) -> Iterator[Metric]:
            return iter(families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Frozen())  # type: ignore[arg-type]
    out = Exposition()
    for family in families:
        out.add(family)
    ours, theirs = out.text().decode(), generate_latest(registry).decode()

    def heads(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("#")]

    def samples(text: str) -> set[tuple[str, frozenset[tuple[str, str]], float]]:
        return {
            (s.name, frozenset(s.labels.items()), s.value)
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    assert heads(ours) == heads(theirs)
    assert samples(ours) == samples(theirs) and len(samples(ours)) > 30
    assert ("x_odd_total", frozenset({("v", 'a\\b"c\nd'), ("w", "é")}), 2.5) in samples(ours)


def test_shards_cut_the_fleets_series_each_node_in_one(registry: Registry, store: Store) -> None:
    names = [f"sim-{i:05d}" for i in range(40)]
    registry.ingest(
        [
            m
            for n in names
            for m in (status(n), heartbeat(n), msg("telemetry", n, metrics_body(), ident=f"t-{n}"))
        ]
    )
    series = NodeSeries(store, "f1", OFFLINE_MS, lambda: NOW + 1000)
    whole = scrape(store)
    parts: dict[tuple[str, frozenset[Any]], float] = {}
    owners: dict[str, int] = {}
    for shard in range(3):
        text = series.render(shard, 3).decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                parts[(s.name, frozenset(s.labels.items()))] = s.value
                owner = owners.setdefault(s.labels["instance"], shard)
                assert owner == shard, f"{s.labels['instance']} in two shards"
    assert parts == whole and set(owners) == set(names)
    assert len(set(owners.values())) == 3  # each shard has some
    with pytest.raises(ValueError, match="shards"):
        series.render(3, 3)


@pytest.mark.parametrize("sent", ["yes", 1, 1e308, {"needed": True}, [True], None])
def test_a_scale_out_signal_that_is_not_a_boolean_is_no_sample(sent: Any) -> None:
    """A node's heartbeat is a way in: ``cloud_scale_out`` other than true or false gives no
    sample (cannot tell), and the rest of the heartbeat's series are still made."""
    body = {**decode(heartbeat("n1").payload).body, "cloud_scale_out": sent}
    families = {f.name: f for f in heartbeat_families(body)}
    assert families["edged_cloud_scale_out"].samples == []
    assert families["edged_cloud_link_up"].samples[0].value == 1.0
    body["cloud_scale_out"] = False
    families = {f.name: f for f in heartbeat_families(body)}
    assert families["edged_cloud_scale_out"].samples[0].value == 0.0


def test_counter_rows_written_straight_read_back_as_the_families_and_bad_rows_left_out(
    registry: Registry, store: Store
) -> None:
    """Issue 48: the counters' lines are written from their rows (each label set parsed once a
    scrape); they read back as the same samples, and a row a database holds with labels that
    are not an object of text is left out, not the scrape failed."""
    names = [f"sim-{i:05d}" for i in range(3)]
    registry.ingest(
        [
            m
            for n in names
            for m in (status(n), heartbeat(n), msg("telemetry", n, metrics_body(), ident=f"t-{n}"))
        ]
    )
    good = scrape(store)
    counted = [k for k in good if k[0].startswith("edged_inference_request")]
    assert len(counted) > 20 and {dict(k[1])["instance"] for k in counted} == set(names)
    with store.transaction() as tx:
        for labels in ('{"model": 5}', "not json", "[1, 2]"):
            tx.execute(
                "INSERT INTO counters (node, name, labels, value, bucket) VALUES (?, ?, ?, ?, ?)",
                ("sim-00001", "edged_inference_requests_total", labels, 1.0, 0),
            )
    assert scrape(store) == good
