#!/usr/bin/env python3
"""The wake word and the commands after it, on the held-out evaluation set (issue 47):
detection, false accepts per hour and near misses accepted, per condition and per voice, with
95 % confidence intervals; the time from the end of the phrase to the event; CPU per second of
audio; then the commands.

The set (models/wakeword/evaluate.py): voices the wake-word model never heard in training
(espeak-ng accents and variants held out, flite's slt and rms, festival's ked and slt, piper's
joe), sentences it never read, near misses it never trained on, held-out noise (babble over
pink noise) at 20 and 10 dB SNR. Each voice's recording of a condition is streamed as one
sequence of 50 ms chunks to a fresh edged (on its gRPC socket), as a microphone loop sends it,
to three spotters: `wake-word` (the trained model, wake-net), `wake-word-pocketsphinx`
(pocketsphinx's keyword spotter, the fallback) and the cascade of the two (a trained
model's event kept only when pocketsphinx heard the phrase within 0.5 s of it). A phrase is
detected when an event's end is from 0.3 s before its end to 0.5 s after; every other event
is a false accept, per hour of the audio that is not the phrase.

Latency: the clean recordings again, sent at the pace of real time; for each phrase, the time
from the moment its end was sent to the moment its event arrived. CPU: edged's own CPU time
(user and system, /proc) over the seconds of audio streamed to each spotter.

Commands: the voice-command template (vad, transcribe, intent) on WAV files of one utterance
(in-grammar phrases said by held-out voices: is the transcript exact, is the intent the
phrase's label; and other sentences: is the transcript empty); then voice-assistant on one
stream, the wake phrase then one of transcribe's phrases, by held-out voices: the wake heard,
the command's transcript and intent; and at the pace of real time, the time from the end of
the command's speech to its event.

    .venv/bin/python bench/voice.py [--negative-s 240] [--latency-seconds 90] [--commands 40]
                                    [--assistant-paced 10] [--thresholds 0.9 ...]
                                    [--endpoints 200 ...] [--assistant-only]
"""

from __future__ import annotations

import argparse
import queue
import re
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import MODELS, start_edged, table  # noqa: E402

RATE = 16000
CHUNK = RATE // 20  # 50 ms, as a microphone loop reads
WAKE = "hey jetson"
# sentences that are none of the device's phrases (the voice-command rows: rejected?)
OTHER = [
    "Good morning, this is the kitchen speaker.",
    "The meeting starts at ten.",
    "I left my keys on the table.",
    "Could you check the oven?",
    "how is the weather tomorrow",
    "call my brother",
    "set an alarm for seven",
    "the train was late again this morning",
    "we need more milk and bread",
    "please close the garage door",
]
# held-out voices that say the commands: one of each engine, and two held-out espeak-ng ones
COMMAND_VOICES = [
    "piper:joe",
    "flite:slt",
    "flite:rms",
    "festival:ked_diphone",
    "festival:cmu_us_slt_arctic_hts",
    "espeak:en-gb-scotland+m7",
    "espeak:en-029+f3",
]


def speech(text: str, voice: str, speed: float = 1.0) -> np.ndarray:
    """``text`` said by ``voice`` (models/wakeword/voices.py), 16 kHz float."""
    from models.wakeword import voices

    return voices.say(voice, text, speed, seed=zlib.crc32(f"{voice}|{text}".encode()))


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
    """The default models (links); wake-word-pocketsphinx (wake-word without its
    detector_model: pocketsphinx's spotter); a wake-net-<t> and wake-word-<t> per threshold of
    the trained model; voice-assistant-<ms> per endpointer window."""
    from models.wakeword.train import set_parameter

    root.mkdir()
    for model in MODELS.iterdir():
        if (model / "config.pbtxt").is_file():
            (root / model.name).symlink_to(model, target_is_directory=True)

    def copy(model: str, suffix: str) -> tuple[Path, str]:
        (root / f"{model}-{suffix}").mkdir()
        (root / f"{model}-{suffix}" / "1").symlink_to(MODELS / model / "1")
        config = (MODELS / model / "config.pbtxt").read_text()
        return root / f"{model}-{suffix}" / "config.pbtxt", config.replace(
            f'name: "{model}"', f'name: "{model}-{suffix}"'
        )

    path, config = copy("wake-word", "pocketsphinx")
    path.write_text(re.sub(r'parameters \{\s*key: "detector_model"[^}]*\}\s*\}', "", config))
    for threshold in thresholds:
        path, config = copy("wake-net", threshold)
        path.write_text(set_parameter(config, "threshold", threshold))
        path, config = copy("wake-word", threshold)
        path.write_text(config.replace('"wake-net"', f'"wake-net-{threshold}"'))
    for ms in endpoints:  # the last of a key's entries counts
        path, config = copy("voice-assistant", str(ms))
        path.write_text(
            f'{config}parameters {{ key: "endpoint_ms" value {{ string_value: "{ms}" }} }}\n'
        )
    return root


def cascade(
    trained: list[tuple[float, float, float]], spotted: list[tuple[float, float, float]]
) -> list[tuple[float, float, float]]:
    """The trained model's events that pocketsphinx confirms (an event of its within 0.5 s)."""
    return [e for e in trained if any(abs(e[1] - o[1]) <= 0.5 for o in spotted)]


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
    outside = [t for t in OTHER if " ".join(t.lower().strip(".?").split()) not in labels]

    def run(text: str, voice: str) -> tuple[str, Any, float]:
        x = np.concatenate(
            [np.zeros(4000, np.float32), speech(text, voice), np.zeros(4000, np.float32)]
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
            wake, command = (level(speech(t, voice)) for t in (WAKE, text))
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
    parser.add_argument(
        "--negative-s", type=float, default=240.0, help="seconds of negatives per held-out voice"
    )
    parser.add_argument("--latency-seconds", type=float, default=90.0)
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
        default=[],
        help="more thresholds of the trained model, a wake-word-<t> each",
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
    from models.wakeword import voices

    held, missing = voices.available(COMMAND_VOICES)
    for reason in missing:
        print(f"left out: {reason}")
    assistants = ["voice-assistant"] + [f"voice-assistant-{ms}" for ms in args.endpoints]
    assistant_rows, assistant_latencies = [], []
    with tempfile.TemporaryDirectory() as tmp:
        models = repository(Path(tmp) / "models", args.thresholds, args.endpoints)
        proc, socket = start_edged(Path(tmp) / "edged", models)
        grpc = socket.with_name("edged-grpc.sock")
        try:
            if not args.assistant_only:
                wake_tables(grpc, proc.pid, args.thresholds, args.negative_s, args.latency_seconds)
                command_row, command_latency = commands(socket, held, args.commands)
            for model in assistants:
                row, _ = assistant(grpc, held, args.commands // 2, pace=False, model=model)
                _, latency = assistant(grpc, held[:2], args.assistant_paced, True, model)
                assistant_rows.append(row)
                assistant_latencies.append(latency)
                print(" | ".join(row), flush=True)
                print(latency, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    if not args.assistant_only:
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


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (/proc/<pid>/stat)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wake_tables(
    grpc: Path, pid: int, thresholds: list[str], negative_s: float, latency_seconds: float
) -> None:
    """The held-out set through each spotter: a table per spotter (per condition, then per
    voice), edged's CPU per second of audio, and the latency at the pace of real time."""
    from models.wakeword import evaluate, voices

    held, missing = voices.available(voices.HELD_OUT)
    for reason in missing:
        print(f"left out: {reason}")
    cache = ROOT / "models" / ".build" / "wakeword"
    clips = evaluate.voice_clips(held, WAKE, negative_s, 1047, cache)
    recs = evaluate.recordings(clips, 1047)
    pcm = [np.clip(np.round(r.audio * 32767), -32768, 32767).astype(np.int16) for r in recs]
    seconds = sum(p.size for p in pcm) / RATE
    spotters = ["wake-word", *(f"wake-word-{t}" for t in thresholds), "wake-word-pocketsphinx"]
    found: dict[str, list[list[tuple[float, float, float]]]] = {}
    for name in spotters:
        used, began = cpu_seconds(pid), time.perf_counter()
        found[name] = [listen(grpc, p, model=name) for p in pcm]
        took, used = time.perf_counter() - began, cpu_seconds(pid) - used
        print(
            f"\n{name}: {seconds / 3600:.2f} h of audio, {seconds / took:.0f}x real time;"
            f" edged's CPU {1000 * used / seconds:.1f} ms per second of audio",
            flush=True,
        )
        print(evaluate.report(recs, [[e[1] for e in events] for events in found[name]]))
    both = [cascade(a, b) for a, b in zip(found["wake-word"], found["wake-word-pocketsphinx"])]
    print("\ncascade (wake-word's events that pocketsphinx confirms):")
    print(evaluate.report(recs, [[e[1] for e in events] for events in both]))
    delays = []
    budget = latency_seconds
    for rec, p in zip(recs, pcm):
        if rec.snr_db is not None or budget <= 0:
            continue
        cut = p[: int(min(budget, 30.0) * RATE)]
        budget -= cut.size / RATE
        events = listen(grpc, cut, pace=True, model="wake-word")
        for _, end in rec.phrases:
            hits = [arrived for _, e, arrived in events if end - 0.3 <= e <= end + 0.5]
            if hits and end < cut.size / RATE:
                delays.append(1000 * (hits[0] - end))
    if delays:
        p50, p95 = np.percentile(delays, [50, 95])
        print(
            f"\nwake-word, end of phrase to event at the pace of real time ({len(delays)}"
            f" phrases): p50 {p50:.0f} ms, p95 {p95:.0f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
