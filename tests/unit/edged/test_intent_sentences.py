"""Issue 47: the built intent model labels every sentence it was made from as labelled, as
written and in the form a voice command reaches it (``transcribe`` hears the sentences lower
case, without punctuation, and its text goes to ``intent``). The sentences are run through the
``intent`` pipeline in-process, as edged serves it: tokenizer, text-encoder, classifier."""

from __future__ import annotations

import asyncio
import csv
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edged.common.live import Live
from edged.config import ModelsConfig, OnnxRuntimeConfig
from edged.models.model_config import ModelConfig
from edged.models.repository import ModelManager
from edged.pipelines.factory import create_pipeline
from edged.runtimes.base import Runtime
from edged.runtimes.onnxruntime import OnnxRuntime
from tests.conftest import MODELS, skip_or_fail

INTENTS = MODELS / "intents.tsv"
NEEDED = [
    MODELS / "text-encoder" / "1" / "model.onnx",
    MODELS / "text-embedding" / "1" / "tokenizer.json",
    MODELS / "intent-classifier" / "1" / "model.onnx",
    MODELS / "intent-classifier" / "1" / "labels.txt",
    MODELS / "intent" / "1",
]


def labelled_sentences() -> list[tuple[str, str]]:
    """(label, text) rows of intents.tsv (header ``label<TAB>text``), as models/build.py
    reads them."""
    with open(INTENTS, encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert rows[0] == ["label", "text"]
    return [(label.strip(), text.strip()) for label, text in rows[1:]]


def spoken(text: str) -> str:
    """A sentence as ``transcribe`` hears it: its phrase in transcribe/1/phrases.txt, as
    models/build.py (build_transcribe) writes them: lower case, punctuation out."""
    return " ".join(re.sub(r"[^a-z' ]", " ", text.lower()).split())


def classify(texts: list[str]) -> list[tuple[str, float]]:
    """The ``intent`` model's answer for each text, from the built repository in-process."""
    missing = [str(p) for p in NEEDED if not p.exists()]
    if missing:
        skip_or_fail(f"intent models not built ({', '.join(missing)}); run `make models`")
    executor = ThreadPoolExecutor(2)
    managers: list[ModelManager] = []

    def factory(config: ModelConfig, version_dir: Path) -> Runtime:
        if config.is_pipeline:
            settings = Live(ModelsConfig())
            return create_pipeline(config, version_dir, managers[0], executor, settings)
        return OnnxRuntime(config, version_dir, OnnxRuntimeConfig(), executor)

    async def scenario() -> list[tuple[str, float]]:
        manager = ModelManager(MODELS, factory)
        managers.append(manager)
        try:
            await manager.load_all(["intent"])
            assert manager.entry("intent").ready_versions, manager.reason("intent")
            answers: list[tuple[str, float]] = []
            for start in range(0, len(texts), 64):
                part = np.array([t.encode() for t in texts[start : start + 64]], dtype=object)
                _, _, out = await manager.infer("intent", None, {"text": part})
                answers += [
                    (label.decode(), float(score))
                    for label, score in zip(out["intent"], out["score"], strict=True)
                ]
            return answers
        finally:
            await manager.close()

    try:
        return asyncio.run(scenario())
    finally:
        executor.shutdown()


def test_every_sentence_of_intents_tsv_gets_its_label_as_written_and_as_spoken() -> None:
    rows = labelled_sentences()
    cases = [(label, text, "as written") for label, text in rows]
    cases += [(label, spoken(text), "as spoken") for label, text in rows if spoken(text) != text]
    answers = classify([text for _, text, _ in cases])
    wrong = [
        f"{form}: {text!r} is {label}, the model says {got} ({score:.2f})"
        for (label, text, form), (got, score) in zip(cases, answers, strict=True)
        if got != label
    ]
    print(f"\n{len(cases) - len(wrong)} of {len(cases)} sentences labelled as in {INTENTS.name}")
    assert not wrong, f"{len(wrong)} of {len(cases)} misclassified:\n  " + "\n  ".join(wrong)


def test_the_spoken_form_is_what_transcribe_hears() -> None:
    """Each phrase transcribe can answer is the spoken form of a sentence of intents.tsv, so
    the test above covers every text a voice command gives the intent model."""
    phrases = MODELS / "transcribe" / "1" / "phrases.txt"
    if not phrases.is_file():
        skip_or_fail(f"{phrases} is missing; run `make models`")
    forms = {spoken(text) for _, text in labelled_sentences()}
    heard = phrases.read_text(encoding="utf-8").splitlines()
    assert heard and not set(heard) - forms, sorted(set(heard) - forms)
