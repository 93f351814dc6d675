"""Which pipeline class a ``backend: "pipeline"`` model names in its ``pipeline`` parameter."""

from __future__ import annotations

from concurrent.futures import Executor
from pathlib import Path

from edged.common.errors import ModelLoadError
from edged.common.live import Live
from edged.config import ModelsConfig
from edged.models.model_config import ModelConfig
from edged.pipelines.audio import LiveVoiceActivity, VoiceActivity
from edged.pipelines.base import Pipeline
from edged.pipelines.image import TextRecognition
from edged.pipelines.speech import Transcribe, VoiceAssistant, WakeWord
from edged.pipelines.text import Intent, TextEmbedding
from edged.runtimes.base import Steps

PIPELINES: dict[str, type[Pipeline]] = {
    "text_embedding": TextEmbedding,
    "intent": Intent,
    "ocr": TextRecognition,
    "vad": VoiceActivity,
    "vad_live": LiveVoiceActivity,
    "wake_word": WakeWord,
    "transcribe": Transcribe,
    "voice_assistant": VoiceAssistant,
}


def create_pipeline(
    config: ModelConfig,
    version_dir: Path,
    steps: Steps,
    executor: Executor,
    settings: Live[ModelsConfig],
) -> Pipeline:
    """The pipeline a model's config asks for."""
    kind = config.parameters.get("pipeline", "")
    cls = PIPELINES.get(kind)
    if cls is None:
        raise ModelLoadError(
            f"model '{config.name}': parameter pipeline='{kind}' is not one of"
            f" {', '.join(sorted(PIPELINES))}"
        )
    if config.decoupled and cls.stream is Pipeline.stream:
        raise ModelLoadError(
            f"model '{config.name}': pipeline '{kind}' answers each request once; it cannot be"
            " decoupled"
        )
    if (config.sequence_idle_s is not None) != cls.stateful:
        raise ModelLoadError(
            f"model '{config.name}': pipeline '{kind}' is stateful (it needs sequence_batching)"
            if cls.stateful
            else f"model '{config.name}': pipeline '{kind}' keeps no state between requests;"
            " sequence_batching does not apply to it"
        )
    return cls(config, version_dir, steps, executor, settings)
