#!/usr/bin/env python3
"""The wake word against a test set made offline with espeak-ng: detection rate, false
accepts per hour, and the time from the end of the phrase to the event.

The set: "hey jetson" said by several voices at three speeds, each after a carrier sentence,
clean and with white noise mixed in at 20 and 10 dB SNR (of the speech); negatives: phrases
that sound alike ("hey jackson", "hey jason", ...) and other speech (commands, sentences), by
the same voices. Each condition is one long recording streamed as one sequence of 50 ms chunks
to a fresh edged (`wake-word` on its gRPC socket), as a microphone loop sends it: the decoder
stays warm across it. A phrase is detected when an event starts within 0.3 s of where it was
said; any other event is a false accept, counted against every second of the recording that is
not the wake phrase (other speech and silence). Each condition also has a recording of
negatives only (no wake phrase; 26 near misses and 10 other sentences by every voice), where
every event is a false accept: in the first recording each near miss follows a wake phrase,
which a second-stage experiment found the spotter treats differently (docs/VOICE.md).

Latency: the clean recording again, sent at the pace of real time; for each phrase, the time
from the moment its end was sent to the moment its event arrived.

Commands: the voice-command template (vad, transcribe, intent) on WAV files of one utterance:
in-grammar phrases (drawn from transcribe's phrases, said by 3 voices: is the transcript exact,
is the intent the phrase's label) and other sentences (is the transcript empty); and how long
each call takes.

Wake phrase, then command: the voice-assistant model on one stream, "hey jetson" then one of
transcribe's phrases, each by 3 voices: the wake heard, the command's transcript and intent;
and at the pace of real time, the time from the end of the command's speech to its event.

    .venv/bin/python bench/voice.py [--voices 5] [--latency-seconds 60] [--commands 40]
                                    [--assistant-paced 10] [--thresholds 1e-30 ...]
                                    [--endpoints 200 ...] [--assistant-only]
"""

from __future__ import annotations

import argparse
import itertools
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import MODELS, start_edged, table  # noqa: E402

RATE = 16000
CHUNK = RATE // 20  # 50 ms, as a microphone loop reads
VOICES = ["en-us", "en-us+f3", "en+m7", "en-us+m3", "en-gb-x-rp", "en-us+f4", "en+m2"]
SPEEDS = [140, 175, 210]  # words per minute (espeak-ng's -s; 175 is its default)
WAKE = "hey jetson"
CARRIERS = [
    "Good morning, this is the kitchen speaker.",
    "The meeting starts at ten.",
    "I left my keys on the table.",
    "Could you check the oven?",
]
NEAR = [
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
]
OTHER = [
    "turn on the lights",
    "what time is it",
    "play some music please",
    "stop the timer",
    "how is the weather tomorrow",
    "call my brother",
    "set an alarm for seven",
    "the train was late again this morning",
    "we need more milk and bread",
    "please close the garage door",
]
# near misses said only in the recording of negatives (no wake phrase in it)
MORE_NEAR = [
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


def speech(text: str, voice: str, speed: int) -> np.ndarray:
    """espeak-ng at ``speed`` words per minute, 16 kHz float."""
    import subprocess
    import wave

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "s.wav"
        subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(out), text],
            check=True,
            capture_output=True,
        )
        with wave.open(str(out)) as wav:
            rate = wav.getframerate()
            pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32)
    pcm /= 32768
    times = np.arange(int(len(pcm) * RATE / rate)) / RATE
    return np.interp(times, np.arange(len(pcm)) / rate, pcm).astype(np.float32)


Recording = tuple[np.ndarray, list[float], list[float], list[tuple[float, float, str]]]


def build(voices: list[str], snr_db: float | None, seed: int, negatives: bool = False) -> Recording:
    """One recording: (16-bit audio, where each wake phrase starts and ends, and every other
    utterance: (start, end, text)). Speech at about -20 dBFS, 0.8 s of silence between
    utterances, and white noise at ``snr_db`` below the speech's power (None: a -60 dB floor,
    as a quiet room). ``negatives``: no wake phrase at all; instead every near miss (``NEAR``
    and ``MORE_NEAR``) after a carrier sentence, and every other sentence, each voice saying a
    third of them at each speed: a negative not placed just after a wake phrase (where the
    spotter has just restarted) is the harder case."""
    rng = np.random.default_rng(seed)
    parts: list[np.ndarray] = []
    starts, ends = [], []
    others: list[tuple[float, float, str]] = []
    position = 0
    gap = np.zeros(int(0.8 * RATE), np.float32)

    def add(x: np.ndarray) -> int:
        nonlocal position
        x = level(x)
        parts.extend([x, gap])
        at = position
        position += len(x) + len(gap)
        return at

    for v, voice in enumerate(voices):
        for s, speed in enumerate(SPEEDS):
            texts = [
                CARRIERS[rng.integers(len(CARRIERS))],
                WAKE,
                NEAR[rng.integers(len(NEAR))],
                OTHER[rng.integers(len(OTHER))],
            ]
            if negatives:
                near = [t for k, t in enumerate(NEAR + MORE_NEAR) if (k + v) % 3 == s]
                texts = [x for t in near for x in (CARRIERS[rng.integers(len(CARRIERS))], t)]
                texts += [t for k, t in enumerate(OTHER) if (k + v) % 3 == s]
            for text in texts:
                said = speech(text, voice, speed)
                at = add(said)
                if text != WAKE:
                    others.append((at / RATE, (at + len(said)) / RATE, text))
                    continue
                # where the phrase is heard: its 10 ms envelope over 2% of its peak
                envelope = np.convolve(np.abs(said), np.ones(160) / 160, mode="same")
                active = np.flatnonzero(envelope > 0.02 * envelope.max())
                starts.append((at + active[0]) / RATE)
                ends.append((at + active[-1]) / RATE)
    audio = np.concatenate(parts)
    sigma = np.sqrt(0.1**2 / 10 ** (snr_db / 10)) if snr_db is not None else 0.001
    audio = audio + sigma * rng.standard_normal(len(audio)).astype(np.float32)
    return (np.clip(audio, -1, 1) * 32767).astype(np.int16), starts, ends, others


def level(x: np.ndarray) -> np.ndarray:
    """Speech at about -20 dBFS (RMS)."""
    return x / max(1e-6, float(np.sqrt(np.mean(x**2)))) * 0.1


def stream(socket: Path, audio: np.ndarray, pace: bool, model: str) -> list[tuple[Any, float]]:
    """The recording as one sequence of 50 ms chunks (``pace``: each sent once it has been
    "recorded"): each response, with when it arrived (seconds since the stream started)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"unix://{socket}")
    events: queue.Queue[tuple[Any, Any, float]] = queue.Queue()
    t0 = time.perf_counter()
    client.start_stream(
        callback=lambda result, error: events.put((result, error, time.perf_counter() - t0))
    )
    try:
        for offset in range(0, len(audio), CHUNK):
            if pace:
                time.sleep(max(0.0, (offset + CHUNK) / RATE - (time.perf_counter() - t0)))
            chunk = audio[offset : offset + CHUNK]
            pcm = grpcclient.InferInput("pcm", [len(chunk)], "INT16")
            pcm.set_data_from_numpy(chunk)
            client.async_stream_infer(
                model,
                [pcm],
                sequence_id=1,
                sequence_start=offset == 0,
                sequence_end=offset + CHUNK >= len(audio),
            )
    finally:
        client.stop_stream()
        client.close()
    found = []
    while not events.empty():
        result, error, arrived = events.get()
        if error is not None:
            raise SystemExit(f"the stream failed: {error}")
        found.append((result, arrived))
    return found


def listen(
    socket: Path, audio: np.ndarray, pace: bool = False, model: str = "wake-word"
) -> list[tuple[float, float, float]]:
    """The wake-word events of the recording: (start, end, when it arrived)."""
    return [
        (*result.as_numpy("times").tolist(), arrived)
        for result, arrived in stream(socket, audio, pace, model)
    ]


def repository(root: Path, thresholds: list[str], endpoints: list[int]) -> Path:
    """The default models (links), a copy of wake-word per threshold (wake-word-<t>) and of
    voice-assistant per endpointer window (voice-assistant-<ms>)."""
    root.mkdir()
    for model in MODELS.iterdir():
        if (model / "config.pbtxt").is_file() and model.name != "wake-word":
            (root / model.name).symlink_to(model, target_is_directory=True)

    def copy(model: str, suffix: str) -> tuple[Path, str]:
        (root / f"{model}-{suffix}").mkdir()
        (root / f"{model}-{suffix}" / "1").symlink_to(MODELS / model / "1")
        config = (MODELS / model / "config.pbtxt").read_text()
        return root / f"{model}-{suffix}" / "config.pbtxt", config.replace(
            f'name: "{model}"', f'name: "{model}-{suffix}"'
        )

    for threshold in thresholds:
        path, config = copy("wake-word", threshold)
        path.write_text(config.replace("=1e-30", f"={threshold}"))
    for ms in endpoints:  # the last of a key's entries counts
        path, config = copy("voice-assistant", str(ms))
        path.write_text(
            f'{config}parameters {{ key: "endpoint_ms" value {{ string_value: "{ms}" }} }}\n'
        )
    return root


def score(
    found: list[tuple[float, float, float]],
    starts: list[float],
    others: list[tuple[float, float, str]],
) -> tuple[int, list[str]]:
    """(phrases detected, what each false accept was heard in)."""
    hits, false = set(), []
    for start, _, _ in found:
        near = [i for i, said in enumerate(starts) if abs(start - said) <= 0.3]
        if near and near[0] not in hits:
            hits.add(near[0])
            continue
        within = [text for a, b, text in others if a - 0.3 <= start <= b]
        false.append(within[0] if within else "silence or a repeat")
    return len(hits), false


def commands(socket: Path, voices: list[str], count: int) -> tuple[list[str], str]:
    """The voice-command template on in-grammar phrases (``count`` of transcribe's phrases,
    each said by every voice) and on sentences that are none of them: (a table row per set,
    the latency line)."""
    import base64
    import io
    import wave

    from edged.client import Client

    client = Client(str(socket), timeout=60)
    phrases, labels = _phrases()
    rng = np.random.default_rng(2)
    chosen = [phrases[i] for i in rng.choice(len(phrases), size=count, replace=False)]
    outside = [t for t in CARRIERS + OTHER if " ".join(t.lower().strip(".?").split()) not in labels]

    def run(text: str, voice: str) -> tuple[str, Any, float]:
        x = np.concatenate(
            [np.zeros(4000, np.float32), speech(text, voice, 175), np.zeros(4000, np.float32)]
        )
        x = level(x)
        x += 0.001 * rng.standard_normal(len(x)).astype(np.float32)
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(RATE)
            wav.writeframes((np.clip(x, -1, 1) * 32767).astype(np.int16).tobytes())
        audio = {"base64": base64.b64encode(buffer.getvalue()).decode()}
        started = time.perf_counter()
        answer = client.run_task({"template": "voice-command", "inputs": {"audio": audio}})
        took = 1000 * (time.perf_counter() - started)
        return answer["outputs"]["transcript"]["text"], answer["outputs"]["command"]["intent"], took

    exact = right = 0
    times = []
    for text in chosen:
        for voice in voices:
            heard, intent, took = run(text, voice)
            exact += heard == text
            right += intent == labels[text]
            times.append(took)
    rejected = 0
    for text in outside:
        for voice in voices:
            heard, _, took = run(text, voice)
            rejected += heard == ""
            times.append(took)
    n, m = len(chosen) * len(voices), len(outside) * len(voices)
    rows = [
        f"{count} phrases x {len(voices)} voices",
        f"{100 * exact / n:.1f}%",
        f"{100 * right / n:.1f}%",
        f"{rejected}/{m} ({100 * rejected / m:.0f}%)",
    ]
    p50, p95 = np.percentile(times, [50, 95])
    what = "voice-command (a WAV of one utterance: vad, transcribe, intent)"
    return rows, f"{what}: p50 {p50:.0f} ms, p95 {p95:.0f} ms ({len(times)} calls)"


def assistant(
    socket: Path, voices: list[str], count: int, pace: bool, model: str = "voice-assistant"
) -> tuple[list[str], str]:
    """The voice-assistant model on one stream: "hey jetson", 0.3 s, then a command (``count``
    of transcribe's phrases, each by every voice), 2.5 s of room noise before the next: (a table
    row: wake heard, command transcript exact, intent right; the latency line: from the end of
    each command's speech to its command event, with ``pace`` at the pace of real time)."""

    phrases, labels = _phrases()
    rng = np.random.default_rng(3)
    chosen = [phrases[i] for i in rng.choice(len(phrases), size=count, replace=False)]
    parts, said = [], []  # said: (text, where its speech ends, in seconds)
    position = 0
    for text in chosen:
        for voice in voices:
            wake, command = (level(speech(t, voice, 175)) for t in (WAKE, text))
            for x in (wake, np.zeros(int(0.3 * RATE)), command, np.zeros(int(2.5 * RATE))):
                if x is command:  # its end: the 10 ms envelope's last point over 2% of peak
                    envelope = np.convolve(np.abs(x), np.ones(160) / 160, mode="same")
                    last = np.flatnonzero(envelope > 0.02 * envelope.max())[-1]
                    said.append((text, (position + last) / RATE))
                parts.append(x.astype(np.float32))
                position += len(x)
    audio = np.concatenate(parts)
    audio = audio + 0.001 * rng.standard_normal(len(audio)).astype(np.float32)
    pcm16 = (np.clip(audio, -1, 1) * 32767).astype(np.int16)
    wakes = exact = right = 0
    delays = []
    for result, arrived in stream(socket, pcm16, pace, model):
        kind = result.as_numpy("event")[0].decode()
        start, _ = result.as_numpy("times").tolist()
        # the command said after this event's start: the first whose speech ends after it
        after = [(text, end) for text, end in said if end > start]
        if kind == "wake":
            wakes += 1
            continue
        if not after:
            continue
        text, end = after[0]
        exact += result.as_numpy("text")[0].decode() == text
        right += result.as_numpy("intent")[0].decode() == labels[text]
        delays.append(1000 * (arrived - end))
    n = len(said)
    row = [
        model,
        f"{count} commands x {len(voices)} voices",
        f"{wakes}/{n}",
        f"{100 * exact / n:.1f}% ({exact} of {wakes} woken)",
        f"{100 * right / n:.1f}% ({right} of {wakes} woken)",
    ]
    p50, p95 = np.percentile(delays, [50, 95]) if delays else (float("nan"),) * 2
    how = "at the pace of real time" if pace else "as fast as it goes (not a latency)"
    line = f"{model}, end of command to its event, {how}:"
    return row, f"{line} p50 {p50:.0f} ms, p95 {p95:.0f} ms ({len(delays)} commands)"


def _phrases() -> tuple[list[str], dict[str, str]]:
    """transcribe's phrases, and the intent label of each (models/intents.tsv)."""
    import csv
    import re

    phrases = (MODELS / "transcribe" / "1" / "phrases.txt").read_text().splitlines()
    labels = {}
    for row in csv.DictReader((MODELS / "intents.tsv").open(), delimiter="\t"):
        labels[" ".join(re.sub(r"[^a-z' ]", " ", row["text"].lower()).split())] = row["label"]
    return phrases, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--voices", type=int, default=5, help=f"of {len(VOICES)}")
    parser.add_argument("--latency-seconds", type=float, default=60.0)
    parser.add_argument("--commands", type=int, default=40, help="in-grammar phrases to say")
    parser.add_argument(
        "--assistant-paced",
        type=int,
        default=10,
        help="commands said to voice-assistant in real time",
    )
    parser.add_argument(
        "--thresholds",
        nargs="+",
        default=["1e-30"],
        help="the phrase's threshold, one wake-word model each",
    )
    parser.add_argument(
        "--endpoints",
        nargs="+",
        type=int,
        default=[],
        help="voice-assistant's endpoint_ms, one copy of it each",
    )
    parser.add_argument(
        "--assistant-only", action="store_true", help="only the voice-assistant rows"
    )
    args = parser.parse_args()
    voices = VOICES[: args.voices]
    rows: list[list[str]] = []
    assistants = ["voice-assistant"] + [f"voice-assistant-{ms}" for ms in args.endpoints]
    assistant_rows, assistant_latencies = [], []
    delays = []
    with tempfile.TemporaryDirectory() as tmp:
        models = repository(Path(tmp) / "models", args.thresholds, args.endpoints)
        proc, socket = start_edged(Path(tmp) / "edged", models)
        grpc = socket.with_name("edged-grpc.sock")
        try:
            if not args.assistant_only:
                rows, delays = wake_rows(grpc, voices, args.thresholds, args.latency_seconds)
                command_row, command_latency = commands(socket, voices[:3], args.commands)
            for model in assistants:
                row, _ = assistant(grpc, voices[:3], args.commands, pace=False, model=model)
                _, latency = assistant(grpc, voices[:1], args.assistant_paced, True, model)
                assistant_rows.append(row)
                assistant_latencies.append(latency)
                print(" | ".join(row), flush=True)
                print(latency, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    if not args.assistant_only:
        print()
        header = [
            "condition",
            "threshold",
            "detected",
            "rate",
            "false accepts",
            "negative audio",
            "false accepts / hour",
            "speed (x real time)",
        ]
        print(table(rows, header))
        print()
        print(
            table(
                [command_row],
                ["commands said", "transcript exact", "intent right", "other speech rejected"],
            )
        )
        print(command_latency)
    print()
    print(
        table(
            assistant_rows,
            [
                "model",
                "wake phrase, then command",
                "wake heard",
                "transcript exact",
                "intent right",
            ],
        )
    )
    print("\n".join(assistant_latencies))
    if delays:
        p50, p95 = np.percentile(delays, [50, 95])
        print(
            f"\nend of phrase to event, at the pace of real time ({len(delays)} phrases):"
            f" p50 {p50:.0f} ms, p95 {p95:.0f} ms"
        )


def wake_rows(
    grpc: Path, voices: list[str], thresholds: list[str], latency_seconds: float
) -> tuple[list[list[str]], list[float]]:
    """The wake-word table's rows (each condition and threshold), and the delays from each
    phrase's end to its event on the clean recording at the pace of real time."""
    rows = []
    clean = None
    conditions = [("clean", None), ("20 dB SNR", 20.0), ("10 dB SNR", 10.0)]
    for (label, snr), negatives in itertools.product(conditions, (False, True)):
        audio, starts, ends, others = build(voices, snr, seed=1, negatives=negatives)
        label += ", negatives only" if negatives else ""
        clean = clean or (audio, starts, ends)
        # every second that is not the wake phrase counts as negative audio
        hours = (len(audio) / RATE - sum(b - a for a, b in zip(starts, ends))) / 3600
        for threshold in thresholds:
            t = time.perf_counter()
            found = listen(grpc, audio, model=f"wake-word-{threshold}")
            took = time.perf_counter() - t
            hits, false = score(found, starts, others)
            rate = f"{100 * hits / len(starts):.1f}%" if starts else "-"
            rows.append(
                [
                    label,
                    threshold,
                    f"{hits}/{len(starts)}",
                    rate,
                    str(len(false)),
                    f"{hours * 60:.1f} min",
                    f"{len(false) / hours:.0f}",
                    f"{len(audio) / RATE / took:.0f}x",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
            if false:
                print("  false accepts in:", sorted(false), flush=True)
    assert clean is not None
    audio, starts, ends = clean
    audio = audio[: int(latency_seconds * RATE)]
    found = listen(grpc, audio, pace=True, model=f"wake-word-{thresholds[0]}")
    delays = []
    for start, _, arrived in found:
        near = [i for i, said in enumerate(starts) if abs(start - said) <= 0.3]
        if near:
            delays.append(1000 * (arrived - ends[near[0]]))
    return rows, delays


if __name__ == "__main__":
    main()
