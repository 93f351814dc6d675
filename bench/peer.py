#!/usr/bin/env python3
"""MLServer (Seldon) as a peer Open Inference Protocol (KServe v2) server for benchmarks.

MLServer lives in its own virtualenv (``.bench-venv/mlserver``) and serves one ONNX file through
a small custom runtime (``onnxruntime.InferenceSession``, CPU provider, default session options).
Everything binds to 127.0.0.1: REST and gRPC on free ports; metrics server, Prometheus middleware
and gzip are off; ``parallel_workers: 0`` (inference runs in the server process, no worker pool);
adaptive batching off unless asked (``max_batch_size``/``max_batch_time`` in model-settings.json).
MLServer's REST side speaks JSON only: it does not accept the binary tensor extension.

    .venv/bin/python bench/peer.py        # smoke: install, serve text-encoder, check, time
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".bench-venv" / "mlserver"
PACKAGES = ("mlserver==1.7.1", "onnxruntime==1.32.0", "numpy", "pocketsphinx==5.1.1")
STAMP = ".peer-installed"

RUNTIME = """\
import asyncio
import json
import os
import time

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxPeerModel(MLModel):
    async def load(self) -> bool:
        path = await get_model_uri(self.settings)
        extra = self.settings.parameters.extra or {}
        options = ort.SessionOptions()
        for key, value in extra.get("session", {}).items():
            options.add_session_config_entry(key, value)  # none by default
        self._session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self._names = [o.name for o in self._session.get_outputs()]
        self._journal = extra.get("journal")  # a line per request seen: {id, model, head}
        # {"fail_every": N, "status": 500, "delay_s": 0, "flatten": false, "models": [...]}: one
        # call in N fails, every call waits delay_s first, "flatten": its outputs turn uniform
        # (an unsure classifier); "models": only these (default: every model)
        self._faults = extra.get("faults")
        self._calls = 0
        return True

    async def _fault(self) -> dict:
        if not self._faults or not os.path.exists(self._faults):
            return {}
        with open(self._faults) as f:
            faults = json.load(f)
        if self.name not in faults.get("models", [self.name]):
            return {}
        self._calls += 1
        await asyncio.sleep(faults.get("delay_s", 0))
        every = faults.get("fail_every", 0)
        if every and self._calls % every == 0:
            raise MLServerError("injected fault", status_code=faults.get("status", 500))
        return faults

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        if self._journal:
            first = next(iter(feeds.values())).ravel()
            line = {"id": payload.id, "model": self.name, "head": first[:4].tolist(),
                    "t": time.time()}
            with open(self._journal, "a") as f:
                f.write(json.dumps(line) + "\\n")
        faults = await self._fault()
        names = [o.name for o in payload.outputs] if payload.outputs else self._names
        results = self._session.run(names, feeds)
        if faults.get("flatten"):
            results = [np.full_like(r, 1 / r.shape[-1]) if r.dtype.kind == "f" else r
                       for r in results]
        outputs = [NumpyCodec.encode_output(n, np.asarray(r)) for n, r in zip(names, results)]
        for out, r in zip(outputs, results):
            out.shape = list(np.shape(r))  # the codec would turn a 1-D [N] into [N, 1]
        return InferenceResponse(
            model_name=self.name, model_version=self.version, id=payload.id, outputs=outputs
        )
"""

# A question-answering model for the knowledge base's escalations (docs/API.md, "ask"): inputs
# ``question`` (BYTES [1]) and ``context`` (BYTES [n], the retrieved passages), output
# ``answer`` (BYTES [1]). It is a small extractive reader: the passage sentence that shares the
# most words with the question. It stands for a large answer model in the cloud; the tests
# check what reaches it (the journal keeps each question and its passages whole).
ANSWER_RUNTIME = """\
import json
import re

from mlserver import MLModel
from mlserver.codecs import StringCodec
from mlserver.types import InferenceRequest, InferenceResponse

WORD = re.compile(r"[a-z0-9]+")
SENTENCE = re.compile(r"(?<=[.!?])\\s+")
COMMON = set("a an and are as at be by do does for from how i in is it my of on or the to what"
             " when where which who why with you your".split())


def words(text):
    return {w for w in WORD.findall(text.lower()) if w not in COMMON}


class AnswerModel(MLModel):
    async def load(self) -> bool:
        self._journal = (self.settings.parameters.extra or {}).get("journal")
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        given = {i.name: StringCodec.decode_input(i) for i in payload.inputs}
        question, context = given["question"][0], given.get("context", [])
        if self._journal:
            line = {"id": payload.id, "model": self.name, "question": question,
                    "context": context}
            with open(self._journal, "a") as f:
                f.write(json.dumps(line) + "\\n")
        asked = words(question)
        sentences = [s for passage in context for s in SENTENCE.split(passage) if s.strip()]
        best = max(sentences, key=lambda s: len(asked & words(s)), default="")
        answer = best or "I do not know."
        output = StringCodec.encode_output("answer", [answer])
        output.shape = [1]
        return InferenceResponse(model_name=self.name, id=payload.id, outputs=[output])
"""

# An open-vocabulary speech recogniser for the device's transcript escalations (docs/VOICE.md):
# input ``audio`` (BYTES [1], a 16 kHz mono 16-bit WAV file), outputs ``text`` (BYTES [1]) and
# ``confidence`` (FP32 [1]: 1 when it heard words). pocketsphinx with its own English acoustic
# model, language model and dictionary (134,860 words), where the device's ``transcribe`` has
# only a grammar of its command phrases. The journal keeps each request's id and audio size.
SPEECH_RUNTIME = """\
import io
import json
import wave

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse
from pocketsphinx import Decoder


class SpeechModel(MLModel):
    async def load(self) -> bool:
        self._journal = (self.settings.parameters.extra or {}).get("journal")
        self._decoder = Decoder(loglevel="FATAL")  # its default: US English, open vocabulary
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        (audio,) = [i for i in payload.inputs if i.name == "audio"]
        data = list(audio.data)[0]
        data = data.encode("latin-1") if isinstance(data, str) else bytes(data)
        if self._journal:
            line = {"id": payload.id, "model": self.name, "audio_bytes": len(data)}
            with open(self._journal, "a") as f:
                f.write(json.dumps(line) + "\\n")
        try:
            with wave.open(io.BytesIO(data)) as wav:
                shape = (wav.getframerate(), wav.getnchannels(), wav.getsampwidth())
                samples = wav.readframes(wav.getnframes())
        except (wave.Error, EOFError) as exc:
            raise MLServerError(f"audio: not a WAV file: {exc}", status_code=400) from None
        if shape != (16000, 1, 2):
            raise MLServerError(f"audio: 16 kHz mono 16-bit only, not {shape}", status_code=400)
        self._decoder.start_utt()
        self._decoder.process_raw(samples, False, True)
        self._decoder.end_utt()
        hypothesis = self._decoder.hyp()
        text = " ".join(hypothesis.hypstr.split()) if hypothesis is not None else ""
        text_out = StringCodec.encode_output("text", [text])
        text_out.shape = [1]
        sure = NumpyCodec.encode_output("confidence", np.array([1.0 if text else 0.0], np.float32))
        sure.shape = [1]
        return InferenceResponse(model_name=self.name, id=payload.id, outputs=[text_out, sure])
"""


def ensure_venv(
    path: Path = DEFAULT_VENV,
    packages: tuple[str, ...] = PACKAGES,
    python: Path = Path(sys.executable),
    stamp_name: str = STAMP,
) -> Path:
    """Create ``path`` (a venv of ``python``) with ``packages``; skipped when its stamp lists
    them all."""
    stamp = path / stamp_name
    if stamp.exists() and all(p in stamp.read_text() for p in packages):
        return path
    subprocess.run([str(python), "-m", "venv", "--clear", str(path)], check=True)
    log = path / "pip-install.log"
    with log.open("wb") as out:
        rc = subprocess.call(
            [str(path / "bin" / "pip"), "install", "--quiet", *packages], stdout=out, stderr=out
        )
    if rc != 0:
        sys.stderr.write(log.read_text(errors="replace")[-4000:])
        raise RuntimeError(f"pip install into {path} failed (rc={rc}); log: {log}")
    freeze = subprocess.run(
        [str(path / "bin" / "pip"), "freeze"], check=True, capture_output=True, text=True
    ).stdout
    stamp.write_text(freeze)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Peer:
    proc: subprocess.Popen[bytes]
    name: str
    http_url: str  # http://127.0.0.1:PORT
    grpc_url: str  # 127.0.0.1:PORT (host:port, as gRPC clients take it)
    log: Path

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM by PID (MLServer shuts down gracefully), SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _status(hostport: str, path: str) -> int:
    conn = http.client.HTTPConnection(hostport, timeout=2)  # no proxy env, unlike urllib
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def start_peer(
    venv: Path,
    onnx_file: Path,
    name: str,
    workdir: Path,
    *,
    timeout: float = 120.0,
    max_batch_size: int = 0,
    max_batch_time: float = 0.0,
    session_config: dict[str, str] | None = None,
    more_models: dict[str, Path] | None = None,
    journal: Path | None = None,
    faults: Path | None = None,
    answer_model: str | None = None,
    speech_model: str | None = None,
) -> Peer:
    """Write settings + runtime under ``workdir``, start ``mlserver start`` and wait until ready.

    Adaptive batching is on only with ``max_batch_size > 1`` and ``max_batch_time > 0`` (seconds);
    it concatenates requests along axis 0, so concurrent requests must share all other dims.
    ``session_config``: ORT session config entries, e.g. {"session.intra_op.allow_spinning": "0"}.
    ``more_models``: other ONNX files to serve, by name. ``journal``: a file where the server
    writes a line per request it sees (the tests check there what reached the cloud);
    ``faults``: a JSON file read at each call, ``{"fail_every": N, "status": 503}`` fails one call
    in N with that status (500 by default); ``"delay_s"`` delays every call, ``"flatten"`` makes
    float outputs uniform (an unsure classifier), ``"models"`` limits the faults to those
    models. ``answer_model``: also serve the extractive
    question-answering model (``ANSWER_RUNTIME``) under that name; ``speech_model``: the
    open-vocabulary recogniser (``SPEECH_RUNTIME``).
    """
    extra: dict[str, Any] = {"session": session_config or {}}
    if journal is not None:
        extra["journal"] = str(journal)
    if faults is not None:
        extra["faults"] = str(faults)
    for model, path in {name: Path(onnx_file), **(more_models or {})}.items():
        write_model(
            workdir / model,
            RUNTIME,
            "peer_onnx_runtime.OnnxPeerModel",
            {"uri": str(path.resolve()), "extra": extra},
            max_batch_size=max_batch_size,
            max_batch_time=max_batch_time,
        )
    if answer_model is not None:
        answer_extra = {"journal": str(journal)} if journal else {}
        write_model(
            workdir / answer_model,
            ANSWER_RUNTIME,
            "peer_answer_runtime.AnswerModel",
            {"extra": answer_extra},
        )
    if speech_model is not None:
        write_model(
            workdir / speech_model,
            SPEECH_RUNTIME,
            "peer_speech_runtime.SpeechModel",
            {"extra": {"journal": str(journal)} if journal else {}},
        )
    http_port, grpc_port = free_port(), free_port()
    settings = {
        "host": "127.0.0.1",  # REST, gRPC and metrics servers all bind to this
        "http_port": http_port,
        "grpc_port": grpc_port,  # gRPC cannot be switched off in MLServer; loopback only
        "parallel_workers": 0,  # no inference worker pool: models run in the main process
        "metrics_endpoint": None,  # no metrics server, no Prometheus middleware/interceptor
        "debug": False,  # no per-request access log
        "gzip_enabled": False,  # REST responses uncompressed, like a plain v2 server
    }
    (workdir / "settings.json").write_text(json.dumps(settings, indent=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLSERVER")}
    log = workdir / "mlserver.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "mlserver"), "start", str(workdir)],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    hp = f"127.0.0.1:{http_port}"
    peer = Peer(proc, name, f"http://{hp}", f"127.0.0.1:{grpc_port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        names = [name, *(more_models or {}), *[m for m in (answer_model, speech_model) if m]]
        if _status(hp, "/v2/health/ready") == 200 and all(
            _status(hp, f"/v2/models/{m}/ready") == 200 for m in names
        ):
            return peer
        time.sleep(0.2)
    peer.stop()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    raise RuntimeError(f"MLServer not ready (rc={proc.returncode}); log tail:\n{tail}")


def write_model(
    model_dir: Path, runtime: str, implementation: str, parameters: dict[str, Any], **more: Any
) -> None:
    """An MLServer model folder: the runtime's source (module named by ``implementation``) and
    its model-settings.json."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / f"{implementation.split('.')[0]}.py").write_text(runtime)
    settings = {
        "name": model_dir.name,
        "implementation": implementation,
        "parameters": parameters,
        **more,
    }
    (model_dir / "model-settings.json").write_text(json.dumps(settings, indent=2))


def infer_json(
    conn: http.client.HTTPConnection, name: str, inputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """One v2 REST JSON inference over a kept-alive connection; outputs by name."""
    ins = [
        {
            "name": k,
            "shape": list(v.shape),
            "datatype": _DT[v.dtype.str[1:]],
            "data": v.ravel().tolist(),
        }
        for k, v in inputs.items()
    ]
    conn.request("POST", f"/v2/models/{name}/infer", json.dumps({"inputs": ins}), _JSON)
    resp = conn.getresponse()
    raw = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {raw[:300]!r}")
    outs = json.loads(raw)["outputs"]
    return {
        o["name"]: np.asarray(o["data"], _NP.get(o["datatype"], object)).reshape(o["shape"])
        for o in outs
    }


_JSON = {"Content-Type": "application/json"}
_DT = {"i8": "INT64", "i4": "INT32", "f4": "FP32", "f8": "FP64"}
_NP = {v: k for k, v in _DT.items()}


def _median_ms(fn: Callable[[], object], runs: int = 50) -> float:
    sys.path.insert(0, str(ROOT))  # run as a script: make `bench` importable
    from bench.serving import timed

    return statistics.median(timed(fn, runs)) * 1000


def smoke() -> None:
    """Serve models/text-encoder, check REST JSON / tritonclient http+grpc against in-process."""
    import onnxruntime as ort
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    onnx_file = ROOT / "models" / "text-encoder" / "1" / "model.onnx"
    if not onnx_file.exists():
        subprocess.run(["make", "models"], cwd=ROOT, check=True)
    t = time.perf_counter()
    venv = ensure_venv(DEFAULT_VENV)
    pins = [
        p for p in (venv / STAMP).read_text().split() if p.startswith(("mlserver", "onnx", "num"))
    ]
    print(f"venv ready in {time.perf_counter() - t:.1f} s: {pins}")
    t = time.perf_counter()
    peer = start_peer(venv, onnx_file, "text-encoder", Path("/tmp/peer/smoke"))
    print(f"ready in {time.perf_counter() - t:.1f} s: {peer.http_url} grpc {peer.grpc_url}")
    try:
        ids = np.random.default_rng(0).integers(1000, 2000, size=(1, 8), dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": ids * 0 + 1, "token_type_ids": ids * 0}
        ref = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
        want = ref.run(["embedding"], feeds)[0]
        conn = http.client.HTTPConnection(peer.http_url.removeprefix("http://"))
        got = infer_json(conn, peer.name, feeds)["embedding"]
        print(f"REST JSON: shape {got.shape}, max|diff| {np.abs(got - want).max():.2e}")
        assert got.shape == want.shape and np.allclose(got, want, atol=1e-5, rtol=0)
        hc = thttp.InferenceServerClient(peer.http_url.removeprefix("http://"))
        gc = tgrpc.InferenceServerClient(peer.grpc_url)

        def triton(mod: Any, client: Any, kw: dict[str, bool]) -> np.ndarray:
            ins = [mod.InferInput(k, list(v.shape), "INT64") for k, v in feeds.items()]
            for i, v in zip(ins, feeds.values()):
                i.set_data_from_numpy(v, **kw)
            outs = [mod.InferRequestedOutput("embedding", **kw)]
            return np.asarray(client.infer(peer.name, ins, outputs=outs).as_numpy("embedding"))

        for label, mod, client, kw in [
            ("tritonclient.http binary", thttp, hc, {"binary_data": True}),
            ("tritonclient.http JSON", thttp, hc, {"binary_data": False}),
            ("tritonclient.grpc", tgrpc, gc, {}),
        ]:
            try:
                d = np.abs(triton(mod, client, kw) - want).max()
                ms = _median_ms(partial(triton, mod, client, kw))
                print(f"{label}: OK, max|diff| {d:.2e}, p50 {ms:.2f} ms")
            except Exception as exc:  # report, keep going
                print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
        rest = _median_ms(lambda: infer_json(conn, peer.name, feeds))
        local = _median_ms(lambda: ref.run(["embedding"], feeds))
        print(f"REST JSON (http.client keep-alive) p50 {rest:.2f} ms; in-process {local:.2f} ms")
        conn.close()
        hc.close()
        gc.close()
    finally:
        peer.stop()
        print(f"stopped pid {peer.proc.pid}, rc={peer.proc.returncode}")


if __name__ == "__main__":
    smoke()
