"""Speech on the device: the wake word, and commands (pocketsphinx 5).

``wake_word`` (stateful, decoupled): live 16 kHz mono 16-bit audio in chunks of a sequence; one
response per wake phrase heard (the phrase, and its start and end in seconds since the sequence
started), as soon as it is heard. Heard by the model trained for the phrase (``detector_model``,
wake-net: a window every 50 ms, wake.py) when its phrase is one of ``phrases``; otherwise by
pocketsphinx's keyword spotter, with the acoustic model and the pronouncing dictionary its
wheel ships (models/build.py copies them into the version directory; keyword spotting needs no
language model). Each sequence has a spotter of its own (a decoder is about 27 MiB: pocketsphinx
shares no model between decoders), so at most ``max_sequences`` run at once.

``transcribe``: a WAV file of one utterance in, its text out, recognised against a grammar of the
commands the device knows (a phrase per line of ``phrases.txt`` in the version directory: the
intent model's training sentences, by default), so that the intent model can take it from
there; an utterance that is not one of them gives an empty text.

pocketsphinx holds the GIL while it decodes (about 1.5 ms per 100 ms of audio on an x86 core):
chunks are decoded in the executor, 50 ms at a time, so that the event loop never waits for a
long chunk and a phrase is reported within 50 ms of the decoder hearing it.
"""

from __future__ import annotations

import asyncio
import io
import re
import shutil
import tempfile
import time
import wave
import weakref
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edged.common.errors import InvalidRequest, ModelLoadError, PayloadTooLarge, Unavailable
from edged.oip.tensors import bytes_tensor
from edged.pipelines import logmel, vad_ops
from edged.pipelines.base import LiveAudio, Pipeline, single_blob, texts_of
from edged.pipelines.wake import Spotter
from edged.request import Sequence
from edged.runtimes.base import Tensors

RATE = 16000
STEP = RATE // 20  # samples decoded between two looks for a phrase: 50 ms
MAX_SEQUENCES = 4
ACOUSTIC_MODEL = "en-us"  # the directory of the version that holds it
DICTIONARY = "cmudict-en-us.dict"
PHRASES = "phrases.txt"
MAX_UTTERANCE_SECONDS = 30
WORD = re.compile(r"^[a-z']+\Z")
# what a stream heard: ("wake", phrase, start, end) or ("utterance", 16-bit samples, start, end)
Event = tuple[str, Any, float, float]


def speech_model(pipeline: Pipeline) -> tuple[Any, Path, Path]:
    """pocketsphinx, and the version's acoustic model and dictionary; ModelLoadError naming
    what is missing."""
    try:
        import pocketsphinx
    except ImportError:
        raise ModelLoadError("pocketsphinx is not installed: pip install pocketsphinx") from None
    hmm = pipeline.version_dir / ACOUSTIC_MODEL
    if not (hmm / "mdef").is_file():
        raise ModelLoadError(f"pipeline '{pipeline.config.name}' needs {hmm}/ (make models)")
    return pocketsphinx, hmm, pipeline.asset(DICTIONARY)


def parse_phrases(model: str, text: str) -> list[tuple[str, float]]:
    """The ``phrases`` parameter: ``phrase=threshold`` items separated by ``;`` (the threshold
    a probability, as pocketsphinx's: lower hears more, e.g. 1e-30), lower case words."""
    found = []
    for item in text.split(";"):
        if not item.strip():
            continue
        phrase, sep, threshold = item.partition("=")
        words = phrase.lower().split()
        try:
            value = float(threshold) if sep else 1e-30
        except ValueError:
            value = -1.0
        if not words or not 0 < value < 1:
            raise ModelLoadError(
                f"model '{model}': parameter phrases: {item.strip()!r} is not"
                " 'phrase=threshold' with a threshold between 0 and 1 (e.g. hey jetson=1e-30)"
            )
        found.append((" ".join(words), value))
    if not found:
        raise ModelLoadError(f"model '{model}': parameter phrases names no phrase")
    return found


def probability(model: str, key: str, parameters: Mapping[str, str], default: float) -> float:
    """A parameter that is a probability (more than 0, at most 1); ModelLoadError naming it."""
    raw = parameters.get(key, str(default))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ModelLoadError(
            f"model '{model}': parameter {key} must be a probability, more than 0 and at most 1"
            f" (e.g. 1e-4), not {raw!r}"
        )
    return value


class WakeWord(LiveAudio):
    """The ``wake_word`` pipeline (see the module's doc)."""

    def prepare(self) -> None:
        self.pocketsphinx, self.hmm, self.dictionary = speech_model(self)
        # the trained model (wake.py) when the config names one, else pocketsphinx's spotter
        self.detector = self.config.parameters.get("detector_model", "")
        self.phrases = parse_phrases(self.config.name, self.config.parameters.get("phrases", ""))
        self.plp = probability(self.config.name, "kws_plp", self.config.parameters, 1e-4)
        # frames (10 ms) the spotter waits after a phrase before it reports it (its own
        # default, 10, costs 70 ms of latency and bought no accuracy on bench/voice.py's set)
        self.delay = self.limit("kws_delay", 3, most=100)
        idle_s = self.config.sequence_idle_s or 1.0
        # each sequence's decoder holds about 27 MiB
        most = self.limit("max_sequences", MAX_SEQUENCES, most=64)
        self.holders = Holders(self.config.name, most, idle_s)
        self.work = Path(tempfile.mkdtemp(prefix="edged-wake-"))
        self.keys = self.work / "phrases.kws"
        self.keys.write_text("".join(f"{p} /{t:g}/\n" for p, t in self.phrases), encoding="utf-8")
        probe = self._decoder()  # every word must be in the dictionary, or it would never fire
        missing = unknown_words(probe, [phrase for phrase, _ in self.phrases])
        if missing:
            raise ModelLoadError(
                f"model '{self.config.name}': no pronunciation for {', '.join(missing)} in"
                f" {DICTIONARY}"
            )

    def _decoder(self) -> Any:
        decoder = self.pocketsphinx.Decoder(
            hmm=str(self.hmm),
            dict=str(self.dictionary),
            lm=None,
            kws=str(self.keys),
            kws_plp=self.plp,
            kws_delay=self.delay,
            loglevel="FATAL",
        )
        decoder.start_utt()
        return decoder

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
        if live.get("dropped"):
            raise InvalidRequest(
                f"model '{self.config.name}': sequence {sequence.id!r} was idle for over"
                f" {self.holders.idle_s:g} s and its decoder went to another: start it again"
            )
        if not live:
            self.holders.take(sequence)
            try:
                spotting = await self._spotting()
            except BaseException:
                self.holders.give(sequence)
                raise
            live.update(spotting, samples=0, utterance=0, pending=np.zeros(0, np.int16))
        live["busy"] = True
        try:
            if "spotter" in live:
                await self._detect(live, pcm)
            heard = await self.offload(self._feed, live, pcm, sequence.end)
            await self._answer(heard, send)
        finally:
            live["busy"] = False
        if sequence.end:
            live.pop("decoder", None)
            self.holders.give(sequence)

    async def _spotting(self) -> dict[str, Any]:
        """A new sequence's spotter: the trained model's (its phrase and threshold from its
        config, as the serving version has them) when its phrase is one of ``phrases``, else a
        pocketsphinx decoder (a phrase named in the config before its model was trained)."""
        config = self.steps.config_of(self.detector) if self.detector else None
        phrase = " ".join(config.parameters.get("phrase", "").lower().split()) if config else ""
        if config is None or phrase not in [p for p, _ in self.phrases]:
            return {"decoder": await self.offload(self._decoder)}
        threshold = probability(self.detector, "threshold", config.parameters, 0.5)
        dims = config.inputs[0].dims if len(config.inputs) == 1 else ()
        frames = dims[1] if len(dims) == 3 and dims[2] == logmel.BANDS else 0
        if frames <= 0:
            raise Unavailable(
                f"model '{self.config.name}': its detector_model '{self.detector}' must take"
                f" one input of [-1, frames, {logmel.BANDS}] log-mel features"
            )
        return {"spotter": Spotter(frames, threshold), "phrase": phrase, "found": []}

    async def _detect(self, live: dict[str, Any], pcm: np.ndarray) -> None:
        """The trained model on every window that ``pcm`` completes (one call for them
        all); what it heard waits in ``found`` for the part of the audio it ended in."""
        spotter: Spotter = live["spotter"]
        windows, ends = await self.offload(spotter.windows, pcm)
        if not ends:
            return
        out = await self.steps.call(self.detector, {"features": windows})
        live["found"] += spotter.decide(ends, out["logit"], out["times"])

    def _feed(self, live: dict[str, Any], pcm: np.ndarray, end: bool) -> list[Event]:
        """Decode ``pcm`` 50 ms at a time (in the executor); what was heard, with its times
        in seconds since the sequence started."""
        audio = np.concatenate([live["pending"], pcm.astype(np.int16, copy=False)])
        whole = audio.size if end else audio.size - audio.size % STEP
        events: list[Event] = []
        for start in range(0, whole, STEP):
            events += self._part(live, audio[start : start + STEP])
        live["pending"] = audio[whole:]
        if end:
            events += self._end(live)
        return events

    def _end(self, live: dict[str, Any]) -> list[Event]:
        """The sequence's end: a phrase that ends with the audio."""
        if "spotter" in live:
            return self._part(live, np.zeros(0, np.int16))
        live["decoder"].end_utt()
        return self._heard(live) if live["decoder"].hyp() is not None else []

    def _part(self, live: dict[str, Any], part: np.ndarray) -> list[Event]:
        """50 ms to the keyword spotter: the phrases it heard, and it listens again."""
        if "spotter" in live:
            return self._found(live, part)
        decoder = live["decoder"]
        decoder.process_raw(part.tobytes(), False, False)
        live["samples"] += part.size
        if decoder.hyp() is None:
            return []
        heard = self._heard(live)
        decoder.end_utt()
        decoder.start_utt()
        live["utterance"] = live["samples"]
        return heard

    def _found(self, live: dict[str, Any], part: np.ndarray) -> list[Event]:
        """What the trained model heard in windows that end in this part (none heard while a
        command was taken: those ended before ``utterance``)."""
        live["samples"] += part.size
        due = [h for h in live["found"] if h.at <= live["samples"]]
        live["found"] = live["found"][len(due) :]
        heard = [("wake", live["phrase"], h.start, h.end) for h in due if h.at > live["utterance"]]
        if heard:
            live["utterance"] = live["samples"]
        return heard

    def _heard(self, live: dict[str, Any]) -> list[Event]:
        base = live["utterance"] / RATE
        return [
            (
                "wake",
                segment.word.strip(),
                base + segment.start_frame / 100,
                base + segment.end_frame / 100,
            )
            for segment in live["decoder"].seg()
        ]

    async def _answer(
        self, events: list[Event], send: Callable[[Tensors], Awaitable[None]]
    ) -> None:
        for _, phrase, start, end in events:
            await send(
                {
                    "phrase": bytes_tensor([str(phrase).encode()]),
                    "times": np.array([start, end], dtype=np.float32),
                }
            )

    async def unload(self) -> None:
        shutil.rmtree(getattr(self, "work", ""), ignore_errors=True)


class VoiceAssistant(WakeWord):
    """``voice_assistant``: the wake word, then the command that follows it, on one live
    stream. After a wake phrase the audio goes to a voice activity detector (pocketsphinx's
    WebRTC endpointer) instead of the spotter: from the phrase's end until the speech that
    follows ends (or ``command_seconds``; nothing said within 2 s gives an empty command),
    then that utterance to the ``transcribe_model`` and its text to the ``intent_model``, as
    steps routed like any call, on the device (its config says ``privacy: private``). One
    response per event:
    ``event`` "wake" or "command", ``text`` (the phrase, or the transcript: "" when it is none
    of the device's phrases), ``intent`` and ``score`` (a command's), ``times``."""

    QUIET_S = 2.0  # no speech this long after the wake phrase: no command

    def prepare(self) -> None:
        super().prepare()
        self.command_s = self.limit("command_seconds", 5, most=60)  # the audio is kept
        # the endpointer's window: 90% of it speech starts the command, 90% quiet ends it
        # (under 0.18 s its 30 ms frames cannot make 90%; 1 s missed a 1 s command)
        self.endpoint_s = self.limit("endpoint_ms", 200, most=1000, least=180) / 1000

    def _part(self, live: dict[str, Any], part: np.ndarray) -> list[Event]:
        command = live.get("command")
        if command is not None:
            live["samples"] += part.size
            return self._capture(live, command, part)
        recent = np.concatenate([live.get("recent", np.zeros(0, np.int16)), part])[-RATE:]
        live["recent"] = recent
        events = super()._part(live, part)
        if events:  # listen for the command from where the phrase ended
            end = int(events[-1][3] * RATE)
            after = recent[recent.size - max(0, min(recent.size, live["samples"] - end)) :]
            detector = self.pocketsphinx.Endpointer(window=self.endpoint_s, ratio=0.9, vad_mode=3)
            command = {
                "start": end,
                "audio": [],
                "frames": b"",
                "spoke": False,
                "onset": 0.0,
                "endpointer": detector,
            }
            live["command"] = command
            events += self._capture(live, command, after)
        return events

    def _capture(
        self, live: dict[str, Any], command: dict[str, Any], part: np.ndarray
    ) -> list[Event]:
        command["audio"].append(part)
        frames = command["frames"] + part.tobytes()
        size = command["endpointer"].frame_bytes
        ended = False
        for at in range(0, len(frames) - len(frames) % size, size):
            command["endpointer"].process(frames[at : at + size])
            if command["endpointer"].in_speech:
                if not command["spoke"]:  # where speech began: seconds since the capture did
                    command["onset"] = command["endpointer"].speech_start
                command["spoke"] = True
            elif command["spoke"]:
                ended = True
        command["frames"] = frames[len(frames) - len(frames) % size :]
        took = (live["samples"] - command["start"]) / RATE
        if not (ended or took >= self.command_s or (not command["spoke"] and took >= self.QUIET_S)):
            return []
        live["command"] = None  # back to the wake phrase, from here
        if "decoder" in live:
            live["decoder"].end_utt()
            live["decoder"].start_utt()
        live["utterance"] = live["samples"]
        return [("utterance", said(command), command["start"] / RATE, live["samples"] / RATE)]

    def _end(self, live: dict[str, Any]) -> list[Event]:
        """The sequence's end: a command still being said ends with it."""
        command = live.get("command")
        if command is None:
            return super()._end(live)
        live["command"] = None
        return [("utterance", said(command), command["start"] / RATE, live["samples"] / RATE)]

    async def _answer(
        self, events: list[Event], send: Callable[[Tensors], Awaitable[None]]
    ) -> None:
        for kind, what, start, end in events:
            text, intent, score = str(what), "", 0.0
            if kind == "utterance":
                text = await self._transcript(what) if what.size else ""
                if text:
                    found = await self.steps.call(
                        self.step("intent_model"), {"text": bytes_tensor([text.encode()])}
                    )
                    (intent,) = texts_of("intent", found["intent"])
                    score = float(found["score"].reshape(-1)[0])
            await send(
                {
                    "event": bytes_tensor([b"wake" if kind == "wake" else b"command"]),
                    "text": bytes_tensor([text.encode()]),
                    "intent": bytes_tensor([intent.encode()]),
                    "score": np.array([score], dtype=np.float32),
                    "times": np.array([start, end], dtype=np.float32),
                }
            )

    async def _transcript(self, samples: np.ndarray) -> str:
        out = await self.steps.call(
            self.step("transcribe_model"), {"audio": bytes_tensor([wav_bytes(samples)])}
        )
        (text,) = texts_of("text", out["text"])
        return text


class Transcribe(Pipeline):
    """The ``transcribe`` pipeline (see the module's doc)."""

    def prepare(self) -> None:
        pocketsphinx, hmm, dictionary = speech_model(self)
        lines = self.asset(PHRASES).read_text(encoding="utf-8").splitlines()
        phrases = sorted({" ".join(line.lower().split()) for line in lines if line.strip()})
        bad = [p for p in phrases if not all(WORD.match(w) for w in p.split())]
        if bad or not phrases:
            raise ModelLoadError(
                f"model '{self.config.name}': {PHRASES} needs phrases of lower-case words"
                f" (a-z and '), one per line: {bad[:3] or 'none found'}"
            )
        self.phrases = set(phrases)
        grammar = f"#JSGF V1.0;\ngrammar commands;\npublic <command> = {' | '.join(phrases)};\n"
        count = self.limit("max_decoders", 2, most=16)  # about 27 MiB each, made now
        self.decoders: asyncio.Queue[Any] = asyncio.Queue()
        for _ in range(count):
            decoder = pocketsphinx.Decoder(
                hmm=str(hmm), dict=str(dictionary), lm=None, loglevel="FATAL"
            )
            missing = unknown_words(decoder, phrases)
            if missing:
                raise ModelLoadError(
                    f"model '{self.config.name}': no pronunciation for {', '.join(missing[:10])}"
                    f" in {DICTIONARY}: take those phrases out of {PHRASES}"
                )
            decoder.add_jsgf_string("commands", grammar)
            decoder.activate_search("commands")
            self.decoders.put_nowait(decoder)

    def sample(self) -> Tensors:
        """Half a second of quiet noise as a WAV file."""
        noise = 0.003 * np.random.default_rng(0).standard_normal(RATE // 2)
        return {"audio": bytes_tensor([wav_bytes((noise * 32767).astype(np.int16))])}

    async def run(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        data = single_blob("audio", inputs["audio"])
        limit = self.limit("max_seconds", MAX_UTTERANCE_SECONDS)
        pcm, rate = await self.offload(vad_ops.decode_wav, data, int(limit * RATE))
        if len(pcm) > limit * rate:
            raise PayloadTooLarge(
                f"the audio is {len(pcm) / rate:.0f} s long; at most {limit} s per request"
            )
        pcm, _ = await self.offload(vad_ops.to_model_rate, pcm, rate)
        samples = (np.clip(pcm, -1, 1) * 32767).astype(np.int16).tobytes()
        decoder = await self.decoders.get()
        try:
            text = await self.offload(self._decode, decoder, samples)
        finally:
            self.decoders.put_nowait(decoder)
        sure = np.array([1.0 if text else 0.0], dtype=np.float32)  # a whole phrase, or none
        return {"text": bytes_tensor([text.encode()]), "confidence": sure}

    def _decode(self, decoder: Any, samples: bytes) -> str:
        """The utterance's phrase, or "" when the best path is not a whole phrase (a grammar
        has no rejection of its own: it returns the nearest partial path)."""
        decoder.start_utt()
        decoder.process_raw(samples, False, True)
        decoder.end_utt()
        hypothesis = decoder.hyp()
        text = " ".join(hypothesis.hypstr.split()) if hypothesis is not None else ""
        return text if text in self.phrases else ""


def said(command: dict[str, Any]) -> np.ndarray:
    """A command's audio, from half a second before the endpointer heard speech begin (it
    misses unvoiced onsets: the "s" of "scan"), but not within 0.1 s of the wake phrase's end
    (the spotter places that end a little early: its tail would spoil the transcript); none
    when nothing was said."""
    if not command["spoke"] or not command["audio"]:
        return np.zeros(0, np.int16)
    start = max(0.1, command["onset"] - 0.5)
    return np.concatenate(command["audio"])[int(start * RATE) :]


def unknown_words(decoder: Any, phrases: list[str]) -> list[str]:
    """The words of ``phrases`` that the decoder's dictionary has no pronunciation for."""
    words = {word for phrase in phrases for word in phrase.split()}
    return sorted(word for word in words if decoder.lookup_word(word) is None)


def wav_bytes(samples: np.ndarray) -> bytes:
    """16 kHz mono 16-bit samples as a WAV file."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE)
        wav.writeframes(samples.tobytes())
    return buffer.getvalue()


class Holders:
    """The sequences that hold one of the model's decoders: at most ``limit``. A sequence gives
    its decoder back when it ends or is dropped (idle in its stream, or its stream gone: the
    decoder goes with it); when all are held, one idle for over ``idle_s`` is taken back for a
    new sequence (its next request is refused), so that callers who stop sending cannot hold
    the model."""

    def __init__(self, model: str, limit: int, idle_s: float) -> None:
        self.model = model
        self.limit = limit
        self.idle_s = idle_s
        self.held: dict[int, weakref.ref[Sequence]] = {}

    def take(self, sequence: Sequence) -> None:
        if len(self.held) >= self.limit:
            now = time.monotonic()
            held = list(self.held.values())  # a snapshot: the garbage collector may drop some
            idle = [
                s
                for s in (ref() for ref in held)
                if s is not None and not s.state.get("busy") and now - s.used > self.idle_s
            ]
            if not idle:
                raise Unavailable(
                    f"model '{self.model}': its {self.limit} decoders are in use (parameter"
                    " max_sequences); end a sequence first"
                )
            oldest = min(idle, key=lambda s: s.used)
            oldest.state.clear()
            oldest.state["dropped"] = True
            self.give(oldest)
        key = id(sequence)
        self.held[key] = weakref.ref(sequence, lambda _: self.held.pop(key, None))

    def give(self, sequence: Sequence) -> None:
        self.held.pop(id(sequence), None)
