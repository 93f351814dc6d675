#!/usr/bin/env python3
"""The wake word's held-out evaluation: voices the training never heard (voices.HELD_OUT),
sentences it never read (the other half of fortunes), near misses it never trained on
(data.EVAL_NEAR), and noise it never mixed (the babble of held-out voices over pink noise).

Per voice, one recording per condition (clean, 20 dB and 10 dB SNR):

- the phrase at three speeds, twice each, each after a sentence and a pause, then a pause;
- every near miss of EVAL_NEAR, and sentences, until the voice's negatives last
  ``negative_s`` seconds (an hour or more over all voices).

A phrase is detected when an event ends (the end the event gives) from 0.3 s before the
phrase's end to 0.5 s after; every other event is a false accept, counted per hour of audio
that is not the phrase. A near miss is accepted when an event ends from its start to 0.5 s
after its end.

    .venv/bin/python -m models.wakeword.evaluate [--model models/wakeword/hey-jetson.onnx]
        [--negative-s 240] [--voices N]

runs the model offline (the live pipeline's Spotter and ONNX Runtime, 50 ms windows), prints
the table per condition and per voice; bench/voice.py runs the same set through edged.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edged.pipelines import wake  # noqa: E402
from models.wakeword import data, voices  # noqa: E402

RATE = voices.RATE
CONDITIONS: list[float | None] = [None, 20.0, 10.0]
SPEEDS = [0.85, 1.0, 1.2]


@dataclass
class Recording:
    voice: str
    snr_db: float | None
    audio: np.ndarray  # float32
    phrases: list[tuple[float, float]] = field(default_factory=list)  # (start, end) seconds
    near: list[tuple[float, float, str]] = field(default_factory=list)
    negative_s: float = 0.0


@dataclass
class Clips:
    """One held-out voice's clips, before any noise."""

    voice: str
    phrases: list[np.ndarray]
    carriers: list[np.ndarray]
    near: list[tuple[str, np.ndarray]]
    sentences: list[np.ndarray]


def clips(voice: str, phrase: str, negative_s: float, seed: int, sentences: list[str]) -> Clips:
    rng = np.random.default_rng(seed)
    said = [
        voices.say(voice, phrase, s, int(rng.integers(1 << 30))) for s in SPEEDS for _ in range(2)
    ]
    carriers = [voices.say(voice, t, 1.0, seed) for t in sentences[:6]]
    near = [(t, voices.say(voice, t, float(rng.uniform(0.9, 1.15)), seed)) for t in data.EVAL_NEAR]
    total = sum(x.size for _, x in near) / RATE
    talk = []
    for text in sentences[6:]:
        if total >= negative_s:
            break
        x = voices.say(voice, text, float(rng.uniform(0.9, 1.15)), int(rng.integers(1 << 30)))
        talk.append(x)
        total += x.size / RATE + 0.5
    return Clips(voice, said, carriers, near, talk)


def voice_clips(
    voice_list: list[str], phrase: str, negative_s: float, seed: int, cache: Path | None
) -> list[Clips]:
    key = zlib.crc32(f"{phrase}|{negative_s}|{seed}|{'|'.join(voice_list)}".encode())
    path = cache / f"eval-{key:08x}.npz" if cache else None
    if path is not None and path.is_file():
        texts, kept = data.load_clips(path)
        return [
            Clips(
                voice,
                kept[f"{i}.phrases"],
                kept[f"{i}.carriers"],
                list(zip(texts[f"{i}.near"], kept[f"{i}.near"])),
                kept[f"{i}.sentences"],
            )
            for i, voice in enumerate(texts["voices"])
        ]
    sentences = data.fortunes(data.EVAL_FORTUNES, 100000, seed)
    if len(sentences) < 50:
        raise SystemExit("the evaluation needs Debian's fortunes package (other speech)")
    rng = np.random.default_rng(seed)
    out = []
    for i, v in enumerate(voice_list):
        picked = [sentences[int(j)] for j in rng.choice(len(sentences), 200, replace=False)]
        out.append(clips(v, phrase, negative_s, seed + i, picked))
    if path is not None:
        texts = {"voices": [c.voice for c in out]}
        texts.update({f"{i}.near": [t for t, _ in c.near] for i, c in enumerate(out)})
        kept: dict[str, list[np.ndarray]] = {}
        for i, c in enumerate(out):
            kept[f"{i}.phrases"], kept[f"{i}.carriers"] = c.phrases, c.carriers
            kept[f"{i}.near"], kept[f"{i}.sentences"] = [x for _, x in c.near], c.sentences
        data.save_clips(path, texts, kept)
    return out


def noise(n: int, babble: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Held-out noise: pink noise under the babble of three held-out voices' sentences."""
    x = data.coloured(n, rng, 1.0) * 0.5
    for _ in range(3):
        parts = [babble[int(rng.integers(len(babble)))] for _ in range(n // RATE // 2 + 2)]
        talk = np.resize(np.concatenate(parts), n)
        x = x + talk / data.rms(talk) * 0.6
    return (x / data.rms(x)).astype(np.float32)


def recording(c: Clips, snr_db: float | None, seed: int, babble: list[np.ndarray]) -> Recording:
    rng = np.random.default_rng(seed)
    parts: list[np.ndarray] = []
    rec = Recording(c.voice, snr_db, np.zeros(0, np.float32))
    at = 0

    def add(x: np.ndarray) -> int:
        nonlocal at
        parts.append(x.astype(np.float32))
        start = at
        at += x.size
        return start

    def pause(lo: float, hi: float) -> None:
        add(np.zeros(int(rng.uniform(lo, hi) * RATE), np.float32))

    pause(1.0, 1.5)
    for i, said in enumerate(c.phrases):
        add(c.carriers[i % len(c.carriers)])
        pause(0.3, 0.8)
        start = add(said)
        rec.phrases.append((start / RATE, (start + said.size) / RATE))
        pause(1.2, 2.0)
    negatives = [("near", t, x) for t, x in c.near] + [("talk", "", x) for x in c.sentences]
    for j in rng.permutation(len(negatives)):
        kind, text, x = negatives[int(j)]
        start = add(x)
        if kind == "near":
            rec.near.append((start / RATE, (start + x.size) / RATE, text))
        pause(0.4, 1.0)
    audio = np.concatenate(parts)
    speech = data.rms(audio[np.abs(audio) > 0.01])
    audio = audio / speech * 0.1  # speech at -20 dBFS
    if snr_db is not None:
        audio = audio + noise(audio.size, babble, rng) * 0.1 / 10 ** (snr_db / 20)
    audio += rng.standard_normal(audio.size).astype(np.float32) * 10 ** (-75 / 20)
    rec.audio = np.clip(audio, -1, 1).astype(np.float32)
    said_s = sum(e - s for s, e in rec.phrases)
    rec.negative_s = rec.audio.size / RATE - said_s
    return rec


def recordings(
    held: list[Clips], seed: int, conditions: list[float | None] = CONDITIONS
) -> list[Recording]:
    out = []
    for k, snr in enumerate(conditions):
        for i, c in enumerate(held):
            others = [x for o in held if o.voice != c.voice for x in o.sentences[:20]]
            out.append(recording(c, snr, seed * 1000 + k * 100 + i, others or c.sentences))
    return out


@dataclass
class Score:
    detected: int = 0
    phrases: int = 0
    false_accepts: int = 0
    negative_s: float = 0.0
    near_accepted: int = 0
    near: int = 0

    def add(self, other: Score) -> None:
        self.detected += other.detected
        self.phrases += other.phrases
        self.false_accepts += other.false_accepts
        self.negative_s += other.negative_s
        self.near_accepted += other.near_accepted
        self.near += other.near


def score(rec: Recording, events: list[float]) -> Score:
    """``events``: each event's end (seconds), as the event gives it."""
    s = Score(phrases=len(rec.phrases), negative_s=rec.negative_s, near=len(rec.near))
    used = set()
    for _, end in rec.phrases:
        hits = [i for i, t in enumerate(events) if end - 0.3 <= t <= end + 0.5 and i not in used]
        if hits:
            s.detected += 1
            used.add(hits[0])
    s.false_accepts = len(events) - len(used)
    for start, end, _ in rec.near:
        if any(start <= t <= end + 0.5 for t in events):
            s.near_accepted += 1
    return s


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def poisson(k: int, hours: float) -> tuple[float, float]:
    """95 % interval of a rate from ``k`` events in ``hours`` (exact, chi-square)."""
    from scipy.stats import chi2

    low = chi2.ppf(0.025, 2 * k) / 2 if k else 0.0
    high = chi2.ppf(0.975, 2 * k + 2) / 2
    return (low / hours, high / hours)


def offline(model: Path, threshold: float) -> Callable[[np.ndarray], list[float]]:
    """The live pipeline's Spotter and the model in ONNX Runtime: the events' ends in a
    recording streamed 10 s at a time (windows every 50 ms, as live)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    frames = session.get_inputs()[0].shape[1]

    def run(audio: np.ndarray) -> list[float]:
        spotter = wake.Spotter(frames, threshold)
        pcm = np.clip(np.round(audio * 32767), -32768, 32767).astype(np.int16)
        times = []
        for at in range(0, pcm.size, RATE * 10):  # 10 s at a time, as edged's largest chunk
            windows, ends = spotter.windows(pcm[at : at + RATE * 10])
            if ends:
                logit, when = session.run(None, {"features": windows})
                times += [h.end for h in spotter.decide(ends, logit, when)]
        return times

    return run


def table(rows: list[tuple[str, Score]]) -> str:
    lines = [
        "| | detected (95 % CI) | false accepts / hour (95 % CI) | near misses accepted"
        " | hours of negatives |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in rows:
        lo, hi = wilson(s.detected, s.phrases)
        hours = s.negative_s / 3600
        flo, fhi = poisson(s.false_accepts, hours) if hours else (0.0, 0.0)
        rate = s.false_accepts / hours if hours else 0.0
        lines.append(
            f"| {name} | {s.detected}/{s.phrases} = {s.detected / max(1, s.phrases):.1%}"
            f" ({lo:.1%}-{hi:.1%}) | {rate:.2f} ({flo:.2f}-{fhi:.2f}) |"
            f" {s.near_accepted}/{s.near} = {s.near_accepted / max(1, s.near):.1%} | {hours:.2f} |"
        )
    return "\n".join(lines)


def condition_name(snr: float | None) -> str:
    return "clean" if snr is None else f"{snr:g} dB SNR"


def report(recs: list[Recording], events: list[list[float]]) -> str:
    by_condition: dict[str, Score] = {}
    by_voice: dict[str, Score] = {}
    for rec, ev in zip(recs, events):
        s = score(rec, ev)
        by_condition.setdefault(condition_name(rec.snr_db), Score()).add(s)
        by_voice.setdefault(rec.voice, Score()).add(s)
    return (
        table(list(by_condition.items()))
        + "\n\nPer voice (all conditions):\n\n"
        + table(list(by_voice.items()))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=ROOT / "models" / "wakeword" / "hey-jetson.onnx"
    )
    parser.add_argument("--threshold", type=float, default=None, help="(default: the model's card)")
    parser.add_argument(
        "--negative-s", type=float, default=240.0, help="seconds of negatives per voice"
    )
    parser.add_argument(
        "--voices", type=int, default=0, help="the first N held-out voices (0: all)"
    )
    parser.add_argument("--seed", type=int, default=1047)
    parser.add_argument("--cache", type=Path, default=ROOT / "models" / ".build" / "wakeword")
    args = parser.parse_args(argv)
    card = json.loads(args.model.with_suffix(".json").read_text())
    threshold = args.threshold if args.threshold is not None else card["threshold"]
    held, missing = voices.available(voices.HELD_OUT)
    for reason in missing:
        print(f"left out: {reason}")
    if args.voices:
        held = held[: args.voices]
    c = voice_clips(held, card["phrase"], args.negative_s, args.seed, args.cache)
    recs = recordings(c, args.seed)
    run = offline(args.model, threshold)
    print(f"{args.model.name}, threshold {threshold}, {len(held)} held-out voices\n")
    print(report(recs, [run(r.audio) for r in recs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
