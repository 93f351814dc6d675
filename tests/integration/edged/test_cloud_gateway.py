"""The cloud tier behind an API gateway: https with TLS 1.3 at least, mutual TLS, a bearer token
and a path prefix (the brief's gateway routes /api/v1/... to the inference server).

The gateway is a small aiohttp reverse proxy on loopback in front of the real MLServer; the
certificates are made for the test with ``cryptography`` (a CA, the gateway's, the device's, and
a rogue device's from another CA). What the gateway saw (path, client certificate, token) is
checked on its side.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import CLOUD_MODEL, Cloud, Daemon, LoopThread, wait_for
from tests.integration.edged.test_routing import ask, cloud_state
from tests.pki import gateway_pki

TOKEN = "Bearer s3cret-fleet-token"
# what the gateway passes on, both ways (binary tensors' JSON header length: Triton takes them)
PASSED = ("Content-Type", "Inference-Header-Content-Length")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gateway_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class Gateway(LoopThread):
    """An https reverse proxy: ``/api/v1/<path>`` -> the cloud server's ``/<path>``."""

    upstream: str
    pki: Path
    max_version: ssl.TLSVersion = ssl.TLSVersion.MAXIMUM_SUPPORTED
    seen: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    async def _close(self) -> None:
        await self.runner.cleanup()
        await self.session.close()

    async def _serve(self) -> None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.pki / "ca.pem")
        context.load_cert_chain(self.pki / "gateway.pem", self.pki / "gateway.key")
        context.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: the device must show its cert
        context.maximum_version = self.max_version
        app = web.Application()
        app.router.add_route("*", "/api/v1/{tail:.*}", self._forward)
        self.session = aiohttp.ClientSession()
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _forward(self, request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(x[0] for x in peer["subject"]) if peer else {}
        self.seen.append(
            {
                "path": request.path,
                "client": subject.get("commonName"),
                "token": request.headers.get("Authorization"),
            }
        )
        if request.headers.get("Authorization") != TOKEN:
            return web.json_response({"error": "unauthorized"}, status=401)
        async with self.session.request(
            request.method,
            f"{self.upstream}/{request.match_info['tail']}",
            data=await request.read(),
            headers={k: v for k, v in request.headers.items() if k in PASSED},
        ) as upstream:
            body = await upstream.read()  # decoded, if Triton gzipped it
            headers = {k: v for k, v in upstream.headers.items() if k in PASSED}
            headers.pop("Content-Encoding", None)
            return web.Response(body=body, status=upstream.status, headers=headers)


@pytest.fixture
def gateway(cloud: Cloud, pki: Path) -> Iterator[Gateway]:
    gw = Gateway(cloud.peer.http_url, pki).start()
    yield gw
    gw.stop()


def daemon_behind(
    make_daemon: type[Daemon], gw: Gateway | GrpcGateway, pki: Path, **cloud: str
) -> Daemon:
    token = pki / "token"
    token.write_text(cloud.pop("token", TOKEN) + "\n")
    token.chmod(0o600)  # edged refuses a token file others may read
    settings = {
        "url": f"https://localhost:{gw.port}/api/v1",
        "ca_file": str(pki / "ca.pem"),
        "cert_file": str(pki / "device.pem"),
        "key_file": str(pki / "device.key"),
        "token_file": str(token),
        **cloud,
    }
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
    config = f'[models]\nload = ["{CLOUD_MODEL}"]\n[cloud]\n{lines}\n'
    daemon = make_daemon(config=config)
    daemon.give(pki)  # the device's key and token are edged's to read, and no one else's
    return daemon.start()


def test_calls_go_through_the_gateway_with_mtls_token_and_prefix(
    make_daemon: type[Daemon], gateway: Gateway, pki: Path
) -> None:
    daemon = daemon_behind(make_daemon, gateway, pki)
    client = daemon.client
    wait_for(lambda: CLOUD_MODEL in cloud_state(client)["catalog"], 10, "the catalog via the gw")
    answer = ask(client, 1, route="cloud")
    assert answer["route"] == "cloud", answer
    infer = [s for s in gateway.seen if s["path"].endswith("/infer")]
    assert infer == [
        {
            "path": f"/api/v1/v2/models/{CLOUD_MODEL}/infer",
            "client": "edge-node-1",
            "token": TOKEN,
        }
    ]
    assert all(s["client"] == "edge-node-1" and s["token"] == TOKEN for s in gateway.seen)


@pytest.mark.parametrize(
    ("case", "settings", "max_tls"),
    [
        ("a gateway that stops at TLS 1.2", {}, ssl.TLSVersion.TLSv1_2),
        (
            "a certificate from another CA",
            {"cert_file": "rogue.pem", "key_file": "rogue.key"},
            None,
        ),
        ("a wrong token", {"token": "Bearer guess"}, None),
    ],
)
def test_a_gateway_edged_cannot_trust_or_enter_is_down_and_work_stays_local(
    make_daemon: type[Daemon],
    cloud: Cloud,
    pki: Path,
    case: str,
    settings: dict[str, str],
    max_tls: ssl.TLSVersion | None,
) -> None:
    gw = Gateway(cloud.peer.http_url, pki)
    if max_tls is not None:
        gw.max_version = max_tls
    gw.start()
    try:
        for key in ("cert_file", "key_file"):
            if key in settings:
                settings[key] = str(pki / settings[key])
        daemon = daemon_behind(make_daemon, gw, pki, **settings)
        client = daemon.client
        wait_for(lambda: cloud_state(client)["link"]["failures"] >= 2, 10, f"{case}: refused")
        state = cloud_state(client)
        print(f"{case}: {state['link']['last_error']}")
        assert not state["link"]["up"] and state["link"]["last_error"]
        answer = ask(client, 1, route="cloud")
        assert answer["route"] == "local" and "is down" in answer["reason"], answer
        assert not [s for s in gw.seen if s["path"].endswith("/infer")]
    finally:
        gw.stop()


# ---- gRPC over mutual TLS ----------------------------------------------------------------------


class GrpcGateway(LoopThread):
    """A gRPC pass-through with mutual TLS in front of the cloud's gRPC port: every unary call
    is forwarded as bytes; what it saw (method, client certificate, token) is kept."""

    def __init__(self, upstream: str, pki: Path) -> None:
        self.upstream = upstream
        self.pki = pki
        self.seen: list[dict[str, Any]] = []
        self.start()

    async def _serve(self) -> None:
        import grpc

        self.channel = grpc.aio.insecure_channel(self.upstream)
        gateway = self

        class Forward(grpc.GenericRpcHandler):
            def service(self, details: Any) -> Any:
                method = details.method

                async def unary(request: bytes, context: Any) -> bytes:
                    names = context.auth_context().get("x509_common_name", [b""])
                    metadata = dict(context.invocation_metadata())
                    gateway.seen.append(
                        {
                            "method": method,
                            "client": names[0].decode(),
                            "token": metadata.get("authorization"),
                        }
                    )
                    call = gateway.channel.unary_unary(method)
                    return await call(request, metadata=[("authorization", TOKEN)])

                return grpc.unary_unary_rpc_method_handler(unary)

        credentials = grpc.ssl_server_credentials(
            [((self.pki / "gateway.key").read_bytes(), (self.pki / "gateway.pem").read_bytes())],
            root_certificates=(self.pki / "ca.pem").read_bytes(),
            require_client_auth=True,
        )
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([Forward()])
        self.port = self.server.add_secure_port("localhost:0", credentials)
        await self.server.start()

    async def _close(self) -> None:
        await self.server.stop(0)
        await self.channel.close()


def test_grpcs_with_mutual_tls_and_a_token(
    make_daemon: type[Daemon], cloud: Cloud, pki: Path
) -> None:
    gw = GrpcGateway(cloud.peer.grpc_url, pki)
    try:
        daemon = daemon_behind(make_daemon, gw, pki, url=f"grpcs://localhost:{gw.port}")
        client = daemon.client
        wait_for(lambda: CLOUD_MODEL in cloud_state(client)["catalog"], 10, "the catalog")
        answer = ask(client, 1, route="cloud")
        assert answer["route"] == "cloud", answer
        infer = [s for s in gw.seen if s["method"].endswith("/ModelInfer")]
        assert infer == [
            {
                "method": "/inference.GRPCInferenceService/ModelInfer",
                "client": "edge-node-1",
                "token": TOKEN,
            }
        ]
        rogue = daemon_behind(
            make_daemon,
            gw,
            pki,
            url=f"grpcs://localhost:{gw.port}",
            cert_file=str(pki / "rogue.pem"),
            key_file=str(pki / "rogue.key"),
        )
        wait_for(lambda: cloud_state(rogue.client)["link"]["failures"] >= 2, 10, "refused")
        assert not cloud_state(rogue.client)["link"]["up"]
        assert {s["client"] for s in gw.seen} == {"edge-node-1"}  # the rogue never got in
    finally:
        gw.stop()
