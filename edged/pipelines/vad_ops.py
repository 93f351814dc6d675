"""Silero VAD (silero_vad.onnx, silero-vad 6.2.3) pre/post-processing over numpy arrays.

The model takes one chunk at a time: ``input`` float32 [1, context + chunk] (512 + 64 samples at
16 kHz, 256 + 32 at 8 kHz), ``state`` float32 [2, 1, 128] carried from the previous call and
``sr`` int64; it returns ``output`` [1, 1] (speech probability) and ``stateN``. The daemon runs
the graph; these functions decode WAV bytes, cut the chunks and turn the probabilities into
speech segments with the same hysteresis as the package's ``get_speech_timestamps``.
"""

from __future__ import annotations

import io
import struct
import wave
from collections.abc import Callable, Iterator

import numpy as np

from edged.common.errors import InvalidRequest, PayloadTooLarge

CHUNK = {16000: 512, 8000: 256}
CONTEXT = {16000: 64, 8000: 32}
STATE_SHAPE = (2, 1, 128)
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
# KSDATAFORMAT_SUBTYPE_* GUIDs differ only in their first two bytes, the format tag.
_GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")
# Half-width of the anti-alias filter used when downsampling; 32 taps a side keep it cheap.
_FIR_HALF = 32
MIN_RATE = 8000
MAX_RATE = 192000


def decode_wav(data: bytes, max_samples: int | None = None) -> tuple[np.ndarray, int]:
    """Decode a WAV file into float32 mono samples in [-1, 1] and its sample rate.

    Integer PCM of 8, 16, 24 or 32 bits and IEEE float of 32 or 64 bits, plain or
    WAVE_FORMAT_EXTENSIBLE; channels are averaged. Raises InvalidRequest for bytes that are not
    WAV, other encodings (A-law, mu-law, ADPCM, ...) and empty audio; PayloadTooLarge, before
    any sample is decoded, for more than ``max_samples`` samples (all channels counted).
    """
    fmt = _wav_format(data)
    tag = fmt[0] if fmt else _PCM
    if tag not in (_PCM, _FLOAT):
        raise InvalidRequest(
            f"unsupported WAV encoding (format {tag:#x}): send integer PCM (8/16/24/32-bit) "
            "or float (32/64-bit)"
        )
    if fmt and data[fmt[1] : fmt[1] + 2] != b"\x01\x00":
        # The stdlib reads only format tag 1 (before 3.12 not even EXTENSIBLE PCM): relabel
        # the header and interpret float samples ourselves below.
        data = data[: fmt[1]] + b"\x01\x00" + data[fmt[1] + 2 :]
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            channels = wav.getnchannels()
            width = wav.getsampwidth()
            rate = wav.getframerate()
            frames = min(wav.getnframes(), len(data) // max(1, width * channels))
            if max_samples is not None and frames * channels > max_samples:
                raise PayloadTooLarge(
                    f"the audio holds {frames * channels} samples ({frames} frames of"
                    f" {channels} channel(s) at {rate} Hz); at most {max_samples} per request:"
                    " send it shorter, in mono or at 16 kHz"
                )
            raw = wav.readframes(frames)
    except (wave.Error, EOFError, ValueError, OSError, RuntimeError, struct.error) as exc:
        # RuntimeError: the stdlib's chunk reader seeking past a chunk that lies about its size.
        detail = str(exc) or "truncated"
        raise InvalidRequest(f"the body is not a WAV file ({detail})") from None
    if width not in ((4, 8) if tag == _FLOAT else (1, 2, 3, 4)):
        raise InvalidRequest(f"unsupported WAV sample width: {8 * width} bits")
    if channels < 1 or rate <= 0:
        raise InvalidRequest("the WAV header is invalid (no channels or no sample rate)")
    if not MIN_RATE <= rate <= MAX_RATE:
        # Resampling 1 Hz audio to 16 kHz would take gigabytes: refuse what no microphone makes.
        raise InvalidRequest(
            f"sample rate {rate} Hz is outside {MIN_RATE}-{MAX_RATE} Hz; resample the audio"
        )
    frame = width * channels
    raw = raw[: len(raw) - len(raw) % frame]  # a truncated last frame is dropped
    if not raw:
        raise InvalidRequest("the WAV file holds no audio")
    if tag == _FLOAT:
        floats = np.frombuffer(raw, dtype="<f4" if width == 4 else "<f8")
        samples = np.clip(np.nan_to_num(floats), -1.0, 1.0).astype(np.float32)
    else:
        samples = _pcm_to_float(raw, width)
    samples = samples.reshape(-1, channels)
    mono = samples.mean(axis=1, dtype=np.float32) if channels > 1 else samples[:, 0]
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def _wav_format(data: bytes) -> tuple[int, int] | None:
    """The format tag of a RIFF/WAVE file and the tag's offset, EXTENSIBLE resolved to its
    sub-format; None when the bytes are not RIFF/WAVE or have no fmt chunk (wave.open will say)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos = 12
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        if data[pos : pos + 4] == b"fmt ":
            body = data[pos + 8 : pos + 8 + size]
            if len(body) < 16:
                return None
            tag = int.from_bytes(body[:2], "little")
            if tag == _EXTENSIBLE and len(body) >= 40 and body[26:40] == _GUID_TAIL:
                tag = int.from_bytes(body[24:26], "little")
            return tag, pos + 8
        pos += 8 + size + (size & 1)  # chunks are word-aligned
    return None


def _pcm_to_float(raw: bytes, width: int) -> np.ndarray:
    """Little-endian PCM bytes to float32 in [-1, 1] (8-bit WAV is unsigned, the rest signed)."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    # one float32 array, scaled in place: no temporaries the size of the audio
    if width == 1:
        out = buf.astype(np.float32)
        out -= 128.0
        out /= 128.0
        return out
    if width == 3:
        # Place the 3 bytes in the top of an int32, so the sign bit lands in place.
        padded = np.zeros((len(buf) // 3, 4), dtype=np.uint8)
        padded[:, 1:] = buf.reshape(-1, 3)
        out = padded.view("<i4").reshape(-1).astype(np.float32)
        out /= 2147483648.0
        return out
    dtype = "<i2" if width == 2 else "<i4"
    out = np.frombuffer(raw, dtype=dtype).astype(np.float32)
    out /= float(2 ** (8 * width - 1))
    return out


def to_model_rate(pcm: np.ndarray, rate: int) -> tuple[np.ndarray, int]:
    """Bring audio to 16 kHz, the rate the rest of the pipeline uses.

    16 kHz passes through. Everything else, 8 kHz included, is resampled: the model's native
    8 kHz branch ended speech 100+ ms later than the 16 kHz branch on the same espeak-ng
    sentences, while 8 kHz audio upsampled to 16 kHz gave the 16 kHz bounds, at the same cost
    (one chunk per 32 ms either way). Resampling is linear interpolation; when downsampling, a
    Hann-windowed sinc low-pass (65 taps, cutoff 0.9 x 8 kHz) runs first so that energy above
    8 kHz does not alias into the speech band.
    """
    if rate <= 0:
        raise InvalidRequest(f"invalid sample rate {rate}")
    if rate == 16000 or len(pcm) == 0:
        return np.asarray(pcm, dtype=np.float32), 16000
    target = 16000
    x = np.asarray(pcm, dtype=np.float32)
    if rate > target and len(x) > 2 * _FIR_HALF:
        taps = np.arange(-_FIR_HALF, _FIR_HALF + 1, dtype=np.float64)
        cutoff = 0.9 * (target / 2) / rate  # in cycles per input sample
        kernel = 2 * cutoff * np.sinc(2 * cutoff * taps) * np.hanning(2 * _FIR_HALF + 1)
        kernel /= kernel.sum()  # unity gain at DC
        x = np.convolve(x, kernel.astype(np.float32), mode="same")
    n_out = max(1, round(len(x) * target / rate))
    # linear interpolation at the output's sample times, in float32 over the input (np.interp
    # would want the input's times as float64: 8 bytes per input sample)
    t_out = np.arange(n_out, dtype=np.float64) * (rate / target)
    left = np.minimum(t_out.astype(np.int64), len(x) - 1)
    right = np.minimum(left + 1, len(x) - 1)
    frac = (t_out - left).astype(np.float32)
    return x[left] * (1 - frac) + x[right] * frac, target


def initial_state() -> np.ndarray:
    """The model's recurrent state before the first chunk: zeros float32 [2, 1, 128]."""
    return np.zeros(STATE_SHAPE, dtype=np.float32)


def chunks(pcm: np.ndarray, rate: int) -> Iterator[np.ndarray]:
    """The model inputs for ``pcm`` at ``rate`` (8000 or 16000), in order.

    Each is float32 [1, context + chunk]: the chunk (512 samples at 16 kHz, 256 at 8 kHz)
    preceded by the previous chunk's last 64 / 32 samples (zeros before the first chunk); the
    last chunk is zero-padded. Feed them in order, carrying ``stateN`` into ``state``.
    """
    if rate not in CHUNK:
        raise ValueError(f"Silero VAD takes 8000 or 16000 Hz, not {rate}; call to_model_rate")
    size, ctx = CHUNK[rate], CONTEXT[rate]
    x = np.asarray(pcm, dtype=np.float32).reshape(-1)
    n = -(-len(x) // size)  # ceil
    padded = np.zeros(ctx + n * size, dtype=np.float32)
    padded[ctx : ctx + len(x)] = x
    for i in range(n):
        start = i * size  # in padded coordinates this window starts ctx samples early
        yield padded[start : start + ctx + size].reshape(1, -1).copy()


def segments(
    probs: np.ndarray,
    rate: int,
    chunk: int | None = None,
    *,
    total_samples: int | None = None,
    threshold: float = 0.5,
    neg_threshold: float | None = None,
    min_speech_ms: float = 250,
    min_silence_ms: float = 100,
    speech_pad_ms: float = 30,
) -> np.ndarray:
    """Speech segments [n, 2] (start, end in seconds, float32) from per-chunk probabilities.

    ``probs[i]`` is the model's output for samples [i * chunk, (i + 1) * chunk) at ``rate``
    (chunk defaults to the model's chunk for the rate); ``total_samples`` is the audio's length
    (default: len(probs) * chunk). The rules are ``Segmenter``'s.
    """
    p = np.asarray(probs, dtype=np.float32).reshape(-1)
    cutter = Segmenter(
        rate,
        chunk,
        threshold=threshold,
        neg_threshold=neg_threshold,
        min_speech_ms=min_speech_ms,
        min_silence_ms=min_silence_ms,
        speech_pad_ms=speech_pad_ms,
    )
    found = [segment for prob in p.tolist() for segment in cutter.push(prob)]
    found += cutter.finish(total_samples if total_samples is not None else len(p) * cutter.size)
    return np.asarray(found, dtype=np.float32).reshape(-1, 2)


class Segmenter:
    """Speech segments from per-chunk probabilities fed one at a time, each given out as soon
    as it is final (what a stream answers with).

    Speech starts at the first chunk with prob >= threshold; it ends where prob first fell
    below ``neg_threshold`` (default max(threshold - 0.15, 0.01)) once it has stayed under
    ``threshold`` for ``min_silence_ms``; segments not longer than ``min_speech_ms`` are
    dropped; then each is widened by ``speech_pad_ms``, except that neighbours closer than two
    pads split the gap between them. The same rules as silero-vad's ``get_speech_timestamps``
    (without its max_speech_duration_s splitting). A closed segment's end is final once the
    next segment's start is known, or once no later speech could start within two pads of it.
    """

    def __init__(
        self,
        rate: int,
        chunk: int | None = None,
        *,
        threshold: float = 0.5,
        neg_threshold: float | None = None,
        min_speech_ms: float = 250,
        min_silence_ms: float = 100,
        speech_pad_ms: float = 30,
    ) -> None:
        if chunk is None and rate not in CHUNK:
            raise ValueError(f"no default chunk for {rate} Hz; pass chunk")
        self.rate = rate
        self.size = chunk if chunk is not None else CHUNK[rate]
        self.threshold = threshold
        self.neg = neg_threshold if neg_threshold is not None else max(threshold - 0.15, 0.01)
        self.min_speech = rate * min_speech_ms / 1000
        self.min_silence = rate * min_silence_ms / 1000
        self.pad = rate * speech_pad_ms / 1000
        self.fed = 0  # chunks so far
        self.start: int | None = None  # sample where the current speech began
        self.silence_from: int | None = None  # sample where prob first dropped below neg
        # closed segments not given out yet: [start, end, padded start] in samples
        self.closed: list[list[int]] = []

    def push(self, prob: float) -> list[tuple[float, float]]:
        """Feed the next chunk's probability; the segments that became final (seconds)."""
        pos = self.fed * self.size
        self.fed += 1
        if prob >= self.threshold:
            self.silence_from = None  # speech came back before the silence was long enough
            if self.start is None:
                self.start = pos
        elif self.start is not None and prob < self.neg:
            # (between the thresholds: speech goes on, silence keeps counting)
            if self.silence_from is None:
                self.silence_from = pos
            if pos - self.silence_from >= self.min_silence:
                self._close(self.silence_from)
        # any later speech starts at or after the open one's start, or the next chunk
        later = self.start if self.start is not None else self.fed * self.size
        # the audio is at least this long: the last chunk fed holds one sample or more
        known = (self.fed - 1) * self.size + 1
        return self._give(lambda end: min(later, known) - end >= 2 * self.pad)

    def finish(self, total_samples: int) -> list[tuple[float, float]]:
        """The end of the audio (``total_samples`` long): the segments still held."""
        if self.start is not None:
            self._close(total_samples)  # speech running until the end of the audio
        return self._give(lambda end: True, total_samples)

    def _close(self, end: int) -> None:
        assert self.start is not None
        if end - self.start > self.min_speech:
            # the padded start: a pad earlier, unless the segment before splits a short gap
            self.closed.append([self.start, end, int(max(0, self.start - self.pad))])
        self.start = self.silence_from = None

    def _give(
        self, alone: Callable[[int], bool], total: int | None = None
    ) -> list[tuple[float, float]]:
        """The closed segments whose padding is known: the next one's start is, or ``alone``
        says for its end that no later speech could come close enough to split the gap."""
        out = []
        while self.closed:
            _, end, padded = self.closed[0]
            if len(self.closed) > 1:
                following = self.closed[1]
                gap = following[0] - end
                # neighbours closer than two pads meet in the middle instead of overlapping
                half = gap // 2 if gap < 2 * self.pad else self.pad
                following[2] = int(max(0, following[0] - half))
            elif alone(end):
                half = self.pad
            else:
                break
            last = end + half if total is None else min(total, end + half)
            out.append((padded / self.rate, int(last) / self.rate))
            del self.closed[0]
        return out
