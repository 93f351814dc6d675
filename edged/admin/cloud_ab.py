"""Cloud A/B: a share of a model's cloud calls go to a second version on the cloud server (over
the config's ``b_cloud_name``/``b_share``); the metrics say how each arm does, and a test that
decides keeps its winner as the operator's split would be kept."""

from __future__ import annotations

import functools
import logging
from typing import Any

from edged.admin.kept import Kept
from edged.cloud import CloudEndpoint
from edged.common.errors import Conflict, EdgedError, InvalidRequest, NotFound
from edged.models.repository import ModelManager
from edged.routing.router import Router

log = logging.getLogger("edged.admin")

MAX_SCORES = 1000  # an A/B test's scores in one call


class CloudSplits:
    def __init__(self, kept: Kept, router: Router, manager: ModelManager) -> None:
        self.kept, self.router, self.manager = kept, router, manager
        for tier in router.clouds:  # an A/B test's decision is kept as the operator's would be
            tier.on_decided = functools.partial(self._decided, tier.name)

    def restore(self) -> None:
        """The kept splits in force again (one that no longer applies: logged, left out)."""
        for key, split in self.kept.splits.items():
            model = key.partition("@")[0]
            try:
                self._split(model, split)
            except EdgedError as exc:
                log.error("admin: the cloud A/B of %s is not applied: %s", model, exc.message)

    def _split(self, model: str, doc: Any, persist: bool = False) -> dict[str, Any]:
        cloud = self.tier(doc.get("tier") if isinstance(doc, dict) else None)
        tier = cloud.name
        b_name = doc.get("b_cloud_name") if isinstance(doc, dict) else None
        share = doc.get("b_share", 0) if isinstance(doc, dict) else None
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise InvalidRequest("'b_share' must be a share of calls, 0 to 1")
        if share and (not isinstance(b_name, str) or not 0 < len(b_name) <= 128):
            raise InvalidRequest("'b_cloud_name' must name the cloud model of arm b")
        by = doc.get("decided_by", "edged")
        if by not in ("edged", "fleet"):
            raise InvalidRequest(
                "'decided_by' must be 'edged' (this node's test decides) or"
                " 'fleet' (the fleet service's)"
            )
        rule = {k: doc[k] for k in ("latency_ms", "min_confidence", "min_score") if k in doc}
        for key, value in rule.items():
            most = 3_600_000.0 if key == "latency_ms" else 1.0
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (0 <= value <= most)
            ):
                raise InvalidRequest(f"'{key}' must be a number, 0 to {most:g}")
        # kept even at share 0: the operator's "off" (or a test's) overrides the config file's
        split: dict[str, Any] = {"b_cloud_name": b_name, "b_share": float(share)}
        if by == "fleet":
            split["decided_by"] = by
        first = cloud is self.router.cloud
        if not first:
            split["tier"] = tier
        splits = {**self.kept.splits, model if first else f"{model}@{tier}": {**split, **rule}}
        if persist:
            self.kept.save(cloud_ab=splits)
        cloud.set_split(model, b_name, float(share), by == "fleet", **rule)
        self.kept.splits = splits
        reply = {"model": model, "ab": cloud.state()["ab"].get(model)}
        return reply if first else {**reply, "tier": tier}

    def set_split(self, model: str, doc: Any) -> dict[str, Any]:
        """PUT /v1/admin/cloud/{m}/ab {"b_cloud_name", "b_share"} (share 0: arm a only;
        optional: "tier" (default: the first), "decided_by" edged or fleet, and the test's
        "latency_ms", "min_confidence")."""
        share = doc.get("b_share", 0) if isinstance(doc, dict) else 0
        cloud = self.tier(doc.get("tier") if isinstance(doc, dict) else None)
        if share and model not in self.manager.entries and model not in cloud.catalog:
            raise NotFound(
                f"no model '{model}' on the device or in the cloud tier {cloud.name}'s catalog:"
                " a split of it would split nothing"
            )
        reply = self._split(model, doc, persist=True)
        log.info("cloud A/B of %s: %s", model, reply["ab"] or "off")
        return reply

    def score(self, model: str, doc: Any) -> dict[str, Any]:
        """POST /v1/admin/cloud/{m}/ab/scores {"scores": [{"request_id", "score"}], "tier"}:
        an operator's scores of answers, counted by the model's A/B test (it must take
        scores: ab_min_score or the split's min_score)."""
        cloud = self.tier(doc.get("tier") if isinstance(doc, dict) else None)
        scores = doc.get("scores") if isinstance(doc, dict) else None
        if not isinstance(scores, list) or not 0 < len(scores) <= MAX_SCORES:
            raise InvalidRequest(f"'scores' must be a list of 1 to {MAX_SCORES} scores")
        checked = []
        for i, row in enumerate(scores):
            ident = row.get("request_id") if isinstance(row, dict) else None
            value = row.get("score") if isinstance(row, dict) else None
            if not isinstance(ident, str) or not 0 < len(ident) <= 256:
                raise InvalidRequest(f"'scores[{i}].request_id' must be a request's id")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (0 <= value <= 1)
            ):
                raise InvalidRequest(f"'scores[{i}].score' must be a number, 0 to 1")
            checked.append((ident, float(value)))
        test = cloud.tests.get(model)
        if test is None or test.min_score is None:
            raise Conflict(f"no A/B test of {model} on tier {cloud.name} takes scores")
        counted = sum(cloud.score(model, ident, value) for ident, value in checked)
        return {"model": model, "counted": counted, "not_waiting": len(checked) - counted}

    def tier(self, name: Any) -> CloudEndpoint:
        """The cloud tier by name (None: the first)."""
        if self.router.cloud is None:
            raise NotFound("this edged has no cloud tier ([cloud] url)")
        if name is None:
            return self.router.cloud
        found = [t for t in self.router.clouds if t.name == name]
        if not found:
            names = ", ".join(t.name for t in self.router.clouds)
            raise InvalidRequest(f"'tier' must name a cloud tier: {names}")
        return found[0]

    def _decided(self, tier: str, model: str, b_cloud_name: str | None, share: float) -> None:
        """An A/B test promoted its winner: in force now, and kept like a PUT of the split."""
        doc = {"b_cloud_name": b_cloud_name, "b_share": share, "tier": tier}
        try:
            self._split(model, doc, persist=True)
        except EdgedError as exc:  # e.g. a full disk: in force until a restart
            log.error("admin: the cloud A/B decision of %s is not kept: %s", model, exc.message)
            self.tier(tier).set_split(model, b_cloud_name, share)
