"""Log-mel features of 16 kHz audio: what the trained wake-word model reads (issue 47).

One definition for both sides: the training script (models/wakeword) computes a clip's frames
with :func:`frames` and the live pipeline computes them as the audio arrives with
:class:`Stream`, which gives the frames :func:`frames` gives for the whole recording, to
float rounding (a test holds it), so what the model saw in training is what it sees on the device.

Frame ``i`` covers samples ``[i * HOP, i * HOP + WINDOW)``: 25 ms windows (Hann), 10 ms apart,
a 512-point FFT, 40 mel bands from 60 Hz to 7.6 kHz (HTK's mel scale), natural log of the band
power with a floor of 1e-10 (digital silence is -23, not -inf).
"""

from __future__ import annotations

import numpy as np

RATE = 16000
WINDOW = 400  # 25 ms
HOP = 160  # 10 ms
FFT = 512
BANDS = 40
LOW_HZ, HIGH_HZ = 60.0, 7600.0
FLOOR = 1e-10


def _mel(hz: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + hz / 700.0)


def _hz(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def filterbank() -> np.ndarray:
    """[FFT // 2 + 1, BANDS] triangular filters, each peaking at 1."""
    edges = _hz(np.linspace(_mel(np.array(LOW_HZ)), _mel(np.array(HIGH_HZ)), BANDS + 2))
    bins = np.linspace(0.0, RATE / 2, FFT // 2 + 1)
    low, centre, high = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins[None, :] - low) / (centre - low)
    falling = (high - bins[None, :]) / (high - centre)
    return np.maximum(0.0, np.minimum(rising, falling)).T.astype(np.float32)


_BANK = filterbank()
_HANN = np.hanning(WINDOW + 2)[1:-1].astype(np.float32)


def count(samples: int) -> int:
    """How many whole frames ``samples`` samples make."""
    return 0 if samples < WINDOW else 1 + (samples - WINDOW) // HOP


def frames(audio: np.ndarray) -> np.ndarray:
    """[frames, BANDS] float32 of ``audio`` (float samples in [-1, 1], or int16), or of each
    row of a [clips, samples] array ([clips, frames, BANDS])."""
    x = np.asarray(audio)
    if x.dtype == np.int16:
        x = x.astype(np.float32) / 32768.0
    x = x.astype(np.float32, copy=False)
    n = count(x.shape[-1])
    if n == 0:
        return np.zeros((*x.shape[:-1], 0, BANDS), np.float32)
    starts = np.arange(n) * HOP
    windows = x[..., starts[:, None] + np.arange(WINDOW)[None, :]] * _HANN
    power = np.abs(np.fft.rfft(windows, FFT, axis=-1)).astype(np.float32) ** 2
    return np.log(np.maximum(power @ _BANK, FLOOR)).astype(np.float32)


class Stream:
    """The frames of audio that arrives in pieces: each :meth:`push` returns the frames the
    samples so far complete, exactly as :func:`frames` would give them for the whole."""

    def __init__(self) -> None:
        self._held = np.zeros(0, np.float32)

    def push(self, audio: np.ndarray) -> np.ndarray:
        x = np.asarray(audio)
        if x.dtype == np.int16:
            x = x.astype(np.float32) / 32768.0
        held = np.concatenate([self._held, x.astype(np.float32, copy=False)])
        n = count(held.size)
        self._held = held[n * HOP :]
        return frames(held[: (n - 1) * HOP + WINDOW]) if n else np.zeros((0, BANDS), np.float32)
