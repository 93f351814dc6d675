"""Named task templates: a graph over named inputs, with which inputs are private by default.

The shipped ones are below; ``[tasks.templates.NAME]`` in the config adds or replaces one, in
the same shape (docs/API.md, "Task graphs").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edged.common.errors import ConfigError, InvalidRequest
from edged.tasks.graph import parse_graph
from edged.tasks.nodes import Graph

DEFAULTS: dict[str, dict[str, Any]] = {
    "image-report": {
        "description": "text read from an image on the device, its fields extracted on the"
        " device, a report on them by the answer model (in the cloud when there is one); the"
        " image never leaves the device, the text it holds may",
        "inputs": {"image": {"private": True}},
        "nodes": [
            {"id": "text", "task": "ocr", "inputs": {"image": "$image"}, "releases": True},
            {"id": "fields", "task": "extract", "inputs": {"text": "text.text"}},
            {
                "id": "report",
                "task": "report",
                "inputs": {"text": "text.text", "fields": "fields.fields"},
            },
        ],
    },
    "voice-command": {
        "description": "a spoken command from audio alone, on the device: where the speech is,"
        " its transcript against the device's command phrases (empty when it is none of them),"
        " then the command's intent",
        "inputs": {"audio": {"private": True}},
        "nodes": [
            {"id": "speech", "task": "vad", "inputs": {"audio": "$audio"}},
            {"id": "transcript", "task": "transcribe", "inputs": {"audio": "$audio"}},
            {"id": "command", "task": "intent", "inputs": {"text": "transcript.text"}},
        ],
    },
    "ask": {
        "description": "the knowledge store answers on the device when a passage is close"
        " enough, else the answer model with the passages (not when one is private)",
        "inputs": {"question": {}},
        "nodes": [{"id": "answer", "task": "ask", "inputs": {"question": "$question"}}],
    },
    "search": {
        "description": "the passages of the knowledge store closest to the query",
        "inputs": {"query": {}},
        "nodes": [{"id": "hits", "task": "search", "inputs": {"query": "$query"}}],
    },
}


@dataclass
class Template:
    name: str
    description: str
    graph: Graph
    private: set[str]  # inputs private unless the request says otherwise


def parse_template(name: str, doc: Any) -> Template:
    """A template from its TOML/JSON shape; InvalidRequest naming what is wrong."""
    if not isinstance(doc, Mapping):
        raise InvalidRequest(f"template '{name}' must be a table")
    unknown = set(doc) - {"description", "inputs", "nodes"}
    if unknown:
        raise InvalidRequest(f"template '{name}' has unknown keys: {', '.join(sorted(unknown))}")
    try:
        graph = parse_graph({"nodes": doc.get("nodes")})
    except InvalidRequest as exc:
        raise InvalidRequest(f"template '{name}': {exc.message}") from None
    declared = doc.get("inputs", {})
    if not isinstance(declared, Mapping) or not all(
        isinstance(v, Mapping) for v in declared.values()
    ):
        raise InvalidRequest(f"template '{name}': 'inputs' must map names to tables")
    undeclared = graph.inputs - set(declared)
    if undeclared:
        raise InvalidRequest(
            f"template '{name}' uses inputs it does not declare: {', '.join(sorted(undeclared))}"
        )
    private = {k for k, v in declared.items() if v.get("private") is True}
    return Template(name, str(doc.get("description", "")), graph, private)


def load_templates(configured: Mapping[str, Any]) -> dict[str, Template]:
    """The shipped templates with the config's laid over them; ConfigError on a bad one."""
    templates = {}
    for name, doc in {**DEFAULTS, **configured}.items():
        try:
            templates[name] = parse_template(name, doc)
        except InvalidRequest as exc:
            raise ConfigError(f"tasks.templates: {exc.message}") from None
    return templates
