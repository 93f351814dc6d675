#!/usr/bin/env python3
"""The docs' sample files, made once and kept in the repository (so that every command of the
README and docs/ runs as written, without fonts or espeak-ng on the machine):

- ``invoice.png``: an invoice's lines in DejaVu Sans (fonts-dejavu-core), for ``edgectl ocr``
  and the ``image-report`` template;
- ``speech.wav``: "turn on the kitchen lights" from espeak-ng, between 0.6 s and 0.8 s of
  silence, 16 kHz mono 16-bit, for ``edgectl vad``, ``listen`` and ``transcribe``;
- ``wake.wav``: a sentence, then "hey jetson", for ``edgectl listen`` and the REST stream;
- ``kitchen.wav``: "hey jetson, scan this receipt", then "hey jetson" and a sentence that is
  none of the device's phrases, for ``edgectl listen --model voice-assistant``;
- ``weather.wav``: "how is the weather tomorrow" (none of the device's phrases: the cloud's
  transcriber hears it), for the ``voice-command`` template.

``manual/`` and ``notes.txt`` are written by hand: the knowledge base's example corpus.

    .venv/bin/python samples/make.py      # again: the same bytes where the tools are the same
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.media import RATE, espeak, speech_in_silence, text_image, wav_bytes  # noqa: E402

INVOICE = ["INVOICE 2041", "Date: 2026-11-30", "Total: $1,234.50", "Pay to: billing@acme.example"]
SPEECH = "turn on the kitchen lights"
WAKE = [("The meeting starts at ten.", 0.7), ("hey jetson", 1.0)]
KITCHEN = [
    ("Good morning, this is the kitchen speaker.", 0.7),
    ("hey jetson", 0.3),
    ("scan this receipt", 2.0),
    ("hey jetson", 0.3),
    ("please call my brother tomorrow", 1.5),
]  # (what is said, then seconds of quiet)
WEATHER = [("how is the weather tomorrow", 0.6)]


def spoken(script: list[tuple[str, float]], seed: int = 0) -> bytes:
    """A WAV of each sentence followed by its quiet, after 0.5 s of quiet, with -50 dB noise."""
    parts = [np.zeros(RATE // 2, np.float32)]
    for text, quiet in script:
        parts += [espeak(text), np.zeros(int(quiet * RATE), np.float32)]
    audio = np.concatenate(parts)
    audio += 0.003 * np.random.default_rng(seed).standard_normal(len(audio)).astype(np.float32)
    return wav_bytes(audio)


def main() -> None:
    (HERE / "invoice.png").write_bytes(text_image(INVOICE))
    wav, start, end = speech_in_silence(SPEECH, 0.6, 0.8)
    (HERE / "speech.wav").write_bytes(wav)
    for name, script in (("wake", WAKE), ("kitchen", KITCHEN), ("weather", WEATHER)):
        (HERE / f"{name}.wav").write_bytes(spoken(script))
    print(
        f"invoice.png; speech.wav: speech from {start:.2f} s to {end:.2f} s; wake.wav,"
        " kitchen.wav, weather.wav"
    )


if __name__ == "__main__":
    main()
