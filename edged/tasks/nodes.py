"""What a parsed task graph is made of: references, nodes and the graph (read by the parser in
``graph.py``, run by ``run.py``, checked per task type by ``kinds.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Ref:
    """Where a node input comes from: a request input (``node`` is None) or a node's output."""

    node: str | None
    name: str

    def __str__(self) -> str:
        return f"${self.name}" if self.node is None else f"{self.node}.{self.name}"


@dataclass
class Node:
    id: str
    task: str
    inputs: dict[str, Ref]
    params: dict[str, Any] = field(default_factory=dict)
    optional: bool = False  # its failure degrades the answer instead of failing it
    private: bool = False  # never leaves the device, whatever its inputs are
    releases: bool = False  # its outputs may leave the device even when its inputs may not
    priority: int | None = None  # the scheduler's priority (1: most urgent)
    deadline_share: float = 1.0  # of the task's time budget, from the task's start
    route: str = "auto"

    @property
    def after(self) -> set[str]:
        """The nodes whose outputs this one takes."""
        return {ref.node for ref in self.inputs.values() if ref.node is not None}


@dataclass
class Graph:
    nodes: dict[str, Node]  # in an order where every node comes after those it takes from
    inputs: set[str]  # the request inputs the graph names

    def order(self) -> list[str]:
        """The order to start nodes in: by dependency level, then priority, then as given."""
        level: dict[str, int] = {}
        for node in self.nodes.values():
            level[node.id] = 1 + max((level[n] for n in node.after), default=-1)
        ranked = sorted(
            enumerate(self.nodes.values()),
            key=lambda item: (level[item[1].id], item[1].priority or 99, item[0]),
        )
        return [node.id for _, node in ranked]
