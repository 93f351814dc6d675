"""Small real ONNX models for tests: y = x * factor, one factor per version, so an answer
tells which version gave it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

CONFIG = """platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
%s
"""


def scale_model(path: Path, factor: float, pad_bytes: int = 0, single_row: bool = False) -> None:
    """y = x * factor, with a dynamic batch dimension. ``pad_bytes``: an unused weight that
    makes the file that much larger (a download that takes a while); ``single_row``: a faulty
    version whose graph fails at run time on batches of more than one row."""
    nodes = [helper.make_node("Mul", ["x", "k"], ["y" if not single_row else "scaled"])]
    weights = [helper.make_tensor("k", TensorProto.FLOAT, [1], [factor])]
    if single_row:
        nodes.append(helper.make_node("Reshape", ["scaled", "one_row"], ["y"]))
        weights.append(helper.make_tensor("one_row", TensorProto.INT64, [2], [1, 2]))
    if pad_bytes:
        rows = np.random.default_rng(int(factor * 1000)).integers(0, 255, pad_bytes, np.uint8)
        weights.append(
            helper.make_tensor("pad", TensorProto.UINT8, [pad_bytes], rows.tobytes(), raw=True)
        )
    graph = helper.make_graph(
        nodes,
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def add_model(repo: Path, name: str, versions: dict[int, float], policy: str = "") -> None:
    (repo / name).mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(CONFIG % policy)
    for version, factor in versions.items():
        scale_model(repo / name / str(version) / "model.onnx", factor)
