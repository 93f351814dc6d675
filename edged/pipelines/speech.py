"""Speech recognition on the device with pocketsphinx 5: the wake word.

``wake_word`` (stateful, decoupled): live 16 kHz mono 16-bit audio in chunks of a sequence; one
response per wake phrase heard (the phrase, and its start and end in seconds since the sequence
started), as soon as it is heard. The acoustic model and the pronouncing dictionary are the
ones pocketsphinx's wheel ships (models/build.py copies them into the version directory);
keyword spotting needs no language model. Each sequence has a decoder of its own (about 27 MiB:
pocketsphinx shares no model between decoders), so at most ``max_sequences`` run at once.

pocketsphinx holds the GIL while it decodes (about 1.5 ms per 100 ms of audio on an x86 core):
chunks are decoded in the executor, 100 ms at a time, so that the event loop never waits for a
long chunk and a phrase is reported within 100 ms of the decoder hearing it.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edged.errors import ModelLoadError, PayloadTooLarge, Unavailable
from edged.pipelines.base import Pipeline
from edged.request import Sequence
from edged.runtimes.base import Tensors

RATE = 16000
STEP = RATE // 10  # samples decoded between two looks for a phrase: 100 ms
MAX_CHUNK_SECONDS = 10
MAX_SEQUENCES = 4
ACOUSTIC_MODEL = "en-us"  # the directory of the version that holds it
DICTIONARY = "cmudict-en-us.dict"


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


class WakeWord(Pipeline):
    """The ``wake_word`` pipeline (see the module's doc)."""

    stateful = True

    def prepare(self) -> None:
        try:
            import pocketsphinx
        except ImportError:
            raise ModelLoadError(
                "pocketsphinx is not installed (pip install pocketsphinx)"
            ) from None
        self.pocketsphinx = pocketsphinx
        self.hmm = self.version_dir / ACOUSTIC_MODEL
        if not (self.hmm / "mdef").is_file():
            raise ModelLoadError(f"pipeline '{self.config.name}' needs {self.hmm}/ (make models)")
        self.dictionary = self.asset(DICTIONARY)
        self.phrases = parse_phrases(self.config.name, self.config.parameters.get("phrases", ""))
        self.plp = float(self.config.parameters.get("kws_plp", "1e-4"))
        self.max_sequences = self.limit("max_sequences", MAX_SEQUENCES)
        self.slots = threading.BoundedSemaphore(self.max_sequences)
        self.work = Path(tempfile.mkdtemp(prefix="edged-wake-"))
        keys = self.work / "phrases.kws"
        keys.write_text("".join(f"{p} /{t:g}/\n" for p, t in self.phrases), encoding="utf-8")
        self.keys = keys
        probe = self._decoder()  # every word must be in the dictionary, or it would never fire
        missing = sorted(
            {w for p, _ in self.phrases for w in p.split() if probe.lookup_word(w) is None}
        )
        if missing:
            raise ModelLoadError(
                f"model '{self.config.name}': no pronunciation for {', '.join(missing)} in"
                f" {DICTIONARY}"
            )

    def _decoder(self) -> Any:
        decoder = self.pocketsphinx.Decoder(
            hmm=str(self.hmm), dict=str(self.dictionary), lm=None, kws=str(self.keys),
            kws_plp=self.plp, loglevel="FATAL",
        )  # fmt: skip
        decoder.start_utt()
        return decoder

    def sample(self) -> Tensors:
        """Half a second of silence."""
        return {"pcm": np.zeros(RATE // 2, dtype=np.int16)}

    async def stream(
        self,
        inputs: Tensors,
        parameters: Mapping[str, Any],
        send: Callable[[Tensors], Awaitable[None]],
        sequence: Sequence | None,
    ) -> None:
        assert sequence is not None  # a stateful model is called in a sequence
        pcm = inputs["pcm"].reshape(-1)
        limit = self.limit("max_chunk_seconds", MAX_CHUNK_SECONDS)
        if pcm.size > limit * RATE:
            raise PayloadTooLarge(
                f"input 'pcm' holds {pcm.size} samples; at most {limit * RATE} ({limit} s at"
                f" {RATE} Hz) per request: send shorter chunks"
            )
        live = sequence.state
        if not live:
            if not self.slots.acquire(blocking=False):
                raise Unavailable(
                    f"model '{self.config.name}': its {self.max_sequences} decoders are in use"
                    " (parameter max_sequences); end a sequence first"
                )
            slot = _Slot(self.slots)
            try:
                decoder = await self.offload(self._decoder)
            except BaseException:
                slot.release()
                raise
            # the slot comes back when the sequence ends, or is dropped (idle, or its stream
            # gone) with its decoder
            weakref.finalize(sequence, slot.release)
            live.update(decoder=decoder, slot=slot, samples=0, utterance=0,
                        pending=np.zeros(0, np.int16))  # fmt: skip
        heard = await self.offload(self._feed, live, pcm, sequence.end)
        for phrase, start, end in heard:
            await send({
                "phrase": np.array([phrase.encode()], dtype=object),
                "times": np.array([start, end], dtype=np.float32),
            })  # fmt: skip
        if sequence.end:
            live.pop("decoder", None)
            live["slot"].release()

    def _feed(
        self, live: dict[str, Any], pcm: np.ndarray, end: bool
    ) -> list[tuple[str, float, float]]:
        """Decode ``pcm`` 100 ms at a time (in the executor); the phrases heard, with their
        times in seconds since the sequence started."""
        decoder = live["decoder"]
        audio = np.concatenate([live["pending"], pcm.astype(np.int16, copy=False)])
        whole = audio.size if end else audio.size - audio.size % STEP
        heard: list[tuple[str, float, float]] = []

        def collect() -> None:
            base = live["utterance"] / RATE
            for segment in decoder.seg():  # 10 ms frames since the utterance started
                heard.append((segment.word.strip(), base + segment.start_frame / 100,
                              base + segment.end_frame / 100))  # fmt: skip

        for start in range(0, whole, STEP):
            part = audio[start : start + STEP]
            decoder.process_raw(part.tobytes(), False, False)
            live["samples"] += part.size
            if decoder.hyp() is not None:
                collect()
                decoder.end_utt()  # and listen again, from here
                decoder.start_utt()
                live["utterance"] = live["samples"]
        live["pending"] = audio[whole:]
        if end:  # a phrase that ends with the audio
            decoder.end_utt()
            if decoder.hyp() is not None:
                collect()
        return heard

    async def unload(self) -> None:
        shutil.rmtree(getattr(self, "work", ""), ignore_errors=True)


class _Slot:
    """One of the model's decoders, taken, given back once."""

    def __init__(self, slots: threading.BoundedSemaphore) -> None:
        self.slots = slots
        self.lock = threading.Lock()
        self.taken = True

    def release(self) -> None:
        with self.lock:
            if not self.taken:
                return
            self.taken = False
        self.slots.release()
