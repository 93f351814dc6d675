"""``edgefleet nodes`` without a service (``cloudsync.fleet.cli.nodes_table``): a row per node
from the retained status and the heartbeats, its models counted as the service counts them."""

from __future__ import annotations

from cloudsync.fleet.cli import nodes_table
from cloudsync.protocol.envelope import Envelope

NOW = 1_800_000_000_000


def message(node: str, kind: str, ts: int, body: dict[str, object]) -> tuple[str, bytes]:
    env = Envelope(node, 1, body, ts=ts)
    return f"edge/v1/f1/{node}/{kind}", env.encode()


def test_a_node_born_before_edged_loaded_its_models_lists_them_from_its_heartbeat() -> None:
    """Found: the README's listing showed "-" for a node whose cloudsync connected before edged
    had loaded its models (the birth is retained, the heartbeats say what is serving)."""
    rows = nodes_table(
        [
            message("n1", "status", NOW - 9000, {"state": "online", "models": []}),
            message(
                "n1",
                "heartbeat",
                NOW - 2000,
                {"outbox": {"pending": 3}, "models": {"intent": "2", "ocr": "1"}},
            ),
            message(
                "n2",
                "status",
                NOW - 9000,
                {"state": "online", "models": [{"name": "intent", "version": "1"}]},
            ),
        ],
        NOW,
    )
    assert [
        (r["node"], r["state"], r["models"], r.get("outbox"), r["heartbeat_age_s"]) for r in rows
    ] == [
        ("n1", "online", ["intent", "ocr"], 3, 2.0),
        ("n2", "online", ["intent"], None, None),
    ]


def test_an_older_heartbeat_does_not_undo_a_newer_birth() -> None:
    rows = nodes_table(
        [
            message("n1", "heartbeat", NOW - 9000, {"models": {"old": "1"}}),
            message(
                "n1",
                "status",
                NOW - 1000,
                {"state": "online", "models": [{"name": "intent", "version": "3"}]},
            ),
        ],
        NOW,
    )
    assert rows[0]["models"] == ["intent"]


def test_a_node_s_poison_leaves_its_row_empty_not_the_listing_failed() -> None:
    rows = nodes_table(
        [
            message("n1", "status", NOW, {"state": "online", "models": "all of them"}),
            message("n1", "heartbeat", NOW, {"outbox": [1], "models": ["x"]}),
            message(
                "n2", "status", NOW, {"state": "online", "models": [7, {"name": 8}, {"name": "ok"}]}
            ),
            ("edge/v1/f1/n3/status", b"\xff not an envelope"),
        ],
        NOW,
    )
    assert [(r["node"], r["models"], r.get("outbox")) for r in rows] == [
        ("n1", [], None),
        ("n2", ["ok"], None),
    ]
