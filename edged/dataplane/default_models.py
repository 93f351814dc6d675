"""The task API for the default models: plain JSON in and out, no tensors to build.

Each call runs the model's pipeline through the data plane, like any OIP request, and shapes
the answer for people: texts with their embeddings, lines of text with boxes, speech segments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edged.common.errors import InvalidRequest
from edged.dataplane.plane import DataPlane
from edged.oip.tensors import bytes_tensor, text_tensor

EMBED_MODEL = "text-embedding"
EMBED_MODELS = (EMBED_MODEL, "text-embedding-int8")
# The text pipelines accept this many texts per request (their `max_items` parameter).
MAX_TEXTS = 256
INTENT_MODEL = "intent"
OCR_MODEL = "ocr"
VAD_MODEL = "vad"
TRANSCRIBE_MODEL = "transcribe"


def _strings(doc: Any, single: str, plural: str) -> list[str]:
    if not isinstance(doc, dict):
        raise InvalidRequest(f"the body must be a JSON object with '{plural}' (a list of strings)")
    if plural in doc:
        values = doc[plural]
    elif single in doc:
        values = [doc[single]]
    else:
        raise InvalidRequest(f"the body needs '{plural}' (a list of strings) or '{single}'")
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise InvalidRequest(f"'{plural}' must be a non-empty list of strings")
    if len(values) > MAX_TEXTS:
        raise InvalidRequest(
            f"'{plural}' has {len(values)} strings; at most {MAX_TEXTS} per request"
        )
    return values


async def embed(plane: DataPlane, doc: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """POST /v1/embed {"texts": [...], "model": "text-embedding"} -> one embedding per text."""
    texts = _strings(doc, "text", "texts")
    model = doc.get("model", EMBED_MODEL)
    if model not in EMBED_MODELS:
        raise InvalidRequest(f"'model' must be one of {', '.join(EMBED_MODELS)}")
    version, out, route = await plane.run(model, {"text": text_tensor("texts", texts)}, params)
    vectors = out["embedding"]
    return {
        "model": model,
        "version": str(version),
        "dim": int(vectors.shape[1]),
        "embeddings": vectors.tolist(),
        **route,
    }


async def intent(plane: DataPlane, doc: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """POST /v1/intent {"texts": [...]} -> the intent of each text and its probability."""
    texts = _strings(doc, "text", "texts")
    version, out, route = await plane.run(
        INTENT_MODEL, {"text": text_tensor("texts", texts)}, params
    )
    return {
        "model": INTENT_MODEL,
        "version": str(version),
        "intents": [
            {"text": t, "intent": i.decode(), "score": round(float(s), 6)}
            for t, i, s in zip(texts, out["intent"], out["score"])
        ],
        **route,
    }


async def ocr(plane: DataPlane, image: bytes, params: Mapping[str, Any]) -> dict[str, Any]:
    """POST /v1/ocr with an encoded image as the body -> lines of text with boxes."""
    if not image:
        raise InvalidRequest("the body is empty: send the image file's bytes")
    version, out, route = await plane.run(OCR_MODEL, {"image": bytes_tensor([image])}, params)
    lines = [
        {"text": t.decode(), "score": round(float(s), 6), "box": b.round(1).tolist()}
        for t, s, b in zip(out["text"], out["scores"], out["boxes"])
    ]
    return {"model": OCR_MODEL, "version": str(version), "lines": lines, **route}


async def vad(plane: DataPlane, audio: bytes, params: Mapping[str, Any]) -> dict[str, Any]:
    """POST /v1/vad with a WAV file as the body -> speech segments in seconds."""
    if not audio:
        raise InvalidRequest("the body is empty: send a WAV file's bytes")
    version, out, route = await plane.run(VAD_MODEL, {"audio": bytes_tensor([audio])}, params)
    segments = [
        {"start": round(float(a), 3), "end": round(float(b), 3)} for a, b in out["segments"]
    ]
    return {"model": VAD_MODEL, "version": str(version), "segments": segments, **route}


async def transcribe(plane: DataPlane, audio: bytes, params: Mapping[str, Any]) -> dict[str, Any]:
    """An utterance (a WAV file's bytes) -> its text: one of the device's command phrases, or
    "" when it is none of them."""
    if not audio:
        raise InvalidRequest("the audio is empty: send a WAV file's bytes")
    version, out, route = await plane.run(
        TRANSCRIBE_MODEL, {"audio": bytes_tensor([audio])}, params
    )
    text = out["text"].reshape(-1)[0].decode()
    return {"model": TRANSCRIBE_MODEL, "version": str(version), "text": text, **route}
