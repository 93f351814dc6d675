"""Voice activity detection: a WAV file in, speech segments (start, end in seconds) out: all
at once, or (decoupled, on a stream) one response per segment as soon as it is final.

Silero VAD is stateful: each 32 ms chunk is run with the state the previous chunk left, so the
chunks of one request run in order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from edged.errors import PayloadTooLarge
from edged.pipelines import vad_ops
from edged.pipelines.base import Pipeline, parameter, single_blob
from edged.runtimes.base import Tensors

# Longest audio per request by default (the model's `max_seconds` parameter): 10 minutes take
# about 5 s of CPU at 16 kHz.
MAX_SECONDS = 600


class VoiceActivity(Pipeline):
    """The ``vad`` pipeline."""

    def sample(self) -> Tensors:
        """Half a second of silence as a WAV file."""
        import io
        import wave

        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(16000)
            wav.writeframes(b"\0\0" * 8000)
        blob = np.empty(1, dtype=object)
        blob[0] = buffer.getvalue()
        return {"audio": blob}

    async def run(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Every speech segment of the audio at once."""
        found = [segment async for segment in self.speech(inputs, parameters)]
        return {"segments": np.asarray(found, dtype=np.float32).reshape(-1, 2)}

    async def stream(
        self,
        inputs: Tensors,
        parameters: Mapping[str, Any],
        send: Callable[[Tensors], Awaitable[None]],
    ) -> None:
        """Decoupled: one response per speech segment ([1, 2]), sent as soon as it is final."""
        async for segment in self.speech(inputs, parameters):
            await send({"segments": np.asarray([segment], dtype=np.float32)})

    async def speech(
        self, inputs: Tensors, parameters: Mapping[str, Any]
    ) -> AsyncIterator[tuple[float, float]]:
        """Speech probabilities chunk by chunk; each segment (start, end in seconds) as soon
        as the hysteresis makes it final."""
        cutter = vad_ops.Segmenter(
            16000,
            threshold=parameter(parameters, "threshold", 0.5, 0.05, 0.95),
            min_speech_ms=parameter(parameters, "min_speech_ms", 250, 0, 60_000),
            min_silence_ms=parameter(parameters, "min_silence_ms", 100, 0, 60_000),
            speech_pad_ms=parameter(parameters, "speech_pad_ms", 30, 0, 10_000),
        )
        data = single_blob("audio", inputs["audio"])
        limit = self.limit("max_seconds", MAX_SECONDS)
        # samples, not seconds, bound the memory: max_seconds at the model's 16 kHz, whatever
        # the file's rate and channels (a 192 kHz file may be 12 times shorter)
        pcm, rate = await self.offload(vad_ops.decode_wav, data, int(limit * 16000))
        if len(pcm) > limit * rate:
            raise PayloadTooLarge(
                f"the audio is {len(pcm) / rate:.0f} s long; at most {limit} s per request"
            )
        pcm, rate = await self.offload(vad_ops.to_model_rate, pcm, rate)
        model = self.step("vad_model")
        state = vad_ops.initial_state()
        sr = np.array([rate], dtype=np.int64)
        for chunk in vad_ops.chunks(pcm, rate):
            out = await self.steps.call(model, {"input": chunk, "state": state, "sr": sr})
            state = out["stateN"]
            for segment in cutter.push(float(out["output"].reshape(-1)[0])):
                yield segment
        for segment in cutter.finish(len(pcm)):
            yield segment
