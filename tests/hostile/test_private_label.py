"""Issue 44, point 9: a caller's explicit ``private`` label wins over a template's release,
against a real daemon and a real cloud (the tests' MLServer behind a recording proxy).

Found: ``image-report`` sent the OCR text of an image marked ``"private": true`` to the cloud
answer model, 8 times out of 8: the template releases what its OCR node reads from the image
(its image input is private by default), and that release overrode the caller's own label.
Now the release applies to the template's default label only: with the caller's label, no byte
of the request reaches the cloud (the proxy saw no inference; the egress ledger has no entry),
and every node that derives from the image says it ran private.
"""

from __future__ import annotations

import pytest

from edged.client import ClientError
from tests.conftest import Cloud, Daemon
from tests.hashproxy import HashProxy
from tests.integration.edged.test_egress import hashing, image_report_daemon, sent
from tests.integration.edged.test_tasks import INVOICE, b64, tasks
from tests.media import text_image

__all__ = ["hashing"]  # the fixture: the recording proxy in front of the cloud

pytestmark = pytest.mark.usefixtures("faults_cleared")


def test_a_callers_private_image_leaves_nothing_with_the_template_that_releases_it(
    make_daemon: type[Daemon], hashing: HashProxy, cloud: Cloud
) -> None:
    daemon = image_report_daemon(make_daemon, hashing)
    image = b64(text_image(INVOICE))
    # the template's own label: its OCR node releases the text, which goes to the cloud
    released = tasks(daemon.client, {"template": "image-report", "inputs": {"image": image}})
    assert released["status"] == "ok"
    assert len(sent(daemon)) == 1
    before = [p for p in hashing.posts() if p["path"].endswith("/infer")]
    assert len(before) == 1

    for labelled in (
        {"template": "image-report", "inputs": {"image": {**image, "private": True}}},
        {"template": "image-report", "inputs": {"image": image}, "private": ["image"]},
    ):
        plan = daemon.client.call("POST", "/v1/tasks", {**labelled, "run": False})["planned"]
        assert {n["id"]: n["private"] for n in plan["nodes"]} == {
            "text": True,
            "fields": True,
            "report": True,
        }, plan
        # the answer model is in the cloud only: the report cannot run, and says why
        with pytest.raises(ClientError) as refused:
            tasks(daemon.client, labelled)
        assert "node 'report' (report) failed" in refused.value.message
        assert "cloud the input is private" in refused.value.message
        assert [p for p in hashing.posts() if p["path"].endswith("/infer")] == before
        assert len(sent(daemon)) == 1  # no new entry in the egress ledger
