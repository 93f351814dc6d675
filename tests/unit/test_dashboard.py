"""The operators' Grafana dashboard (docs/monitoring/edged-dashboard.json): its layout and
variables, metric names that a real edged registry and a real cloudsync process export, and
queries that promtool parses as PromQL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from bench.peer import free_port
from edged.client import Client
from edged.metrics import Metrics
from tests.conftest import skip_or_fail, wait_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "monitoring" / "edged-dashboard.json"
PROMTOOL = Path(
    os.environ.get("PROMTOOL", ROOT / "build" / "promtool" / "usr" / "bin" / "promtool")
)
ROWS = ["Inference", "Routing", "Device", "Sync"]
GRID_COLUMNS = 24
DATASOURCE = "${datasource}"
# Grafana's own variables, as a query over the default 6 h range would see them
BUILTIN_VARIABLES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__interval_ms": "60000",
    "__range": "6h",
    "__range_s": "21600",
    "__range_ms": "21600000",
}
INSTANCE_MATCHER = re.compile(r'\binstance\s*=~\s*"\$(?:instance|\{instance(?::\w+)?\})"')
JOB_MATCHER = re.compile(r'\bjob\s*=\s*"(\w+)"')
PROMETHEUS_OWN = {"up"}  # Prometheus' series per scrape target, in every job

# PromQL words that look like metric names but are not (aggregations are caught by "(" unless
# a "by"/"without" clause comes first, so they are listed too)
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "atan2",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_STRING = r""""(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`"""
_TOKEN = re.compile(
    rf"""
    (?P<string>{_STRING})
    | (?P<matchers>\{{(?:{_STRING}|[^{{}}"'`])*\}})
    | (?P<range>\[[^\]]*\])
    | (?P<variable>\$\{{[^}}]*\}}|\$\w+)
    | (?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z]*)
    | (?P<name>[a-zA-Z_:][\w:]*)
    | (?P<other>\S)
    """,
    re.VERBOSE,
)


class Selector(NamedTuple):
    """A series selector of a query: its metric name ("" for ``{__name__=...}``), matchers."""

    name: str
    matchers: str


class Query(NamedTuple):
    """One PromQL expression of the dashboard and where it is."""

    where: str
    rule: str  # the recording rule's name it is checked under
    expr: str


def selectors(expr: str) -> list[Selector]:
    """The series selectors of a PromQL expression: identifiers that are not functions,
    keywords, label names (in by/without/on/ignoring lists), strings, durations or variables."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    found: list[Selector] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "name" and text.lower() in LABEL_LISTS and following[1] == "(":
            i += 2
            while i < len(tokens) and tokens[i][1] != ")":
                i += 1
        elif kind == "name" and following[1] != "(" and text.lower() not in KEYWORDS:
            matchers = following[1] if following[0] == "matchers" else ""
            found.append(Selector(text, matchers))
            i += 1 if not matchers else 2
            continue
        elif kind == "matchers":
            found.append(Selector("", text))  # {__name__="..."}: no name to check
        i += 1
    return found


def load() -> dict[str, Any]:
    """The shipped dashboard."""
    return dict(json.loads(DASHBOARD.read_text()))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    found: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(dashboard: dict[str, Any]) -> list[Query]:
    """Every PromQL expression: the panels' targets and the annotations'."""
    found = [
        Query(f"panel {p['id']} ({p['title']}) {t['refId']}", f"panel_{p['id']}_{n}", t["expr"])
        for p in panels(dashboard)
        for n, t in enumerate(p.get("targets", []), 1)
    ]
    found += [
        Query(f"annotation {a['name']}", f"annotation_{n}", a["expr"])
        for n, a in enumerate(dashboard["annotations"]["list"], 1)
        if "expr" in a
    ]
    return found


def to_promql(expr: str, variables: dict[str, str]) -> str:
    """The expression as Grafana sends it: its ``$variables`` replaced."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name.isdigit():  # $1 in label_replace's replacement: PromQL's, not Grafana's
            return match.group()
        assert name in variables, f"{expr!r} uses ${name}, which the dashboard does not define"
        return variables[name]

    return re.sub(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))", value, expr)


def exported(exposition: str) -> set[str]:
    """The series names a registry's text exposition stands for, samples or not: each
    family's name as its TYPE line gives it (counters with ``_total``, info with ``_info``),
    histograms' and summaries' ``_bucket``/``_sum``/``_count``, and every sample's name."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.update(name + suffix for suffix in suffixes.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    """The shipped dashboard, read once."""
    return load()


@pytest.fixture(scope="module")
def edged_names() -> set[str]:
    """What edged's registry exports (every family prints its TYPE, with samples or not)."""
    return exported(Metrics().render().decode())


@pytest.fixture(scope="module")
def cloudsync_names(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """GET /metrics of a real cloudsync, booted offline (its broker's port has no listener)."""
    workdir = tmp_path_factory.mktemp("cloudsync")
    config = workdir / "cloudsync.toml"
    config.write_text(
        f"""
[node]
fleet = "f1"
name = "n1"
[mqtt]
host = "127.0.0.1"
port = {free_port()}
[outbox]
path = "{workdir}/outbox.db"
[edged]
socket = "{workdir}/no-edged.sock"
[local]
socket = "{workdir}/cloudsync.sock"
[commands]
trust_dir = "{workdir}/trust"
"""
    )
    log = workdir / "cloudsync.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cloudsync.agent.cli", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        local = Client(str(workdir / "cloudsync.sock"), timeout=10)
        text: list[str] = []

        def answered() -> bool:
            text.append(local.metrics())
            return True

        wait_for(answered, 30, "cloudsync's /metrics", proc)
        yield exported(text[0])
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"cloudsync did not stop on SIGTERM; log:\n{log.read_text()}")


def test_the_dashboard_is_identified_and_imports_into_any_grafana(
    dashboard: dict[str, Any],
) -> None:
    assert dashboard["uid"] == "edged-node"
    assert dashboard["title"] == "edged node"
    assert dashboard["schemaVersion"] == 39
    assert dashboard["tags"]
    assert dashboard["time"] == {"from": "now-6h", "to": "now"}
    assert dashboard["refresh"] == "30s"
    assert dashboard.get("id") is None, "an exported id would clash on import"
    assert "job=" in dashboard["description"] and "instance" in dashboard["description"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query"
    assert instance["datasource"]["uid"] == DATASOURCE
    assert instance["multi"] and instance["includeAll"]
    assert instance["definition"] == "label_values(cloudsync_mqtt_connected, instance)"
    query = instance["query"]
    assert (query["query"] if isinstance(query, dict) else query) == instance["definition"]


def test_the_file_is_two_space_indented_json() -> None:
    text = DASHBOARD.read_text()
    assert text == json.dumps(json.loads(text), indent=2, ensure_ascii=False) + "\n"


def test_the_rows_come_in_order_each_with_its_panels(dashboard: dict[str, Any]) -> None:
    ordered = sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert ordered == dashboard["panels"], "panels are listed in the order they are shown"
    rows = [p["title"] for p in ordered if p["type"] == "row"]
    assert rows == ROWS
    per_row: dict[str, int] = {}
    current = None
    for panel in ordered:
        if panel["type"] == "row":
            current = panel["title"]
            per_row[current] = len(panel.get("panels", []))  # those of a collapsed row
        else:
            assert current is not None, f"panel {panel['id']} comes before the first row"
            per_row[current] += 1
    for title, count in per_row.items():
        assert 4 <= count <= 12, f"row {title} has {count} panels: too few or too many to read"


def test_panel_ids_are_unique(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels(dashboard)]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), f"duplicate ids: {sorted(i for i in ids if ids.count(i) > 1)}"


def test_panels_fit_the_grid_and_do_not_overlap(dashboard: dict[str, Any]) -> None:
    placed: list[tuple[int, int, int, int, int]] = []
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
        assert x >= 0 and y >= 0 and w > 0 and h > 0, f"panel {panel['id']}: {grid}"
        assert x + w <= GRID_COLUMNS, f"panel {panel['id']} is wider than the grid: {grid}"
        for other, ox, oy, ow, oh in placed:
            overlap = x < ox + ow and ox < x + w and y < oy + oh and oy < y + h
            assert not overlap, f"panels {other} and {panel['id']} overlap"
        placed.append((panel["id"], x, y, w, h))


def test_every_panel_queries_the_chosen_datasource(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DATASOURCE, f"panel {panel['id']}"
        assert panel.get("targets"), f"panel {panel['id']} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"panel {panel['id']}: refIds {refs}"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"panel {panel['id']} has an empty query"
            assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE
        if panel["type"] != "table":  # a table's columns are labels
            assert panel["fieldConfig"]["defaults"].get("unit"), f"panel {panel['id']}: no unit"
    for annotation in dashboard["annotations"]["list"]:
        if not annotation.get("builtIn"):
            assert annotation["datasource"]["uid"] == DATASOURCE, annotation["name"]


def test_every_selector_is_filtered_by_instance_and_ranges_follow_grafana(
    dashboard: dict[str, Any],
) -> None:
    for query in queries(dashboard):
        found = selectors(query.expr)
        assert found, f"{query.where}: no metric in {query.expr!r}"
        for selector in found:
            assert INSTANCE_MATCHER.search(selector.matchers), (
                f"{query.where}: {selector.name} is not filtered by $instance"
            )
        for window in re.findall(r"\[([^\]]*)\]", query.expr):
            assert window in ("$__rate_interval", "$__range"), (
                f"{query.where}: range [{window}] (use $__rate_interval)"
            )


def test_every_metric_is_one_that_edged_or_cloudsync_exports(
    dashboard: dict[str, Any], edged_names: set[str], cloudsync_names: set[str]
) -> None:
    by_job = {"edged": edged_names, "cloudsync": cloudsync_names}
    both = (edged_names & cloudsync_names) | PROMETHEUS_OWN
    used = set()
    for query in queries(dashboard):
        for selector in selectors(query.expr):
            name = selector.name
            assert name, f"{query.where}: a selector without a metric name ({selector.matchers})"
            used.add(name)
            if name in both:  # process_*, up: only the job tells whose
                job = JOB_MATCHER.search(selector.matchers)
                assert job and job.group(1) in by_job, f"{query.where}: {name} needs its job"
                assert name in by_job[job.group(1)] | PROMETHEUS_OWN, f"{query.where}: {name}"
            else:
                assert name in edged_names | cloudsync_names, (
                    f"{query.where}: {name} is exported by neither edged nor cloudsync"
                )
    assert used & edged_names and used & cloudsync_names


def test_every_query_is_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    if not PROMTOOL.is_file():
        skip_or_fail(f"promtool is not at {PROMTOOL} (make {PROMTOOL.relative_to(ROOT)})")
    variables = {
        **BUILTIN_VARIABLES,
        **{
            v["name"]: v.get("allValue") or ".*"
            for v in dashboard["templating"]["list"]
            if v["type"] in ("query", "custom")
        },
    }
    rules = [
        {"record": f"dashboard:{q.rule}", "expr": to_promql(q.expr, variables)}
        for q in queries(dashboard)
    ]
    assert check_rules(rules, tmp_path) == (0, f"SUCCESS: {len(rules)} rules found")


def check_rules(rules: list[dict[str, str]], tmp_path: Path) -> tuple[int, str]:
    """``promtool check rules`` on recording rules (JSON is YAML): exit code, last line."""
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}, indent=2))
    done = subprocess.run(
        [PROMTOOL, "check", "rules", path], capture_output=True, text=True, timeout=60
    )
    output = (done.stdout + done.stderr).strip()
    return done.returncode, output.splitlines()[-1].strip() if done.returncode == 0 else output


def test_the_promql_check_fails_on_a_broken_query(tmp_path: Path) -> None:
    if not PROMTOOL.is_file():
        skip_or_fail(f"promtool is not at {PROMTOOL} (make {PROMTOOL.relative_to(ROOT)})")
    broken = [{"record": "dashboard:broken", "expr": "histogram_quantile(0.9, rate(x[5m])"}]
    code, output = check_rules(broken, tmp_path)
    assert code != 0 and "parse error" in output, output


def test_selectors_are_told_from_functions_keywords_labels_and_strings() -> None:
    expr = (
        'sum by (instance, le) (rate(a_bucket{instance=~"$instance", x="y}z"}[$__rate_interval]))'
        " / on (instance) group_left (model) b_total offset 5m"
        ' or label_replace(c, "dst", "$1", "src", "(.*)") > bool 1e3'
        ' and sum without (le) (d{job="edged"}) * Inf + count(e) unless {__name__="f"}'
    )
    assert selectors(expr) == [
        Selector("a_bucket", '{instance=~"$instance", x="y}z"}'),
        Selector("b_total", ""),
        Selector("c", ""),
        Selector("d", '{job="edged"}'),
        Selector("e", ""),
        Selector("", '{__name__="f"}'),
    ]
    assert (
        to_promql(
            "rate(m{i=~'${instance:regex}'}[$__rate_interval]) $1",
            {"instance": ".*", "__rate_interval": "5m"},
        )
        == "rate(m{i=~'.*'}[5m]) $1"
    )
    with pytest.raises(AssertionError, match=r"\$nope"):
        to_promql("m{a=~'$nope'}", {})


def test_names_come_from_the_exposition_as_prometheus_stores_them() -> None:
    text = "\n".join(
        [
            "# TYPE h_seconds histogram",
            "# TYPE c_total counter",
            "# TYPE i_info gauge",
            "# TYPE g gauge",
            'g{a="1"} 2.0',
            "g_created 1.0",
        ]
    )
    assert exported(text) == {
        "h_seconds_bucket",
        "h_seconds_sum",
        "h_seconds_count",
        "c_total",
        "i_info",
        "g",
        "g_created",
    }
