"""Small real ONNX models for tests: y = x * factor, one factor per version, so an answer
tells which version gave it."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

CONFIG = """platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
%s
"""


def scale_model(path: Path, factor: float) -> None:
    """y = x * factor, with a dynamic batch dimension."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor("k", TensorProto.FLOAT, [1], [factor])],
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
