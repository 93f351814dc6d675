"""The house rules (docs/ARCHITECTURE.md, "Layers"): every import points downward.

Read from the source with ``ast`` (every ``import``, at any depth, ``TYPE_CHECKING`` ones too),
so a rule broken anywhere fails here, naming the module, the line and the rule:

- edged's layers, bottom up: leaves, parts, core, the data plane, task graphs, the adapters
  (REST, gRPC), the composition root. A module imports its own layer or lower ones.
- edged's client-side tools (the client library, edgectl, ``top``) import only leaves, the
  client and the text splitter; nothing of the daemon imports them.
- edged never imports cloudsync.
- cloudsync's protocol imports nothing else of cloudsync; the fleet side never imports the
  device agent; cloudsync reaches into edged only through its public seams (the client, the
  shared helpers, the config loader, the log setup, the event log, atomic files, statistics,
  the load snapshot and the gauges made of it, what a model may be called).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

EDGED_LAYERS = [
    (
        "leaves",
        [
            "edged", "edged.errors", "edged.common", "edged.stats", "edged.atomic",
            "edged.protocol", "edged.models.config", "edged.routing", "edged.background",
            "edged.breaker", "edged.events", "edged.logs", "edged.request", "edged.egress",
            "edged.wire",
        ],
    ),
    (
        "parts",
        ["edged.config", "edged.device", "edged.link", "edged.runtimes", "edged.cloud",
         "edged.knowledge", "edged.systemd", "edged.gauges"],
    ),
    (
        "core",
        ["edged.scheduler", "edged.metrics", "edged.models", "edged.privacy", "edged.router",
         "edged.pipelines", "edged.admin"],
    ),
    ("data plane", ["edged.dataplane"]),
    ("task graphs", ["edged.tasks"]),
    ("adapters", ["edged.server"]),
    ("composition root", ["edged.app", "edged.cli", "edged.__main__"]),
]  # fmt: skip
TOOLS = ["edged.client", "edged.edgectl", "edged.top", "edged.top_live"]
TOOLS_MAY_IMPORT = ["edged.client", "edged.knowledge.text", "edged.egress"]
CLOUDSYNC_MAY_IMPORT = [
    "edged", "edged.client", "edged.common", "edged.config", "edged.logs", "edged.events",
    "edged.atomic", "edged.stats", "edged.errors", "edged.gauges", "edged.device.monitor",
    "edged.models.names", "edged.routing.abtest", "edged.egress",
]  # fmt: skip


def under(module: str, prefixes: list[str]) -> str | None:
    """The longest of ``prefixes`` that ``module`` is or is inside (``edged`` itself only as
    the package: its version)."""
    found = [p for p in prefixes if module == p or (p != "edged" and module.startswith(p + "."))]
    return max(found, key=len, default=None)


def layer(module: str) -> tuple[int, str] | None:
    best: tuple[int, int, str] | None = None
    for index, (name, prefixes) in enumerate(EDGED_LAYERS):
        prefix = under(module, prefixes)
        if prefix is not None and (best is None or len(prefix) > best[1]):
            best = (index, len(prefix), name)
    return None if best is None else (best[0], best[2])


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, module) for each module of ours that ``path`` imports (``from a import b`` is
    ``a.b`` when that is a module)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield node.lineno, full if full in known else node.module


def violations(root: Path) -> list[str]:
    files = sorted([*(root / "edged").rglob("*.py"), *(root / "cloudsync").rglob("*.py")])
    known = {module_of(f, root) for f in files}
    found = []
    for path in files:
        source = module_of(path, root)
        for line, target in imports(path, root, known):
            if not target.startswith(("edged", "cloudsync")) or target == source:
                continue
            why = rule(source, target)
            if why:
                found.append(f"{path.relative_to(root)}:{line}: {source} imports {target}: {why}")
    return found


def rule(source: str, target: str) -> str:
    """Why ``source`` may not import ``target`` ("" when it may)."""
    if source.startswith("edged"):
        if target.startswith("cloudsync"):
            return "edged never imports cloudsync"
        if under(source, TOOLS):
            if layer(target) == (0, "leaves") or under(target, TOOLS + TOOLS_MAY_IMPORT):
                return ""
            return "a client-side tool imports only leaves, the client and the text splitter"
        if under(target, TOOLS):
            return "the daemon does not import the client-side tools"
        mine, theirs = layer(source), layer(target)
        if mine is None or theirs is None:
            return f"{source if mine is None else target} has no layer (tests/unit/test_house.py)"
        if theirs[0] > mine[0]:
            return f"upward: {mine[1]} may not import {theirs[1]}"
        return ""
    if target.startswith("edged"):
        if under(target, CLOUDSYNC_MAY_IMPORT):
            return ""
        return "cloudsync reaches edged only through its public seams"
    if source.startswith("cloudsync.protocol") and not target.startswith("cloudsync.protocol"):
        return "the protocol imports nothing else of cloudsync"
    if source.startswith("cloudsync.fleet") and target.startswith("cloudsync.agent"):
        return "the fleet side never imports the device agent"
    if target == "cloudsync" or source == "cloudsync":
        return ""
    if source.startswith("cloudsync.agent") and target.startswith("cloudsync.fleet"):
        return "the device agent never imports the fleet side"
    return ""


def test_every_import_points_downward() -> None:
    found = violations(ROOT)
    assert not found, "\n".join(found)


def test_a_rule_broken_on_purpose_is_named(tmp_path: Path) -> None:
    """The same check over a copy of the tree in which the data plane imports the task graphs,
    the protocol imports the agent and edged imports cloudsync: each is found, with its line."""
    for package in ("edged", "cloudsync"):
        for path in (ROOT / package).rglob("*.py"):
            copy = tmp_path / path.relative_to(ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(path.read_text())
    broken = {
        "edged/dataplane/plane.py": "from edged.tasks.run import TaskRunner\n",
        "cloudsync/protocol/topics.py": "from cloudsync.agent.session import Agent\n",
        "edged/errors.py": "import cloudsync.protocol.envelope\n",
        "cloudsync/fleet/rollout.py": "from cloudsync.agent import outbox\n",
        "edged/top.py": "from edged.router import Router\n",
    }
    for name, line in broken.items():
        path = tmp_path / name
        path.write_text(path.read_text() + "\n" + line)
    found = violations(tmp_path)
    assert len(found) == len(broken), "\n".join(found)
    text = "\n".join(found)
    assert "edged.dataplane.plane imports edged.tasks.run: upward: data plane may not" in text
    assert "imports cloudsync.agent.session: the protocol imports nothing else" in text
    assert "edged.errors imports cloudsync.protocol.envelope: edged never imports" in text
    assert "cloudsync.agent.outbox: the fleet side never imports the device agent" in text
    assert "edged.top imports edged.router: a client-side tool imports only" in text
