"""Voice activity detection: a WAV file in, speech segments (start, end in seconds) out: all
at once, or (decoupled, on a stream) one response per segment as soon as it is final.

Silero VAD is stateful: each 32 ms chunk is run with the state the previous chunk left, so the
chunks of one request run in order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from edged.common.errors import PayloadTooLarge
from edged.pipelines import vad_ops
from edged.pipelines.base import LiveAudio, Pipeline, parameter, single_blob
from edged.request import Sequence
from edged.runtimes.base import Tensors

# Longest audio per request by default (the model's `max_seconds` parameter): 10 minutes take
# about 5 s of CPU at 16 kHz.
MAX_SECONDS = 600
RATE = 16000  # the rate the model runs at
CHUNK, CONTEXT = vad_ops.CHUNK[RATE], vad_ops.CONTEXT[RATE]
SAMPLE_RATE = np.array([RATE], dtype=np.int64)


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
        sequence: Sequence | None,
    ) -> None:
        """Decoupled: one response per speech segment ([1, 2]), sent as soon as it is final."""
        async for segment in self.speech(inputs, parameters):
            await send({"segments": np.asarray([segment], dtype=np.float32)})

    async def speech(
        self, inputs: Tensors, parameters: Mapping[str, Any]
    ) -> AsyncIterator[tuple[float, float]]:
        """Speech probabilities chunk by chunk; each segment (start, end in seconds) as soon
        as the hysteresis makes it final."""
        cutter = self.cutter(parameters)
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
        state = vad_ops.initial_state()
        for chunk in vad_ops.chunks(pcm, rate):
            prob, state = await self.probability(chunk, state)
            for segment in cutter.push(prob):
                yield segment
        for segment in cutter.finish(len(pcm)):
            yield segment

    def cutter(self, parameters: Mapping[str, Any]) -> vad_ops.Segmenter:
        """The segment rules, with the request's parameters."""
        return vad_ops.Segmenter(
            RATE,
            threshold=parameter(parameters, "threshold", 0.5, 0.05, 0.95),
            min_speech_ms=parameter(parameters, "min_speech_ms", 250, 0, 60_000),
            min_silence_ms=parameter(parameters, "min_silence_ms", 100, 0, 60_000),
            speech_pad_ms=parameter(parameters, "speech_pad_ms", 30, 0, 10_000),
        )

    async def probability(self, window: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        """The model on one window (the context, then a chunk): the speech probability and
        the state for the next."""
        out = await self.steps.call(
            self.step("vad_model"), {"input": window, "state": state, "sr": SAMPLE_RATE}
        )
        return float(out["output"].reshape(-1)[0]), out["stateN"]


class LiveVoiceActivity(LiveAudio, VoiceActivity):
    """``vad_live``: audio as it is captured, a chunk per request of a sequence (16 kHz mono
    16-bit PCM, ``pcm`` INT16 [-1], any length up to ``max_chunk_seconds``); one response per
    speech segment, in seconds since the sequence started, as soon as it is final; the
    sequence's last request (``sequence_end``) gives the rest. The same chunks, model state and
    rules as the whole file through ``vad``: the same segments. The segment rules are the first
    request's parameters."""

    async def stream(
        self,
        inputs: Tensors,
        parameters: Mapping[str, Any],
        send: Callable[[Tensors], Awaitable[None]],
        sequence: Sequence | None,
    ) -> None:
        assert sequence is not None  # a stateful model is called in a sequence
        pcm = self.chunk(inputs)
        live = sequence.state
        if not live:
            live.update(
                cutter=self.cutter(parameters),
                state=vad_ops.initial_state(),
                context=np.zeros(CONTEXT, np.float32),
                tail=np.zeros(0, np.float32),
                samples=0,
            )
        audio = np.concatenate([live["tail"], pcm.astype(np.float32) / 32768.0])
        live["samples"] += pcm.size
        if sequence.end and audio.size % CHUNK:  # the last chunk is zero-padded, as a file's
            audio = np.concatenate([audio, np.zeros(CHUNK - audio.size % CHUNK, np.float32)])
        whole = audio.size - audio.size % CHUNK
        for start in range(0, whole, CHUNK):
            window = np.concatenate([live["context"], audio[start : start + CHUNK]])
            prob, live["state"] = await self.probability(window.reshape(1, -1), live["state"])
            live["context"] = window[-CONTEXT:]
            for segment in live["cutter"].push(prob):
                await send({"segments": np.asarray([segment], dtype=np.float32)})
        live["tail"] = audio[whole:]
        if sequence.end:
            for segment in live["cutter"].finish(live["samples"]):
                await send({"segments": np.asarray([segment], dtype=np.float32)})
