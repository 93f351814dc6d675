"""Real inputs made on the spot: text drawn with a real font, speech from espeak-ng."""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from tests.conftest import skip_or_fail

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
RATE = 16000


def text_image(lines: list[str], size: int = 28, pad: int = 24) -> bytes:
    """A PNG of black text lines on white, in DejaVu Sans (fonts-dejavu-core)."""
    if not FONT.is_file():
        skip_or_fail(f"{FONT} is missing: install fonts-dejavu-core (make test does)")
    font = ImageFont.truetype(str(FONT), size)
    width = max(int(font.getlength(line)) for line in lines) + 2 * pad
    height = len(lines) * int(size * 1.8) + 2 * pad
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((pad, pad + i * int(size * 1.8)), line, fill="black", font=font)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def char_accuracy(found: str, truth: str, spaces: bool = False) -> float:
    """1 - edit distance / length; spaces are ignored unless ``spaces``."""
    if not spaces:
        found, truth = found.replace(" ", ""), truth.replace(" ", "")
    return 1.0 - edit_distance(found, truth) / max(1, len(truth))


def wav_bytes(pcm: np.ndarray, rate: int = RATE) -> bytes:
    """16-bit mono WAV of float samples in [-1, 1]."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def espeak(text: str, voice: str | None = None) -> np.ndarray:
    """Speech from espeak-ng (its default voice, or ``voice``: en-us+f3 ...), as float samples
    at 16 kHz."""
    if shutil.which("espeak-ng") is None:
        skip_or_fail("espeak-ng is not installed (make test installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        voices = ["-v", voice] if voice else []
        command = ["espeak-ng", *voices, "-w", str(out), text]
        subprocess.run(command, check=True, capture_output=True)
        with wave.open(str(out)) as wav:
            rate = wav.getframerate()
            pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32) / 32768
    if rate != RATE:  # espeak-ng writes 22050 Hz
        times = np.arange(int(len(pcm) * RATE / rate)) / RATE
        pcm = np.interp(times, np.arange(len(pcm)) / rate, pcm).astype(np.float32)
    return pcm


def speech_in_silence(text: str, lead: float, tail: float) -> tuple[bytes, float, float]:
    """A WAV with speech between ``lead`` s and ``tail`` s of silence, and the true bounds:
    where the speech's 10 ms envelope first and last passes 2% of its peak."""
    speech = espeak(text)
    window = RATE // 100
    envelope = np.convolve(np.abs(speech), np.ones(window) / window, mode="same")
    active = np.flatnonzero(envelope > 0.02 * envelope.max())
    start = lead + active[0] / RATE
    end = lead + active[-1] / RATE
    pcm = np.concatenate(
        [np.zeros(int(lead * RATE), np.float32), speech, np.zeros(int(tail * RATE), np.float32)]
    )
    return wav_bytes(pcm), start, end
