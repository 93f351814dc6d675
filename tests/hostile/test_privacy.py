"""The privacy property against real daemons and a real cloud tier (MLServer behind the fault
proxy, which keeps every byte sent towards the cloud): with privacy from each source (the
request's flag, ``routing.private_models``, ``privacy: private`` in config.pbtxt, a private
knowledge namespace) and the route cloud, auto (with escalation forced) or hedged, over REST and
gRPC, no inference request derived from the private input reaches the cloud. Each case has a
control (the same call without privacy) that does reach it, so the check can fail.

The cloud's catalog lists every default model ([[cloud.models]]), so every step of every
pipeline could be sent there; MLServer serves only the classifier and the answer model, so the
rest fail there and run locally — after the bytes have left, which is what is checked.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from edged.client import Client, ClientError
from tests.conftest import (
    ANSWER_MODEL,
    MODELS,
    Cloud,
    Daemon,
    copy_model,
    linked_repository,
    wait_for,
)
from tests.media import speech_in_silence, text_image

MARK = "zqxprivacymark"  # in every private text: found in the bytes sent, it leaked
ALL_MODELS = sorted(p.parent.name for p in MODELS.glob("*/config.pbtxt"))
PIPELINES = ("intent", "ocr", "vad")
ROUTES = ("cloud", "auto", "hedged")


def _param(key: str, value: str) -> str:
    return f'parameters {{\n  key: "{key}"\n  value {{ string_value: "{value}" }}\n}}\n'


def _repository(path: Path, private_configs: bool) -> Path:
    """The default models; the classifier always escalates (a local answer is never sure
    enough); with ``private_configs``, the pipelines say ``privacy: private``."""
    repo = linked_repository(path)
    classifier = copy_model(repo, "intent-classifier") / "config.pbtxt"
    classifier.write_text(classifier.read_text() + _param("escalate_below", "1.01"))
    if private_configs:
        for name in PIPELINES:
            config = copy_model(repo, name) / "config.pbtxt"
            config.write_text(config.read_text() + _param("privacy", "private"))
    return repo


def _config(cloud: Cloud, private_models: tuple[str, ...] = ()) -> str:
    models = "".join(f'[[cloud.models]]\nname = "{m}"\n' for m in [*ALL_MODELS, ANSWER_MODEL])
    return f"""
[cloud]
url = "http://{cloud.proxy.address}"
breaker_min_calls = 1000000
{models}
[routing]
private_models = {json.dumps(list(private_models))}
[knowledge]
answer_model = "{ANSWER_MODEL}"
answer_threshold = 1.0
private_namespaces = ["secret"]
"""


def _start(make_daemon: type[Daemon], cloud: Cloud, repo: Path, config: str) -> Daemon:
    daemon = make_daemon(models=repo, config=config).start()
    wait_for(lambda: daemon.client.status()["cloud"]["link"]["up"], 60, "the cloud link up")
    catalog = lambda: set(ALL_MODELS) <= set(daemon.client.status()["cloud"]["catalog"])  # noqa: E731
    wait_for(catalog, 30, "the cloud's catalog with every model")
    return daemon


@pytest.fixture(scope="module")
def inputs() -> dict[str, bytes]:
    """A private input for each pipeline, each holding the marker where it can."""
    wav, _, _ = speech_in_silence(f"{MARK} turn on the lights", 0.3, 0.3)
    return {
        "intent": f"{MARK} turn on the lights in the kitchen".encode(),
        "ocr": text_image([MARK.upper(), "TOTAL 12.50"]),
        "vad": wav,
    }


def _rest(client: Client, model: str, data: bytes, **params: Any) -> dict[str, Any]:
    if model == "intent":
        return client.task("intent", {"texts": [data.decode()]}, **params)
    return client.task(model, raw=data, **params)


def _grpc(daemon: Daemon, model: str, data: bytes, **params: Any) -> dict[str, Any]:
    triton = grpcclient.InferenceServerClient(
        url=f"unix://{daemon.socket}".replace("edged.sock", "edged-grpc.sock")
    )
    name = {"intent": "text", "ocr": "image", "vad": "audio"}[model]
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
    result = triton.infer(model, [tensor], parameters=params)
    answer = result.get_response().parameters
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in answer.items()}


def _call(daemon: Daemon, transport: str, model: str, data: bytes, **params: Any) -> Any:
    if transport == "rest":
        return _rest(daemon.client, model, data, **params)
    return _grpc(daemon, model, data, **params)


def _left(cloud: Cloud) -> bytes:
    """What was sent towards the cloud since the last look, less the link's probes."""
    return cloud.proxy.sent()


def _settle(cloud: Cloud, quiet_s: float = 0.5, limit_s: float = 10.0) -> None:
    """Forget what was sent, once nothing /infer has been sent for ``quiet_s``: a control call
    that hedged may leave its losing path's steps running after it answered (a pipeline's later
    chunks reach the cloud a moment later), and those are not the next step's."""
    deadline = time.monotonic() + limit_s
    last = time.monotonic()
    while time.monotonic() < deadline:
        if b"/infer" in _left(cloud):
            last = time.monotonic()
        elif time.monotonic() - last >= quiet_s:
            return
        time.sleep(0.05)


def _assert_nothing_left(cloud: Cloud, what: str, only: bytes = b"/infer") -> None:
    """Nothing derived from the private input left: no inference request at all (``only``:
    none to that path), and not the marker, neither while the call ran nor in the second after
    it answered (what it may have left running)."""
    sent = _left(cloud)
    time.sleep(1.0)
    sent += _left(cloud)
    assert MARK.encode() not in sent.lower(), f"{what}: the marker reached the cloud"
    assert only not in sent, f"{what}: a request to {only.decode()} reached the cloud"


@pytest.fixture
def quiet(cloud: Cloud) -> Iterator[Cloud]:
    cloud.proxy.restore()
    cloud.fail_every(0)
    _left(cloud)
    yield cloud


@pytest.mark.timeout(600)
def test_request_flag_keeps_every_step_and_template_on_the_device(
    make_daemon: type[Daemon],
    quiet: Cloud,
    inputs: dict[str, bytes],
    tmp_path: Path,
) -> None:
    daemon = _start(make_daemon, quiet, _repository(tmp_path / "repo", False), _config(quiet))
    for transport in ("rest", "grpc"):
        for model in PIPELINES:
            for route in ROUTES:
                what = f"{model} over {transport}, route {route}"
                _settle(quiet)
                reply = _call(daemon, transport, model, inputs[model], route=route, private=True)
                _assert_nothing_left(quiet, f"private {what}")
                assert reply["route"] == "local" and reply["private"] is True, (what, reply)
                # the control: without the flag, the same call does reach the cloud
                if route != "auto" or model == "intent":  # auto: only escalation is certain
                    _call(daemon, transport, model, inputs[model], route=route)
                    assert b"/infer" in _left(quiet), f"control ({what}) never reached the cloud"
    # the templates, private as a whole: the report of the image is not written in the cloud
    image = {"base64": base64.b64encode(inputs["ocr"]).decode()}
    for route in ROUTES:
        doc = {"template": "image-report", "inputs": {"image": image}}
        _settle(quiet)
        with pytest.raises(ClientError):  # the report needs the answer model: not on the device
            daemon.client.run_task(doc, route=route, private=True)
        _assert_nothing_left(quiet, f"image-report, route {route}")
        daemon.client.run_task(doc, route=route)  # control: the released text is reported
        assert b"/infer" in _left(quiet), "control: image-report's report never reached the cloud"
        voice = {"audio": {"base64": base64.b64encode(inputs["vad"]).decode()}}
        daemon.client.run_task(
            {"template": "voice-command", "inputs": voice}, route=route, private=True
        )
        _assert_nothing_left(quiet, f"voice-command, route {route}")
        # no flag: the template's audio is private by default (and transcribe's is)
        daemon.client.run_task({"template": "voice-command", "inputs": voice}, route=route)
        _assert_nothing_left(quiet, f"voice-command without a flag, route {route}")
        if route != "auto":  # control: the audio released, its steps do reach the cloud
            released = {"audio": {**voice["audio"], "private": False}}
            daemon.client.run_task({"template": "voice-command", "inputs": released}, route=route)
            assert b"/infer" in _left(quiet), "control: released audio never reached the cloud"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["private_models", "config.pbtxt"])
def test_a_private_model_makes_its_steps_and_what_follows_private(
    make_daemon: type[Daemon],
    quiet: Cloud,
    inputs: dict[str, bytes],
    tmp_path: Path,
    source: str,
) -> None:
    operator = PIPELINES if source == "private_models" else ()
    repo = _repository(tmp_path / "repo", source == "config.pbtxt")
    daemon = _start(make_daemon, quiet, repo, _config(quiet, operator))
    for transport in ("rest", "grpc"):
        for model in PIPELINES:
            for route in ROUTES:
                what = f"{model} ({source}) over {transport}, route {route}"
                _settle(quiet)
                reply = _call(daemon, transport, model, inputs[model], route=route)
                _assert_nothing_left(quiet, what)
                assert reply["route"] == "local" and reply["private"] is True, (what, reply)
                assert "is private" in reply["reason"], (what, reply)
    # the steps themselves are not private: called on their own, they may go (the control)
    daemon.client.embed([MARK], route="cloud")
    assert MARK.encode() in _left(quiet), "control: text-embedding on its own never reached it"
    # a task node that runs a private model: its output is private for the nodes after it
    graph = {
        "nodes": [
            {"id": "command", "task": "intent", "inputs": {"text": "$text"}},
            {"id": "report", "task": "report", "inputs": {"text": "command.intent"}},
        ]
    }
    with pytest.raises(ClientError):
        daemon.client.run_task({"graph": graph, "inputs": {"text": MARK}}, route="cloud")
    _assert_nothing_left(quiet, "a report on a private model's output")


@pytest.mark.timeout(300)
def test_a_private_namespace_keeps_its_passages_and_what_follows_on_the_device(
    make_daemon: type[Daemon], quiet: Cloud, tmp_path: Path
) -> None:
    daemon = _start(make_daemon, quiet, _repository(tmp_path / "repo", False), _config(quiet))
    passage = f"The vault code is {MARK} and it opens the vault at noon."
    for namespace in ("secret", "open"):
        daemon.client.kb_ingest(namespace, [{"text": passage, "source": "vault.txt"}])

    def graph(namespace: str) -> dict[str, Any]:
        nodes = [
            {
                "id": "hits",
                "task": "search",
                "inputs": {"query": "$question"},
                "params": {"namespace": namespace},
            },
            {
                "id": "answer",
                "task": "answer",
                "inputs": {"question": "$question", "context": "hits.context"},
            },
        ]
        return {"graph": {"nodes": nodes}, "inputs": {"question": "what opens the vault?"}}

    # the question is not private (its embedding may go), the passages and the answer are
    answer_model = f"/{ANSWER_MODEL}/".encode()
    with pytest.raises(ClientError):  # the answer model is only in the cloud
        daemon.client.run_task(graph("secret"), route="cloud")
    _assert_nothing_left(quiet, "an answer on a private namespace's passages", answer_model)
    reply = daemon.client.kb_ask("secret", "what opens the vault?")
    assert reply["answered_by"] == "passage", reply
    _assert_nothing_left(quiet, "ask in a private namespace", answer_model)
    # the control: the same graph over the open namespace sends the passage to the answer model
    daemon.client.run_task(graph("open"), route="cloud")
    assert MARK.encode() in _left(quiet), "control: the open namespace's passage never left"
