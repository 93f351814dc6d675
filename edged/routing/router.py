"""The router: runs each model call where ``routing.decide`` says, and keeps serving when a tier
fails.

For every model call (an API request, or a step of a pipeline) it gathers plain facts — is the
model ready locally, can the cloud take it (link up, circuit closed, in the catalog), the learned
latency of each path, the device's load, the time left — asks the pure ``decide()``, and runs:

- ``local``: on the device; if that fails for want of capacity (429) or a server-side error,
  the cloud takes it when it may (route ``fallback``). A local classifier whose confidence is
  under its model's ``escalate_below`` is asked again in the cloud (route ``escalated``).
- ``cloud``: through the cloud endpoint, leaving enough of the deadline to run locally; if the
  call fails (timeout, reset, 5xx, open circuit) it runs locally (route ``fallback``). Without a
  local fallback a retryable failure is retried, within the deadline.
- ``hedged``: both at once; the first good answer wins, the other is cancelled.

Each call appends what was decided and what happened to the request's ``RouteContext``; the data
plane returns it with the answer. Privacy is checked again right before a cloud call.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import pathlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.cloud import CloudEndpoint, CloudError
from edged.common import logs
from edged.common.atomic import write_atomic
from edged.common.errors import EdgedError, NotFound, Unavailable
from edged.config import RoutingConfig
from edged.device import LoadMonitor
from edged.metrics import Metrics
from edged.models.model_config import ModelConfig
from edged.models.repository import ModelManager
from edged.oip.tensors import confidence, payload_bytes
from edged.privacy import Privacy
from edged.request import RouteContext, current_qos, current_route, set_route
from edged.routing import tiers
from edged.routing.decide import Decision, Path, RouteRequest, decide
from edged.routing.estimates import Estimates
from edged.routing.learned import Learner
from edged.runtimes.base import Tensors

log = logging.getLogger(__name__)

CLOUD_VERSION = "cloud"  # the model_version of an answer the cloud gave
NO_CLOUD = Path(False, "no cloud tier is configured")
# a cloud tier to try: the endpoint, why it is there, the time it is expected to take
TierChoice = tuple[CloudEndpoint, str, float | None]
MIN_LOCAL_RESERVE_S = 0.02  # time kept for a local fallback when the local path is unmeasured


def local_reserve(decision: Decision) -> float:
    """The time a cloud call leaves for running locally after it, when it may fall back there:
    twice the local estimate (at least MIN_LOCAL_RESERVE_S), at most half the deadline; none
    when running locally would miss the deadline anyway (the cloud gets all of it)."""
    local = decision.predicted_local_s
    if decision.fallback != "local" or (local is not None and local >= decision.deadline_s):
        return 0.0
    return min(max(MIN_LOCAL_RESERVE_S, 2 * (local or 0.0)), decision.deadline_s / 2)


def should_fall_back(exc: BaseException) -> bool:
    """A local failure the cloud may make good: no capacity, or a server-side error."""
    status = exc.status if isinstance(exc, EdgedError) else 500
    return status in (429, 500, 503)


class Router:
    """Decides and runs every model call; pipelines call their steps through it too."""

    def __init__(
        self,
        manager: ModelManager,
        config: RoutingConfig,
        cloud: CloudEndpoint | None,
        monitor: LoadMonitor | None,
        metrics: Metrics,
        tiers: Sequence[CloudEndpoint] = (),
    ) -> None:
        """``cloud``: the first cloud tier ([cloud]); ``tiers``: more ([[cloud.tiers]])."""
        self.manager = manager
        self.config = config
        self.policy = config.to_policy()
        self.privacy = Privacy(manager, config.private_models)
        self.cloud = cloud
        self.clouds: list[CloudEndpoint] = [cloud, *tiers] if cloud is not None else []
        self.monitor = monitor
        self.metrics = metrics
        self.estimates = Estimates()
        for tier in self.clouds:
            tier.on_counted = metrics.ab_call
            tier.on_service = functools.partial(self._served, tier)
        self.learner: Learner | None = Learner() if config.policy == "learned" else None
        self.drained: str | None = None  # why the local tier takes no new work (edged.admin)

    def configure(self, config: RoutingConfig) -> None:
        """New rules and settings (SIGHUP); a learner keeps what it learned."""
        self.config = config
        self.policy = config.to_policy()
        self.privacy.configure(config.private_models)
        if config.policy == "learned" and self.learner is None:
            self.learner = Learner()
        elif config.policy != "learned":
            self.learner = None

    def load_state(self, path: pathlib.Path) -> None:
        """What the learner learned before a restart (a missing or bad file: start afresh)."""
        if self.learner is None:
            return
        try:
            self.learner.load_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError) as exc:
            log.warning("routing: cannot read %s, learning afresh: %s", path, exc)
            return
        log.info("routing: the learner resumes with %d contexts", len(self.learner.table))

    def save_state(self, path: pathlib.Path) -> None:
        """Keep what the learner learned (atomically: a crash leaves the old file)."""
        if self.learner is None:
            return
        try:
            write_atomic(path, json.dumps(self.learner.to_json()))
        except OSError as exc:
            log.warning("routing: cannot save the learner to %s: %s", path, exc)

    # ---- what pipelines see (runtimes.base.Steps) ------------------------------------------

    async def call(self, name: str, inputs: Tensors) -> Tensors:
        return (await self.infer(name, None, inputs))[1]

    def config_of(self, name: str) -> ModelConfig:
        return self.manager.config_of(name)

    def labels_of(self, name: str, output: str, version: int | None = None) -> list[str]:
        return self.manager.labels_of(name, output, version)

    # ---- facts -----------------------------------------------------------------------------

    def _load(self) -> float | None:
        if self.monitor is None:
            return None
        snap = self.monitor.latest
        values = [v for v in (snap.cpu_percent, snap.gpu_percent) if v is not None]
        return max(values) if values else None

    def facts(self, name: str, payload: int, left: float) -> dict[str, float | None]:
        snap = self.monitor.latest if self.monitor is not None else None
        link = self.cloud.link if self.cloud is not None else None
        queue = None
        entry = self.manager.entries.get(name)
        if entry is not None:
            queue = float(sum(mv.inflight for mv in entry.versions.values()))
        return {
            "local_load": self._load(),
            "cpu": snap.cpu_percent if snap else None,
            "gpu": snap.gpu_percent if snap else None,
            "memory": snap.memory_used_percent if snap else None,
            "temperature": snap.temperature_c if snap else None,
            "battery": None,
            "rtt": link.rtt * 1000 if link is not None and link.rtt is not None else None,
            "deadline": left * 1000,
            "payload": float(payload),
            "queue": queue,
        }

    def _local_path(
        self, name: str, version: int | None, payload: int, internal: bool = False
    ) -> tuple[Path, ModelConfig | None, Exception | None]:
        if self.drained is not None and not internal:
            why = f"the local tier is {self.drained}"
            return Path(False, why), None, Unavailable(f"model '{name}': {why}")
        try:
            _, mv = self.manager.resolve(name, version)
        except (NotFound, Unavailable) as exc:
            return Path(False, exc.message), None, exc
        found = self.estimates.forecast(name, "local", self._load(), payload)
        predicted, deviation = found or (None, None)
        if predicted is not None:  # idle-unloaded models load again first
            predicted += self.manager.wake_cost(name)
        return Path(True, "", predicted, 0.0, deviation), mv.config, None

    def _cloud_path(
        self,
        name: str,
        version: int | None,
        payload: int,
        config: ModelConfig | None,
        flexible: bool = False,
        left_s: float = 0.0,
    ) -> tuple[Path, list[TierChoice]]:
        """The cloud as the decision sees it, and the tiers to try in order: of those that
        can take the call now, work that can wait (``flexible``) prefers the cheapest expected
        within ``left_s``, urgent work the fastest (its estimate, else the link's RTT); the
        path is the first one's (edged.routing.tiers)."""
        if not self.clouds:
            return NO_CLOUD, []  # no tier
        if config is not None and config.decoupled:
            why = "a decoupled model streams its responses from the device only"
            return Path(False, why), []
        if version is not None:
            why = f"version {version} was asked for, and only the device has it"
            return Path(False, why), []
        options: list[tiers.Option[tuple[CloudEndpoint, Path]]] = []
        refused = []
        for tier in self.clouds:
            why = tier.unavailable(name)
            if why:
                refused.append(why if len(self.clouds) == 1 else f"tier {tier.name}: {why}")
                continue
            link = tier.link
            found = self.estimates.forecast(
                name, self._key(tier), None, payload, rtt=link.rtt, bandwidth=link.bandwidth
            )
            predicted, deviation = found or (None, None)
            path = Path(True, "", predicted, tier.cost(name), deviation)
            seconds = predicted if predicted is not None else link.rtt
            options.append(tiers.Option((tier, path), path.cost, seconds))
        if not options:
            return Path(False, "; ".join(refused)), []
        ordered = tiers.order(options, flexible, left_s)
        first = ordered[0][0].tier[1]
        return first, [(o.tier[0], why, o.seconds) for o, why in ordered]

    def _key(self, tier: CloudEndpoint) -> str:
        """The path a tier's latency is learned under: the first tier's is "cloud"."""
        return "cloud" if tier is self.cloud else f"cloud:{tier.name}"

    def _served(self, tier: CloudEndpoint, model: str, seconds: float, served: int) -> None:
        """The tier's server says what ``model`` took it lately, over ``served`` inferences
        (its statistics): its service time, the network not in it (a prediction adds the RTT
        of the moment); learned as that many calls would teach it."""
        self.estimates.observe(model, self._key(tier), seconds, times=served)

    # ---- the capability registry -----------------------------------------------------------

    def tiers(self, name: str) -> tuple[dict[str, Any], str | None]:
        """Where a model can run now, with its measured latency (mean over the calls seen) and
        the cloud's cost per call; and its task type."""

        def measured(path: str) -> dict[str, Any]:
            found = self.estimates.summary(name, path)
            if found is None:
                return {"latency_ms": None, "calls": 0}
            seconds, calls = found
            if path == "cloud" and self.cloud is not None:  # service time + the RTT of now
                seconds += self.cloud.link.rtt or 0.0
            return {"latency_ms": round(seconds * 1000, 3), "calls": calls}

        local, config, _ = self._local_path(name, None, 0)
        task = config.parameters.get("task_type") if config else None
        row: dict[str, Any] = {
            "model": name,
            "local": {"available": local.available, "why_not": local.why_not, **measured("local")},
            "cloud": None,
        }
        entry = self._catalog().get(name)
        if entry is not None:
            assert self.cloud is not None
            why = self.cloud.unavailable(name)
            row["cloud"] = {
                "available": not why,
                "why_not": why,
                "cloud_name": entry.cloud_name,
                "cost": entry.cost,
                **measured("cloud"),
                "service_ms": self.cloud.service.as_ms().get(entry.cloud_name),
            }
            task = task or entry.task_type
        return row, task

    def _catalog(self) -> Mapping[str, Any]:
        """What some cloud tier serves (the first tier's entry where several do)."""
        return {k: v for tier in reversed(self.clouds) for k, v in tier.catalog.items()}

    def capabilities(self) -> list[dict[str, Any]]:
        """For each task type: which models serve it on which tier, now (``tiers``)."""
        catalog = self._catalog()
        by_task: dict[str, list[dict[str, Any]]] = {}
        for name in sorted(set(self.manager.entries) | set(catalog)):
            row, task = self.tiers(name)
            by_task.setdefault(task or "unknown", []).append(row)
        return [{"task_type": t, "models": rows} for t, rows in sorted(by_task.items())]

    # ---- running ---------------------------------------------------------------------------

    async def infer(
        self,
        name: str,
        version: int | None,
        inputs: Tensors,
        parameters: Mapping[str, Any] | None = None,
    ) -> tuple[str, Tensors]:
        """Run one model call where the decision says: (the version that served, outputs)."""
        ctx = current_route()
        if ctx is None:  # a call from outside a request: default deadline, no private label
            deadline = time.monotonic() + self.policy.default_deadline_s
            ctx = RouteContext(deadline=deadline, internal=True)
            set_route(ctx)
        payload = payload_bytes(inputs)
        local, config, local_error = self._local_path(name, version, payload, ctx.internal)
        left = ctx.deadline - time.monotonic()
        flexible = tiers.flexible(current_qos().priority, left)  # it can wait: the cheap tier
        cloud, choices = self._cloud_path(name, version, payload, config, flexible, left)
        if not cloud.available and local_error is not None:
            # (a version asked for is the device's alone: not there, it is a 404 all the same)
            if isinstance(local_error, NotFound) and name in self._catalog() and version is None:
                raise Unavailable(  # a cloud-only model while the cloud is down: not a 404
                    f"model '{name}' runs only in the cloud, which cannot serve it now:"
                    f" {cloud.why_not}"
                )
            raise local_error  # nothing to route: the local error (404, 503) stands
        why_private = self.privacy.why(name, ctx.released)
        if why_private:  # the request's data reached a private model: private from here on
            ctx.make_private(why_private)
        private = ctx.private
        request = RouteRequest(
            model=name,
            task_type=config.parameters.get("task_type") if config else None,
            private=private,
            deadline_s=max(0.0, left),
            payload_bytes=payload,
            override=ctx.override,  # type: ignore[arg-type]
        )
        # the facts feed rule conditions only: not gathered when no rule could use them
        facts = self.facts(name, payload, left) if self.policy.rules else {}
        decision = decide(request, local, cloud, facts, self.policy)
        if self.learner is not None:
            decision = self.learner.refine(decision, request, local, cloud)
        reason = decision.reason
        if decision.basis == "private" and ctx.private_why:
            reason += f" ({ctx.private_why})"
        record: dict[str, Any] = {
            "model": name,
            "route": decision.route,
            "reason": reason,
            "basis": decision.basis,
            "predicted_ms": _ms(decision.predicted_s),
            "deadline_ms": _ms(left),
            "trace": decision.trace,  # a tuple; JSON writes it as a list
        }
        ctx.decisions.append(record)
        call = Call(name, version, inputs, parameters or {}, config, ctx, private, payload, record)
        call.tiers = choices
        call.flexible = flexible
        # reset below: a pipeline's step must not leave its model and route on the pipeline's logs
        token = logs.set_fields(model=name, route=decision.route, reason=reason)
        started = time.perf_counter()
        try:
            return await self._run(decision, call)
        finally:
            logs.reset_fields(token)
            record["actual_ms"] = _ms(time.perf_counter() - started)
            if self.learner is not None and decision.basis == "learned":
                for tier, seconds in call.ran.items():  # would it have been in time there?
                    in_time = seconds is not None and seconds <= decision.deadline_s
                    if tier == "local":
                        self.learner.learn(request, "local", local, decision.deadline_s, in_time)
                    else:
                        self.learner.learn(request, "cloud", cloud, decision.deadline_s, in_time)
            self.metrics.route(name, record["route"], decision.rule or decision.basis)

    async def _run(self, decision: Decision, call: Call) -> tuple[str, Tensors]:
        if decision.route == "none":
            raise Unavailable(f"model '{call.name}': {decision.reason}")
        if decision.route == "local":
            try:
                served, out = await self._local(call)
            except Exception as exc:
                if decision.fallback != "cloud" or not should_fall_back(exc):
                    raise
                why = exc.message if isinstance(exc, EdgedError) else str(exc)
                call.note("fallback", f"local failed ({why}): ran in the cloud")
                try:
                    return await self._cloud(call, reserve=0.0)
                except CloudError as cloud_exc:
                    raise Unavailable(f"the cloud failed too: {cloud_exc.message}") from None
            if decision.fallback == "cloud" and call.config is not None:
                return await self._escalate(call, served, out)
            return served, out
        if decision.route == "cloud":
            try:
                return await self._cloud(call, local_reserve(decision))
            except CloudError as exc:
                if decision.fallback != "local":
                    raise Unavailable(
                        f"model '{call.name}': the cloud failed: {exc.message}"
                    ) from None
                call.note("fallback", f"cloud failed ({exc.message}): ran locally")
                return await self._local(call)
        return await self._hedge(call)

    async def _local(self, call: Call) -> tuple[str, Tensors]:
        load = self._load()
        waking = self.manager.wake_cost(call.name) > 0
        started = time.perf_counter()
        call.ran["local"] = None
        _, served, out = await self.manager.infer(
            call.name, call.version, call.inputs, call.parameters
        )
        seconds = time.perf_counter() - started
        call.ran["local"] = seconds
        if not waking:  # a load is not the model's latency
            self.estimates.observe(call.name, "local", seconds, load, call.payload)
        output = call.config.confidence_output if call.config is not None else None
        scores = out.get(output) if output is not None else None
        if scores is not None and scores.size and scores.dtype.kind in "iuf":
            best = scores.max(axis=-1) if scores.ndim > 1 else scores
            # the call's mean best score: a new version's drift shows in its distribution
            self.metrics.confidence(call.name, served, float(best.mean(dtype=np.float64)))
        return str(served), out

    async def _cloud(self, call: Call, reserve: float) -> tuple[str, Tensors]:
        """Call the cloud within the deadline (less ``reserve``, kept for a local fallback):
        the call's tiers in order, the next one when a tier fails (its fault, not the
        request's) while time is left."""
        if call.private or call.ctx.private:  # the last gate before the network
            raise CloudError("a private input never leaves the device", endpoint_fault=False)
        if call.config is not None:
            call.config.check_inputs(call.inputs)  # bad input never travels (InvalidRequest)
        if not call.tiers:
            raise CloudError("no cloud tier can take it now", endpoint_fault=False)
        for k, (tier, why, expected) in enumerate(call.tiers):
            later = call.tiers[k + 1 :]
            if len(self.clouds) > 1:
                call.record["tier"] = tier.name
                call.record["reason"] += f"; tier {tier.name} ({why})"
            keep = reserve
            if later:  # a silent tier (an interrupted spot instance) leaves the next its time
                left = call.ctx.deadline - time.monotonic()
                keep = left - tiers.budget(left, reserve, expected, later[0][2])
            try:
                return await self._on_tier(call, tier, keep)
            except CloudError as exc:
                if not later or not exc.tier_fault or time.monotonic() >= call.ctx.deadline:
                    raise
                call.record["reason"] += f"; tier {tier.name} failed ({exc.message})"
        raise AssertionError("unreachable: the last tier raises or returns")

    async def _on_tier(
        self, call: Call, tier: CloudEndpoint, reserve: float
    ) -> tuple[str, Tensors]:
        """One tier; with no fallback, retry what may succeed later while time is left. Each
        try draws its A/B arm afresh: a retry after a failing arm's circuit opened goes to
        the other arm."""
        wanted = [o.name for o in call.config.outputs] if call.config else []
        deadline = call.ctx.deadline
        attempt = 0
        said = ""
        while True:
            arm, target, why = tier.arm(call.name)
            call.record["cloud_model"] = target
            say = f"; A/B: {why}" if why else f"; A/B: arm b ({target})" if arm == "b" else ""
            if say != said:  # once, not once a retry
                call.record["reason"] += say
                said = say
            rtt = tier.link.rtt
            started = time.perf_counter()
            budget = deadline - time.monotonic() - reserve
            call.ran["cloud"] = None
            egress = self._egress(call)
            try:
                out = await tier.infer(
                    call.name,
                    call.inputs,
                    wanted,
                    budget,
                    call.ctx.request_id,
                    call.payload,
                    target,
                    call.config.confidence_output if call.config is not None else None,
                    egress,
                )
            except CloudError as exc:
                if "seq" in egress:  # it was sent: the answer's trace points to its entry
                    call.record.setdefault("egress", []).append(egress["seq"])
                seconds = time.perf_counter() - started
                self.metrics.cloud_call(call.name, target, seconds, False, tier.name, 0.0)
                attempt += 1
                pause = tier.backoff(attempt)
                if (
                    reserve > 0
                    or not exc.retryable
                    or attempt > tier.config.max_retries
                    or time.monotonic() + pause >= deadline
                ):
                    raise
                await asyncio.sleep(pause)
                continue
            seconds = time.perf_counter() - started
            if "seq" in egress:
                call.record.setdefault("egress", []).append(egress["seq"])
            call.ran["cloud"] = seconds
            cost = tier.cost(call.name)
            self.metrics.cloud_call(call.name, target, seconds, True, tier.name, cost)
            self.estimates.observe(call.name, self._key(tier), seconds, None, call.payload, rtt)
            return CLOUD_VERSION, out

    def _egress(self, call: Call) -> dict[str, Any]:
        """What the egress ledger records of a call about to leave, beside what the cloud
        tier adds: who asked, the route and its reason, and each input's privacy (``public``,
        or ``released``: a default-private model's input the request let go)."""
        label = "released" if self.privacy.why(call.name) else "public"
        route, reason = call.record.get("route"), call.record.get("reason")
        if call.leaving is not None:
            route, reason = call.leaving[0], f"{reason}; {call.leaving[1]}"
        return {
            "uid": call.ctx.uid,
            "route": route,
            "reason": reason,
            "labels": dict.fromkeys(call.inputs, label),
        }

    async def _escalate(self, call: Call, served: str, outputs: Tensors) -> tuple[str, Tensors]:
        """Ask the cloud again when the local answer is not sure enough (hard examples)."""
        assert call.config is not None
        threshold = call.config.parameters.get("escalate_below")
        if threshold is None:
            return served, outputs
        output = call.config.confidence_output or call.config.outputs[0].name
        if output not in outputs:
            return served, outputs
        sure = confidence(outputs[output])
        if sure >= float(threshold):
            return served, outputs
        call.leaving = ("escalated", f"confidence {sure:.3f} < {threshold}")
        try:
            result = await self._cloud(call, reserve=0.0)
        except CloudError as exc:
            call.record["reason"] += (
                f"; confidence {sure:.3f} < {threshold}, the cloud failed: {exc.message}"
            )
            return served, outputs
        call.note("escalated", f"confidence {sure:.3f} < {threshold}: the cloud answered")
        return result

    async def _hedge(self, call: Call) -> tuple[str, Tensors]:
        """Both at once; the first good answer wins, the other is cancelled."""
        tasks = {
            asyncio.ensure_future(self._local(call)): "local",
            asyncio.ensure_future(self._cloud(call, reserve=0.0)): "cloud",
        }
        errors: list[str] = []
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception()
                    if exc is None:
                        call.record["reason"] += f"; {tasks[task]} answered first"
                        return task.result()
                    errors.append(f"{tasks[task]}: {getattr(exc, 'message', exc)}")
            raise Unavailable(f"both tiers failed: {'; '.join(errors)}")
        finally:
            for task in pending:
                task.cancel()


@dataclass
class Call:
    """One model call on its way: what it runs and the record of its decision."""

    name: str
    version: int | None
    inputs: Tensors
    parameters: Mapping[str, Any]
    config: ModelConfig | None
    ctx: RouteContext
    private: bool
    payload: int
    record: dict[str, Any]
    ran: dict[str, float | None] = field(default_factory=dict)  # tier: seconds (None: failed)
    tiers: list[TierChoice] = field(default_factory=list)  # the cloud tiers to try, in order
    flexible: bool = False  # the request can wait: the cheapest tier first
    leaving: tuple[str, str] | None = None  # a step that sends it beside the decision: why

    def note(self, route: str, what: str) -> None:
        """The route changed on the way (fallback, escalated): say so, and why."""
        self.record["route"] = route
        self.record["reason"] += f"; {what}"
        logs.set_fields(route=route, reason=self.record["reason"])  # until Router.infer resets


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
