"""Running a task: the request read into a graph and its inputs (a template by name, free text
mapped to a template by the intent model, or an explicit graph), privacy labels carried from
inputs to outputs, nodes started as their inputs are ready (independent ones concurrently),
each routed on its own; the deadline cancels what is unfinished.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edged.common.errors import DeadlineExceeded, EdgedError, InvalidRequest
from edged.config import TasksConfig
from edged.dataplane import default_models
from edged.dataplane.plane import DataPlane
from edged.knowledge.service import KnowledgeService
from edged.routing.router import Router
from edged.tasks.graph import parse_graph
from edged.tasks.kinds import KINDS, Answer, Context
from edged.tasks.nodes import Graph, Node
from edged.tasks.templates import Template, load_templates

log = logging.getLogger(__name__)
# Where progress goes while a task runs (a JSON-lines stream): one event per node started and
# finished.
Progress = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Plan:
    """What a request asks for, read and checked, before anything runs."""

    task: str  # the template's name, or "graph"
    graph: Graph
    values: dict[str, Any]  # the request's inputs: text or bytes
    private: set[str]  # the request inputs that may not leave the device
    deadline_s: float
    intent: dict[str, Any] | None = None  # how free text was read
    strict: bool = False  # the whole request is private: no node releases what it derives
    # the inputs the caller labelled private itself (an input's "private": true, the request's
    # "private" list, or the whole request): no node releases what derives from them
    explicit: set[str] = field(default_factory=set)

    # nodes whose outputs are private by what they are or did, whatever their inputs: a private
    # model, a private namespace (known when planned), a private passage found (when run)
    derived: set[str] = field(default_factory=set)

    def labels(self) -> dict[str, bool]:
        """Per node: does it run private (a private input reaches it)? Outputs carry their
        inputs' labels, and the node's own (``derived``), unless the node releases them (and
        the request is not private as a whole)."""
        private_out: dict[str, bool] = {}
        sealed_out: dict[str, bool] = {}  # derived from an input the caller labelled private
        runs_private: dict[str, bool] = {}
        for node in self.graph.nodes.values():
            sealed = any(
                ref.name in self.explicit if ref.node is None else sealed_out[ref.node]
                for ref in node.inputs.values()
            )
            touched = (
                node.private
                or sealed
                or any(
                    ref.name in self.private if ref.node is None else private_out[ref.node]
                    for ref in node.inputs.values()
                )
            )
            runs_private[node.id] = touched
            sealed_out[node.id] = sealed  # the caller's label wins over a node's release
            private_out[node.id] = sealed or (
                (touched or node.id in self.derived) and (self.strict or not node.releases)
            )
        return runs_private


@dataclass
class Outcome:
    node: str
    status: str  # ok, failed, skipped, cancelled
    outputs: dict[str, Any] = field(default_factory=dict)
    route: dict[str, Any] = field(default_factory=dict)
    started_ms: float | None = None
    ended_ms: float | None = None
    error: str | None = None
    error_status: int = 500

    def as_dict(self, node: Node, private: bool) -> dict[str, Any]:
        row: dict[str, Any] = {"id": self.node, "task": node.task, "status": self.status}
        row.update(self.route)
        row["private"] = private
        row["optional"] = node.optional
        if self.started_ms is not None:
            row["started_ms"] = self.started_ms
        if self.ended_ms is not None:
            row["ended_ms"] = self.ended_ms
        if self.error is not None:
            row["error"] = self.error
        return row


def decode_inputs(doc: Any) -> tuple[dict[str, Any], set[str], set[str]]:
    """The request's inputs: a string, a list of strings, or {"base64": ...} for bytes; either
    as {"text"|"base64": ..., "private": true} to label it private, or ``false`` to release it
    (a template's private input). (values, private names, released names)."""
    if not isinstance(doc, Mapping):
        raise InvalidRequest("'inputs' must be an object")
    values: dict[str, Any] = {}
    private: set[str] = set()
    released: set[str] = set()
    for name, value in doc.items():
        if isinstance(value, Mapping):
            unknown = set(value) - {"text", "base64", "private"}
            if unknown or ("text" in value) == ("base64" in value):
                raise InvalidRequest(
                    f"input '{name}': an object must have 'text' or 'base64' (and 'private')"
                )
            label = value.get("private")
            if label is not None and not isinstance(label, bool):
                raise InvalidRequest(f"input '{name}': 'private' must be true or false")
            if label is not None:
                (private if label else released).add(name)
            if "base64" in value:
                try:
                    values[name] = base64.b64decode(value["base64"], validate=True)
                except (binascii.Error, TypeError, ValueError):
                    raise InvalidRequest(f"input '{name}': 'base64' is not base64") from None
                continue
            value = value["text"]
        if isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            values[name] = value
        else:
            raise InvalidRequest(
                f"input '{name}' must be text, a list of texts, or {{\"base64\": ...}}"
            )
    return values, private, released


REQUEST_KEYS = {"template", "text", "graph", "inputs", "private", "deadline_ms", "run"}
# Free text: the template inputs it fills when the request does not give them.
FREE_TEXT_INPUTS = ("text", "question", "query")


class TaskRunner:
    """POST /v1/tasks: ``plan`` (read and check), ``explain`` (the decomposition), ``execute``."""

    def __init__(
        self,
        plane: DataPlane,
        router: Router,
        config: TasksConfig,
        knowledge: KnowledgeService | None = None,
        answer: Answer | None = None,
        answer_model: str | None = None,
        private_namespaces: Iterable[str] = (),
    ) -> None:
        """``plane`` runs each node's model; ``router`` says where a node would run (and what
        is private); ``knowledge`` serves the search and ask nodes."""
        self.plane = plane
        self.router = router
        self.knowledge = knowledge
        self.config = config
        self.answer = answer  # question, passages -> answer (knowledge.answer_model)
        self.answer_model = answer_model
        self.private_namespaces = set(private_namespaces)
        self.templates: dict[str, Template] = load_templates(config.templates)

    def catalog(self) -> list[dict[str, Any]]:
        """GET /v1/tasks: the templates and the task types."""
        return [
            {
                "template": t.name,
                "description": t.description,
                "inputs": sorted(t.graph.inputs),
                "private_inputs": sorted(t.private),
                "nodes": [{"id": n.id, "task": n.task} for n in t.graph.nodes.values()],
            }
            for t in self.templates.values()
        ]

    async def plan(self, doc: Any, params: Mapping[str, Any]) -> Plan:
        """Read a request into a plan, checked whole (InvalidRequest naming the problem)."""
        if not isinstance(doc, Mapping):
            raise InvalidRequest("the body must be a JSON object")
        unknown = set(doc) - REQUEST_KEYS
        if unknown:
            raise InvalidRequest(f"unknown keys: {', '.join(sorted(unknown))}")
        ways = [k for k in ("template", "text", "graph") if k in doc]
        if len(ways) != 1:
            raise InvalidRequest("give one of 'template' (a name), 'text' or 'graph'")
        values, explicit, released = decode_inputs(doc.get("inputs", {}))
        private = set(explicit)
        copies: set[str] = set()  # inputs filled with the free text
        intent = None
        if "graph" in doc:
            task, graph = "graph", parse_graph(doc["graph"])
        else:
            name = doc.get("template")
            if "text" in doc:
                name, intent = await self._read(doc["text"], params)
                for key in FREE_TEXT_INPUTS:  # what was written is what the template works on
                    if key not in values:
                        values[key] = doc["text"]
                        copies.add(key)
            template = self.templates.get(name) if isinstance(name, str) else None
            if template is None:
                raise InvalidRequest(
                    f"no template '{name}'; templates: {', '.join(sorted(self.templates))}"
                )
            task, graph = template.name, template.graph
            private |= template.private - released
        marked = doc.get("private", [])
        if not isinstance(marked, list) or not all(isinstance(m, str) for m in marked):
            raise InvalidRequest("'private' must be a list of input names")
        explicit |= set(marked)
        private |= explicit
        if private & copies:  # one text, one label for all its copies
            private |= copies
        if explicit & copies:
            explicit |= copies
        strict = params.get("private") is True  # the whole request is private
        if strict:
            private |= set(values)
            explicit |= set(values)
        missing = sorted(graph.inputs - set(values))
        if missing:
            raise InvalidRequest(f"the task '{task}' needs input(s): {', '.join(missing)}")
        deadline_ms = doc.get("deadline_ms", self.config.deadline_ms)
        if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int) or deadline_ms < 1:
            raise InvalidRequest("'deadline_ms' must be a positive integer")
        plan = Plan(task, graph, values, private, deadline_ms / 1000, intent, strict, explicit)
        plan.derived = {n.id for n in graph.nodes.values() if self._private_node(n)}
        return plan

    def _private_node(self, node: Node) -> bool:
        """Are a node's outputs private by what it runs: a private model (or one with private
        steps), or the knowledge store's private namespace?"""
        privacy = self.router.privacy
        models = [m for m in KINDS[node.task].models if m != "answer"]
        # released: a default-private model's inputs are labelled by the graph (the template)
        if any(privacy.why(m, released=True) for m in models):
            return True
        namespace = node.params.get("namespace")
        return node.task in ("search", "ask") and namespace in self.private_namespaces

    async def _read(self, text: Any, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """Free text -> a template, by the intent model on the device."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest("'text' must be a non-empty string")
        # what the user wrote is read on the device: private, whatever the request says
        reply = await default_models.intent(
            self.plane, {"texts": [text]}, {**params, "private": True}
        )
        label, score = reply["intents"][0]["intent"], reply["intents"][0]["score"]
        intent = {"label": label, "score": score, "route": reply.get("route")}
        template = self.config.intents.get(label)
        if template is None or score < self.config.min_intent_score:
            raise InvalidRequest(
                f"the request reads as '{label}' (score {score:.2f}), which no template"
                f" handles; templates: {', '.join(sorted(self.templates))}"
            )
        intent["template"] = template
        return template, intent

    def explain(self, plan: Plan) -> dict[str, Any]:
        """The decomposition: nodes, dependencies, the order they start in, privacy, and what
        each needs (its models, where they can run now, their measured latency)."""
        private = plan.labels()
        nodes = []
        for node in plan.graph.nodes.values():
            models = [self._estimate(m) for m in KINDS[node.task].models]
            nodes.append(
                {
                    "id": node.id,
                    "task": node.task,
                    "after": sorted(node.after),
                    "inputs": {k: str(v) for k, v in node.inputs.items()},
                    "private": private[node.id],
                    "releases": node.releases,
                    "optional": node.optional,
                    "priority": node.priority,
                    "deadline_ms": round(plan.deadline_s * node.deadline_share * 1000),
                    "route": node.route,
                    "estimate": models,
                }
            )
        return {
            "task": plan.task,
            "intent": plan.intent,
            "order": plan.graph.order(),
            "private_inputs": sorted(plan.private & set(plan.values)),
            "deadline_ms": round(plan.deadline_s * 1000),
            "nodes": nodes,
        }

    def _estimate(self, model: str) -> dict[str, Any]:
        """Where a node's model can run now and how fast it has been (the router's view)."""
        if model == "answer":
            if self.answer_model is None:
                return {"model": None, "why_not": "no answer model (knowledge.answer_model)"}
            model = self.answer_model
        return self.router.tiers(model)[0]

    async def execute(
        self, plan: Plan, params: Mapping[str, Any], progress: Progress | None = None
    ) -> dict[str, Any]:
        """Run a plan; ``progress`` hears of each node as it starts and finishes."""
        started = time.monotonic()
        deadline = started + plan.deadline_s
        private = plan.labels()  # again as nodes finish: one may find private data
        nodes = plan.graph.nodes
        results: dict[str, Outcome] = {}
        running: dict[asyncio.Task[Outcome], str] = {}
        pending = plan.graph.order()

        def ms() -> float:
            return round((time.monotonic() - started) * 1000, 3)

        async def run_node(node: Node) -> Outcome:
            outcome = Outcome(node.id, "ok", started_ms=ms())
            private.update(plan.labels())
            if progress is not None:
                started_at = {"at_ms": outcome.started_ms, "private": private[node.id]}
                await progress(
                    {"event": "started", "node": node.id, "task": node.task, **started_at}
                )
            values = {
                name: plan.values[ref.name]
                if ref.node is None
                else results[ref.node].outputs[ref.name]
                for name, ref in node.inputs.items()
            }
            node_deadline = min(deadline, started + plan.deadline_s * node.deadline_share)
            node_params: dict[str, Any] = {
                "private": private[node.id],
                "timeout": max(1, int((node_deadline - time.monotonic()) * 1e6)),
            }
            if node.priority is not None:
                node_params["priority"] = node.priority
            if node.route != "auto":
                node_params["route"] = node.route
            elif params.get("route") in ("local", "cloud", "hedged"):
                node_params["route"] = params["route"]
            ctx = Context(self.plane, self.knowledge, self.answer, node_params)
            try:
                self.plane.take_parameters(node_params)  # this node's routing facts
                outcome.outputs, outcome.route = await asyncio.wait_for(
                    KINDS[node.task].run(ctx, node, values), node_deadline - time.monotonic()
                )
            except asyncio.TimeoutError:  # TimeoutError from 3.11; JetPack 6 has 3.10
                share = f"{node.deadline_share:.0%} of " if node.deadline_share < 1 else ""
                outcome.status = "failed"
                outcome.error = f"took more than its time ({share}{plan.deadline_s * 1000:.0f} ms)"
                outcome.error_status = DeadlineExceeded.status
            except EdgedError as exc:
                outcome.status, outcome.error, outcome.error_status = (
                    "failed",
                    exc.message,
                    exc.status,
                )
            except Exception as exc:  # a bug in a node: the task says so, edged keeps serving
                log.exception("task node %s (%s) failed", node.id, node.task)
                outcome.status, outcome.error = "failed", f"{type(exc).__name__}: {exc}"
            if outcome.route.pop("private", False):  # it reached private data on the way
                plan.derived.add(node.id)
            outcome.ended_ms = ms()
            if progress is not None:
                await progress({"event": "finished", **outcome.as_dict(node, private[node.id])})
            return outcome

        def start_ready() -> None:
            for node_id in list(pending):
                node = nodes[node_id]
                if not all(d in results for d in node.after):
                    continue
                pending.remove(node_id)
                broken = [d for d in sorted(node.after) if results[d].status != "ok"]
                if broken:
                    source = results[broken[0]]
                    why = f"its input from '{source.node}' is missing ({source.status}"
                    why += f": {source.error})" if source.error else ")"
                    results[node_id] = Outcome(
                        node_id, "skipped", error=why, error_status=source.error_status
                    )
                    if not node.optional:
                        stop("cancelled")
                        fail(node, why, source.error_status)
                    continue
                running[asyncio.create_task(run_node(node))] = node_id

        def stop(status: str) -> None:
            for task, node_id in running.items():
                task.cancel()
                results[node_id] = Outcome(node_id, status, started_ms=None, ended_ms=ms())
            for node_id in pending:
                results[node_id] = Outcome(node_id, status)
            running.clear()
            pending.clear()

        def fail(node: Node, why: str, status: int) -> None:
            error = EdgedError(f"task '{plan.task}': node '{node.id}' ({node.task}) {why}")
            error.status = status
            raise error

        try:
            while pending or running:
                before = len(results)
                start_ready()
                if not running:
                    if len(results) == before and pending:  # cannot happen in a checked graph
                        raise InvalidRequest(f"nodes never became ready: {', '.join(pending)}")
                    continue
                left = deadline - time.monotonic()
                done, _ = await asyncio.wait(
                    running, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    unfinished = sorted([*running.values(), *pending])
                    finished = sorted(n for n, o in results.items() if o.status == "ok")
                    stop("cancelled")
                    raise DeadlineExceeded(
                        f"task '{plan.task}' passed its deadline of"
                        f" {plan.deadline_s * 1000:.0f} ms: cancelled {', '.join(unfinished)}"
                        + (f" (finished: {', '.join(finished)})" if finished else "")
                    )
                for task in done:
                    outcome = task.result()
                    results[running.pop(task)] = outcome
                    node = nodes[outcome.node]
                    if outcome.status == "failed" and not node.optional:
                        stop("cancelled")
                        fail(node, f"failed: {outcome.error}", outcome.error_status)
        finally:  # the caller went away (or a node failed): nothing keeps running for nobody
            for task in running:
                task.cancel()
        return self._answer(plan, results, private, ms())

    def _answer(
        self, plan: Plan, results: dict[str, Outcome], private: dict[str, bool], total_ms: float
    ) -> dict[str, Any]:
        nodes = plan.graph.nodes
        taken = {d for n in nodes.values() for d in n.after}
        degraded = [
            f"node '{o.node}' {o.status}: {o.error}" for o in results.values() if o.status != "ok"
        ]
        return {
            "task": plan.task,
            **({"intent": plan.intent} if plan.intent else {}),
            "status": "degraded" if degraded else "ok",
            "degraded": degraded,
            # what the task gives: the outputs of the nodes no other node takes from
            "result": {
                n: results[n].outputs for n in nodes if n not in taken and results[n].status == "ok"
            },
            "outputs": {n: o.outputs for n, o in results.items() if o.status == "ok"},
            "nodes": [results[n].as_dict(nodes[n], private[n]) for n in plan.graph.order()],
            "total_ms": total_ms,
        }
