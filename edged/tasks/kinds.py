"""The task types a graph node may have: what each takes, what it gives, how it runs.

Each runs through the same data plane as the default models' calls (/v1/ocr, /v1/intent...), so
each node is routed by the path decision on its own: the router sees the node's privacy,
priority, deadline and route override as request parameters.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edged.common.errors import InvalidRequest, Unavailable
from edged.dataplane import default_models
from edged.dataplane.plane import DataPlane
from edged.knowledge.service import KnowledgeService
from edged.tasks.nodes import Node

# question, passages -> (answer, route, reason): the daemon's answer model (knowledge.answer_model)
Answer = Callable[[str, list[str]], Awaitable[tuple[str, str, str]]]
LOCAL_RULES = {"route": "local", "reason": "rules on the device (no model)"}


@dataclass
class Context:
    """What a node runs with: the data plane, the knowledge store, the answer model, its
    routing parameters."""

    plane: DataPlane
    knowledge: KnowledgeService | None
    answer: Answer | None
    params: dict[str, Any]  # private, route, priority, timeout (microseconds)

    def kb(self) -> KnowledgeService:
        self.plane.check_ready()  # not while edged stops
        if self.knowledge is None:
            raise Unavailable("this edged has no knowledge store")
        return self.knowledge


Outputs = dict[str, Any]
Run = Callable[[Context, "Node", dict[str, Any]], Awaitable[tuple[Outputs, dict[str, Any]]]]


@dataclass(frozen=True)
class Kind:
    """A task type: required and optional inputs, outputs, parameters it accepts, its runner."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    run: Run
    optional: tuple[str, ...] = ()
    params: Mapping[str, Callable[[Any], bool]] = field(default_factory=dict)  # name -> is valid
    models: tuple[str, ...] = ()  # the models it calls (for the estimate); "answer": the answerer

    def check(self, node: Node) -> None:
        missing = [i for i in self.inputs if i not in node.inputs]
        if missing:
            raise InvalidRequest(
                f"node '{node.id}' ({node.task}) needs input(s) {', '.join(missing)}"
            )
        extra = set(node.inputs) - set(self.inputs) - set(self.optional)
        if extra:
            raise InvalidRequest(
                f"node '{node.id}' ({node.task}) takes no input(s) {', '.join(sorted(extra))};"
                f" it takes {', '.join(self.inputs + self.optional)}"
            )
        unknown = set(node.params) - set(self.params)
        if unknown:
            raise InvalidRequest(
                f"node '{node.id}' ({node.task}) has unknown params {', '.join(sorted(unknown))}"
                + (f"; it takes {', '.join(self.params)}" if self.params else "")
            )
        for name, value in node.params.items():
            if not self.params[name](value):
                raise InvalidRequest(f"node '{node.id}': param '{name}' {PARAM_RULES[name]}")


def _bytes(node: Node, name: str, value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise InvalidRequest(
            f"node '{node.id}' input '{name}' must be bytes: send it as {{\"base64\": ...}}"
        )
    return value


def _text(node: Node, name: str, value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = "\n".join(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"node '{node.id}' input '{name}' must be non-empty text")
    return value


def _route(reply: Mapping[str, Any]) -> dict[str, Any]:
    """Where a node ran and why; ``private`` when its call became private on the way (the
    runner marks the node's outputs private then)."""
    keys = ("route", "reason", "predicted_ms", "actual_ms", "private")
    return {k: reply[k] for k in keys if k in reply}


async def _ocr(ctx: Context, node: Node, values: dict[str, Any]) -> tuple[Outputs, dict[str, Any]]:
    image = _bytes(node, "image", values["image"])
    reply = await default_models.ocr(ctx.plane, image, ctx.params)
    lines = reply["lines"]
    return {"lines": lines, "text": "\n".join(line["text"] for line in lines)}, _route(reply)


async def _vad(ctx: Context, node: Node, values: dict[str, Any]) -> tuple[Outputs, dict[str, Any]]:
    audio = _bytes(node, "audio", values["audio"])
    reply = await default_models.vad(ctx.plane, audio, ctx.params)
    segments = reply["segments"]
    return {"segments": segments, "speech": bool(segments)}, _route(reply)


async def _transcribe(
    ctx: Context, node: Node, values: dict[str, Any]
) -> tuple[Outputs, dict[str, Any]]:
    audio = _bytes(node, "audio", values["audio"])
    reply = await default_models.transcribe(ctx.plane, audio, ctx.params)
    return {"text": reply["text"]}, _route(reply)


async def _intent(
    ctx: Context, node: Node, values: dict[str, Any]
) -> tuple[Outputs, dict[str, Any]]:
    if values["text"] == "":  # a transcript that matched no phrase: nothing to classify
        return {"intent": None, "score": 0.0}, {"route": "local", "reason": "no text: no intent"}
    text = _text(node, "text", values["text"])
    reply = await default_models.intent(ctx.plane, {"texts": [text]}, ctx.params)
    (first,) = reply["intents"]
    return {"intent": first["intent"], "score": first["score"]}, _route(reply)


async def _embed(
    ctx: Context, node: Node, values: dict[str, Any]
) -> tuple[Outputs, dict[str, Any]]:
    text = _text(node, "text", values["text"])
    reply = await default_models.embed(ctx.plane, {"texts": [text]}, ctx.params)
    return {"embedding": reply["embeddings"][0]}, _route(reply)


# Field extraction on the device: amounts, dates, e-mail addresses and "key: value" lines.
AMOUNT = re.compile(r"(?:[$€£]\s?\d[\d,]*(?:\.\d{2})?|\b\d[\d,]*\.\d{2}\b)")
DATE = re.compile(
    r"\b(?:\d{4}-\d{2}-\d{2}|\d{1,2}[/.]\d{1,2}[/.]\d{2,4}|"
    r"\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{4})\b"
)
EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b")
TOTAL = re.compile(r"\b(?:total|amount due|balance due)\b")  # not "subtotal"
KEY_VALUE = re.compile(r"^\s*([A-Za-z][A-Za-z /]{1,30}?)\s*[:=]\s*(.+?)\s*$")


def extract_fields(text: str) -> dict[str, Any]:
    """What a document's text states plainly: amounts, dates, e-mails, labelled values, and
    the total (a labelled value whose key says total, else the largest amount)."""
    labelled = {}
    for line in text.splitlines():
        found = KEY_VALUE.match(line)
        if found:
            labelled[found.group(1).strip().lower()] = found.group(2)
    amounts = AMOUNT.findall(text)
    total = next((v for k, v in labelled.items() if TOTAL.search(k)), None)
    if total is None and amounts:
        total = max(amounts, key=lambda a: float(re.sub(r"[^\d.]", "", a) or 0))
    return {
        "total": total,
        "amounts": amounts,
        "dates": DATE.findall(text),
        "emails": EMAIL.findall(text),
        "labelled": labelled,
    }


async def _extract(
    ctx: Context, node: Node, values: dict[str, Any]
) -> tuple[Outputs, dict[str, Any]]:
    return {"fields": extract_fields(_text(node, "text", values["text"]))}, dict(LOCAL_RULES)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _is_k(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100


# Node params, checked when the graph is read: what each must be.
PARAM_RULES = {
    "namespace": "must be a namespace's name",
    "k": "must be an integer, 1 to 100",
    "question": "must be non-empty text",
}


async def _search(
    ctx: Context, node: Node, values: dict[str, Any]
) -> tuple[Outputs, dict[str, Any]]:
    query = _text(node, "query", values["query"])
    namespace = node.params.get("namespace", "default")
    reply = await ctx.kb().search(namespace, query, node.params.get("k", 5))
    hits = reply["hits"]
    outputs = {"hits": hits, "context": [h["text"] for h in hits]}
    route: dict[str, Any] = {"route": "local", "reason": "the knowledge store is on the device"}
    if _any_private(hits):
        route["private"] = True
    return outputs, route


def _any_private(hits: list[dict[str, Any]]) -> bool:
    """Is one of the passages found one that was ingested private?"""
    return any(h.get("metadata", {}).get("private") is True for h in hits)


async def _ask(ctx: Context, node: Node, values: dict[str, Any]) -> tuple[Outputs, dict[str, Any]]:
    question = _text(node, "question", values["question"])
    namespace = node.params.get("namespace", "default")
    reply = await ctx.kb().ask(namespace, question, private=bool(ctx.params.get("private")))
    outputs = {k: reply[k] for k in ("answer", "sources", "answered_by")}
    route = _route(reply)
    if _any_private(reply["passages"]):  # the answer may be a private passage's text
        route["private"] = True
    return outputs, route


async def _answer_with(
    ctx: Context, node: Node, question: str, context: list[str]
) -> tuple[str, dict[str, Any]]:
    if ctx.answer is None:
        raise Unavailable("it needs an answer model: none is set (knowledge.answer_model)")
    answer, route, reason = await ctx.answer(question, context)
    return answer, {"route": route, "reason": reason}


async def _answer(
    ctx: Context, node: Node, values: dict[str, Any]
) -> tuple[Outputs, dict[str, Any]]:
    question = _text(node, "question", values["question"])
    context = values.get("context", [])
    passages = [context] if isinstance(context, str) else context
    if not isinstance(passages, list) or not all(isinstance(p, str) for p in passages):
        raise InvalidRequest(f"node '{node.id}' input 'context' must be text or a list of texts")
    answer, route = await _answer_with(ctx, node, question, passages)
    return {"answer": answer}, route


async def _report(
    ctx: Context, node: Node, values: dict[str, Any]
) -> tuple[Outputs, dict[str, Any]]:
    text = _text(node, "text", values["text"])
    fields = values.get("fields") or {}
    if not isinstance(fields, dict):  # an extract node's fields, not a request's raw input
        raise InvalidRequest(f"node '{node.id}' input 'fields' must be an extract node's fields")
    question = node.params.get("question", "What is this document about, and what does it ask?")
    context = [line for line in text.splitlines() if line.strip()]
    context += [f"{k}: {v}" for k, v in fields.get("labelled", {}).items()]
    summary, route = await _answer_with(ctx, node, question, context)
    return {"report": {"summary": summary, "fields": fields, "lines": len(context)}}, route


KINDS: dict[str, Kind] = {
    "ocr": Kind(("image",), ("lines", "text"), _ocr, models=(default_models.OCR_MODEL,)),
    "vad": Kind(("audio",), ("segments", "speech"), _vad, models=(default_models.VAD_MODEL,)),
    "intent": Kind(("text",), ("intent", "score"), _intent, models=(default_models.INTENT_MODEL,)),
    "transcribe": Kind(
        ("audio",), ("text",), _transcribe, models=(default_models.TRANSCRIBE_MODEL,)
    ),
    "embed": Kind(("text",), ("embedding",), _embed, models=(default_models.EMBED_MODEL,)),
    "extract": Kind(("text",), ("fields",), _extract),
    "search": Kind(
        ("query",), ("hits", "context"), _search, params={"namespace": _is_text, "k": _is_k}
    ),
    "ask": Kind(
        ("question",),
        ("answer", "sources", "answered_by"),
        _ask,
        params={"namespace": _is_text},
    ),
    "answer": Kind(("question",), ("answer",), _answer, optional=("context",), models=("answer",)),
    "report": Kind(
        ("text",),
        ("report",),
        _report,
        optional=("fields",),
        params={"question": _is_text},
        models=("answer",),
    ),
}
