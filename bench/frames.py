#!/usr/bin/env python3
"""A camera frame into a model: what each way in costs, against the same graph in-process.

The frame is 1920x1080x3 uint8 (6.2 MB), the graph reads all of it (ReduceMax over every
element, cast to float: one number out), so the serving cost is moving the frame. Rows, one
run, batch 1, sequential calls (medians and p95 of ``--runs`` calls):

- ``in-process``: ONNX Runtime's ``InferenceSession.run`` in this process (the baseline);
- ``REST JSON``: the frame as a JSON list (``server.max_json_bytes`` raised for it);
- ``REST binary``: Triton's binary tensor extension, one keep-alive connection;
- ``gRPC``: tritonclient.grpc, ``raw_input_contents``;
- ``gRPC + shared memory``: tritonclient.grpc, the frame written into a registered system
  shared-memory region (tritonclient.utils.shared_memory) before each call, as a camera loop
  does; the write is counted in the call's time;
- ``REST + shared memory``: the same region named in a JSON request on the REST socket;
- ``... + sealed memfd``: the same two, through a region edged made (the region socket,
  ``Client.shared_region``) and reads in place: the frame copied into it before each call as
  above, and, in the last rows, not copied (a camera that writes its frames into the region),
  called over the region socket itself (``SharedRegion.infer``: no HTTP) and over REST.

``overhead`` is a row's p50 minus in-process p50.

    .venv/bin/python bench/frames.py [--runs 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import UnixHTTPConnection, rest_request  # noqa: E402
from bench.serving import timed  # noqa: E402
from edged.client import Client  # noqa: E402

SHAPE = [1, 1080, 1920, 3]
CONFIG = """name: "frame"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "image" data_type: TYPE_UINT8 dims: [ 1, 1080, 1920, 3 ] } ]
output [ { name: "peak" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def frame_model(repository: Path) -> Path:
    """A graph that reads every byte of the frame: max over it, as float."""
    nodes = [
        helper.make_node("ReduceMax", ["image"], ["top"], keepdims=0),
        helper.make_node("Cast", ["top"], ["scalar"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["scalar", "one"], ["peak"]),
    ]
    graph = helper.make_graph(
        nodes,
        "frame",
        [helper.make_tensor_value_info("image", TensorProto.UINT8, SHAPE)],
        [helper.make_tensor_value_info("peak", TensorProto.FLOAT, [1])],
        [helper.make_tensor("one", TensorProto.INT64, [1], [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = repository / "frame" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    save(model, str(path))
    (repository / "frame" / "config.pbtxt").write_text(CONFIG)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    import subprocess

    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    frame = np.random.default_rng(0).integers(0, 255, SHAPE, dtype=np.uint8)
    rows: list[tuple[str, list[float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        onnx_file = frame_model(work / "models")
        options = ort.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
        rows.append(("in-process", timed(lambda: session.run(None, {"image": frame}), args.runs)))

        (work / "edged.toml").write_text(
            f'state_dir = "{work}/state"\n[server]\nsocket = "{work}/edged.sock"\n'
            "max_json_bytes = 134217728\nmax_request_bytes = 134217728\n"
            f'[models]\nrepository = "{work / "models"}"\n'
        )
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edged",
                "--config",
                str(work / "edged.toml"),
                "--log-level",
                "warning",
            ],
        )
        try:
            client = Client(str(work / "edged.sock"))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if client.ready():
                        break
                except Exception:
                    pass
                time.sleep(0.1)
            conn = UnixHTTPConnection(str(work / "edged.sock"), 60)
            doc = {
                "inputs": [
                    {
                        "name": "image",
                        "datatype": "UINT8",
                        "shape": SHAPE,
                        "data": frame.reshape(-1).tolist(),
                    }
                ]
            }
            json_body = json.dumps(doc).encode()

            def post(path: str, body: bytes, headers: dict[str, str]) -> None:
                conn.request("POST", path, body=body, headers=headers)
                response = conn.getresponse()
                response.read()
                assert response.status == 200, response.status

            json_runs = max(10, args.runs // 10)  # seconds each: fewer
            rows.append(
                (
                    "REST JSON",
                    timed(
                        lambda: post(
                            "/v2/models/frame/infer",
                            json_body,
                            {"Content-Type": "application/json"},
                        ),
                        json_runs,
                    ),
                )
            )
            path, body, headers = rest_request("frame", {"image": frame})
            rows.append(("REST binary", timed(lambda: post(path, body, headers), args.runs)))

            grpc = grpcclient.InferenceServerClient(f"unix://{work / 'edged-grpc.sock'}")
            image = grpcclient.InferInput("image", SHAPE, "UINT8")
            image.set_data_from_numpy(frame)
            rows.append(("gRPC", timed(lambda: grpc.infer("frame", [image]), args.runs)))

            key = f"/edged_bench_{os.getpid()}"
            region = shm.create_shared_memory_region("frame", key, frame.nbytes)
            try:
                grpc.register_system_shared_memory("frame", key, frame.nbytes)
                by_region = grpcclient.InferInput("image", SHAPE, "UINT8")
                by_region.set_shared_memory("frame", frame.nbytes)

                def shared() -> None:
                    shm.set_shared_memory_region(region, [frame])
                    grpc.infer("frame", [by_region])

                rows.append(("gRPC + shared memory", timed(shared, args.runs)))
                by_rest = {
                    "inputs": [
                        {
                            "name": "image",
                            "datatype": "UINT8",
                            "shape": SHAPE,
                            "parameters": {
                                "shared_memory_region": "frame",
                                "shared_memory_byte_size": frame.nbytes,
                            },
                        }
                    ]
                }
                rest_body = json.dumps(by_rest).encode()

                def shared_rest() -> None:
                    shm.set_shared_memory_region(region, [frame])
                    post("/v2/models/frame/infer", rest_body, {"Content-Type": "application/json"})

                rows.append(("REST + shared memory", timed(shared_rest, args.runs)))
                grpc.unregister_system_shared_memory()
            finally:
                shm.destroy_shared_memory_region(region)
            with client.shared_region("frame", frame.nbytes) as sealed:
                view = sealed.array(SHAPE)

                def sealed_grpc() -> None:
                    view[...] = frame
                    grpc.infer("frame", [by_region])

                def sealed_rest(copy: bool = True) -> None:
                    if copy:
                        view[...] = frame
                    post("/v2/models/frame/infer", rest_body, {"Content-Type": "application/json"})

                rows.append(("gRPC + sealed memfd", timed(sealed_grpc, args.runs)))
                rows.append(("REST + sealed memfd", timed(sealed_rest, args.runs)))
                over_socket = {"inputs": [sealed.input("image", "UINT8", SHAPE, frame.nbytes)]}
                rows.append(
                    (
                        "region socket + sealed memfd, written in place",
                        timed(lambda: sealed.infer("frame", over_socket), args.runs),
                    )
                )
                rows.append(
                    (
                        "REST + sealed memfd, written in place",
                        timed(lambda: sealed_rest(False), args.runs),
                    )
                )
        finally:
            proc.terminate()
            proc.wait(60)

    base = statistics.median(rows[0][1]) * 1000
    print(
        f"onnxruntime {ort.__version__}; frame {'x'.join(map(str, SHAPE))} uint8"
        f" ({frame.nbytes / 1e6:.1f} MB); {args.runs} calls a row (JSON: fewer)\n"
    )
    print("| way in | p50 ms | p95 ms | overhead ms (p50 - in-process) |")
    print("| --- | --- | --- | --- |")
    for name, samples in rows:
        ordered = sorted(samples)
        p50 = statistics.median(ordered) * 1000
        p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] * 1000
        print(f"| {name} | {p50:.2f} | {p95:.2f} | {p50 - base:.2f} |")


if __name__ == "__main__":
    main()
