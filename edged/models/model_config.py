"""A model's ``config.pbtxt``, read with Triton's own protobuf schema.

Only what edged honours is lifted into plain attributes; the protobuf message stays available
as ``ModelConfig.proto`` (the scheduler reads ``dynamic_batching`` from it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as pb

from edged.common.errors import ConfigError, InvalidRequest, ModelLoadError
from edged.oip.tensors import DATATYPES

MAX_CONFIG_BYTES = 1 << 20

# Triton's TYPE_* -> OIP datatype names.
CONFIG_DATATYPES = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES",
}

ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
PIPELINE_BACKEND = "pipeline"
PLAN_PLATFORM = "tensorrt_plan"  # Triton's TensorRT engines (edged.runtimes.tensorrt)
PLAN_BACKEND = "tensorrt"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the model declares it (dims exclude the batch dimension)."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False
    label_filename: str = ""
    reshape: tuple[int, ...] | None = None  # the shape the model itself takes (Triton's reshape)

    def shape(self, max_batch_size: int) -> list[int]:
        """The full shape as clients see it (-1 for a variable dimension)."""
        return ([-1] if max_batch_size > 0 else []) + list(self.dims)

    def metadata(self, max_batch_size: int) -> dict[str, Any]:
        """The OIP metadata entry for this tensor."""
        return {"name": self.name, "datatype": self.datatype, "shape": self.shape(max_batch_size)}


def oip_datatype(data_type: int) -> str:
    """The OIP datatype name of a config DataType value (TYPE_FP32 -> FP32); KeyError if none."""
    return CONFIG_DATATYPES[pb.DataType.Name(data_type)]


def _spec(kind: str, model: str, message: Any) -> TensorSpec:
    type_name = pb.DataType.Name(message.data_type)
    if type_name not in CONFIG_DATATYPES:
        raise ConfigError(f"model '{model}': {kind} '{message.name}' has data_type {type_name}")
    return TensorSpec(
        name=message.name,
        datatype=oip_datatype(message.data_type),
        dims=tuple(int(d) for d in message.dims),
        optional=bool(getattr(message, "optional", False)),
        label_filename=getattr(message, "label_filename", ""),
        reshape=tuple(int(d) for d in message.reshape.shape)
        if message.HasField("reshape")
        else None,
    )


class ModelConfig:
    """A parsed and checked ``config.pbtxt``."""

    def __init__(self, proto: pb.ModelConfig, directory: Path) -> None:
        self.proto = proto
        self.directory = directory
        self.name: str = proto.name
        self.max_batch_size: int = proto.max_batch_size
        self.inputs = [_spec("input", self.name, i) for i in proto.input]
        self.outputs = [_spec("output", self.name, o) for o in proto.output]
        self.parameters: dict[str, str] = {k: v.string_value for k, v in proto.parameters.items()}
        self.instance_count = max(1, sum(g.count or 1 for g in proto.instance_group) or 1)

    @property
    def platform(self) -> str:
        """The platform name reported in model metadata."""
        if self.proto.platform:
            return str(self.proto.platform)
        if self.proto.backend == ONNX_BACKEND:
            return ONNX_PLATFORM
        if self.proto.backend == PLAN_BACKEND:
            return PLAN_PLATFORM
        return str(self.proto.backend)

    @functools.cached_property  # read on every local call; a config does not change
    def confidence_output(self) -> str | None:
        """The output whose best score is the model's confidence: ``confidence_output`` in
        its parameters, else its first classification output (one with labels)."""
        named = self.parameters.get("confidence_output")
        if named:
            return named
        return next((o.name for o in self.outputs if o.label_filename), None)

    @property
    def decoupled(self) -> bool:
        """Triton's ``model_transaction_policy { decoupled: true }``: zero or many responses
        per request, so it is called on a stream (gRPC ModelStreamInfer) only."""
        return bool(self.proto.model_transaction_policy.decoupled)

    @property
    def sequence_idle_s(self) -> float | None:
        """Triton's ``sequence_batching``: a stateful model, whose requests carry a sequence
        id; None for any other. The seconds a sequence may stay idle before it is dropped
        (``max_sequence_idle_microseconds``, Triton's default 1 s)."""
        if not self.proto.HasField("sequence_batching"):
            return None
        idle = self.proto.sequence_batching.max_sequence_idle_microseconds
        return idle / 1e6 if idle else 1.0

    @property
    def is_pipeline(self) -> bool:
        """True for edged's pipeline backend (pre/post-processing around other models)."""
        return bool(self.proto.backend == PIPELINE_BACKEND)

    def model_filename(self) -> str:
        """The file inside a version directory that holds the model."""
        default = "model.plan" if self.platform == PLAN_PLATFORM else "model.onnx"
        return str(self.proto.default_model_filename or default)

    def version_policy(self, available: list[int]) -> list[int]:
        """Which of the available versions to serve, by Triton's version_policy."""
        available = sorted(available)
        policy = self.proto.version_policy
        which = policy.WhichOneof("policy_choice")
        if which == "all":
            return available
        if which == "specific":
            wanted = set(policy.specific.versions)
            return [v for v in available if v in wanted]
        count = policy.latest.num_versions if which == "latest" else 1
        return available[-max(1, count) :]

    def as_json(self) -> dict[str, Any]:
        """The configuration as Triton's JSON form (GET /v2/models/{m}/config)."""
        return json_format.MessageToDict(self.proto, preserving_proto_field_name=True)

    def labels(self, output: TensorSpec, version_dir: Path) -> list[str] | None:
        """The labels of a classification output, from its label_filename."""
        path = self.label_file(output, version_dir)
        return None if path is None else path.read_text(encoding="utf-8").splitlines()

    def label_file(self, output: TensorSpec, version_dir: Path) -> Path | None:
        """Where an output's label_filename is: the version's directory, else the model's."""
        if not output.label_filename:
            return None
        for base in (version_dir, self.directory):
            path = base / output.label_filename
            if path.is_file():
                return path
        return None

    def check_label_files(self, version_dir: Path) -> None:
        """Refuse to load a version whose config names a label file that is in neither its
        directory nor the model's (Triton fails such a load too): its classification answers
        would be class numbers instead of labels."""
        for output in self.outputs:
            if output.label_filename and self.label_file(output, version_dir) is None:
                raise ModelLoadError(
                    f"output '{output.name}' names the label file '{output.label_filename}',"
                    f" which is in neither {version_dir} nor {self.directory}"
                )

    def check_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        """Reject inputs whose names, datatypes or shapes do not match the configuration."""
        known = {spec.name: spec for spec in self.inputs}
        for name in inputs:
            if name not in known:
                raise InvalidRequest(
                    f"model '{self.name}' has no input '{name}'; its inputs are:"
                    f" {', '.join(known) or 'none'}"
                )
        batch: int | None = None
        for spec in self.inputs:
            array = inputs.get(spec.name)
            if array is None:
                if spec.optional:
                    continue
                raise InvalidRequest(f"model '{self.name}' needs input '{spec.name}'")
            expected = DATATYPES[spec.datatype]
            if array.dtype != expected:
                got = "BYTES" if array.dtype == object else str(array.dtype)
                raise InvalidRequest(
                    f"input '{spec.name}' must be {spec.datatype}, got {_oip_name(got)}"
                )
            shape = list(array.shape)
            dims = list(spec.dims)
            if self.max_batch_size > 0:
                if not shape:
                    raise InvalidRequest(f"input '{spec.name}' needs a batch dimension")
                if shape[0] > self.max_batch_size:
                    raise InvalidRequest(
                        f"input '{spec.name}': batch size {shape[0]} is over the model's"
                        f" max_batch_size {self.max_batch_size}"
                    )
                if batch is not None and shape[0] != batch:
                    raise InvalidRequest("all inputs must have the same batch size")
                batch = shape[0]
                shape = shape[1:]
            if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape)):
                want = spec.shape(self.max_batch_size)
                raise InvalidRequest(
                    f"input '{spec.name}' has shape {list(array.shape)}, the model expects {want}"
                )


def _oip_name(numpy_name: str) -> str:
    for name, dtype in DATATYPES.items():
        if str(dtype) == numpy_name:
            return name
    return numpy_name


def read_config(directory: Path, name: str | None = None) -> ModelConfig:
    """Read and check ``<directory>/config.pbtxt``; the model's name is ``name`` (default: the
    directory's; a version's own config.pbtxt is in a directory named by the version)."""
    path = directory / "config.pbtxt"
    name = name or directory.name
    try:
        with path.open("rb") as f:  # limits before allocation: a config is text of a few KiB
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is over {MAX_CONFIG_BYTES >> 10} KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text: {exc}") from None
    proto = pb.ModelConfig()
    try:
        text_format.Parse(text, proto)
    except text_format.ParseError as exc:
        raise ConfigError(f"{path}:{exc}") from None
    if not proto.name:
        proto.name = name
    elif proto.name != name:
        raise ConfigError(f"{path}: name '{proto.name}' differs from the model's, '{name}'")
    kinds = (
        proto.platform in (ONNX_PLATFORM, PLAN_PLATFORM),
        proto.backend in (ONNX_BACKEND, PIPELINE_BACKEND, PLAN_BACKEND),
    )
    if not any(kinds):
        raise ConfigError(
            f"{path}: platform '{proto.platform}' / backend '{proto.backend}' is not supported;"
            f' use platform "{ONNX_PLATFORM}" or "{PLAN_PLATFORM}", or backend'
            f' "{PIPELINE_BACKEND}"'
        )
    if proto.max_batch_size < 0:
        raise ConfigError(f"{path}: max_batch_size must be >= 0")
    if proto.model_transaction_policy.decoupled and proto.backend != PIPELINE_BACKEND:
        raise ConfigError(
            f'{path}: only a pipeline (backend "{PIPELINE_BACKEND}") can be decoupled; a'
            " graph answers each request once"
        )
    if proto.HasField("sequence_batching") and not proto.model_transaction_policy.decoupled:
        raise ConfigError(
            f"{path}: a model with sequence_batching must be decoupled in edged (its sequences"
            " live on the stream that carries them)"
        )
    config = ModelConfig(proto, directory)
    names = [t.name for t in config.inputs] + [t.name for t in config.outputs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: input and output names must be unique")
    check_routing_parameters(path, config)
    return config


PRIVACY_VALUES = ("private", "default-private")


def check_routing_parameters(path: Path, config: ModelConfig) -> None:
    """The parameters the router reads: a typo must not let private data leave, nor fail
    every request later (ConfigError naming the parameter)."""
    parameters = config.parameters
    privacy = parameters.get("privacy")
    if privacy is not None and privacy not in PRIVACY_VALUES:
        raise ConfigError(
            f"{path}: parameter privacy is {privacy!r}; one of {', '.join(PRIVACY_VALUES)}"
        )
    threshold = parameters.get("escalate_below")
    if threshold is not None:
        try:
            number = float(threshold)
        except ValueError:
            number = float("nan")
        if not 0 <= number < float("inf"):  # NaN fails too
            raise ConfigError(
                f"{path}: parameter escalate_below must be a number >= 0 (a confidence: above 1"
                f" always escalates), not {threshold!r}"
            )
    output = parameters.get("confidence_output")
    if output is not None and output not in {o.name for o in config.outputs}:
        raise ConfigError(
            f"{path}: parameter confidence_output names {output!r}, not an output of the model"
        )
    # what the router scores (edged.routing.router: _escalate): this output, else the first
    scored = config.confidence_output or next((o.name for o in config.outputs), None)
    spec = next((o for o in config.outputs if o.name == scored), None)
    if threshold is not None and spec is not None and spec.datatype in ("BYTES", "BOOL"):
        raise ConfigError(  # its scores are what escalation compares with the threshold
            f"{path}: parameter escalate_below scores the output {scored!r}, which is"
            f" {spec.datatype}: a confidence is a number (set confidence_output)"
        )
