"""Task graphs read and checked before anything runs (edged.tasks.graph), the privacy labels a
plan carries from inputs to outputs, the shipped templates, and field extraction."""

from __future__ import annotations

from typing import Any

import pytest

from edged.common.errors import ConfigError, InvalidRequest
from edged.tasks.graph import parse_graph
from edged.tasks.kinds import extract_fields
from edged.tasks.run import Plan, decode_inputs
from edged.tasks.templates import DEFAULTS, load_templates


def node(node_id: str, task: str, **inputs: str) -> dict[str, Any]:
    return {"id": node_id, "task": task, "inputs": inputs}


@pytest.mark.parametrize(
    ("nodes", "says"),
    [
        (
            [node("a", "extract", text="b.fields"), node("b", "extract", text="a.fields")],
            "the graph has a cycle: a -> b -> a",
        ),
        (
            [
                node("a", "extract", text="c.fields"),
                node("b", "extract", text="a.fields"),
                node("c", "extract", text="b.fields"),
            ],
            "the graph has a cycle: a -> b -> c -> a",
        ),
        ([node("a", "translate", text="$text")], "unknown task type 'translate'"),
        (
            [node("a", "extract", text="ocr.text")],
            "node 'a' input 'text' refers to 'ocr.text': there is no node 'ocr'",
        ),
        (
            [node("a", "ocr", image="$image"), node("b", "extract", text="a.words")],
            "a ocr node has no output 'words' (its outputs: lines, text)",
        ),
        ([node("a", "report")], "node 'a' (report) needs input(s) text"),
        ([node("a", "intent", text="$t", image="$i")], "takes no input(s) image"),
        ([node("a", "extract", text="text")], "use '$input' for a request input"),
        (
            [node("a", "extract", text="$t"), node("a", "extract", text="$t")],
            "two nodes have the id 'a'",
        ),
        ([], "the graph has no nodes"),
        (
            [{**node("a", "search", query="$q"), "params": {"limit": 3}}],
            "unknown params limit; it takes namespace, k",
        ),
        (
            [{**node("a", "search", query="$q"), "params": {"k": "5"}}],
            "node 'a': param 'k' must be an integer, 1 to 100",
        ),
        (
            [{**node("a", "report", text="$t"), "params": {"question": ""}}],
            "node 'a': param 'question' must be non-empty text",
        ),
        (
            [{**node("a", "extract", text="$t"), "constraints": {"deadline_share": 2}}],
            "'deadline_share' must be a number in (0, 1]",
        ),
        (
            [{**node("a", "extract", text="$t"), "constraints": {"route": "edge"}}],
            "'route' must be one of auto, local, cloud, hedged",
        ),
    ],
)
def test_a_bad_graph_is_refused_naming_the_problem(nodes: list[Any], says: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_graph({"nodes": nodes})
    assert says in refused.value.message


def test_nodes_start_by_level_then_priority() -> None:
    graph = parse_graph(
        {
            "nodes": [
                {**node("late", "report", text="read.text"), "constraints": {"priority": 1}},
                node("read", "ocr", image="$image"),
                {**node("urgent", "intent", text="$t"), "constraints": {"priority": 1}},
                node("fields", "extract", text="read.text"),
            ]
        }
    )
    assert graph.order() == ["urgent", "read", "late", "fields"]
    assert graph.inputs == {"image", "t"}
    assert list(graph.nodes)[-1] in ("late", "fields")  # after what it takes from


def test_private_inputs_make_their_nodes_private_unless_a_node_releases_its_outputs() -> None:
    template = load_templates({})["image-report"]
    plan = Plan("image-report", template.graph, {"image": b"..."}, {"image"}, 5.0)
    assert plan.labels() == {"text": True, "fields": False, "report": False}
    # without the release, what is read from a private image stays private downstream
    nodes = [dict(n) for n in DEFAULTS["image-report"]["nodes"]]
    nodes[0] = {k: v for k, v in nodes[0].items() if k != "releases"}
    kept = Plan("g", parse_graph({"nodes": nodes}), {"image": b"..."}, {"image"}, 5.0)
    assert kept.labels() == {"text": True, "fields": True, "report": True}
    forced = [*nodes[:2], {**nodes[2], "constraints": {"private": True}}]
    graph = parse_graph({"nodes": forced})
    assert Plan("g", graph, {"image": b""}, set(), 5.0).labels()["report"] is True


def test_an_input_the_caller_labels_private_is_never_released() -> None:
    """Issue 44: image-report sent the text read from an image the caller marked private to
    the cloud answer model; the template's release is for its own default label only."""
    template = load_templates({})["image-report"]
    values = {"image": b"..."}
    explicit = Plan("image-report", template.graph, values, {"image"}, 5.0, explicit={"image"})
    assert explicit.labels() == {"text": True, "fields": True, "report": True}
    # the same in a graph of the caller's own: its label wins over its own node's release
    graph = parse_graph({"nodes": DEFAULTS["image-report"]["nodes"]})
    assert Plan("g", graph, values, {"image"}, 5.0, explicit={"image"}).labels()["report"]
    # another input's label does not reach nodes that do not take it
    mixed = {"nodes": [*DEFAULTS["image-report"]["nodes"], node("i", "intent", text="$t")]}
    plan = Plan("g", parse_graph(mixed), {**values, "t": "hi"}, {"image", "t"}, 5.0, explicit={"t"})
    assert plan.labels() == {"text": True, "fields": False, "report": False, "i": True}


def test_templates_from_the_config_are_checked_at_start() -> None:
    assert set(load_templates({})) == {"image-report", "voice-command", "ask", "search"}
    mine = {"nodes": [node("a", "intent", text="$text")], "inputs": {"text": {}}}
    assert load_templates({"mine": mine})["mine"].graph.order() == ["a"]
    with pytest.raises(ConfigError) as bad:
        load_templates({"mine": {"nodes": [node("a", "intent", text="$text")]}})
    assert "template 'mine' uses inputs it does not declare: text" in bad.value.message
    with pytest.raises(ConfigError) as bad:
        load_templates({"mine": {"nodes": [node("a", "intent", text="b.x")]}})
    assert "template 'mine': node 'a' input 'text' refers to 'b.x'" in bad.value.message


def test_inputs_are_text_or_base64_bytes_and_may_be_marked_private_or_released() -> None:
    values, private, released = decode_inputs(
        {
            "q": "hello",
            "img": {"base64": "aGk=", "private": True},
            "t": {"text": "x"},
            "wav": {"base64": "aGk=", "private": False},
        }
    )
    assert values == {"q": "hello", "img": b"hi", "t": "x", "wav": b"hi"}
    assert private == {"img"} and released == {"wav"}
    for bad, says in [
        ({"img": {"base64": "%%%"}}, "not base64"),
        ({"img": {"text": "a", "base64": "aGk="}}, "'text' or 'base64'"),
        ({"n": 3}, "must be text"),
        ({"img": {"base64": "aGk=", "private": "yes"}}, "'private' must be true or false"),
        ({"img": {"base64": "aGk=", "private": 1}}, "'private' must be true or false"),
    ]:
        with pytest.raises(InvalidRequest) as refused:
            decode_inputs(bad)
        assert says in refused.value.message


def test_fields_are_extracted_from_a_documents_text() -> None:
    fields = extract_fields(
        "INVOICE 2041\nDate: 2026-11-30\nSubtotal: $1,100.00\nTotal: $1,234.50\n"
        "Pay to billing@acme.example by 15/12/2026"
    )
    assert fields["total"] == "$1,234.50"
    assert fields["amounts"] == ["$1,100.00", "$1,234.50"]
    assert fields["dates"] == ["2026-11-30", "15/12/2026"]
    assert fields["emails"] == ["billing@acme.example"]
    assert fields["labelled"]["date"] == "2026-11-30"
    assert extract_fields("no numbers here")["total"] is None


def test_a_graph_has_at_most_64_nodes_and_a_body_must_be_an_object() -> None:
    nodes = [node(f"n{i}", "extract", text="$t") for i in range(65)]
    with pytest.raises(InvalidRequest) as refused:
        parse_graph({"nodes": nodes})
    assert "the graph has 65 nodes; at most 64" in refused.value.message
    assert len(parse_graph({"nodes": nodes[:64]}).nodes) == 64
    for bad in (None, [], {"nodes": "a"}, {"nodes": [3]}):
        with pytest.raises(InvalidRequest):
            parse_graph(bad)
