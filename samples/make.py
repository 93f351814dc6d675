#!/usr/bin/env python3
"""The README's sample files, made once and kept in the repository (so that every command of
the quick start runs as written, without fonts or espeak-ng on the machine):

- ``invoice.png``: an invoice's lines in DejaVu Sans (fonts-dejavu-core), for ``edgectl ocr``
  and the ``image-report`` template;
- ``speech.wav``: "turn on the kitchen lights" from espeak-ng, between 0.6 s and 0.8 s of
  silence, 16 kHz mono 16-bit, for ``edgectl vad``, ``listen`` and ``transcribe``.

    .venv/bin/python samples/make.py      # again: the same bytes where the tools are the same
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.media import speech_in_silence, text_image  # noqa: E402

INVOICE = ["INVOICE 2041", "Date: 2026-11-30", "Total: $1,234.50", "Pay to: billing@acme.example"]
SPEECH = "turn on the kitchen lights"


def main() -> None:
    (HERE / "invoice.png").write_bytes(text_image(INVOICE))
    wav, start, end = speech_in_silence(SPEECH, 0.6, 0.8)
    (HERE / "speech.wav").write_bytes(wav)
    print(f"invoice.png; speech.wav: speech from {start:.2f} s to {end:.2f} s")


if __name__ == "__main__":
    main()
