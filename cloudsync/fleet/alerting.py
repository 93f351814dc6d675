"""Device alerts to Prometheus Alertmanager (its API v2, ``POST /api/v2/alerts``), as
Prometheus itself sends them, so Alertmanager's own routing, grouping, silences and inhibitions
do the paging:

- every ``[alerts] resend_s`` the replica that holds the runner lease sends every alert firing
  (``endsAt`` four intervals ahead: an alert the service stops sending resolves by itself)
  and every alert resolved in the last 15 minutes (``endsAt`` when the device resolved it), to
  each Alertmanager of ``[alerts] alertmanagers`` (a cluster: each one, as Prometheus does);
- labels: ``alertname``, ``severity``, ``instance`` (the node), ``fleet``, the node's labels
  (names made Prometheus': ``.``, ``/``, ``-`` as ``_``) and the alert's own (``model``...), which
  win; annotations: ``summary``, ``description``, ``value``; ``startsAt``: when the condition
  began on the device;
- an alert is one row per node, name and labels (``cloudsync.fleet.observe``): the same alert
  announced again after a reconnect or a restart is the same alert, and Alertmanager
  deduplicates by the labels too.

An Alertmanager that does not answer is logged (once until it answers again) and tried at the
next interval; nothing is lost meanwhile (the state is in the database).
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from cloudsync.fleet.observe import iso, label_name
from cloudsync.fleet.store import Store

log = logging.getLogger("edgefleet.alerting")
RESOLVED_RESEND_MS = 15 * 60 * 1000
TIMEOUT_S = 5.0


class Alerting:
    def __init__(
        self,
        store: Store,
        fleet: str,
        alertmanagers: list[str],
        resend_s: float,
        clock: Callable[[], int],
        console_url: str = "",
        context: ssl.SSLContext | None = None,
    ) -> None:
        self.store, self.fleet, self.clock = store, fleet, clock
        self.urls = [u.rstrip("/") + "/api/v2/alerts" for u in alertmanagers]
        self.resend_ms = int(resend_s * 1000)
        self.console_url = console_url.rstrip("/")
        self.context = context
        self.failing: set[str] = set()

    def firing(self, limit: int = 50) -> list[dict[str, Any]]:
        """The alerts firing, counted by name and severity, the most common first."""
        return self.store.query(
            "SELECT alertname, severity, COUNT(*) AS n FROM alerts WHERE state = 'firing'"
            " GROUP BY alertname, severity ORDER BY n DESC, alertname LIMIT ?",
            (limit,),
        )

    def latest(self, node: str | None = None, limit: int = 10) -> list[dict[str, Any]]:
        """Of all nodes: the alerts firing, the latest to start first; of one node: its alerts,
        firing and resolved."""
        if node is None:
            return self.store.query(
                "SELECT * FROM alerts WHERE state = 'firing' ORDER BY starts_ms DESC LIMIT ?",
                (limit,),
            )
        return self.store.query(
            "SELECT * FROM alerts WHERE node = ? ORDER BY state, starts_ms DESC LIMIT ?",
            (node, limit),
        )

    def alerts(self) -> list[dict[str, Any]]:
        """What to send now: the alerts firing, and those resolved lately."""
        now = self.clock()
        rows = self.store.query(
            "SELECT a.*, n.node_labels, n.labels AS operator_labels FROM alerts a"
            " LEFT JOIN nodes n ON n.node = a.node WHERE a.state = 'firing' OR a.ends_ms > ?"
            " ORDER BY a.node, a.fingerprint",
            (now - RESOLVED_RESEND_MS,),
        )
        out = []
        for row in rows:
            node_labels = {
                **json.loads(row["node_labels"] or "{}"),
                **json.loads(row["operator_labels"] or "{}"),
            }
            labels = {label_name(k): str(v) for k, v in node_labels.items()}
            labels.update(json.loads(row["labels"]))
            labels.update(
                alertname=row["alertname"],
                severity=row["severity"],
                instance=row["node"],
                fleet=self.fleet,
            )
            ends = row["ends_ms"] if row["state"] == "resolved" else now + 4 * self.resend_ms
            alert = {
                "labels": labels,
                "annotations": json.loads(row["annotations"]),
                "startsAt": iso(row["starts_ms"]),
                "endsAt": iso(ends),
            }
            if self.console_url:
                alert["generatorURL"] = f"{self.console_url}/console/nodes/{row['node']}"
            out.append(alert)
        return out

    def push(self) -> int:
        """Send what there is to every Alertmanager; how many of them took it."""
        alerts = self.alerts()
        if not alerts:
            return len(self.urls)
        body = json.dumps(alerts).encode()
        took = 0
        for url in self.urls:
            request = urllib.request.Request(
                url, body, {"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context):
                    pass
            except (OSError, urllib.error.URLError) as exc:  # HTTPError is one of them
                if url not in self.failing:
                    log.error("Alertmanager %s does not take the alerts: %s", url, exc)
                    self.failing.add(url)
                continue
            if url in self.failing:
                log.info("Alertmanager %s takes the alerts again", url)
                self.failing.discard(url)
            took += 1
        return took
