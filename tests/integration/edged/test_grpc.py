"""tritonclient's own gRPC client, unchanged, against edged's gRPC socket."""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import MODELS, Daemon
from tests.media import espeak, wav_bytes


@pytest.fixture(scope="module")
def triton(daemon: Daemon) -> grpcclient.InferenceServerClient:
    path = daemon.socket.with_name("edged-grpc.sock")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    return grpcclient.InferenceServerClient(url=f"unix://{path}")


def test_health_and_metadata(triton: grpcclient.InferenceServerClient) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("text-encoder")
    server = triton.get_server_metadata()
    assert server.name == "edged" and "model_repository" in server.extensions
    meta = triton.get_model_metadata("text-encoder")
    assert meta.platform == "onnxruntime_onnx"
    assert next((t.name, t.datatype, list(t.shape)) for t in meta.inputs) == (
        "input_ids",
        "INT64",
        [-1, -1],
    )
    config = triton.get_model_config("text-encoder").config
    assert config.max_batch_size == 64 and config.dynamic_batching.priority_levels == 2


def test_infer_with_raw_contents_equals_onnx_runtime(
    triton: grpcclient.InferenceServerClient,
) -> None:
    ids = np.array([[101, 7592, 2088, 2003, 4248, 102]], dtype=np.int64)
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }
    inputs = []
    for name, array in feeds.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)  # tritonclient sends raw_input_contents
        inputs.append(tensor)
    result = triton.infer("text-encoder", inputs, priority=1, timeout=5_000_000)
    session = ort.InferenceSession(str(MODELS / "text-encoder" / "1" / "model.onnx"))
    (expected,) = session.run(["embedding"], feeds)
    np.testing.assert_allclose(result.as_numpy("embedding"), expected, atol=1e-5)
    response = result.get_response()
    assert response.model_version == "1"
    # where it ran and why, as InferParameters
    assert response.parameters["route"].string_param == "local"
    assert "no cloud tier" in response.parameters["reason"].string_param
    assert response.parameters["actual_ms"].double_param > 0


def test_pipelines_take_strings(triton: grpcclient.InferenceServerClient) -> None:
    text = grpcclient.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"scan this invoice", b"how hot is the gpu"], object))
    result = triton.infer("intent", [text])
    assert list(result.as_numpy("intent")) == [b"image-report", b"device-status"]


def test_errors_map_to_grpc_status_codes(triton: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as unknown:
        triton.get_model_metadata("no-such-model")
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    bad = grpcclient.InferInput("embedding", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as shape:
        triton.infer("intent-classifier", [bad])
    assert shape.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "has shape [1, 3], the model expects [-1, 384]" in shape.value.message()
    assert triton.is_server_live()  # and it keeps serving


def test_repository_calls(triton: grpcclient.InferenceServerClient) -> None:
    index = {(m.name, m.version): m.state for m in triton.get_model_repository_index().models}
    assert index[("intent-classifier", "1")] == "READY"
    triton.unload_model("vad")
    assert not triton.is_model_ready("vad")
    triton.load_model("vad")
    assert triton.is_model_ready("vad")


def test_typed_contents_as_other_grpc_clients_send_them(daemon: Daemon) -> None:
    """Clients generated from Triton's protos may send typed contents instead of raw bytes."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    embedding = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    request = pb.ModelInferRequest(model_name="intent-classifier")
    tensor = request.inputs.add(name="embedding", datatype="FP32", shape=[1, 384])
    tensor.contents.fp32_contents.extend(embedding.tolist())
    path = daemon.socket.with_name("edged-grpc.sock")
    with grpc.insecure_channel(f"unix://{path}") as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
        wrong = pb.ModelInferRequest(model_name="intent-classifier")
        bad = wrong.inputs.add(name="embedding", datatype="FP32", shape=[1, 384])
        bad.contents.fp32_contents.extend([0.0] * 10)  # 10 values for 384
        with pytest.raises(grpc.RpcError) as error:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(wrong, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs 384 elements" in error.value.details()
    probabilities = np.frombuffer(reply.raw_output_contents[0], np.float32)
    session = ort.InferenceSession(str(MODELS / "intent-classifier" / "1" / "model.onnx"))
    (expected,) = session.run(["probabilities"], {"embedding": embedding[None, :]})
    np.testing.assert_allclose(probabilities, expected.reshape(-1), atol=1e-6)


def test_a_stream_answers_each_request_by_id_and_goes_on_after_an_error(
    triton: grpcclient.InferenceServerClient,
) -> None:
    """ModelStreamInfer as tritonclient streams: every request answered once, under its id, as
    the unary call answers it; a bad one answered with its error while the stream goes on."""
    import queue

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    rng = np.random.default_rng(1)
    sent: dict[str, np.ndarray] = {}
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(40):
            embedding = rng.standard_normal((1, 384)).astype(np.float32)
            tensor = grpcclient.InferInput("embedding", [1, 384], "FP32")
            if i == 17:  # a wrong shape: refused, this request only
                embedding = np.zeros((1, 3), np.float32)
                tensor = grpcclient.InferInput("embedding", [1, 3], "FP32")
            tensor.set_data_from_numpy(embedding)
            sent[f"r{i}"] = embedding
            triton.async_stream_infer(
                "intent-classifier", [tensor], request_id=f"r{i}", priority=1 + i % 2
            )
        got = [answers.get(timeout=30) for _ in range(40)]
    finally:
        triton.stop_stream()
    assert answers.empty()  # one answer per request, no more
    session = ort.InferenceSession(str(MODELS / "intent-classifier" / "1" / "model.onnx"))
    ids = set()
    for result, error in got:
        if error is not None:
            assert "r17" not in ids and "embedding" in str(error), error
            ids.add("r17")
            continue
        response = result.get_response()
        ids.add(response.id)
        (expected,) = session.run(["probabilities"], {"embedding": sent[response.id]})
        # (within 1e-5: requests of a stream are batched together, as concurrent calls are)
        np.testing.assert_allclose(result.as_numpy("probabilities"), expected, atol=1e-5)
        assert response.parameters["route"].string_param == "local"
    assert ids == set(sent)


def test_a_caller_that_leaves_mid_stream_leaves_nothing_behind(
    daemon: Daemon, triton: grpcclient.InferenceServerClient
) -> None:
    """The stream's pending requests are cancelled with it: no error logged, nothing in
    flight, and the next stream is served."""
    logged = daemon.log.stat().st_size
    text = grpcclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"how hot is the gpu"], object))
    for _ in range(3):
        triton.start_stream(callback=lambda result, error: None)
        for i in range(50):
            triton.async_stream_infer("intent", [text], request_id=str(i))
        triton.stop_stream(cancel_requests=True)
    status = daemon.client.call("GET", "/v1/status")
    deadline = time.monotonic() + 10
    while status["inflight"] > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        status = daemon.client.call("GET", "/v1/status")
    assert status["inflight"] == 1  # this status call
    tail = daemon.log.read_bytes()[logged:].decode(errors="replace")
    assert '"log.level":"error"' not in tail, tail[-2000:]
    answers: list[Any] = []
    triton.start_stream(callback=lambda result, error: answers.append((result, error)))
    triton.async_stream_infer("intent", [text], request_id="after")
    triton.stop_stream()  # waits for the answers of what was sent
    [(result, error)] = answers
    assert error is None and list(result.as_numpy("intent")) == [b"device-status"]


def test_a_decoupled_model_answers_each_speech_segment_on_the_stream(
    daemon: Daemon, triton: grpcclient.InferenceServerClient
) -> None:
    """vad-segments (decoupled): one response per speech segment, the segments the unary vad
    model finds in the same audio, each flagged not final; its end an empty final response
    when asked for (Triton's enable_empty_final_response), nothing otherwise; zero segments
    give zero responses; a non-decoupled model on the same stream answers once, final; bad
    audio is answered with its error and the stream goes on; unary calls are refused."""
    import queue

    phrases = ["Turn on the lights.", "What is the weather tomorrow?", "Stop the music."]
    pause = np.zeros(16000, np.float32)
    pcm = np.concatenate([pause] + [part for p in phrases for part in (espeak(p), pause)])
    wav = wav_bytes(pcm)
    expected = [[s["start"], s["end"]] for s in daemon.client.vad(wav)]
    assert len(expected) >= len(phrases)

    def audio(blob: bytes) -> list[grpcclient.InferInput]:
        tensor = grpcclient.InferInput("audio", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([blob], object))
        return [tensor]

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    text = grpcclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"how hot is the gpu"], object))
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        triton.async_stream_infer("vad-segments", audio(wav), request_id="speech")
        triton.async_stream_infer(
            "vad-segments", audio(wav), request_id="speech-end", enable_empty_final_response=True
        )
        triton.async_stream_infer(
            "vad-segments",
            audio(wav_bytes(pause)),
            request_id="quiet",
            enable_empty_final_response=True,
        )
        triton.async_stream_infer("vad-segments", audio(b"RIFF not a wav"), request_id="bad")
        triton.async_stream_infer("intent", [text], request_id="intent")
    finally:
        triton.stop_stream()  # waits for every answer of what was sent
    by_id: dict[str, list[tuple[Any, Any]]] = {}
    while not answers.empty():
        result, error = answers.get()
        key = "bad" if error is not None else result.get_response().id
        by_id.setdefault(key, []).append((result, error))
    assert sorted(by_id) == ["bad", "intent", "quiet", "speech", "speech-end"]

    def final(result: Any) -> bool:
        return bool(result.get_response().parameters["triton_final_response"].bool_param)

    for key in ("speech", "speech-end"):
        rows = [result for result, _ in by_id[key]]
        segments = [r.as_numpy("segments") for r in rows if r.get_response().outputs]
        assert [s.shape for s in segments] == [(1, 2)] * len(expected)
        np.testing.assert_allclose(np.concatenate(segments), expected, atol=1e-6)
        for r in rows[: len(expected)]:
            response = r.get_response()
            assert not final(r) and response.model_name == "vad-segments"
            assert response.model_version == "1"
            assert response.parameters["route"].string_param == "local"
    assert len(by_id["speech"]) == len(expected)  # no empty final unless asked for
    [*_, (end, _)] = by_id["speech-end"]
    assert len(by_id["speech-end"]) == len(expected) + 1
    assert final(end) and not end.get_response().outputs
    [(quiet, _)] = by_id["quiet"]  # no speech: no segment, only the end asked for
    assert final(quiet) and not quiet.get_response().outputs
    [(_, error)] = by_id["bad"]
    assert "not a WAV file" in str(error)
    [(intent, _)] = by_id["intent"]
    assert final(intent) and list(intent.as_numpy("intent")) == [b"device-status"]

    with pytest.raises(InferenceServerException) as refused:
        triton.infer("vad-segments", audio(wav))
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "decoupled" in str(refused.value) and "ModelStreamInfer" in str(refused.value)
    body = {"inputs": [{"name": "audio", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    status, _, answer = daemon.client.request(
        "POST", "/v2/models/vad-segments/infer", json.dumps(body).encode()
    )
    assert status == 400 and "ModelStreamInfer" in json.loads(answer)["error"]


def test_live_audio_in_a_sequence_gives_the_whole_files_segments(
    daemon: Daemon, triton: grpcclient.InferenceServerClient
) -> None:
    """vad-live (stateful, decoupled): audio sent as it is captured, in chunks of uneven
    length (one sequence per stream of audio), gives the segments that vad finds in the whole
    file, in order, the last ones at sequence_end; two sequences interleaved on one stream
    keep their own state; a chunk of a sequence never started, a chunk in the wrong datatype
    and a chunk over max_chunk_seconds are each refused with their reason, and the stream and
    its sequences go on; unary calls are refused."""
    import queue

    phrases = ["Turn on the lights.", "What is the weather tomorrow?"]
    pause = np.zeros(16000, np.float32)
    pcm = np.concatenate([pause] + [part for p in phrases for part in (espeak(p), pause)])
    pcm16 = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
    expected = [[s["start"], s["end"]] for s in daemon.client.vad(wav_bytes(pcm))]
    assert len(expected) >= len(phrases)
    rng = np.random.default_rng(7)
    n = len(pcm16)
    cuts = np.concatenate(
        [
            rng.choice(np.arange(1, n // 4), size=20, replace=False),
            rng.choice(np.arange(3 * n // 4, n), size=20, replace=False),
        ]
    )
    # 41 chunks, from a few samples to half the audio (over 64 KiB, decoded in a thread: the
    # chunks after it must still wait for it)
    chunks = np.split(pcm16, np.sort(cuts))

    def chunk(samples: np.ndarray, datatype: str = "INT16") -> list[grpcclient.InferInput]:
        tensor = grpcclient.InferInput("pcm", [len(samples)], datatype)
        tensor.set_data_from_numpy(samples)
        return [tensor]

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, part in enumerate(chunks):
            for sequence in (11, "second"):  # the same audio twice, interleaved
                triton.async_stream_infer(
                    "vad-live",
                    chunk(part),
                    request_id=f"{sequence}-{i}",
                    sequence_id=sequence,
                    sequence_start=i == 0,
                    sequence_end=i == len(chunks) - 1,
                )
            if i == 3:
                triton.async_stream_infer(
                    "vad-live", chunk(part), request_id="stray", sequence_id=99
                )
                triton.async_stream_infer(
                    "vad-live",
                    chunk(part.astype(np.float32), "FP32"),
                    request_id="float",
                    sequence_id=11,
                )
                triton.async_stream_infer(
                    "vad-live",
                    chunk(np.zeros(16000 * 11, np.int16)),
                    request_id="long",
                    sequence_id=11,
                )
    finally:
        triton.stop_stream()
    segments: dict[str, list[list[float]]] = {"11": [], "second": []}
    errors = []
    while not answers.empty():
        result, error = answers.get()
        if error is not None:
            errors.append(str(error))
            continue
        response = result.get_response()
        assert response.model_name == "vad-live"
        assert not response.parameters["triton_final_response"].bool_param
        segments[response.id.split("-")[0]] += result.as_numpy("segments").tolist()
    for found in segments.values():
        np.testing.assert_allclose(found, expected, atol=1e-6)
    assert len(errors) == 3, errors
    assert any("sequence 99 is not open on this stream" in e for e in errors), errors
    assert any("pcm" in e and "INT16" in e for e in errors), errors
    assert any("at most 160000" in e for e in errors), errors

    with pytest.raises(InferenceServerException) as refused:
        triton.infer("vad-live", chunk(chunks[0]))
    assert "ModelStreamInfer" in str(refused.value)
