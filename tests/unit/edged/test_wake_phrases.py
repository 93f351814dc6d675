"""The wake-word model's configuration: its phrases and thresholds, and every word checked
against the dictionary when it loads (pocketsphinx itself only logs an unknown word, and the
phrase then never fires)."""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from edged.common.errors import ModelLoadError, Unavailable
from edged.config import ModelsConfig
from edged.models.model_config import read_config
from edged.pipelines.speech import Transcribe, VoiceAssistant, WakeWord, parse_phrases
from edged.pipelines.wake import Spotter
from tests.conftest import MODELS, require_models


def test_phrases_and_thresholds() -> None:
    assert parse_phrases("m", "hey jetson=1e-30") == [("hey jetson", 1e-30)]
    assert parse_phrases("m", " Hey  Jetson ; ok robot=1e-20;") == [
        ("hey jetson", 1e-30),
        ("ok robot", 1e-20),
    ]
    for bad in ("", ";", "hey jetson=0", "hey jetson=1", "hey=x", "=1e-20", "a=-1"):
        with pytest.raises(ModelLoadError, match="parameter phrases"):
            parse_phrases("m", bad)


def test_a_word_not_in_the_dictionary_is_refused_when_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_models()
    scratch = tmp_path / "tmp"  # where the model writes its phrases file
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    model = tmp_path / "wake-word"
    shutil.copytree(MODELS / "wake-word", model, symlinks=True)
    config = (model / "config.pbtxt").read_text()
    unknown = config.replace("hey jetson=1e-30", "hey jetbot=1e-30; hey xqzt=1e-30")
    (model / "config.pbtxt").write_text(unknown)
    with ThreadPoolExecutor(1) as pool:
        wake = WakeWord(read_config(model), model / "1", None, pool, ModelsConfig())  # type: ignore[arg-type]
        with pytest.raises(ModelLoadError, match=r"no pronunciation for jetbot, xqzt"):
            asyncio.run(wake.load())
    assert not list(scratch.iterdir())  # a model that did not load left nothing behind


@pytest.mark.parametrize(
    ("model", "key", "value", "says"),
    [
        ("wake-word", "kws_plp", "lots", "kws_plp must be a probability"),
        ("wake-word", "kws_plp", "2", "kws_plp must be a probability"),
        ("wake-word", "kws_plp", "0", "kws_plp must be a probability"),
        ("wake-word", "max_sequences", "100000", "max_sequences must be between 1 and 64"),
        ("wake-word", "kws_delay", "0", "kws_delay must be between 1 and 100"),
        ("voice-assistant", "command_seconds", "86400", "command_seconds must be between 1 and"),
        ("voice-assistant", "endpoint_ms", "100", "endpoint_ms must be between 180 and 1000"),
        ("voice-assistant", "endpoint_ms", "0.3", "endpoint_ms must be between 180 and 1000"),
        ("transcribe", "max_decoders", "1000000", "max_decoders must be between 1 and 16"),
    ],
)
def test_speech_parameters_are_checked_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, key: str, value: str, says: str
) -> None:
    """A decoder holds about 27 MiB: a million of them is refused, naming the parameter, before
    the first is made."""
    require_models()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    copy = tmp_path / model
    shutil.copytree(MODELS / model, copy, symlinks=True)
    parameter = f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'
    config = copy / "config.pbtxt"
    config.write_text(config.read_text() + parameter)  # the last of a key's entries counts
    cls = {"wake-word": WakeWord, "voice-assistant": VoiceAssistant, "transcribe": Transcribe}
    with ThreadPoolExecutor(1) as pool:
        pipeline = cls[model](read_config(copy), copy / "1", None, pool, ModelsConfig())  # type: ignore[arg-type]
        with pytest.raises(ModelLoadError, match=says):
            asyncio.run(pipeline.load())


class _Steps:
    """What the pipeline asks of the repository: wake-net's config (its phrase as given)."""

    def __init__(self, folder: Path, phrase: str, inputs: str = "dims: [ -1, 148, 40 ]") -> None:
        text = (MODELS / "wake-net" / "config.pbtxt").read_text()
        text = text.replace('string_value: "hey jetson"', f'string_value: "{phrase}"')
        self.folder = folder / "wake-net"
        self.folder.mkdir(exist_ok=True)
        (self.folder / "config.pbtxt").write_text(text.replace("dims: [ -1, 148, 40 ]", inputs))

    def config_of(self, name: str) -> object:
        assert name == "wake-net"
        return read_config(self.folder)


def test_the_trained_model_listens_for_its_own_phrase_and_pocketsphinx_for_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wake-net's phrase is one of the config's phrases: its spotter, at its threshold; a
    phrase named before its model was trained: pocketsphinx's decoder; a detector that does
    not take log-mel windows: refused, saying so."""
    require_models()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    copy = tmp_path / "wake-word"
    shutil.copytree(MODELS / "wake-word", copy, symlinks=True)

    def spotting(phrases: str, steps: _Steps) -> dict[str, object]:
        config = copy / "config.pbtxt"
        text = (MODELS / "wake-word" / "config.pbtxt").read_text()
        config.write_text(text.replace("hey jetson=1e-30", phrases))
        with ThreadPoolExecutor(1) as pool:
            wake = WakeWord(read_config(copy), copy / "1", steps, pool, ModelsConfig())  # type: ignore[arg-type]

            async def run() -> dict[str, object]:
                await wake.offload(wake.prepare)
                try:
                    return await wake._spotting()
                finally:
                    await wake.unload()

            return asyncio.run(run())

    trained = spotting("ok robot=1e-20; Hey  Jetson=1e-30", _Steps(tmp_path, "Hey Jetson"))
    assert trained["phrase"] == "hey jetson" and "decoder" not in trained
    spotter = trained["spotter"]
    assert (
        isinstance(spotter, Spotter)
        and spotter.frames == 148
        and spotter.threshold == float(read_config(MODELS / "wake-net").parameters["threshold"])
    )
    untrained = spotting("ok robot=1e-20", _Steps(tmp_path, "hey jetson"))
    assert set(untrained) == {"decoder"}
    with pytest.raises(Unavailable, match=r"one input of \[-1, frames, 40\] log-mel features"):
        spotting("hey jetson=1e-30", _Steps(tmp_path, "hey jetson", "dims: [ -1, 148, 64 ]"))


def test_wake_nets_config_names_the_phrase_and_threshold_its_training_chose() -> None:
    """models/wake-net/config.pbtxt against the card models/wakeword/train.py wrote beside the
    model the build copies (models/wakeword/hey-jetson.json)."""
    import json

    card = json.loads((MODELS / "wakeword" / "hey-jetson.json").read_text())
    config = read_config(MODELS / "wake-net")
    assert config.parameters["phrase"] == card["phrase"] == "hey jetson"
    assert float(config.parameters["threshold"]) == card["threshold"]
    assert [spec.dims for spec in config.inputs] == [(-1, card["frames"], card["bands"])]


@pytest.mark.parametrize("threshold", ["abc", "0", "2", "nan", "-1", ""])
def test_a_delivered_wake_net_with_a_threshold_that_is_not_a_probability_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threshold: str
) -> None:
    """wake-net's threshold comes with each new version (make wake-model, a delivery): one that
    is not a probability is refused when a sequence starts, naming it, and no spotter is made."""
    require_models()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    steps = _Steps(tmp_path, "hey jetson")
    config = steps.folder / "config.pbtxt"
    pattern = r'(key: "threshold"\s*value \{ string_value: )"[^"]*"'
    text, found = re.subn(pattern, lambda m: f'{m.group(1)}"{threshold}"', config.read_text())
    assert found == 1
    config.write_text(text)
    with ThreadPoolExecutor(1) as pool:
        wake = WakeWord(
            read_config(MODELS / "wake-word"),
            MODELS / "wake-word" / "1",
            steps,
            pool,
            ModelsConfig(),
        )  # type: ignore[arg-type]

        async def run() -> None:
            await wake.offload(wake.prepare)
            try:
                await wake._spotting()
            finally:
                await wake.unload()

        with pytest.raises(ModelLoadError, match="threshold must be a probability"):
            asyncio.run(run())
