"""The trained wake-word model on live audio: windows in, wake events out (issue 47).

The model (an ONNX model of its own in the repository, ``wake-net`` by default, trained by
models/wakeword/train.py) reads the log-mel frames of a 1.5 s window and answers a logit (is
the whole phrase in the window?) and where the phrase starts and ends, in seconds before the
window's end. :class:`Spotter` keeps the frames of a live stream, makes a window every
``stride`` frames (50 ms), and turns the model's answers into events: a window whose
probability reaches the threshold is the phrase, unless an event was reported less than
``refractory_s`` before (the phrase stays in the window for a second after it is said).

Before the stream has 1.5 s of audio the window is padded with the frames of a quiet room
(white noise at -80 dBFS), as the model saw in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edged.pipelines import logmel

STRIDE = 5  # frames between two windows: 50 ms


def _quiet() -> np.ndarray:
    noise = np.random.default_rng(0).standard_normal(logmel.RATE).astype(np.float32) * 1e-4
    return logmel.frames(noise).mean(axis=0)


QUIET = _quiet()


@dataclass(frozen=True)
class Heard:
    """An event: where the window that heard it ended (samples since the stream began), and
    the phrase's start and end in seconds since then."""

    at: int
    start: float
    end: float


class Spotter:
    def __init__(
        self,
        frames: int,
        threshold: float,
        *,
        stride: int = STRIDE,
        refractory_s: float = 1.0,
    ) -> None:
        self.frames, self.threshold, self.stride = frames, threshold, stride
        # compared as logits: no exp to overflow, and a NaN (a broken model) is never the phrase
        self.least = float(np.log(threshold / (1.0 - threshold))) if threshold < 1 else np.inf
        self.refractory_s = refractory_s
        self.stream = logmel.Stream()
        self.history = np.tile(QUIET, (frames, 1)).astype(np.float32)
        self.seen = 0  # frames so far
        self.quiet_until = -np.inf

    def windows(self, pcm: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The windows that ``pcm`` completes ([N, frames, bands]), and the frame count at the
        end of each."""
        new = self.stream.push(pcm)
        joined = np.concatenate([self.history, new])
        first = (self.seen // self.stride + 1) * self.stride
        ends = list(range(first, self.seen + len(new) + 1, self.stride))
        picked = [joined[e - self.seen : e - self.seen + self.frames] for e in ends]
        self.seen += len(new)
        self.history = joined[-self.frames :]
        window = (
            np.stack(picked) if picked else np.zeros((0, self.frames, logmel.BANDS), np.float32)
        )
        return window, ends

    def decide(self, ends: list[int], logits: np.ndarray, times: np.ndarray) -> list[Heard]:
        """Events from the model's answers for the windows that ended at ``ends``."""
        heard = []
        for end, logit, (before_start, before_end) in zip(
            ends, logits.reshape(-1), times.reshape(-1, 2)
        ):
            if not float(logit) >= self.least:
                continue
            sample = (end - 1) * logmel.HOP + logmel.WINDOW
            now = sample / logmel.RATE
            if now < self.quiet_until:
                continue
            self.quiet_until = now + self.refractory_s
            start = max(0.0, now - max(float(before_start), 0.0))
            stop = min(now, max(start, now - max(float(before_end), 0.0)))
            heard.append(Heard(sample, round(start, 3), round(stop, 3)))
        return heard
