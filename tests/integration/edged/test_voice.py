"""The wake word on a live stream: tritonclient's gRPC stream, audio in 100 ms chunks of a
sequence, as a microphone loop sends it. Speech from espeak-ng (several voices), with a little
noise as a microphone has (pocketsphinx hears nothing in digital silence)."""

from __future__ import annotations

import base64
import csv
import queue
import re
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from edged.client import ClientError
from tests.conftest import (
    MODELS,
    SPEECH_MODEL,
    Cloud,
    Daemon,
    copy_model,
    linked_repository,
    wait_for,
)
from tests.media import espeak, wav_bytes

RATE = 16000
CHUNK = RATE // 10  # 100 ms


@pytest.fixture(scope="module")
def triton(daemon: Daemon) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"unix://{daemon.socket.with_name('edged-grpc.sock')}")


def recording(sentences: list[str], voice: str, seed: int) -> tuple[np.ndarray, list[float]]:
    """16-bit audio of the sentences with 0.7 s between them and -50 dB noise; and where each
    "hey jetson" starts, in seconds."""
    parts, starts, position = [], [], 0
    for sentence in sentences:
        speech = espeak(sentence, voice)
        if sentence == "hey jetson":
            starts.append(position / RATE)
        parts += [speech, np.zeros(int(0.7 * RATE), np.float32)]
        position += len(parts[-2]) + len(parts[-1])
    audio = np.concatenate(parts)
    audio += 0.003 * np.random.default_rng(seed).standard_normal(len(audio)).astype(np.float32)
    return (np.clip(audio, -1, 1) * 32767).astype(np.int16), starts


def listen(
    triton: grpcclient.InferenceServerClient, streams: dict[str, np.ndarray]
) -> dict[str, list[tuple[str, float, float]]]:
    """Each recording as a sequence of 100 ms chunks, all on one stream, interleaved; the wake
    events of each: (phrase, start, end)."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        longest = max(len(audio) for audio in streams.values())
        for offset in range(0, longest + CHUNK, CHUNK):
            for name, audio in streams.items():
                if offset > len(audio):
                    continue
                chunk = audio[offset : offset + CHUNK]
                pcm = grpcclient.InferInput("pcm", [len(chunk)], "INT16")
                pcm.set_data_from_numpy(chunk)
                triton.async_stream_infer(
                    "wake-word",
                    [pcm],
                    request_id=f"{name}@{offset}",
                    sequence_id=name,
                    sequence_start=offset == 0,
                    sequence_end=offset + CHUNK > len(audio),
                )
    finally:
        triton.stop_stream()
    heard: dict[str, list[tuple[str, float, float]]] = {name: [] for name in streams}
    while not answers.empty():
        result, error = answers.get()
        assert error is None, error
        response = result.get_response()
        assert not response.parameters["triton_final_response"].bool_param
        start, end = result.as_numpy("times").tolist()
        heard[response.id.split("@")[0]].append((result.as_numpy("phrase")[0].decode(), start, end))
    return heard


def test_the_wake_phrase_is_heard_where_it_was_said_and_not_elsewhere(
    triton: grpcclient.InferenceServerClient,
) -> None:
    """Three voices, each saying "hey jetson" twice among other sentences, and one recording
    of other speech only, as four sequences on one stream: each phrase heard once, its start
    within 0.15 s of where it was said, in the sequence's own time; nothing in the other."""
    script = [
        "Good morning, this is a test of the speech system.",
        "hey jetson",
        "the weather is nice today",
        "hey jetson",
        "please call my brother tomorrow",
    ]
    streams, truth = {}, {}
    for seed, voice in enumerate(["en-us", "en-us+f3", "en+m7"]):
        streams[voice], truth[voice] = recording(script, voice, seed)
    others = [
        "Good morning, this is a test of the speech system.",
        "turn on the lights",
        "the weather is nice today",
        "what time is it",
        "play some music please",
    ]
    streams["other"], truth["other"] = recording(others, "en-us", 9)
    heard = listen(triton, streams)
    print({name: [(p, round(s, 2)) for p, s, _ in found] for name, found in heard.items()})
    assert heard["other"] == []
    for voice in ("en-us", "en-us+f3", "en+m7"):
        found = heard[voice]
        assert [phrase for phrase, _, _ in found] == ["hey jetson", "hey jetson"], (voice, found)
        for (_, start, end), said in zip(found, truth[voice]):
            assert abs(start - said) <= 0.15 and 0.3 < end - start < 1.2, (voice, found, said)


def test_wake_word_refusals_name_their_reason(
    triton: grpcclient.InferenceServerClient,
) -> None:
    """A unary call, a chunk over max_chunk_seconds, and more sequences at once than the model
    has decoders (4): each refused with its reason; the others are served."""
    with pytest.raises(InferenceServerException, match="ModelStreamInfer"):
        pcm = grpcclient.InferInput("pcm", [CHUNK], "INT16")
        pcm.set_data_from_numpy(np.zeros(CHUNK, np.int16))
        triton.infer("wake-word", [pcm])
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for sid in range(1, 7):  # six sequences started, none ended: the fifth and sixth refused
            pcm = grpcclient.InferInput("pcm", [CHUNK], "INT16")
            pcm.set_data_from_numpy(np.zeros(CHUNK, np.int16))
            triton.async_stream_infer(
                "wake-word",
                [pcm],
                request_id=str(sid),
                sequence_id=sid,
                sequence_start=True,
                enable_empty_final_response=True,
            )
        long = grpcclient.InferInput("pcm", [11 * RATE], "INT16")
        long.set_data_from_numpy(np.zeros(11 * RATE, np.int16))
        triton.async_stream_infer("wake-word", [long], request_id="long", sequence_id=1)
    finally:
        triton.stop_stream()
    got = [answers.get_nowait() for _ in range(answers.qsize())]
    errors = sorted(str(error) for _, error in got if error is not None)
    assert len(errors) == 3, errors
    assert sum("its 4 decoders are in use" in e for e in errors) == 2, errors
    assert any("at most 160000" in e for e in errors), errors
    served = sorted(result.get_response().id for result, error in got if error is None)
    assert served == ["1", "2", "3", "4"]
    # none of the four was ended: the stream's end gave their decoders back
    answers = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for sid in range(1, 5):
            pcm = grpcclient.InferInput("pcm", [CHUNK], "INT16")
            pcm.set_data_from_numpy(np.zeros(CHUNK, np.int16))
            triton.async_stream_infer(
                "wake-word",
                [pcm],
                request_id=str(sid),
                sequence_id=sid,
                sequence_start=True,
                sequence_end=True,
                enable_empty_final_response=True,
            )
    finally:
        triton.stop_stream()
    again = [answers.get_nowait() for _ in range(answers.qsize())]
    assert [error for _, error in again] == [None] * 4


def test_rest_and_edgectl_hear_what_grpc_hears(
    daemon: Daemon, triton: grpcclient.InferenceServerClient, tmp_path: Path
) -> None:
    """The same recording over POST /v2/models/wake-word/stream (a chunked upload, sent as
    fast as the socket takes it, answers read while it is sent) and through `edgectl listen`
    gives the events of the gRPC stream; a model that is not stateful is refused with the
    reason, and a WAV that is not 16 kHz mono 16-bit is a usage error naming what to send."""
    script = ["The meeting starts at ten.", "hey jetson", "please call my brother tomorrow"]
    audio, _ = recording(script, "en-us", 3)
    [grpc_heard] = listen(triton, {"one": audio}).values()
    data = audio.tobytes()
    chunks = (data[i : i + 5000] for i in range(0, len(data), 5000))  # not 100 ms: any size
    events = list(daemon.client.listen(chunks))
    assert events[-1] == {"event": "end"}
    heard = []
    for event in events[:-1]:
        outputs = {o["name"]: o["data"] for o in event["outputs"]}
        heard.append((outputs["phrase"][0], *outputs["times"]))
        assert event["parameters"]["route"] == "local"
    assert len(heard) == len(grpc_heard) == 1
    assert heard[0][0] == grpc_heard[0][0] == "hey jetson"
    np.testing.assert_allclose(heard[0][1:], grpc_heard[0][1:], atol=0.011)  # one frame
    with pytest.raises(ClientError, match="not a stateful model of one INT16 input") as refused:
        list(daemon.client.listen(iter([data[:3200]]), model="intent"))
    assert refused.value.status == 400

    wav = tmp_path / "wake.wav"
    with wave.open(str(wav), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(data)
    edgectl = [sys.executable, "-m", "edged.edgectl", "--socket", str(daemon.socket), "listen"]
    done = subprocess.run([*edgectl, str(wav)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "wake: hey jetson" in done.stdout and "1 event(s)" in done.stdout
    with wave.open(str(wav), "wb") as out:
        out.setnchannels(2)
        out.setsampwidth(2)
        out.setframerate(44100)
        out.writeframes(data)
    done = subprocess.run([*edgectl, str(wav)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "send 16 kHz mono 16-bit" in done.stderr, done.stderr


def test_voice_command_runs_from_audio_alone(daemon: Daemon) -> None:
    """The voice-command template from a WAV file only: where the speech is, its transcript
    against the device's phrases (the intent model's sentences), the intent of that; every
    node on the device (the audio is private by default); an utterance that is none of the
    phrases has an empty transcript and no intent."""
    phrases = (MODELS / "transcribe" / "1" / "phrases.txt").read_text().splitlines()
    labels = {}
    for row in csv.DictReader((MODELS / "intents.tsv").open(), delimiter="\t"):
        labels[" ".join(re.sub(r"[^a-z' ]", " ", row["text"].lower()).split())] = row["label"]
    said = ["scan this receipt", "listen to me", "the weather is nice today"]
    assert said[0] in phrases and said[1] in phrases and said[2] not in phrases
    for seed, text in enumerate(said):
        speech = espeak(text)
        audio = np.concatenate([np.zeros(4000, np.float32), speech, np.zeros(4000, np.float32)])
        audio += 0.003 * np.random.default_rng(seed).standard_normal(len(audio)).astype(np.float32)
        wav = base64.b64encode(wav_bytes(audio)).decode()
        doc = {"template": "voice-command", "inputs": {"audio": {"base64": wav}}}
        answer = daemon.client.run_task(doc)
        outputs = answer["outputs"]
        assert answer["status"] == "ok" and outputs["speech"]["speech"] is True
        assert [n["route"] for n in answer["nodes"]] == ["local"] * 3
        assert all(n["private"] for n in answer["nodes"][:2])  # the audio's nodes
        if text in phrases:
            assert outputs["transcript"]["text"] == text
            assert outputs["command"]["intent"] == labels[text] and outputs["command"]["score"] > 0
        else:
            assert outputs["transcript"]["text"] == ""
            assert outputs["command"] == {"intent": None, "score": 0.0}


def test_an_open_transcript_escalates_to_the_cloud_only_when_the_audio_is_released(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    """An utterance that is none of the device's phrases goes to the cloud's open-vocabulary
    recogniser (MLServer running pocketsphinx with its language model, over gRPC: OIP's JSON
    cannot carry a WAV file's bytes) only when the caller released the audio; by default it is
    private (the template's input, transcribe's ``privacy: default-private``) and never sent."""
    cloud = faults_cleared
    config = f"""
[models]
load = ["vad", "transcribe", "intent"]
[cloud]
url = "grpc://{cloud.peer.grpc_url}"
[routing]
local_threshold_ms = 10000  # the device first (2 cores: transcribe's estimate is over 100 ms)
"""
    daemon = make_daemon(config=config).start()
    client = daemon.client
    wait_for(lambda: SPEECH_MODEL in client.status()["cloud"]["catalog"], 30, "the catalog")

    def utterance(text: str, seed: int) -> bytes:
        speech = espeak(text, "en-us")
        audio = np.concatenate([np.zeros(4000, np.float32), speech, np.zeros(4000, np.float32)])
        audio += 0.003 * np.random.default_rng(seed).standard_normal(len(audio)).astype(np.float32)
        return wav_bytes(audio)

    def sent() -> list[int]:  # the sizes of the audio files the cloud's recogniser was sent
        return [s["audio_bytes"] for s in cloud.seen() if s["model"] == SPEECH_MODEL]

    other = utterance("how is the weather tomorrow", 1)  # none of the device's phrases
    phrase = utterance("scan this receipt", 2)
    before = sent()

    def link_up() -> None:
        # the LM's ~0.5 s on a loaded 2-core runner can make the link monitor's probe time out,
        # and a link that is down rightly keeps calls local (CI, 2026-12-07: "cloud excluded:
        # link ... is down" on the call after an escalation): what is tested here is the
        # escalation of released audio, so each released call waits for the link first
        wait_for(lambda: client.status()["cloud"]["link"]["up"], 30, "the cloud link up")

    def command(wav: bytes, **label: bool) -> dict[str, Any]:
        if label.get("private") is False:
            link_up()
        audio = {"base64": base64.b64encode(wav).decode(), **label}
        answer = client.run_task({"template": "voice-command", "inputs": {"audio": audio}})
        assert answer["status"] == "ok", answer
        return answer

    # private by default: the template's audio, and transcribe called directly
    kept = command(other)
    node = kept["nodes"][1]
    assert (node["id"], node["route"], node["private"]) == ("transcript", "local", True), node
    assert kept["outputs"]["transcript"]["text"] == ""
    blob = np.array([other], dtype=object)
    out, answer = client.infer_answer(SPEECH_MODEL, {"audio": blob})
    assert out["text"][0] == b"" and answer["route"] == "local" and answer["private"] is True
    assert "privacy: default-private" in answer["reason"], answer
    assert sent() == before  # nothing reached the cloud
    # released: the open transcript is asked again of the cloud, the intent of what it heard
    released = command(other, private=False)
    node = released["nodes"][1]
    assert (node["route"], node["private"]) == ("escalated", False), node["reason"]
    assert "confidence 0.000 < 0.5: the cloud answered" in node["reason"], node
    heard = released["outputs"]["transcript"]["text"]
    assert heard == "how is the weather tomorrow", heard  # the cloud's language model
    assert released["outputs"]["command"]["intent"] is not None
    assert sent() == [*before, len(other)]
    released_call = {"private": False, "timeout": 10_000_000}  # the LM takes ~0.5 s on 2 cores
    link_up()
    out, answer = client.infer_answer(SPEECH_MODEL, {"audio": blob}, parameters=released_call)
    assert answer["route"] == "escalated" and b"weather" in out["text"][0], (out, answer)
    assert sent() == [*before, len(other), len(other)]
    # a phrase of the device's, released: heard on the device, not escalated
    local = command(phrase, private=False)
    assert local["nodes"][1]["route"] == "local" and not local["nodes"][1]["private"]
    assert local["outputs"]["transcript"]["text"] == "scan this receipt"
    assert sent() == [*before, len(other), len(other)]


def test_callers_who_stop_sending_do_not_hold_the_model(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    """wake-word with one decoder and a 1 s idle time: a stream that started a sequence and
    went quiet holds the decoder for 1 s, no longer: another caller is refused (503, the
    reason) before, served after, and the quiet one's next chunk is refused with why; a REST
    upload that stops sending ends with a 408 line after the idle time, and the daemon
    serves the next caller meanwhile."""
    repo = linked_repository(tmp_path / "models", ["wake-net", "wake-word"])
    model = copy_model(repo, "wake-word")
    config = (model / "config.pbtxt").read_text()
    config = config.replace(
        "max_sequence_idle_microseconds: 10000000", "max_sequence_idle_microseconds: 1000000"
    )
    (model / "config.pbtxt").write_text(config.replace('string_value: "4"', 'string_value: "1"'))
    daemon = make_daemon(models=repo).start()
    url = f"unix://{daemon.socket.with_name('edged-grpc.sock')}"
    quiet_client, other_client = (grpcclient.InferenceServerClient(url) for _ in range(2))
    answers: dict[str, queue.Queue[tuple[Any, Any]]] = {
        "quiet": queue.Queue(),
        "other": queue.Queue(),
    }

    def chunk() -> list[grpcclient.InferInput]:
        pcm = grpcclient.InferInput("pcm", [CHUNK], "INT16")
        pcm.set_data_from_numpy(np.zeros(CHUNK, np.int16))
        return [pcm]

    def one(client: grpcclient.InferenceServerClient, name: str, **sequence: Any) -> Any:
        client.async_stream_infer(
            "wake-word",
            chunk(),
            request_id=name,
            sequence_id=1,
            enable_empty_final_response=True,
            **sequence,
        )
        return answers[name.split("-")[0]].get(timeout=30)

    quiet_client.start_stream(callback=lambda result, error: answers["quiet"].put((result, error)))
    other_client.start_stream(callback=lambda result, error: answers["other"].put((result, error)))
    try:
        assert one(quiet_client, "quiet-1", sequence_start=True)[1] is None
        _, refused = one(other_client, "other-1", sequence_start=True)
        assert "its 1 decoders are in use" in str(refused), refused
        time.sleep(1.5)
        assert one(other_client, "other-2", sequence_start=True)[1] is None
        _, dropped = one(quiet_client, "quiet-2")
        assert "was idle for over 1 s" in str(dropped), dropped
    finally:
        quiet_client.stop_stream()
        other_client.stop_stream()

    def slow() -> Iterator[bytes]:
        yield np.zeros(CHUNK, np.int16).tobytes()
        time.sleep(2.5)  # the caller stops sending, without ending the upload
        yield np.zeros(CHUNK, np.int16).tobytes()

    started = time.monotonic()
    events = list(daemon.client.listen(slow()))
    assert events[-1]["event"] == "error" and events[-1]["status"] == 408, events
    assert "no audio for 1 s" in events[-1]["error"]
    assert time.monotonic() - started < 2.4  # it did not wait for the caller


def test_the_voice_assistant_hears_the_wake_phrase_then_the_command(daemon: Daemon) -> None:
    """voice-assistant on one live stream (REST, 100 ms chunks as they come): "hey jetson",
    then "scan this receipt": a wake event, then a command event with its transcript and
    intent, all on the device; a second "hey jetson" with nothing said after it: a wake
    event and an empty command once 2 s have passed quietly; other speech: nothing."""
    said = [
        ("Good morning, this is the kitchen speaker.", 11000),
        ("hey jetson", 5000),
        ("scan this receipt", 24000),
        ("the weather is nice today", 8000),
        ("hey jetson", 40000),
    ]  # (what, then samples of silence)
    audio = np.concatenate([p for text, gap in said for p in (espeak(text), np.zeros(gap))])
    audio += 0.003 * np.random.default_rng(0).standard_normal(len(audio))
    data = (np.clip(audio, -1, 1) * 32767).astype(np.int16).tobytes()
    chunks = (data[i : i + 2 * CHUNK] for i in range(0, len(data), 2 * CHUNK))
    events = list(daemon.client.listen(chunks, model="voice-assistant"))
    assert events[-1] == {"event": "end"}
    got = []
    for event in events[:-1]:
        outputs = {o["name"]: o["data"] for o in event["outputs"]}
        got.append((outputs["event"][0], outputs["text"][0], outputs["intent"][0]))
        assert event["parameters"]["route"] == "local"
    assert got == [
        ("wake", "hey jetson", ""),
        ("command", "scan this receipt", "image-report"),
        ("wake", "hey jetson", ""),
        ("command", "", ""),
    ], got
    times = [o["data"] for e in events[:-1] for o in e["outputs"] if o["name"] == "times"]
    assert times[0][1] <= times[1][0] + 0.01 < times[1][1]  # the command follows the phrase
    assert times[3][1] - times[3][0] == pytest.approx(2.0, abs=0.2)  # 2 s of quiet: no command


def test_endpoint_ms_is_the_quiet_that_ends_a_command(
    daemon: Daemon, make_daemon: type[Daemon], tmp_path: Path
) -> None:
    """The same phrase and command to voice-assistant as shipped (endpoint_ms 200) and to a
    copy with endpoint_ms 600: the command ends 0.4 s later in the second."""
    said = ["Good morning, this is the kitchen speaker.", "hey jetson", "scan this receipt"]
    gaps = [11000, 5000, 2 * RATE]  # samples of silence after each
    audio = np.concatenate([p for t, gap in zip(said, gaps) for p in (espeak(t), np.zeros(gap))])
    audio += 0.003 * np.random.default_rng(0).standard_normal(len(audio))
    data = (np.clip(audio, -1, 1) * 32767).astype(np.int16).tobytes()
    repo = linked_repository(tmp_path / "models")
    model = copy_model(repo, "voice-assistant")
    parameter = 'parameters { key: "endpoint_ms" value { string_value: "600" } }\n'
    (model / "config.pbtxt").write_text((model / "config.pbtxt").read_text() + parameter)
    slow = make_daemon(repo, config='[models]\nload = ["voice-assistant"]\n').start()
    ends = []
    for edged in (daemon, slow):
        chunks = (data[i : i + 2 * CHUNK] for i in range(0, len(data), 2 * CHUNK))
        events = list(edged.client.listen(chunks, model="voice-assistant"))
        outputs = [{o["name"]: o["data"] for o in e["outputs"]} for e in events[:-1]]
        assert [(o["event"][0], o["text"][0]) for o in outputs] == [  # (the same on each)
            ("wake", "hey jetson"),
            ("command", "scan this receipt"),
        ]
        ends.append(outputs[1]["times"][1])
    assert ends[1] - ends[0] == pytest.approx(0.4, abs=0.1), ends


def test_audio_far_faster_than_real_time_is_served_and_others_are_too(daemon: Daemon) -> None:
    """A minute of audio pushed as fast as the socket takes it (hundreds of times real time)
    to wake-word over REST, while other callers ask for intents: the stream is decoded to its
    end (back-pressure, not a refusal), and every other call is answered meanwhile."""
    import threading

    audio, _ = recording(["Good morning, this is a test.", "hey jetson"] * 6, "en-us", 5)
    minute = np.tile(audio, int(np.ceil(60 * RATE / len(audio))))[: 60 * RATE]
    data = minute.tobytes()
    events: list[dict[str, Any]] = []

    def stream() -> None:
        events.extend(daemon.client.listen(data[i : i + 32000] for i in range(0, len(data), 32000)))

    streamer = threading.Thread(target=stream)
    streamer.start()
    answered = 0
    while streamer.is_alive() and answered < 50:
        reply = daemon.client.intent(["how hot is the gpu"])
        answered += reply[0]["intent"] == "device-status"
    streamer.join(120)
    assert not streamer.is_alive() and events[-1] == {"event": "end"}, events[-3:]
    heard = [e for e in events if "outputs" in e]
    assert len(heard) >= 10  # "hey jetson" about a dozen times in the minute
    assert answered >= 5, answered  # the others were served while the stream ran
