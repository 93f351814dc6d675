"""Every name, id and hash pattern that checks outside input anchors at the very end: Python's
``$`` also matches before a final newline, so ``"intent\\n"`` passed as a model name, a topic
segment, a file in a manifest or a rollout's window ("01:00-02:00\\n" was stored as it came)."""

from __future__ import annotations

import re

import pytest

from cloudsync.fleet import abtests, observe, registry, rollouts
from cloudsync.fleet.routes import enrolment
from cloudsync.protocol import labels, manifest, topics, trust
from edged.common import egress, names
from edged.knowledge import store
from edged.pipelines import speech

VALID = [
    (names.MODEL_NAME, "intent-classifier"),
    (store.NAMESPACE, "docs"),
    (egress.SEGMENT, "egress-000000000001.jsonl"),
    (egress.SHA256, "a" * 64),
    (speech.WORD, "jetson"),
    (topics.NAME, "jetson-17"),
    (topics.CMD_ID, "c0ffee"),
    (topics.ENROL_ID, "f" * 32),
    (trust.KID, "fleet-1"),
    (trust.COMMAND, "rollback"),
    (trust.FINGERPRINT, "b" * 64),
    (manifest.FILE_PART, "model.onnx"),
    (manifest.SHA256, "c" * 64),
    (manifest.DEB_VERSION, "1:0.2.0~rc1"),
    (labels.LABEL, "berlin"),
    (observe.LABEL_NAME, "instance"),
    (enrolment.SERIAL, "1a2b"),
    (rollouts.WINDOW, "01:00-02:00"),
    (registry.HASH, "d" * 64),
    (abtests.CLOUD_NAME, "intent-classifier-b"),
]


@pytest.mark.parametrize(("pattern", "valid"), VALID, ids=[v for _, v in VALID])
def test_a_pattern_takes_its_example_and_nothing_after_it(
    pattern: re.Pattern[str], valid: str
) -> None:
    assert pattern.match(valid)
    for tail in ("\n", "\r\n", "\n\n", " "):
        assert pattern.match(valid + tail) is None, repr(valid + tail)


def test_a_rollout_window_with_a_line_end_is_refused() -> None:
    assert rollouts.parse_window("01:00-02:00") == (60, 120)
    with pytest.raises(ValueError, match="HH:MM-HH:MM"):
        rollouts.parse_window("01:00-02:00\n")
