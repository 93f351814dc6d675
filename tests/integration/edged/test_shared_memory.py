"""Triton's system shared memory extension with Triton's own client and its shared-memory
utilities (tritonclient.utils.shared_memory), unchanged: gRPC on edged's socket, HTTP through a
loopback relay. Inputs and outputs pass by region, offset and size; the error cases name the
region; a region is its uid's own (another uid, as 65534 with setpriv, neither reads a file its
mode keeps from it nor uses another's region); a process's regions go when it exits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests import asunit
from tests.conftest import MODELS, Daemon, skip_or_fail
from tests.relay import tcp_relay

MODEL = "intent-classifier"
IN_BYTES, OUT_BYTES = 384 * 4, 6 * 4


@pytest.fixture(scope="module")
def expected() -> tuple[np.ndarray, np.ndarray]:
    embedding = np.random.default_rng(7).standard_normal((1, 384)).astype(np.float32)
    session = ort.InferenceSession(str(MODELS / MODEL / "1" / "model.onnx"))
    (probabilities,) = session.run(["probabilities"], {"embedding": embedding})
    return embedding, probabilities


@pytest.fixture
def regions(daemon: Daemon) -> Iterator[dict[str, Any]]:
    """An input and an output region, as a client makes them (its handles by name), shared
    with edged's group as docs/API.md says (chgrp edged, mode 0660)."""
    tag = f"edged_test_{os.getpid()}"
    handles = {
        "in": shm.create_shared_memory_region("in", f"/{tag}_in", IN_BYTES),
        "out": shm.create_shared_memory_region("out", f"/{tag}_out", OUT_BYTES),
    }
    if daemon.account is not None:
        for name in ("in", "out"):
            os.chown(f"/dev/shm/{tag}_{name}", -1, daemon.account.gid)
            os.chmod(f"/dev/shm/{tag}_{name}", 0o660)
    yield {"tag": tag, **handles}
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)


def grpc_of(daemon: Daemon) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"unix://{daemon.socket.with_name('edged-grpc.sock')}")


def test_tritons_grpc_client_passes_tensors_through_shared_memory(
    daemon: Daemon, regions: dict[str, Any], expected: tuple[np.ndarray, np.ndarray]
) -> None:
    client = grpc_of(daemon)
    assert "system_shared_memory" in client.get_server_metadata().extensions
    embedding, probabilities = expected
    shm.set_shared_memory_region(regions["in"], [embedding])
    tag = regions["tag"]
    client.register_system_shared_memory("in", f"/{tag}_in", IN_BYTES)
    client.register_system_shared_memory("out", f"/{tag}_out", OUT_BYTES)
    try:
        status = client.get_system_shared_memory_status().regions
        assert {n: (r.key, r.byte_size) for n, r in status.items()} == {
            "in": (f"/{tag}_in", IN_BYTES),
            "out": (f"/{tag}_out", OUT_BYTES),
        }
        tensor = grpcclient.InferInput("embedding", [1, 384], "FP32")
        tensor.set_shared_memory("in", IN_BYTES)
        wanted = grpcclient.InferRequestedOutput("probabilities")
        wanted.set_shared_memory("out", OUT_BYTES)
        result = client.infer(MODEL, [tensor], outputs=[wanted])
        output = result.get_output("probabilities")
        assert output.parameters["shared_memory_region"].string_param == "out"
        assert output.parameters["shared_memory_byte_size"].int64_param == OUT_BYTES
        assert not result.get_response().raw_output_contents  # not in the answer: in the region
        got = shm.get_contents_as_numpy(regions["out"], np.float32, [1, 6])
        np.testing.assert_allclose(got, probabilities, atol=1e-6)
        # an input at an offset of a larger region: the second half of "in" is not read
        with pytest.raises(InferenceServerException) as small:
            half = grpcclient.InferInput("embedding", [1, 384], "FP32")
            half.set_shared_memory("in", IN_BYTES, offset=4)
            client.infer(MODEL, [half])
        assert "region 'in': offset 4 + 1536 bytes is past its 1536 bytes" in small.value.message()
    finally:
        client.unregister_system_shared_memory()
    assert not client.get_system_shared_memory_status().regions


def test_tritons_http_client_through_a_relay_does_the_same(
    daemon: Daemon, regions: dict[str, Any], expected: tuple[np.ndarray, np.ndarray]
) -> None:
    embedding, probabilities = expected
    shm.set_shared_memory_region(regions["in"], [embedding])
    with tcp_relay(daemon.socket) as address:
        client = httpclient.InferenceServerClient(address)
        client.register_system_shared_memory("in", f"/{regions['tag']}_in", IN_BYTES)
        client.register_system_shared_memory("out", f"/{regions['tag']}_out", OUT_BYTES)
        try:
            tensor = httpclient.InferInput("embedding", [1, 384], "FP32")
            tensor.set_shared_memory("in", IN_BYTES)
            wanted = httpclient.InferRequestedOutput("probabilities", binary_data=True)
            wanted.set_shared_memory("out", OUT_BYTES)
            result = client.infer(MODEL, [tensor], outputs=[wanted])
            assert result.get_output("probabilities")["parameters"] == {
                "shared_memory_region": "out",
                "shared_memory_byte_size": OUT_BYTES,
            }
            got = shm.get_contents_as_numpy(regions["out"], np.float32, [1, 6])
            np.testing.assert_allclose(got, probabilities, atol=1e-6)
            assert [r["name"] for r in client.get_system_shared_memory_status()] == ["in", "out"]
            client.unregister_system_shared_memory("in")
            assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]
        finally:
            client.unregister_system_shared_memory()
        with pytest.raises(InferenceServerException) as cuda:  # no CUDA here: said so
            client.get_cuda_shared_memory_status()
        assert "CUDA shared memory: not on this edged" in cuda.value.message()
    with pytest.raises(InferenceServerException, match="UNIMPLEMENTED"):
        grpc_of(daemon).get_cuda_shared_memory_status()


def test_the_error_cases_name_the_region_and_the_limit(
    daemon: Daemon, regions: dict[str, Any]
) -> None:
    client = grpc_of(daemon)
    tag = regions["tag"]

    def refused(call: Any, says: str) -> None:
        with pytest.raises(InferenceServerException) as error:
            call()
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT", error.value
        assert says in error.value.message(), error.value.message()

    refused(
        lambda: client.register_system_shared_memory("big", f"/{tag}_in", IN_BYTES, 8),
        "offset 8 + byte_size 1536 is past the end",
    )
    refused(
        lambda: client.register_system_shared_memory("x", "/no_such_key_here", 4),
        "no such shared-memory file",
    )
    refused(
        lambda: client.register_system_shared_memory("x", "/../etc/passwd", 4), "one path component"
    )
    os.symlink(f"/dev/shm/{tag}_in", f"/dev/shm/{tag}_link")
    try:
        refused(
            lambda: client.register_system_shared_memory("x", f"/{tag}_link", 4),
            "a link is refused",
        )
    finally:
        os.unlink(f"/dev/shm/{tag}_link")
    client.register_system_shared_memory("in", f"/{tag}_in", IN_BYTES)
    client.register_system_shared_memory("tiny", f"/{tag}_out", 4)
    try:
        refused(
            lambda: client.register_system_shared_memory("in", f"/{tag}_in", IN_BYTES),
            "registered already",
        )
        tensor = grpcclient.InferInput("embedding", [1, 384], "FP32")
        tensor.set_shared_memory("nope", IN_BYTES)
        refused(lambda: client.infer(MODEL, [tensor]), "no shared-memory region 'nope'")
        tensor.set_shared_memory("in", IN_BYTES - 4)
        refused(lambda: client.infer(MODEL, [tensor]), "needs 1536 bytes")
        tensor.set_shared_memory("in", IN_BYTES)
        wanted = grpcclient.InferRequestedOutput("probabilities")
        wanted.set_shared_memory("tiny", 4)
        refused(
            lambda: client.infer(MODEL, [tensor], outputs=[wanted]),
            "the output is 24 bytes, the request gave 4",
        )
        # the file made smaller under a registered region: an error, not a crash
        os.truncate(f"/dev/shm/{tag}_in", 100)
        refused(lambda: client.infer(MODEL, [tensor]), "its file is smaller than registered")
        assert client.is_server_live()
    finally:
        client.unregister_system_shared_memory()


OTHER_UID = """
import json, sys
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
client = grpcclient.InferenceServerClient("unix://" + sys.argv[1])
seen = []
for name, key in (("stolen", sys.argv[2]), ):
    try:
        client.register_system_shared_memory(name, key, 16)
        seen.append("registered")
    except InferenceServerException as exc:
        seen.append(exc.message())
seen.append(sorted(client.get_system_shared_memory_status().regions))
try:
    client.unregister_system_shared_memory("roots")
    seen.append("unregistered")
except InferenceServerException as exc:
    seen.append(exc.message())
print(json.dumps(seen))
"""


def test_another_uid_neither_reads_a_file_kept_from_it_nor_sees_anothers_region(
    daemon: Daemon, regions: dict[str, Any]
) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        skip_or_fail("another uid needs root and setpriv (make test runs so)")
    tag = regions["tag"]
    client = grpc_of(daemon)
    client.register_system_shared_memory("roots", f"/{tag}_out", OUT_BYTES)
    try:
        path = daemon.socket.with_name("edged-grpc.sock")
        # the probe must reach the socket: search permission on its directories, for now
        closed = [(d, d.stat().st_mode) for d in path.parents if not d.stat().st_mode & 0o001]
        for directory, mode in closed:
            directory.chmod(mode | 0o001)
        mode = path.stat().st_mode
        path.chmod(0o666)
        try:
            done = subprocess.run(
                [
                    *asunit.setpriv(65534),
                    sys.executable,
                    "-c",
                    OTHER_UID,
                    str(path),
                    f"/{tag}_in",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "HOME": "/"},
            )
        finally:
            path.chmod(mode)
            for directory, before in closed:
                directory.chmod(before)
        assert done.returncode == 0, done.stderr
        stolen, listed, unregistered = json.loads(done.stdout)
        assert "its mode does not let uid 65534" in stolen  # root's, edged's group may read it
        assert listed == [] and "no shared-memory region 'roots'" in unregistered
        assert list(client.get_system_shared_memory_status().regions) == ["roots"]
    finally:
        client.unregister_system_shared_memory()


CHILD = """
import sys, tritonclient.grpc as grpcclient
client = grpcclient.InferenceServerClient("unix://" + sys.argv[1])
client.register_system_shared_memory("left", sys.argv[2], 16)
print(len(client.get_system_shared_memory_status().regions))
"""


def test_a_processes_regions_go_when_it_exits(daemon: Daemon, regions: dict[str, Any]) -> None:
    path = daemon.socket.with_name("edged-grpc.sock")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), f"/{regions['tag']}_in"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    client = grpc_of(daemon)
    deadline = time.monotonic() + 10
    while client.get_system_shared_memory_status().regions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not client.get_system_shared_memory_status().regions
