"""The fleet service's HTTP API under schemathesis (issue 24): every operation of
docs/fleet-api.json, called with generated and mutated parameters and bodies by an admin, against
the real service process (a real Mosquitto, a few nodes, a deployment): no 500, every answer's
status and body as the document says, and the service alive after it all."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.core.parameters import ParameterLocation

from tests.fleetservice import TOKENS, FleetService
from tests.integration.cloudsync.test_fleet_nodes import births
from tests.mosquitto import Broker, make_pki

SCHEMA = schemathesis.openapi.from_path(Path(__file__).resolve().parents[2] / "docs/fleet-api.json")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetService]:
    work = tmp_path_factory.mktemp("fleet-api")
    why = Broker.available()
    if why:
        pytest.skip(why)
    broker = Broker(work / "mosquitto", make_pki(work / "pki", ["n1"])).start()
    service = FleetService(work / "service", broker).start()
    births(broker, 5)
    service.wait_for(lambda: service.call("GET", "/v1/nodes")[1]["counts"].get("online") == 5)
    yield service
    service.kill()
    broker.kill()


@SCHEMA.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented(
    case: schemathesis.Case, service: FleetService
) -> None:
    # a schema-valid body may still be refused for what a schema cannot say (a manifest's
    # signatures, a URL for each of its files): 422, which the document lists. A case whose
    # headers are the mutation (its Authorization left out) goes as generated: the admin's
    # token put back would make the service accept it, and schemathesis call that a failure
    negative_headers = case.meta is not None and case.meta.is_negative_at(ParameterLocation.HEADER)
    token = {} if negative_headers else {"Authorization": f"Bearer {TOKENS['admin']}"}
    case.call_and_validate(
        base_url=service.url,
        headers=token,
        excluded_checks=[schemathesis.checks.positive_data_acceptance],
    )
