"""A task graph: nodes with a task type, inputs that name the request's inputs (``$name``) or
other nodes' outputs (``node.output``), and constraints. Parsed and checked whole before anything
runs: a cycle, an unknown task type, a dangling reference or a wrong output gets an
InvalidRequest that names the node and the problem.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edged.common.errors import InvalidRequest
from edged.tasks.kinds import KINDS
from edged.tasks.nodes import Graph, Node, Ref

MAX_NODES = 64
ROUTES = ("auto", "local", "cloud", "hedged")


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{what} must be a non-empty string")
    return value


def parse_ref(value: Any, where: str) -> Ref:
    """``$name`` (a request input) or ``node.output``."""
    text = _text(value, where)
    if text.startswith("$"):
        if len(text) == 1:
            raise InvalidRequest(f"{where}: '$' must be followed by the request input's name")
        return Ref(None, text[1:])
    node, dot, output = text.partition(".")
    if not dot or not node or not output:
        raise InvalidRequest(
            f"{where} is '{text}': use '$input' for a request input or 'node.output' for"
            " another node's output"
        )
    return Ref(node, output)


def parse_node(doc: Any, index: int) -> Node:
    if not isinstance(doc, Mapping):
        raise InvalidRequest(f"node {index} must be an object with 'id', 'task' and 'inputs'")
    unknown = set(doc) - {"id", "task", "inputs", "params", "constraints", "releases"}
    if unknown:
        raise InvalidRequest(f"node {index} has unknown keys: {', '.join(sorted(unknown))}")
    node_id = _text(doc.get("id"), f"node {index}'s 'id'")
    if "." in node_id or node_id.startswith("$"):
        raise InvalidRequest(f"node id '{node_id}' may not contain '.' or start with '$'")
    task = _text(doc.get("task"), f"node '{node_id}': 'task'")
    if task not in KINDS:
        raise InvalidRequest(
            f"node '{node_id}': unknown task type '{task}'; known: {', '.join(sorted(KINDS))}"
        )
    raw_inputs = doc.get("inputs", {})
    if not isinstance(raw_inputs, Mapping):
        raise InvalidRequest(f"node '{node_id}': 'inputs' must be an object")
    inputs = {str(k): parse_ref(v, f"node '{node_id}' input '{k}'") for k, v in raw_inputs.items()}
    params = doc.get("params", {})
    if not isinstance(params, Mapping):
        raise InvalidRequest(f"node '{node_id}': 'params' must be an object")
    node = Node(node_id, task, inputs, dict(params))
    releases = doc.get("releases", False)
    if not isinstance(releases, bool):
        raise InvalidRequest(f"node '{node_id}': 'releases' must be true or false")
    node.releases = releases
    _constraints(node, doc.get("constraints", {}))
    KINDS[task].check(node)
    return node


def _constraints(node: Node, doc: Any) -> None:
    where = f"node '{node.id}': constraint"
    if not isinstance(doc, Mapping):
        raise InvalidRequest(f"node '{node.id}': 'constraints' must be an object")
    unknown = set(doc) - {"optional", "private", "priority", "deadline_share", "route"}
    if unknown:
        raise InvalidRequest(f"{where}s unknown: {', '.join(sorted(unknown))}")
    for key in ("optional", "private"):
        value = doc.get(key, False)
        if not isinstance(value, bool):
            raise InvalidRequest(f"{where} '{key}' must be true or false")
        setattr(node, key, value)
    priority = doc.get("priority")
    if priority is not None and (
        not isinstance(priority, int) or isinstance(priority, bool) or priority < 1
    ):
        raise InvalidRequest(f"{where} 'priority' must be an integer >= 1")
    node.priority = priority
    share = doc.get("deadline_share", 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise InvalidRequest(f"{where} 'deadline_share' must be a number in (0, 1]")
    node.deadline_share = float(share)
    route = doc.get("route", "auto")
    if route not in ROUTES:
        raise InvalidRequest(f"{where} 'route' must be one of {', '.join(ROUTES)}")
    node.route = route


def parse_graph(doc: Any) -> Graph:
    """A graph from ``{"nodes": [...]}``, checked whole."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("nodes"), list):
        raise InvalidRequest("'graph' must be an object with 'nodes' (a list)")
    raw = doc["nodes"]
    if not raw:
        raise InvalidRequest("the graph has no nodes")
    if len(raw) > MAX_NODES:
        raise InvalidRequest(f"the graph has {len(raw)} nodes; at most {MAX_NODES}")
    nodes: dict[str, Node] = {}
    for index, item in enumerate(raw):
        node = parse_node(item, index)
        if node.id in nodes:
            raise InvalidRequest(f"two nodes have the id '{node.id}'")
        nodes[node.id] = node
    for node in nodes.values():
        for name, ref in node.inputs.items():
            if ref.node is None:
                continue
            source = nodes.get(ref.node)
            if source is None:
                raise InvalidRequest(
                    f"node '{node.id}' input '{name}' refers to '{ref}': there is no node"
                    f" '{ref.node}'"
                )
            outputs = KINDS[source.task].outputs
            if ref.name not in outputs:
                raise InvalidRequest(
                    f"node '{node.id}' input '{name}' refers to '{ref}': a {source.task} node"
                    f" has no output '{ref.name}' (its outputs: {', '.join(outputs)})"
                )
    ordered = _topological(nodes)
    inputs = {r.name for n in nodes.values() for r in n.inputs.values() if r.node is None}
    return Graph({i: nodes[i] for i in ordered}, inputs)


def _topological(nodes: dict[str, Node]) -> list[str]:
    """Kahn's order; a cycle is named by walking it."""
    waiting = {n.id: set(n.after) for n in nodes.values()}
    order: list[str] = []
    ready = [i for i, deps in waiting.items() if not deps]
    while ready:
        current = ready.pop(0)
        order.append(current)
        for other, deps in waiting.items():
            if current in deps:
                deps.discard(current)
                if not deps and other not in order and other not in ready:
                    ready.append(other)
    if len(order) == len(nodes):
        return order
    # every node left waits on another node left: follow the first dependency until it repeats
    left = {i: deps for i, deps in waiting.items() if i not in order}
    walk = [min(left)]
    while True:
        step = min(d for d in left[walk[-1]] if d in left)
        if step in walk:
            cycle = [*walk[walk.index(step) :], step]
            raise InvalidRequest(f"the graph has a cycle: {' -> '.join(reversed(cycle))}")
        walk.append(step)
