"""What the wake-word model learns from: synthetic speech and generated sound (issue 47).

- Positives: the phrase said by the training voices (models/wakeword/voices.py) at speeds from
  0.8 to 1.35 and random pitches, with and without punctuation (which changes the prosody).
- Near misses, made on purpose from the phrase's sounds: each word swapped for the words of
  CMU's pronouncing dictionary (the one pocketsphinx ships) within a small phone edit distance,
  the words alone, split and run together, the phrase with a sound added. The near misses the
  evaluation says (EVAL_NEAR) are never trained on.
- Other speech: sentences of Debian's ``fortunes`` (the training half of its files; the other
  half is the evaluation's) and the intent model's sentences, what people say after the phrase.
- Sound that is not speech, generated: white, pink and brown noise, hum, music-like tones and
  chords with a beat, babble of several voices.

:class:`Sampler` draws 1.5 s windows from these, each augmented (room reverberation, noise at
an SNR, a telephone band, gain), labelled 1 when the whole phrase is in the window, 0 when it
is not (a window that ends inside the phrase, or starts after it began, is a negative: the
model must wait for the end of the phrase).
"""

from __future__ import annotations

import os
import re
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from . import voices

RATE = voices.RATE
WINDOW_S = 1.5
WINDOW = int(WINDOW_S * RATE)

# said by the evaluation (bench/voice.py), never trained on
EVAL_NEAR = [
    "hey jackson",
    "hey jason",
    "hey johnson",
    "hey json",
    "jetson",
    "hey jet set",
    "hey nelson",
    "hey Stetson",
    "get some",
    "hey Jeff son",
    "hey justin",
    "hey watson",
    "jets on",
    "a jet sun",
    "hey gibson",
    "hey jensen",
    "hey jetty",
    "hey Jefferson",
    "hey Madison",
    "the jetsons",
    "hey Dennis",
    "okay Jetta",
    "hey Epsom",
    "hey Jess",
    "send a message to jessica",
    "the jet set is back in town",
]

FORTUNES = Path("/usr/share/games/fortunes")
TRAIN_FORTUNES = ["fortunes", "people", "computers", "work", "miscellaneous", "politics"]
EVAL_FORTUNES = ["wisdom", "literature", "science", "food", "kids", "love", "pets", "sports"]
INTENTS = Path(__file__).resolve().parents[1] / "intents.tsv"


@cache
def dictionary() -> dict[str, list[str]]:
    """CMU's pronouncing dictionary from pocketsphinx's wheel: word -> phones (no stress)."""
    import pocketsphinx

    path = Path(pocketsphinx.get_model_path()) / "en-us" / "cmudict-en-us.dict"
    words: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        word, *phones = line.split()
        if "(" not in word and word.isalpha():
            words[word] = phones
    return words


def distance(a: list[str], b: list[str]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def unknown_words(phrase: str) -> list[str]:
    """The words of ``phrase`` CMU's dictionary cannot say (the model could not be trained)."""
    return [w for w in phrase.lower().split() if w not in dictionary()]


def near_misses(phrase: str, limit: int = 400, seed: int = 0) -> list[str]:
    """Phrases that sound like ``phrase`` and are not it (none of EVAL_NEAR)."""
    words = dictionary()
    said = phrase.lower().split()
    unknown = unknown_words(phrase)
    if unknown:
        raise ValueError(f"not in the pronouncing dictionary: {', '.join(unknown)}")
    alike: list[list[str]] = []
    for w in said:
        phones = words[w]
        # a short word changes a sound, a long one one or two; never none (a homophone, as
        # "hay" for "hey", is the phrase itself: a negative of it would teach noise)
        reach = 1 if len(phones) <= 3 else 2
        slack = 0 if len(phones) <= 3 else reach
        close = sorted(
            (distance(phones, p), v)
            for v, p in words.items()
            if v != w and abs(len(p) - len(phones)) <= slack
        )
        alike.append([v for d, v in close if 1 <= d <= reach])
    out: set[str] = set()
    for i, options in enumerate(alike):  # one word changed
        out.update(" ".join([*said[:i], v, *said[i + 1 :]]) for v in options)
    rng = np.random.default_rng(seed)
    for _ in range(limit):  # every word changed
        out.add(" ".join(str(rng.choice(o)) if o else w for o, w in zip(alike, said)))
    out.update(said)  # each word alone
    if len(said) > 1:
        out.add(" ".join(reversed(said)))
    last = said[-1]
    for cut in range(2, len(last) - 1):  # the last word cut short (split, it is the phrase)
        out.add(" ".join([*said[:-1], last[:cut]]))
    out.update(f"{x} {last}" for x in ("the", "my", "your"))
    banned = {e.lower() for e in EVAL_NEAR} | {phrase.lower()}
    chosen = sorted(out - banned)
    rng.shuffle(chosen)
    return chosen[:limit]


def positives(phrase: str) -> list[str]:
    return [phrase, phrase + ".", phrase + "!", phrase + "?", phrase.replace(" ", ", ", 1)]


def fortunes(files: list[str], limit: int, seed: int = 0) -> list[str]:
    """Sentences of 3 to 16 plain words from Debian's fortunes (empty if not installed)."""
    found: list[str] = []
    for name in files:
        path = FORTUNES / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for entry in text.split("\n%\n"):
            body = re.sub(r"\s+", " ", entry.split("--")[0])
            for sentence in re.split(r"(?<=[.!?])\s+", body):
                words = sentence.split()
                if 3 <= len(words) <= 16 and re.fullmatch(r"[A-Za-z ,.'?!-]+", sentence):
                    found.append(sentence.strip())
    rng = np.random.default_rng(seed)
    rng.shuffle(found)
    return found[:limit]


def intents() -> list[str]:
    return [line.split("\t")[1] for line in INTENTS.read_text().splitlines()[1:] if "\t" in line]


ENGINES = {"espeak": 0.4, "flite": 0.3, "festival": 0.3, "piper": 0.3}


@dataclass
class Bank:
    """Clips, 16 kHz float32, trimmed: the phrase, near misses, other speech."""

    phrase: str
    positive: list[np.ndarray] = field(default_factory=list)
    near: list[np.ndarray] = field(default_factory=list)
    speech: list[np.ndarray] = field(default_factory=list)


def _say(batch: list[tuple[str, str, float, int]]) -> list[np.ndarray]:
    """The clips of jobs of one voice (a text it cannot say, or under 0.1 s, is left out)."""
    said = voices.say_many(batch[0][0], [(t, s, seed) for _, t, s, seed in batch])
    return [x for x in said if x is not None and x.size > RATE // 10]


def synthesize(jobs: list[tuple[str, str, float, int]], workers: int) -> list[np.ndarray]:
    """Every job's clip, in batches of one voice, ``workers`` processes at a time."""
    by_voice: dict[str, list[tuple[str, str, float, int]]] = {}
    for job in jobs:
        by_voice.setdefault(job[0], []).append(job)
    batches = [b[i : i + 40] for b in by_voice.values() for i in range(0, len(b), 40)]
    if workers <= 1:
        return [x for b in batches for x in _say(b)]
    with ProcessPoolExecutor(workers) as pool:
        return [x for done in pool.map(_say, batches) for x in done]


def build_bank(
    phrase: str,
    speakers: list[str],
    *,
    per_voice: int,
    near: int,
    speech: int,
    seed: int,
    workers: int = 2,
    cache: Path | None = None,
) -> Bank:
    """``per_voice`` positives a voice on average, ``near`` near misses and ``speech``
    sentences, each by a voice drawn at random, the engine first (ENGINES' shares: espeak-ng
    has hundreds of voices, the others a few, and a model that heard mostly espeak-ng misses
    the others), cached in ``cache`` by every job (text, voice, speed, seed)."""
    rng = np.random.default_rng(seed)
    texts = positives(phrase)

    def speed() -> float:
        return float(rng.uniform(0.8, 1.35))

    engines = {e: [v for v in speakers if v.startswith(e + ":")] for e in ENGINES}
    engines = {e: v for e, v in engines.items() if v}
    shares = np.array([ENGINES[e] for e in engines])

    def voice() -> str:
        family = list(engines.values())[int(rng.choice(len(engines), p=shares / shares.sum()))]
        return str(family[int(rng.integers(len(family)))])

    def job(text: str) -> tuple[str, str, float, int]:
        return (voice(), text, speed(), int(rng.integers(1 << 30)))

    pos = [job(texts[i % len(texts)]) for i in range(per_voice * len(speakers))]
    misses = near_misses(phrase, limit=max(near // 3, 1), seed=seed)
    nears = [job(misses[i % len(misses)]) for i in range(near)]
    sentences = fortunes(TRAIN_FORTUNES, speech, seed) + intents()
    talk = [job(sentences[i % len(sentences)]) for i in range(speech)]
    jobs = zlib.crc32(repr(pos + nears + talk).encode())  # every text, voice, speed and seed
    key = f"{phrase}-{len(speakers)}-{jobs:08x}"
    path = cache / (re.sub(r"[^a-z0-9-]+", "_", key.lower()) + ".npz") if cache else None
    if path is not None and path.is_file():
        _, kept = load_clips(path)
        return Bank(phrase, kept["positive"], kept["near"], kept["speech"])
    bank = Bank(
        phrase,
        synthesize(pos, workers),
        synthesize(nears, workers),
        synthesize(talk, workers),
    )
    if path is not None:
        save_clips(path, {}, {"positive": bank.positive, "near": bank.near, "speech": bank.speech})
    return bank


def save_clips(path: Path, texts: dict[str, list[str]], clips: dict[str, list[np.ndarray]]) -> None:
    """Lists of texts and of clips in one .npz (arrays only: a cache is read back with no
    pickle, so a file put in its place can only be wrong data, never code)."""
    parts: dict[str, np.ndarray] = {}
    for key, items in clips.items():
        parts[f"{key}.audio"] = np.concatenate(items) if items else np.zeros(0, np.float32)
        parts[f"{key}.sizes"] = np.array([x.size for x in items], np.int64)
    for key, words in texts.items():
        parts[f"{key}.texts"] = np.array(words, dtype=str)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial.npz")
    np.savez(partial, **parts)
    os.replace(partial, path)  # whole, or not there


def load_clips(path: Path) -> tuple[dict[str, list[str]], dict[str, list[np.ndarray]]]:
    """What :func:`save_clips` wrote: (texts, clips)."""
    texts: dict[str, list[str]] = {}
    clips: dict[str, list[np.ndarray]] = {}
    with np.load(path, allow_pickle=False) as saved:
        for name in saved.files:
            key, kind = name.rsplit(".", 1)
            if kind == "texts":
                texts[key] = [str(t) for t in saved[name]]
            elif kind == "sizes":
                audio, ends = saved[f"{key}.audio"], np.cumsum(saved[name])
                clips[key] = [audio[e - n : e] for e, n in zip(ends, saved[name])]
    return texts, clips


# --- sound that is not speech ---------------------------------------------------------------


def coloured(n: int, rng: np.random.Generator, exponent: float) -> np.ndarray:
    """Noise whose power falls as 1/f**exponent (0 white, 1 pink, 2 brown), unit RMS."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.arange(spectrum.size, dtype=np.float64)
    f[0] = 1.0
    x = np.fft.irfft(spectrum / f ** (exponent / 2), n)
    return (x / (np.std(x) + 1e-9)).astype(np.float32)


def music(n: int, rng: np.random.Generator) -> np.ndarray:
    """Tones and chords that change on a beat, with harmonics and a noise drum."""
    t = np.arange(n) / RATE
    beat = float(rng.uniform(0.25, 0.7))
    x = np.zeros(n, np.float32)
    for start in np.arange(0, n / RATE, beat):
        span = (t >= start) & (t < start + beat)
        for _ in range(int(rng.integers(1, 4))):
            f0 = 110.0 * 2 ** (int(rng.integers(0, 36)) / 12)
            for h in range(1, 5):
                x[span] += np.sin(2 * np.pi * f0 * h * t[span]) / h
        hit = (t >= start) & (t < start + 0.05)
        x[hit] += rng.standard_normal(int(hit.sum())).astype(np.float32) * 0.8
    return x / (np.std(x) + 1e-9)


def hum(n: int, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(n) / RATE
    f0 = float(rng.choice([50.0, 60.0]))
    x = sum(np.sin(2 * np.pi * f0 * h * t + rng.uniform(0, 6)) / h for h in range(1, 6))
    return (x / np.std(x)).astype(np.float32)


def reverb(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A room: an exponentially decaying noise tail (RT60 0.15 to 0.8 s) after the direct
    sound."""
    rt60 = float(rng.uniform(0.15, 0.8))
    length = int(rt60 * RATE)
    decay = np.exp(-6.9 * np.arange(length) / length)
    ir = (rng.standard_normal(length) * decay).astype(np.float32) * float(rng.uniform(0.1, 0.4))
    ir[0] = 1.0
    from scipy.signal import fftconvolve

    y = fftconvolve(x, ir)[: x.size]
    return (y * (np.abs(x).max() / (np.abs(y).max() + 1e-9))).astype(np.float32)


def telephone(x: np.ndarray) -> np.ndarray:
    from scipy.signal import butter, sosfilt

    sos = butter(4, [300, 3400], btype="band", fs=RATE, output="sos")
    return sosfilt(sos, x).astype(np.float32)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2)) + 1e-9)


# --- windows ---------------------------------------------------------------------------------


@dataclass
class Batch:
    audio: np.ndarray  # [B, WINDOW] float32
    label: np.ndarray  # [B] 1 or 0
    start: np.ndarray  # [B] seconds from the phrase's start to the window's end (positives)
    end: np.ndarray  # [B] seconds from the phrase's end to the window's end (positives)


class Sampler:
    """Windows drawn at random from a bank, augmented; see the module's text."""

    MIX = {"positive": 0.35, "near": 0.22, "partial": 0.13, "speech": 0.2, "sound": 0.1}

    def __init__(self, bank: Bank, seed: int, noisy: float = 0.7) -> None:
        if not bank.positive or not bank.near or not bank.speech:
            raise ValueError("the bank needs positives, near misses and other speech")
        self.bank = bank
        self.rng = np.random.default_rng(seed)
        self.noisy = noisy
        kinds = list(self.MIX)
        self.kinds, self.weights = kinds, np.array([self.MIX[k] for k in kinds])

    def _background(self, n: int) -> np.ndarray:
        rng = self.rng
        kind = rng.choice(["white", "pink", "brown", "music", "hum", "babble"])
        if kind == "music":
            return music(n, rng)
        if kind == "hum":
            return hum(n, rng)
        if kind == "babble":
            x = np.zeros(n, np.float32)
            for _ in range(int(rng.integers(2, 6))):
                clip = self.bank.speech[int(rng.integers(len(self.bank.speech)))]
                x += np.resize(clip, n) * float(rng.uniform(0.3, 1.0))
            return x / rms(x)
        return coloured(n, rng, {"white": 0.0, "pink": 1.0, "brown": 2.0}[kind])

    def _talk(self, n: int) -> np.ndarray:
        """``n`` samples of other speech (sentences end to end with short gaps)."""
        parts, total = [], 0
        while total < n:
            clip = self.bank.speech[int(self.rng.integers(len(self.bank.speech)))]
            gap = np.zeros(int(self.rng.uniform(0.05, 0.5) * RATE), np.float32)
            parts += [clip, gap]
            total += clip.size + gap.size
        x = np.concatenate(parts)
        offset = int(self.rng.integers(0, max(1, x.size - n)))
        return x[offset : offset + n]

    def _context(self, n: int) -> np.ndarray:
        """What comes before or after a phrase: quiet, or other speech."""
        if n <= 0:
            return np.zeros(0, np.float32)
        if self.rng.random() < 0.4:
            return self._talk(n) * float(self.rng.uniform(0.3, 1.0))
        return np.zeros(n, np.float32)

    def _place(self, clip: np.ndarray) -> tuple[np.ndarray, int, int]:
        """``clip`` in a window, wholly inside, mostly near the window's end."""
        room = WINDOW - clip.size
        if self.rng.random() < 0.6:
            after = int(self.rng.uniform(0, min(0.3 * RATE, room)))
        else:
            after = int(self.rng.integers(0, room + 1))
        before = room - after
        gap = int(self.rng.uniform(0.05, 0.4) * RATE)
        pre = self._context(before)
        pre[max(0, before - gap) :] = 0.0  # a pause before the phrase
        x = np.concatenate([pre, clip, np.zeros(after, np.float32)])
        return x, before, before + clip.size

    def _fitting(self, clips: list[np.ndarray]) -> np.ndarray:
        for _ in range(20):
            clip = clips[int(self.rng.integers(len(clips)))]
            if clip.size < WINDOW - RATE // 20:
                return clip
        return clips[0][: WINDOW - RATE // 20]

    def _vary(self, clip: np.ndarray) -> np.ndarray:
        """Most of the time, the clip resampled by 0.8 to 1.25: its pitch, formants and pace
        move together, as from one speaker to another."""
        if self.rng.random() < 0.3:
            return clip
        factor = float(np.exp(self.rng.uniform(np.log(0.8), np.log(1.25))))
        n = int(clip.size / factor)
        if n >= WINDOW - RATE // 20:
            return clip
        return np.interp(np.arange(n) * factor, np.arange(clip.size), clip).astype(np.float32)

    def _colour(self, x: np.ndarray) -> np.ndarray:
        """Half the time, a random smooth EQ: a tilt of up to 6 dB an octave and two bumps
        or dips of up to 9 dB (a microphone, a room, a voice's timbre)."""
        if self.rng.random() < 0.5:
            return x
        spectrum = np.fft.rfft(x)
        octaves = np.log2(np.maximum(np.fft.rfftfreq(x.size, 1 / RATE), 50.0) / 1000.0)
        db = self.rng.uniform(-6, 6) * octaves
        for _ in range(2):
            centre, width = self.rng.uniform(-3, 2.5), self.rng.uniform(0.3, 1.2)
            db += self.rng.uniform(-9, 9) * np.exp(-(((octaves - centre) / width) ** 2))
        return np.fft.irfft(spectrum * 10 ** (db / 20), x.size).astype(np.float32)

    def one(self) -> tuple[np.ndarray, int, float, float]:
        rng = self.rng
        kind = self.kinds[int(rng.choice(len(self.kinds), p=self.weights))]
        label, start, end = 0, 0.0, 0.0
        if kind in ("positive", "near"):
            x, a, b = self._place(self._vary(self._fitting(getattr(self.bank, kind))))
            if kind == "positive":
                label, start, end = 1, (WINDOW - a) / RATE, (WINDOW - b) / RATE
        elif kind == "partial":
            clip = self._vary(self._fitting(self.bank.positive))
            if rng.random() < 0.7:  # the window ends inside the phrase
                cut = int(clip.size * rng.uniform(0.3, 0.85))
                part = clip[:cut]
                x = np.concatenate([self._context(WINDOW - part.size), part])
            else:  # the window starts after the phrase began
                cut = int(clip.size * rng.uniform(0.25, 0.7))
                part = clip[cut:]
                x = np.concatenate([part, self._context(WINDOW - part.size)])
        elif kind == "speech":
            x = self._talk(WINDOW)
        else:
            x = np.zeros(WINDOW, np.float32)
        x = self._colour(x[:WINDOW].astype(np.float32))
        if kind != "sound" and rng.random() < 0.3:
            x = reverb(x, rng)
        if kind == "sound" or rng.random() < self.noisy:
            snr = float(rng.uniform(0, 30))
            speech_level = rms(x[np.abs(x) > 0.01 * np.abs(x).max()]) if x.any() else 0.1
            noise = self._background(WINDOW)
            x = x + noise * speech_level / 10 ** (snr / 20) * (
                1.0 if x.any() else rng.uniform(0.05, 1)
            )
        if rng.random() < 0.15:
            x = telephone(x)
        peak = float(np.abs(x).max()) or 1.0
        gain = 10 ** (float(rng.uniform(-35, -1)) / 20) / peak
        x = np.clip(np.round(x * gain * 32767), -32768, 32767) / 32768.0
        x += rng.standard_normal(WINDOW) * 10 ** (float(rng.uniform(-90, -60)) / 20)
        return x.astype(np.float32), label, start, end

    def batch(self, size: int) -> Batch:
        rows = [self.one() for _ in range(size)]
        return Batch(
            np.stack([r[0] for r in rows]),
            np.array([r[1] for r in rows], np.float32),
            np.array([r[2] for r in rows], np.float32),
            np.array([r[3] for r in rows], np.float32),
        )
