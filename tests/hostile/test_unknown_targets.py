"""Issue 44, point 13, against a real daemon and a real cloud (the tests' server):

- a version nobody has of a model the device and the cloud both serve was answered a retryable
  503 ("the cloud cannot serve it now"): a version asked for is the device's alone, so its
  absence is a 404, as for a model without a cloud;
- an A/B split of a model that exists nowhere was accepted (and kept): now a 404 naming it,
  while a split of a model the tier serves is still taken.
"""

from __future__ import annotations

import pytest

from edged.client import ClientError
from tests.conftest import CLOUD_MODEL as MODEL
from tests.conftest import CLOUD_MODEL_B as MODEL_B
from tests.conftest import Cloud, Daemon
from tests.integration.edged.test_routing import edged_with_cloud

pytestmark = pytest.mark.usefixtures("faults_cleared")
X = {"inputs": [{"name": "embedding", "datatype": "FP32", "shape": [1, 384], "data": [0.0] * 384}]}


def test_an_unknown_version_is_a_404_and_a_split_of_nothing_is_refused(
    make_daemon: type[Daemon], cloud: Cloud
) -> None:
    daemon = edged_with_cloud(make_daemon, cloud)
    client = daemon.client
    with pytest.raises(ClientError) as missing:
        client.call("POST", f"/v2/models/{MODEL}/versions/99/infer", X)
    assert missing.value.status == 404, missing.value.message
    assert missing.value.retry_after is None
    with pytest.raises(ClientError) as nowhere:
        client.call(
            "PUT", "/v1/admin/cloud/no-such-model/ab", {"b_cloud_name": MODEL_B, "b_share": 0.5}
        )
    assert nowhere.value.status == 404
    assert nowhere.value.message == (
        "no model 'no-such-model' on the device or in the cloud tier cloud's catalog: a split"
        " of it would split nothing"
    )
    assert "no-such-model" not in client.call("GET", "/v1/admin/routing").get("cloud_ab", {})
    taken = client.call(
        "PUT", f"/v1/admin/cloud/{MODEL}/ab", {"b_cloud_name": MODEL_B, "b_share": 0.5}
    )
    assert taken["ab"] == {"b_cloud_name": MODEL_B, "b_share": 0.5}
