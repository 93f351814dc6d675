"""The house rules (docs/ARCHITECTURE.md, "Layers"): every import points downward.

Read from the source with ``ast`` (every ``import``, at any depth, ``TYPE_CHECKING`` ones too,
and what the ``__init__`` of each package an import goes into loads: Python runs it), so a rule
broken anywhere fails here, naming the module, the line and the rule:

- edged's layers, bottom up: leaves, parts, core, the data plane, task graphs, the adapters
  (REST, gRPC), the composition root. A module imports its own layer or lower ones.
- edged's client-side tools (the client library, edgectl, ``top``) import only leaves, the
  client and the text splitter; nothing of the daemon imports them.
- edged never imports cloudsync; the shared leaf package, ``edged.common``, imports nothing
  else of edged.
- cloudsync's protocol imports nothing else of cloudsync; the fleet side never imports the
  device agent; cloudsync reaches into edged only through the client and the shared leaf
  package (``edged.common``: the config base, logs, the event log, atomic files, statistics,
  the egress ledger, the load snapshot and the gauges made of it, the A/B verdict, what a
  model may be called), nothing else of edged (issue 45).
- No cycle between modules, whatever their layers (a cycle inside a layer, or one hidden under
  ``TYPE_CHECKING`` or in a function, is a cycle all the same).
- ``TYPE_CHECKING`` imports of our modules only where listed below, with the reason: a part
  handed a whole object it imports only for its type is a hub in disguise.
- The fleet service's SQL only in its repositories (and the store).
- One word per idea: ``cli`` and ``config`` modules only in a program's package, no two
  packages of one name.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from tests import house_map

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

EDGED_LAYERS = [
    (
        "leaves",
        [
            "edged",
            "edged.common",
            "edged.oip",
            "edged.models.model_config",
            "edged.routing",
            "edged.background",
            "edged.breaker",
            "edged.served",
            "edged.request",
            "edged.wire",
        ],
    ),
    (
        "parts",
        [
            "edged.config",
            "edged.device",
            "edged.link",
            "edged.runtimes",
            "edged.cloud",
            "edged.knowledge",
            "edged.systemd",
        ],
    ),
    (
        "core",
        [
            "edged.scheduler",
            "edged.metrics",
            "edged.models",
            "edged.privacy",
            "edged.routing.router",
            "edged.pipelines",
            "edged.admin",
        ],
    ),
    ("data plane", ["edged.dataplane"]),
    ("task graphs", ["edged.tasks"]),
    ("adapters", ["edged.server"]),
    ("composition root", ["edged.app", "edged.cli", "edged.__main__"]),
]
TOOLS = ["edged.client", "edged.edgectl", "edged.top", "edged.top_live"]
TOOLS_MAY_IMPORT = ["edged.client", "edged.knowledge.text"]
CLOUDSYNC_MAY_IMPORT = ["edged", "edged.client", "edged.common"]


# (module, what it imports for types only): why it may
TYPE_CHECKING_ALLOWED = {
    ("edged.top_live", "edged.top"): "top (and rich) loaded only when `edgectl top` runs",
}
# the fleet service's adapters: handed what they use by its composition root (fleet.daemon)
FLEET_ADAPTERS = [
    "cloudsync.fleet.api",
    "cloudsync.fleet.routes",
    "cloudsync.fleet.console",
    "cloudsync.fleet.actions",
]
FLEET_CONSOLE = "cloudsync.fleet.console"
# the fleet service's modules that may hold SQL: the store and the repositories
FLEET_SQL = {
    "store",
    "registry",
    "deployments",
    "rollouts",
    "abtests",
    "enrolment",
    "audit",
    "commands",
    "sessions",
    "leases",
    "alerting",
    "observe",
    "exporter",
}
SQL = re.compile(r"\b(SELECT\s|INSERT\s+INTO\s|UPDATE\s+\w+\s+SET\s|DELETE\s+FROM\s)")
WRITE = re.compile(r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+([a-z_]+)\b")


class Import(NamedTuple):
    line: int
    target: str
    types_only: bool  # under ``if TYPE_CHECKING:``


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


def imports(path: Path, root: Path, known: set[str]) -> Iterator[Import]:
    """Each module of ours that ``path`` imports (``from a import b`` is ``a.b`` when that is a
    module), and whether it is under ``if TYPE_CHECKING:``."""

    def walk(node: ast.AST, types_only: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, types_only)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield Import(node.lineno, full if full in known else node.module, types_only)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                yield from walk(child, True)
            for child in node.orelse:
                yield from walk(child, types_only)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, types_only)

    yield from walk(ast.parse(path.read_text(), str(path)), False)


def packages_entered(source: str, target: str, known: set[str]) -> list[str]:
    """The packages whose ``__init__`` an import of ``target`` from ``source`` runs (those
    ``source`` is not inside already)."""
    parts = target.split(".")
    found = []
    for n in range(1, len(parts)):
        package = ".".join(parts[:n])
        if package in known and not (source == package or source.startswith(package + ".")):
            found.append(package)
    return found


@functools.cache  # read once per tree: every test of the real one asks for it
def graph(root: Path) -> dict[str, list[tuple[Path, Import]]]:
    """Module -> what it imports of ours (its path beside each, for the messages)."""
    files = sorted([*(root / "edged").rglob("*.py"), *(root / "cloudsync").rglob("*.py")])
    known = {module_of(f, root) for f in files}
    found: dict[str, list[tuple[Path, Import]]] = {module_of(f, root): [] for f in files}
    for path in files:
        source = module_of(path, root)
        for imp in imports(path, root, known):
            if imp.target.startswith(("edged", "cloudsync")) and imp.target != source:
                found[source].append((path, imp))
    return found


def violations(root: Path) -> list[str]:
    modules = graph(root)
    known = set(modules)
    found = []
    for source, edges in modules.items():
        for path, imp in edges:
            where = f"{path.relative_to(root)}:{imp.line}: {source} imports {imp.target}"
            why = rule(source, imp.target)
            if why:
                found.append(f"{where}: {why}")
            for package in packages_entered(source, imp.target, known):
                for _, loaded in modules[package]:
                    why = rule(source, loaded.target)
                    if why:
                        found.append(
                            f"{where}, whose package {package} loads {loaded.target}: {why}"
                        )
            if imp.types_only and (source, imp.target) not in TYPE_CHECKING_ALLOWED:
                why = "import it, or hand over only what is used (or list it here, with why)"
                found.append(f"{where} under TYPE_CHECKING: {why}")
    fleet = root / "cloudsync" / "fleet"
    for path in sorted(fleet.rglob("*.py")):
        if path.relative_to(fleet).with_suffix("").as_posix() not in FLEET_SQL:
            for number, text in enumerate(path.read_text().splitlines(), 1):
                if SQL.search(text):
                    found.append(
                        f"{path.relative_to(root)}:{number}: SQL outside the fleet"
                        " service's repositories"
                    )
    return found


def cycles(root: Path) -> list[str]:
    """Each set of modules that import one another, round (Tarjan's strongly connected
    components over every import, and the packages' ``__init__`` each import runs)."""
    modules = graph(root)
    known = set(modules)
    edges = {
        source: sorted(
            {
                t
                for _, imp in found
                for t in (imp.target, *packages_entered(source, imp.target, known))
                if t in known
            }
        )
        for source, found in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[str] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append("a cycle: " + ", ".join(sorted(component)))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(found)


def rule(source: str, target: str) -> str:
    """Why ``source`` may not import ``target`` ("" when it may)."""
    if source.startswith("edged"):
        if target.startswith("cloudsync"):
            return "edged never imports cloudsync"
        if under(source, ["edged.common"]) and not under(target, ["edged.common"]):
            return "the shared leaf package (edged.common) imports nothing else of edged"
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
        return "cloudsync reaches edged only through the client and edged.common"
    if source.startswith("cloudsync.protocol") and not target.startswith("cloudsync.protocol"):
        return "the protocol imports nothing else of cloudsync"
    if source.startswith("cloudsync.fleet") and target.startswith("cloudsync.agent"):
        return "the fleet side never imports the device agent"
    if under(source, FLEET_ADAPTERS) and target in (
        "cloudsync.fleet.service",
        "cloudsync.fleet.daemon",
    ):
        return "a fleet adapter is handed what it uses (fleet.daemon composes): not the service"
    if under(source, [FLEET_CONSOLE]) and under(
        target, ["cloudsync.fleet.api", "cloudsync.fleet.routes"]
    ):
        return "the console and the JSON API are two adapters over fleet.actions, apart"
    if (
        under(source, ["cloudsync.fleet.routes"])
        and under(target, ["cloudsync.fleet.routes", "cloudsync.fleet.api", FLEET_CONSOLE])
        and target != "cloudsync.fleet.routes.base"
    ):
        return "a route module is one resource's: of the adapters it uses the shared base only"
    if target == "cloudsync" or source == "cloudsync":
        return ""
    if source.startswith("cloudsync.agent") and target.startswith("cloudsync.fleet"):
        return "the device agent never imports the fleet side"
    return ""


def test_every_import_points_downward() -> None:
    found = violations(ROOT)
    assert not found, "\n".join(found)


def test_no_module_imports_itself_round_a_cycle() -> None:
    found = cycles(ROOT)
    assert not found, "\n".join(found)


def test_the_types_only_imports_are_the_listed_ones() -> None:
    """Counted, so that a new one is a decision (the agent's parts imported ``Agent`` for its
    type: a cycle of four files the layers did not see, issue 45)."""
    seen = {
        (source, imp.target)
        for source, edges in graph(ROOT).items()
        for _, imp in edges
        if imp.types_only
    }
    assert seen == set(TYPE_CHECKING_ALLOWED)


def copy_tree(to: Path) -> None:
    for package in ("edged", "cloudsync"):
        for path in (ROOT / package).rglob("*.py"):
            copy = to / path.relative_to(ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(path.read_text())


def test_a_rule_broken_on_purpose_is_named(tmp_path: Path) -> None:
    """The same check over a copy of the tree in which the data plane imports the task graphs,
    the protocol imports the agent and edged imports cloudsync: each is found, with its line."""
    copy_tree(tmp_path)
    broken = {
        "edged/dataplane/plane.py": "from edged.tasks.run import TaskRunner\n",
        "cloudsync/protocol/topics.py": "from cloudsync.agent.session import Agent\n",
        "edged/common/errors.py": "import cloudsync.protocol.envelope\n",
        "cloudsync/fleet/gates.py": "from cloudsync.agent import outbox\n",
        "edged/top.py": "from edged.routing.router import Router\n",
        "edged/common/stats.py": "from edged.config import Config\n",
        "cloudsync/fleet/routes/nodes.py": "from cloudsync.fleet.service import Service\n",
        "cloudsync/fleet/routes/audit.py": "from cloudsync.fleet.routes.rollouts import summary\n",
        "cloudsync/fleet/routes/enrolment.py": 'X = "DELETE FROM barred"\n',
    }
    for name, line in broken.items():
        path = tmp_path / name
        path.write_text(path.read_text() + "\n" + line)
    found = violations(tmp_path)
    assert len(found) == len(broken), "\n".join(found)
    text = "\n".join(found)
    assert "edged.dataplane.plane imports edged.tasks.run: upward: data plane may not" in text
    assert "imports cloudsync.agent.session: the protocol imports nothing else" in text
    assert "edged.common.errors imports cloudsync.protocol.envelope: edged never imports" in text
    assert "cloudsync.agent.outbox: the fleet side never imports the device agent" in text
    assert "edged.top imports edged.routing.router: a client-side tool imports only" in text
    assert "edged.common.stats imports edged.config: the shared leaf package" in text
    assert "routes.nodes imports cloudsync.fleet.service: a fleet adapter is handed" in text
    assert "routes.audit imports cloudsync.fleet.routes.rollouts: a route module is one" in text
    assert "cloudsync/fleet/routes/enrolment.py:" in text and "SQL outside the fleet" in text


def writers(root: Path) -> dict[str, set[str]]:
    """Each table of the fleet service's database -> the modules whose SQL writes it."""
    found: dict[str, set[str]] = {}
    fleet = root / "cloudsync" / "fleet"
    for path in sorted(fleet.rglob("*.py")):
        for table in WRITE.findall(path.read_text()):
            found.setdefault(table, set()).add(path.relative_to(fleet).with_suffix("").as_posix())
    return found


def test_each_fleet_table_is_written_by_one_repository() -> None:
    """One owner per table (issue 45: the A/B tests inserted into ``commands`` and the registry
    set their results; the registry pruned the events and alerts observe.py writes; rollouts
    wrote the deployments' models): the others call the owner's functions, in their own
    transaction when they need one."""
    found = writers(ROOT)
    assert {"commands", "deployments", "events", "alerts", "telemetry"} <= set(found)
    shared = {table: sorted(modules) for table, modules in found.items() if len(modules) > 1}
    assert not shared, shared


def test_a_second_writer_put_back_on_purpose_is_named(tmp_path: Path) -> None:
    copy_tree(tmp_path)
    path = tmp_path / "cloudsync" / "fleet" / "abtests.py"
    path.write_text(path.read_text() + '\nX = "UPDATE commands SET result = NULL"\n')
    found = writers(tmp_path)
    assert found["commands"] == {"commands", "abtests"}


def test_cycles_hidden_imports_and_stray_sql_put_back_on_purpose_are_named(tmp_path: Path) -> None:
    """Over a copy of the tree: the agent's metrics importing ``Agent`` for its type (the cycle
    issue 45 removed), the task kinds importing the graph parser in a function, the API and the
    console importing each other, a package's ``__init__`` that loads the knowledge store for
    the client-side tools, and SQL in the API: each found, and nothing else."""
    copy_tree(tmp_path)
    added = {
        "cloudsync/agent/metrics.py": (
            "if TYPE_CHECKING:\n    from cloudsync.agent.session import Agent\n"
        ),
        "edged/tasks/kinds.py": "def parse():\n    from edged.tasks.graph import parse_graph\n",
        "cloudsync/fleet/console.py": "from cloudsync.fleet.api import app\n",
        "cloudsync/fleet/api.py": (
            'def console():\n    from cloudsync.fleet.console import Console\n\nX = "SELECT 1"\n'
        ),
        "edged/knowledge/__init__.py": "from edged.knowledge.store import KnowledgeStore\n",
    }
    for name, text in added.items():
        path = tmp_path / name
        path.write_text(path.read_text() + "\n" + text)
    assert cycles(tmp_path) == [
        "a cycle: cloudsync.agent.metrics, cloudsync.agent.session",
        "a cycle: cloudsync.fleet.api, cloudsync.fleet.console",
        "a cycle: edged.tasks.graph, edged.tasks.kinds",
    ]
    found = violations(tmp_path)
    text = "\n".join(found)
    assert "cloudsync.agent.metrics imports cloudsync.agent.session under TYPE_CHECKING" in text
    assert "cloudsync/fleet/api.py:" in text and "SQL outside the fleet service's" in text
    apart = [f for f in found if "two adapters over fleet.actions, apart" in f]
    assert [f.split(": ")[1] for f in apart] == [
        "cloudsync.fleet.console imports cloudsync.fleet.api"
    ], text
    tools = [f for f in found if "whose package edged.knowledge loads edged.knowledge.store" in f]
    assert tools and all("a client-side tool imports only" in f for f in tools), text
    assert len(found) == 3 + len(tools), text


def test_the_map_of_long_modules_is_the_codes() -> None:
    """docs/ARCHITECTURE.md's table of the modules over 450 lines is what the code has (it
    drifted: four missing, eleven figures off by more than five lines, issue 45)."""
    assert not house_map.problems(), "\n".join(house_map.problems())
    assert house_map.in_doc(house_map.DOC.read_text()) == house_map.table(), (
        "docs/ARCHITECTURE.md's long modules differ from the code: python -m tests.house_map"
    )


def test_the_map_names_a_long_module_without_a_reason(tmp_path: Path) -> None:
    copy_tree(tmp_path)
    (tmp_path / "edged" / "long.py").write_text("x = 1\n" * (house_map.LIMIT + 1))
    (tmp_path / "edged" / "top.py").write_text("x = 1\n")
    assert house_map.problems(tmp_path) == [
        "edged/long.py: over 450 lines (451), no reason in tests/house_map.py",
        "edged/top.py: no longer over 450 lines: drop it from tests/house_map.py",
    ]
    assert "| `edged/long.py` | 451 | ? |" in house_map.table(tmp_path)


def test_a_reload_swaps_settings_and_changes_no_object_a_reader_holds() -> None:
    """Issue 45: ``Daemon.apply`` set keys with ``setattr`` on the config objects that the REST
    middleware, the access checks and the pipelines held. It builds new snapshots and swaps them
    into their ``Live`` holders: no ``setattr`` and no assignment to an attribute of a section."""
    tree = ast.parse((ROOT / "edged" / "app.py").read_text())
    apply = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "apply")
    calls = [
        n
        for n in ast.walk(apply)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
    ]
    deep = [
        ast.unparse(t)
        for n in ast.walk(apply)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute)
        and isinstance(t.value, ast.Attribute)
        and t.value.attr != "self"
        and ast.unparse(t.value).count(".") >= 2
    ]
    assert not calls and not deep, (calls, deep)


def test_test_modules_outside_packages_have_names_of_their_own() -> None:
    """pytest imports a test file of a directory without ``__init__.py`` by its basename: two
    such files of one name stop the whole run at collection (``import file mismatch``: a unit
    test_admin.py beside the integration one did, in CI)."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def console_scripts() -> dict[str, str]:
    """pyproject's ``[project.scripts]``: program -> ``module:function``."""
    scripts: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    return scripts


def misnamed(root: Path) -> list[str]:
    """One word per idea: each module called ``cli`` or ``config`` outside a program's package
    (a console script's), and each package name two packages share."""
    entries = [target.split(":")[0] for target in console_scripts().values()]
    homes = {entry.rpartition(".")[0] for entry in entries}
    found, packages = [], {}
    for path in [*(root / "edged").rglob("*.py"), *(root / "cloudsync").rglob("*.py")]:
        module = module_of(path, root)
        if path.stem in ("cli", "config") and module.rpartition(".")[0] not in homes:
            found.append(f"{module}: cli or config outside a program's package")
        if path.name == "__init__.py":
            packages.setdefault(path.parent.name, []).append(module)
    found += [
        f"{', '.join(sorted(m))}: one package name twice" for m in packages.values() if len(m) > 1
    ]
    return found


def test_one_word_per_idea_in_the_names_of_modules() -> None:
    """A module called ``cli`` or ``config`` is a program's (its command line, its config
    file), in the package of a console script (issue 45: a model's config.pbtxt, the tools'
    shared helpers and the daemons' configs made four ``config.py`` and four ``cli.py``); no
    two packages share a name (there were two ``protocol/``)."""
    entries = [target.split(":")[0] for target in console_scripts().values()]
    assert {"edged.cli", "cloudsync.agent.cli", "cloudsync.fleet.cli"} <= set(entries), entries
    assert misnamed(ROOT) == []


def test_a_second_word_put_back_on_purpose_is_named(tmp_path: Path) -> None:
    """Over a copy of the tree: a model's config as ``config.py`` again, and a second package
    called ``protocol``: both named, and nothing else."""
    copy_tree(tmp_path)
    (tmp_path / "edged" / "models" / "config.py").write_text("")
    (tmp_path / "edged" / "protocol").mkdir()
    (tmp_path / "edged" / "protocol" / "__init__.py").write_text("")
    assert sorted(misnamed(tmp_path)) == [
        "cloudsync.protocol, edged.protocol: one package name twice",
        "edged.models.config: cli or config outside a program's package",
    ]


def test_the_formatter_wins() -> None:
    """No formatter's skip or off marker in our Python (issue 45: 1,133 of them kept lines
    hand-laid against ``ruff format``): the layout is the formatter's, everywhere."""
    marker = re.compile(r"#\s*fmt:\s*(skip|off)\b")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for top in ("edged", "cloudsync", "tests", "bench", "models")
        for path in (ROOT / top).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if marker.search(line)
    ]
    assert not found, found
