"""docs/fleet-api.json (the fleet service's OpenAPI 3.1 document) against the API as the code
builds it: a real Service over a real SQLite file (never started: nothing connects to a broker)
and the app ``cloudsync.fleet.daemon.application`` composes. The routes, their roles, who may
call them and the limits the document states are read from the code; a few calls over loopback
HTTP (aiohttp's TestServer)
check what the guard and the handlers answer, and that ``GET /v1/openapi.json`` serves the
document's own bytes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import test_utils, web

from cloudsync.fleet.actions import ROLES
from cloudsync.fleet.api import OPENAPI, PUBLIC
from cloudsync.fleet.config import FleetServiceConfig
from cloudsync.fleet.daemon import application
from cloudsync.fleet.deployments import MAX_MODELS, MAX_PRIORITY
from cloudsync.fleet.registry import MAX_PAGE
from cloudsync.fleet.service import Service
from cloudsync.protocol import manifest
from cloudsync.protocol.labels import LABEL, MAX_LABELS
from cloudsync.protocol.topics import NAME
from edged.common.names import MODEL_NAME

DOC = Path(__file__).resolve().parents[4] / "docs" / "fleet-api.json"
METHODS = {"get", "put", "post", "delete", "patch", "options", "head", "trace"}
TOKENS = {role: f"{role}-token-for-the-openapi-test" for role in ROLES}


def load() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DOC.read_text(encoding="utf-8"))
    return doc


def operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(METHOD, path) -> the document's operation."""
    return {
        (method.upper(), path): op
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method in METHODS
    }


def resolve(doc: dict[str, Any], node: Any) -> Any:
    """``node``, or what its ``$ref`` (a local one) points at."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        node = doc
        for part in ref[2:].split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    tokens = [
        {"name": f"{role}-user", "role": role, "sha256": hashlib.sha256(token.encode()).hexdigest()}
        for role, token in TOKENS.items()
    ]
    database = f"sqlite://{tmp_path / 'fleet.db'}"
    config = FleetServiceConfig.model_validate(
        {
            "service": {
                "replica": "openapi-test",
                "state_dir": str(tmp_path),
                "database": database,
            },
            "api": {"tokens": tokens},
        }
    )
    service = Service(config)  # not started: no broker, no threads
    yield service
    service.store.close()


@pytest.fixture
def app(service: Service) -> web.Application:
    return application(service)


def routes(app: web.Application) -> dict[tuple[str, str], str]:
    """(METHOD, path) -> the role the route was registered with (HEAD left out, and the web
    console's HTML pages: not the JSON API this document describes)."""
    found: dict[tuple[str, str], str] = {}
    for route in app.router.routes():
        assert route.resource is not None
        if route.method == "HEAD" or route.resource.canonical.startswith("/console"):
            continue
        found[(route.method, route.resource.canonical)] = route.handler.role  # type: ignore[attr-defined]
    return found


def test_the_document_is_openapi_3_1_json_as_written() -> None:
    raw = DOC.read_bytes()
    text = raw.decode("utf-8")
    doc = json.loads(text)
    assert text == json.dumps(doc, indent=2, ensure_ascii=False) + "\n"  # 2 spaces, a newline
    assert doc["openapi"].startswith("3.1.")
    assert doc["info"]["title"] == "edgefleet fleet service API"
    assert doc["info"]["version"] == "1"
    assert OPENAPI.samefile(DOC) and DOC.is_symlink()  # what the service serves is this file
    schemes = doc["components"]["securitySchemes"]
    assert doc["security"] == [{"bearerAuth": []}]
    assert schemes["bearerAuth"]["type"] == "http"
    assert schemes["bearerAuth"]["scheme"] == "bearer"
    # every $ref points at something, every path template's parameter is declared
    refs = re.findall(r'"\$ref": "([^"]+)"', text)
    assert refs
    for ref in set(refs):
        assert resolve(doc, {"$ref": ref}) is not None, ref
    for path, item in doc["paths"].items():
        named = set(re.findall(r"\{([^}]+)\}", path))
        for method, op in item.items():
            if method not in METHODS:
                continue
            params = [
                resolve(doc, p) for p in item.get("parameters", []) + op.get("parameters", [])
            ]
            declared = {p["name"] for p in params if p["in"] == "path"}
            assert declared == named, (method, path)
            assert all(p["required"] for p in params if p["in"] == "path"), (method, path)


def test_the_document_has_every_route_of_the_app_and_no_other(app: web.Application) -> None:
    assert set(operations(load())) == set(routes(app))


def test_each_operation_states_the_role_its_route_needs(app: web.Application) -> None:
    ops = operations(load())
    for key, role in routes(app).items():
        op = ops[key]
        assert op["x-edgefleet-role"] == role, key
        assert role in op["description"], key


def test_who_may_call_each_operation(app: web.Application) -> None:
    doc = load()
    ops = operations(doc)
    for (method, path), role in routes(app).items():
        op = ops[(method, path)]
        codes = set(op["responses"])
        if path in PUBLIC:
            assert op.get("security") == [], path
            assert "401" not in codes and "403" not in codes, path
            continue
        assert "security" not in op, path  # the global bearer scheme
        assert "401" in codes, (method, path)
        assert ("403" in codes) == (ROLES[role] > ROLES["viewer"]), (method, path)
        for code, response in op["responses"].items():
            response = resolve(doc, response)
            content = response.get("content", {})
            if int(code) >= 400:
                assert content["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/Error"
                }, (method, path, code)
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["error"] and error["properties"]["error"]["type"] == "string"


def ecma(pattern: re.Pattern[str]) -> str:
    """A Python pattern anchored with \\Z as JSON Schema writes it (ECMA-262's $ without the
    m flag is the very end, as \\Z is in Python, whose $ also matches before a last line end)."""
    return pattern.pattern.removesuffix("\\Z") + "$"


def test_the_documents_limits_are_the_codes() -> None:
    schemas = load()["components"]["schemas"]
    labels = schemas["Labels"]
    assert labels["propertyNames"]["pattern"] == ecma(LABEL)
    assert labels["additionalProperties"]["pattern"] == ecma(LABEL)
    assert labels["maxProperties"] == MAX_LABELS
    request = schemas["DeploymentRequest"]["properties"]
    assert request["id"]["pattern"] == ecma(NAME)
    assert request["priority"]["maximum"] == MAX_PRIORITY
    assert request["models"]["maxItems"] == MAX_MODELS
    signed = schemas["SignedManifest"]["properties"]
    assert signed["spec"]["const"] == manifest.SPEC
    assert signed["model"]["pattern"] == ecma(MODEL_NAME)
    assert signed["files"]["maxItems"] == manifest.MAX_FILES
    assert schemas["Manifest"]["properties"]["signatures"]["maxItems"] == manifest.MAX_SIGNATURES
    files = schemas["FileEntry"]["properties"]
    assert files["sha256"]["pattern"] == ecma(manifest.SHA256)
    assert files["length"]["maximum"] == manifest.MAX_FILE_BYTES
    part = manifest.FILE_PART.pattern.removeprefix("^").removesuffix("\\Z")
    assert files["path"]["pattern"] == f"^{part}(/{part})*$"
    assert set(schemas["AuditEntry"]["properties"]["role"]["enum"]) == set(ROLES)
    for path in ("/v1/nodes", "/v1/audit"):
        (limit,) = [p for p in load()["paths"][path]["get"]["parameters"] if p["name"] == "limit"]
        assert limit["schema"]["maximum"] == MAX_PAGE


def test_the_openapi_document_is_valid() -> None:
    from openapi_spec_validator import OpenAPIV31SpecValidator

    OpenAPIV31SpecValidator(load()).validate()


def signed() -> dict[str, Any]:
    """A manifest's signed part (no trust_dir here: its form is all that is checked)."""
    files = [{"path": "m.onnx", "sha256": "0" * 64, "length": 1}]
    return manifest.make("m", 1, files)


async def answers(app: web.Application) -> None:
    doc = load()
    ops = operations(doc)
    example = {
        name: resolve(doc, response)["content"]["application/json"]["example"]
        for name, response in doc["components"]["responses"].items()
        if name in ("Unauthorized", "Forbidden")
    }
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        # this file's bytes, without a token
        reply = await client.get("/v1/openapi.json")
        assert reply.status == 200 and reply.content_type == "application/json"
        assert await reply.read() == DOC.read_bytes()

        def documented(method: str, path: str, status: int) -> None:
            assert str(status) in ops[(method, path)]["responses"], (method, path, status)

        for (method, path), op in ops.items():
            url = path.replace("{node}", "n1").replace("{id}", "d1").replace("{action}", "pause")
            if path in PUBLIC:
                reply = await client.request(method, url)
                documented(method, path, reply.status)
                continue
            # no token, a wrong one: 401
            for headers in ({}, {"Authorization": "Bearer not-a-token"}):
                reply = await client.request(method, url, headers=headers)
                assert reply.status == 401, (method, path)
                assert await reply.json() == example["Unauthorized"]
            role = op["x-edgefleet-role"]
            if ROLES[role] > ROLES["viewer"]:  # a viewer: 403, naming the role needed
                reply = await client.request(
                    method, url, headers={"Authorization": f"Bearer {TOKENS['viewer']}"}
                )
                assert reply.status == 403, (method, path)
                message = f"role viewer may not do this: {role} needed"
                assert await reply.json() == {"error": message}
                if role == "operator":
                    assert example["Forbidden"] == {"error": message}

        # calls an empty registry answers: each status is one the document gives
        async def call(method: str, path: str, url: str, role: str, **kw: Any) -> Any:
            headers = {"Authorization": f"Bearer {TOKENS[role]}"}
            reply = await client.request(method, url, headers=headers, **kw)
            documented(method, path, reply.status)
            return reply.status, await reply.json()

        for state in doc["components"]["schemas"]["NodeState"]["enum"]:
            status, page = await call("GET", "/v1/nodes", f"/v1/nodes?state={state}", "viewer")
            assert status == 200 and page == {"nodes": [], "next": None, "counts": {}}
        # "²": str.isdigit takes it, int() does not (was a 500); 5,000 digits: int() refuses
        for query in (
            "state=zombie",
            "limit=abc",
            "selector=a",
            "selector=a=b%20c",
            "limit=%C2%B2",
            "limit=" + "1" * 5000,
        ):
            assert (await call("GET", "/v1/nodes", f"/v1/nodes?{query}", "viewer"))[0] == 400
        assert await call("GET", "/v1/nodes/{node}", "/v1/nodes/n1", "viewer") == (
            404,
            {"error": "no such node"},
        )
        got = await call("GET", "/v1/nodes/{node}/history", "/v1/nodes/n1/history", "viewer")
        assert got == (200, {"history": []})
        labels = "/v1/nodes/{node}/labels"
        assert (
            await call(
                "PUT", labels, "/v1/nodes/n1/labels", "operator", json={"labels": {"k": "v"}}
            )
        )[0] == 404
        assert (
            await call("PUT", labels, "/v1/nodes/n1/labels", "operator", json={"labels": {"k": 1}})
        )[0] == 422
        assert (await call("PUT", labels, "/v1/nodes/n1/labels", "admin", data=b"{nope"))[0] == 400
        got = await call("GET", "/v1/deployments", "/v1/deployments", "viewer")
        assert got == (200, {"deployments": []})
        status, _ = await call(
            "POST",
            "/v1/deployments",
            "/v1/deployments",
            "operator",
            json={"id": "d1", "models": []},
        )
        assert status == 422
        one = "/v1/deployments/{id}"
        assert (await call("GET", one, "/v1/deployments/d1", "viewer"))[0] == 404
        assert (await call("DELETE", one, "/v1/deployments/d1", "admin"))[0] == 404
        got = await call("GET", "/v1/rollouts", "/v1/rollouts", "viewer")
        assert got == (200, {"rollouts": []})
        assert (await call("GET", "/v1/rollouts/{id}", "/v1/rollouts/r1", "viewer"))[0] == 404
        act = "/v1/rollouts/{id}/{action}"
        for action in ("pause", "explode"):
            status, _ = await call("POST", act, f"/v1/rollouts/r1/{action}", "operator")
            assert status == 404
        status, why = await call(
            "POST", "/v1/rollouts", "/v1/rollouts", "operator", json={"id": "r1", "stages": [0.5]}
        )
        assert status == 422
        body = {"id": "r1", "manifest": {"signed": signed()}, "urls": {"m.onnx": "https://x/m"}}
        status, why = await call("POST", "/v1/rollouts", "/v1/rollouts", "operator", json=body)
        assert status == 409 and "deploy key" in why["error"]  # none configured here
        for query in ("after=x", "after=%C2%B2", "after=" + "9" * 5000, "limit=%C2%B2"):
            assert (await call("GET", "/v1/audit", f"/v1/audit?{query}", "operator"))[0] == 400
        metrics = "/v1/fleet/metrics"
        for query in ("shard=%C2%B2", "shards=%C2%B2", "shard=1&shards=1", "shards=999"):
            viewer = {"Authorization": f"Bearer {TOKENS['viewer']}"}
            reply = await client.get(f"{metrics}?{query}", headers=viewer)
            assert reply.status == 400, query
            documented("GET", metrics, reply.status)
        status, log = await call("GET", "/v1/audit", "/v1/audit?limit=2", "operator")
        assert status == 200 and log["next"] == 2 and len(log["entries"]) == 2
        entry = doc["components"]["schemas"]["AuditEntry"]
        assert set(log["entries"][0]) == set(entry["required"]) == set(entry["properties"])


def test_the_service_serves_this_document_and_answers_as_it_says(app: web.Application) -> None:
    asyncio.run(answers(app))
