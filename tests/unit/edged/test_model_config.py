"""config.pbtxt read with Triton's schema: checks, version policy, input validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edged.common.errors import ConfigError, InvalidRequest, ModelLoadError
from edged.common.live import Live
from edged.models.model_config import read_config

CONFIG = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] label_filename: "labels.txt" } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
%s
"""


def write(tmp_path: Path, text: str, name: str = "m") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.pbtxt").write_text(text)
    return directory


def test_reads_tritons_fields(tmp_path: Path) -> None:
    cfg = read_config(write(tmp_path, CONFIG % ""))
    assert cfg.platform == "onnxruntime_onnx"
    assert cfg.max_batch_size == 8
    assert cfg.instance_count == 2
    assert cfg.inputs[0].shape(cfg.max_batch_size) == [-1, 3]
    assert cfg.as_json()["input"][0]["data_type"] == "TYPE_FP32"


def test_a_label_file_is_the_versions_else_the_models_and_one_missing_fails_the_load(
    tmp_path: Path,
) -> None:
    """A version that lacks the label file its config names (a manifest that left it out) is
    not loaded: its classifications would answer class numbers instead of labels."""
    directory = write(tmp_path, CONFIG % "")
    cfg = read_config(directory)
    version = directory / "2"
    version.mkdir()
    with pytest.raises(ModelLoadError) as missing:
        cfg.check_label_files(version)
    assert missing.value.message == (
        f"output 'y' names the label file 'labels.txt', which is in neither {version} nor"
        f" {directory}"
    )
    (directory / "labels.txt").write_text("cat\ndog\n")
    cfg.check_label_files(version)  # the model's own
    assert cfg.labels(cfg.outputs[0], version) == ["cat", "dog"]
    (version / "labels.txt").write_text("ant\n")
    assert cfg.labels(cfg.outputs[0], version) == ["ant"]  # the version's first
    assert cfg.labels(cfg.inputs[0], version) is None  # no label file named


def test_escalation_needs_a_numeric_confidence_output(tmp_path: Path) -> None:
    """escalate_below compares a score with its threshold: an output of text cannot be one (it
    failed every escalated request with a 500 before it was refused at load)."""
    text_out = 'output [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]'
    base = CONFIG.replace(
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] label_filename: "labels.txt" } ]',
        text_out,
    )
    escalate = 'parameters { key: "escalate_below" value { string_value: "0.5" } }'
    places = [tmp_path / str(i) for i in range(4)]
    for place in places:
        place.mkdir()
    with pytest.raises(ConfigError) as refused:
        read_config(write(places[0], base % escalate))
    assert refused.value.message.endswith(
        "parameter escalate_below scores the output 'text', which is BYTES: a confidence is a"
        " number (set confidence_output)"
    )
    assert read_config(write(places[1], base % "")).outputs[0].datatype == "BYTES"
    assert read_config(write(places[2], CONFIG % escalate)).confidence_output == "y"
    # text first, then a classification output: the router scores the one with labels
    both = base.replace(
        text_out,
        'output [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] },'
        ' { name: "y" data_type: TYPE_FP32 dims: [ -1 ] label_filename:'
        ' "labels.txt" } ]',
    )
    assert read_config(write(places[3], both % escalate)).confidence_output == "y"


def test_syntax_error_points_at_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config.pbtxt:3:\d+"):
        read_config(write(tmp_path, 'name: "m"\nplatform: "onnxruntime_onnx"\nmax_batch: 1\n'))


def test_name_must_match_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="differs from the model"):
        read_config(write(tmp_path, CONFIG % "", name="other"))


def test_unknown_platform_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not supported"):
        read_config(write(tmp_path, 'platform: "tensorflow_savedmodel"'))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("", [3]),
        ("version_policy: { latest: { num_versions: 2 } }", [2, 3]),
        ("version_policy: { all: {} }", [1, 2, 3]),
        ("version_policy: { specific: { versions: [1, 3, 9] } }", [1, 3]),
    ],
)
def test_version_policy(tmp_path: Path, policy: str, expected: list[int]) -> None:
    cfg = read_config(write(tmp_path, CONFIG % policy))
    assert cfg.version_policy([3, 1, 2]) == expected


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"x": np.zeros((1, 3), np.float64)}, "must be FP32, got FP64"),
        ({"x": np.zeros((1, 4), np.float32)}, r"shape \[1, 4\], the model expects \[-1, 3\]"),
        ({"x": np.zeros((9, 3), np.float32)}, "over the model's max_batch_size 8"),
        ({"x": np.zeros(3, np.float32), "z": np.zeros(1)}, "no input 'z'"),
        ({}, "needs input 'x'"),
    ],
)
def test_inputs_are_checked(tmp_path: Path, inputs: dict[str, np.ndarray], message: str) -> None:
    cfg = read_config(write(tmp_path, CONFIG % ""))
    with pytest.raises(InvalidRequest, match=message):
        cfg.check_inputs(inputs)


def test_good_inputs_pass(tmp_path: Path) -> None:
    read_config(write(tmp_path, CONFIG % "")).check_inputs({"x": np.zeros((2, 3), np.float32)})


def test_only_a_pipeline_that_streams_can_be_decoupled(tmp_path: Path) -> None:
    """Triton's model_transaction_policy: a graph answers each request once, so it cannot be
    decoupled; a pipeline can, if it streams (vad), and one that answers once (intent) is
    refused when it loads, naming why."""
    from concurrent.futures import ThreadPoolExecutor

    from edged.common.errors import ModelLoadError
    from edged.config import ModelsConfig
    from edged.pipelines.factory import create_pipeline

    decoupled = "model_transaction_policy { decoupled: true }"
    assert not read_config(write(tmp_path, CONFIG % "")).decoupled
    (tmp_path / "graph").mkdir()
    with pytest.raises(ConfigError, match=r"only a pipeline .* can be decoupled"):
        read_config(write(tmp_path / "graph", CONFIG % decoupled))
    pipeline = 'backend: "pipeline"\nparameters { key: "pipeline" value { string_value: "%s" } }\n'
    vad = read_config(write(tmp_path, pipeline % "vad" + decoupled, "vad"))
    assert vad.decoupled
    with ThreadPoolExecutor(1) as pool:
        made = create_pipeline(vad, tmp_path, None, pool, Live(ModelsConfig()))  # type: ignore[arg-type]
        assert made.config is vad
        intent = read_config(write(tmp_path, pipeline % "intent" + decoupled, "intent"))
        with pytest.raises(ModelLoadError, match="'intent' answers each request once"):
            create_pipeline(intent, tmp_path, None, pool, Live(ModelsConfig()))  # type: ignore[arg-type]
        # stateful: sequence_batching needs a decoupled model, and a pipeline that keeps state
        sequences = "sequence_batching { max_sequence_idle_microseconds: 2500000 }"
        with pytest.raises(ConfigError, match="sequence_batching must be decoupled"):
            read_config(write(tmp_path, pipeline % "vad_live" + sequences, "live0"))
        live = read_config(write(tmp_path, pipeline % "vad_live" + decoupled + sequences, "live"))
        assert live.sequence_idle_s == 2.5 and vad.sequence_idle_s is None
        create_pipeline(live, tmp_path, None, pool, Live(ModelsConfig()))  # type: ignore[arg-type]
        forgetful = read_config(write(tmp_path, pipeline % "vad_live" + decoupled, "live2"))
        with pytest.raises(ModelLoadError, match="'vad_live' is stateful"):
            create_pipeline(forgetful, tmp_path, None, pool, Live(ModelsConfig()))  # type: ignore[arg-type]
        stateless = read_config(write(tmp_path, pipeline % "vad" + decoupled + sequences, "v2"))
        with pytest.raises(ModelLoadError, match="keeps no state between requests"):
            create_pipeline(stateless, tmp_path, None, pool, Live(ModelsConfig()))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("privacy", "privat", "parameter privacy is 'privat'"),  # a typo must not let data out
        ("privacy", "", "parameter privacy is ''"),
        ("escalate_below", "high", "escalate_below must be a number >= 0"),
        ("escalate_below", "nan", "escalate_below must be a number >= 0"),
        ("escalate_below", "-1", "escalate_below must be a number >= 0"),
        ("escalate_below", "inf", "escalate_below must be a number >= 0"),
        ("confidence_output", "z", "confidence_output names 'z', not an output"),
    ],
)
def test_routing_parameters_are_checked_when_the_config_is_read(
    tmp_path: Path, key: str, value: str, says: str
) -> None:
    parameter = f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}'
    with pytest.raises(ConfigError, match=says):
        read_config(write(tmp_path, CONFIG % parameter))
    good = {"privacy": "default-private", "escalate_below": "1.01", "confidence_output": "y"}
    parameter = f'parameters {{ key: "{key}" value {{ string_value: "{good[key]}" }} }}'
    (tmp_path / "good").mkdir()
    assert read_config(write(tmp_path / "good", CONFIG % parameter)).parameters[key] == good[key]
