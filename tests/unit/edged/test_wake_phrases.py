"""The wake-word model's configuration: its phrases and thresholds, and every word checked
against the dictionary when it loads (pocketsphinx itself only logs an unknown word, and the
phrase then never fires)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from edged.config import ModelsConfig
from edged.errors import ModelLoadError
from edged.models.config import read_config
from edged.pipelines.speech import WakeWord, parse_phrases
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
