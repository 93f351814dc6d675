"""The trained wake word's live half: log-mel frames as the audio arrives, windows every
50 ms, and events from the model's answers (edged/pipelines/logmel.py, wake.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.pipelines import logmel, wake

RATE = logmel.RATE


def _audio(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(seconds * RATE)) * 3000).astype(np.int16)


def test_frame_counts_and_the_band_of_a_tone() -> None:
    assert [logmel.count(n) for n in (0, 399, 400, 559, 560, 16000)] == [0, 0, 1, 1, 2, 98]
    t = np.arange(RATE) / RATE
    frames = logmel.frames((0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32))
    assert frames.shape == (98, logmel.BANDS)
    centres = logmel.filterbank().argmax(axis=0) * RATE / logmel.FFT
    loudest = int(frames.mean(axis=0).argmax())
    assert abs(centres[loudest] - 1000) < 100, (loudest, centres[loudest])
    silent = logmel.frames(np.zeros(RATE, np.float32))
    assert np.all(silent == np.float32(np.log(logmel.FLOOR)))  # a floor, not -inf
    assert logmel.frames(np.zeros(399, np.int16)).shape == (0, logmel.BANDS)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=12))
def test_frames_as_the_audio_arrives_are_the_frames_of_the_whole(cuts: list[int]) -> None:
    audio = _audio(sum(cuts) / RATE + 0.01)
    whole = logmel.frames(audio)
    stream = logmel.Stream()
    pieces, at = [], 0
    for n in cuts:
        pieces.append(stream.push(audio[at : at + n]))
        at += n
    pieces.append(stream.push(audio[at:]))
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-4)  # BLAS rounding


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 6000), min_size=1, max_size=10))
def test_a_window_every_50_ms_holds_the_last_frames(cuts: list[int]) -> None:
    frames = 30
    audio = _audio(sum(cuts) / RATE)
    whole = np.concatenate([np.tile(wake.QUIET, (frames, 1)), logmel.frames(audio)])
    spotter = wake.Spotter(frames, 0.5)
    at, ends, windows = 0, [], []
    for n in cuts:
        w, e = spotter.windows(audio[at : at + n])
        at += n
        windows += list(w)
        ends += e
    assert ends == list(range(5, logmel.count(audio.size) + 1, 5))
    for end, window in zip(ends, windows):
        np.testing.assert_allclose(window, whole[end : end + frames], atol=1e-4)  # end-30..end-1


def test_events_need_the_threshold_and_keep_a_second_apart() -> None:
    spotter = wake.Spotter(148, 0.9)
    hop = logmel.HOP
    ends = [100, 105, 110, 200, 205]  # frame counts: windows end at (end - 1) * 160 + 400
    logits = np.array([2.0, 3.0, 3.0, 3.0, 3.0], np.float32)  # p 0.88, then 0.95
    times = np.array([[0.9, 0.1]] * 5, np.float32)
    heard = spotter.decide(ends, logits, times)
    first = (104 * hop + 400) / RATE  # 105's window: the first at or over 0.9
    assert [h.at for h in heard] == [104 * hop + 400, 204 * hop + 400]  # 110 within 1 s: none
    assert heard[0].start == round(first - 0.9, 3) and heard[0].end == round(first - 0.1, 3)
    # times out of range are clamped: a start not before 0, an end not after the window's
    late = wake.Spotter(148, 0.5).decide([10], np.array([5.0]), np.array([[9.0, -1.0]]))
    assert late[0].start == 0.0 and late[0].end == round(late[0].at / RATE, 3)


def test_a_model_that_answers_nan_or_extremes_hears_nothing_false() -> None:
    """A broken model's NaN is never the phrase; logits far past either side decide without
    overflow; a threshold of 1 is never reached."""
    spotter = wake.Spotter(148, 0.9)
    times = np.zeros((3, 2), np.float32)
    heard = spotter.decide([100, 200, 300], np.array([np.nan, -1e30, 1e30]), times)
    assert [h.at for h in heard] == [299 * logmel.HOP + logmel.WINDOW]
    assert wake.Spotter(148, 1.0).decide([10], np.array([1e30]), np.zeros((1, 2))) == []
