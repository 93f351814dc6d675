#!/usr/bin/env python3
"""Triton Inference Server itself, as the cloud in the tests and a peer in benchmarks.

PyPI's ``nvidia-pytriton`` 0.7.0 wheel bundles ``tritonserver`` 2.51.0 (HTTP and gRPC
frontends, the python backend, the statistics, shared-memory, repository and binary-tensor
extensions). Its python-backend stub links the system's ``libpython3.X``, so the venv
(``.bench-venv/triton``) is made from Debian's (or Ubuntu's) own ``/usr/bin/python3``, never
pyenv's: from pyenv's 3.11.7 the stub fails at model load (``'_thread.RLock' object has no
attribute '_recursion_count'``). The stub for that Python is copied where the backend looks
for it (the wheel keeps one per Python version beside it).

Each model is the ONNX file of our repository served by Triton's python backend running ONNX
Runtime (CPU), behind Triton's own dynamic batcher; its config.pbtxt is ours, read and written
with Triton's protobuf schema (``tritonclient``'s ``model_config_pb2``), the platform turned
into ``backend: "python"``. What the tests need of a cloud, as bench/peer.py's MLServer runtime
gives it: a journal (a line per request seen) and faults read from a JSON file at each call
(``fail_every``, ``status``, ``delay_s``, ``flatten``, ``models``).

    .venv/bin/python bench/triton_peer.py     # smoke: install, serve intent-classifier, call it
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from google.protobuf import text_format  # noqa: E402
from tritonclient.grpc import model_config_pb2 as pb  # noqa: E402

from bench.peer import Peer, _status, ensure_venv, free_port  # noqa: E402

VENV = ROOT / ".bench-venv" / "triton"
SYSTEM_PYTHON = Path("/usr/bin/python3")  # the python backend's stub links its libpython
PACKAGES = ("nvidia-pytriton==0.7.0", "onnxruntime==1.32.0", "numpy", "pocketsphinx==5.1.1")
STAMP = ".triton-installed"

# The python backend's model: ONNX Runtime on the version's model.onnx; the journal and the
# faults as bench/peer.py's MLServer runtime has them. Faults map to Triton's error codes
# (what Triton's HTTP frontend turns into a status: UNAVAILABLE 503, INVALID_ARG 400, the rest
# INTERNAL 500; Triton has no code for 429).
MODEL_PY = """\
import json
import os
import sys
import time

sys.path.insert(0, {site!r})  # the venv's packages: the stub runs the system's interpreter

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

JOURNAL, FAULTS = {journal!r}, {faults!r}
CODES = {{503: "UNAVAILABLE", 400: "INVALID_ARG", 404: "NOT_FOUND", 409: "ALREADY_EXISTS"}}


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        here = os.path.join(args["model_repository"], args["model_version"])
        options = ort.SessionOptions()  # threads that do not spin, as edged's sessions
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            os.path.join(here, "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.calls = 0

    def faults(self):
        if not FAULTS or not os.path.exists(FAULTS):
            return {{}}
        with open(FAULTS) as f:
            faults = json.load(f)
        return faults if self.name in faults.get("models", [self.name]) else {{}}

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {{n: pb_utils.get_input_tensor_by_name(request, n).as_numpy()
                      for n in self.inputs}}
            if JOURNAL:
                head = next(iter(feeds.values())).ravel()[:4].tolist()
                line = {{"id": request.request_id(), "model": self.name, "head": head,
                         "t": time.time(), "server": "triton"}}
                with open(JOURNAL, "a") as f:
                    f.write(json.dumps(line) + "\\n")
            faults = self.faults()
            if faults:
                self.calls += 1
                time.sleep(faults.get("delay_s", 0))
                every = faults.get("fail_every", 0)
                if every and self.calls % every == 0:
                    code = CODES.get(faults.get("status", 500), "INTERNAL")
                    code = getattr(pb_utils.TritonError, code)
                    error = pb_utils.TritonError("injected fault", code)
                    responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                    continue
            results = self.session.run(self.outputs, feeds)
            if faults.get("flatten"):
                results = [np.full_like(r, 1 / r.shape[-1]) if r.dtype.kind == "f" else r
                           for r in results]
            tensors = [pb_utils.Tensor(n, np.asarray(r)) for n, r in zip(self.outputs, results)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
"""


# The tests' question-answering and speech models (bench/peer.py's ANSWER_RUNTIME and
# SPEECH_RUNTIME, the same logic) as python-backend models: a passage's sentence that shares the
# most words with the question; pocketsphinx's open-vocabulary English recogniser.
PRELUDE = """\
import io
import json
import re
import sys
import wave

sys.path.insert(0, {site!r})

import numpy as np
import triton_python_backend_utils as pb_utils

JOURNAL = {journal!r}


def journal(line):
    if JOURNAL:
        with open(JOURNAL, "a") as f:
            f.write(json.dumps({{**line, "server": "triton"}}) + "\\n")


def text(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    values = [] if tensor is None else tensor.as_numpy().ravel().tolist()
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def strings(name, values):
    return pb_utils.Tensor(name, np.array([v.encode() for v in values], dtype=np.object_))
"""
ANSWER_PY = """
WORD = re.compile(r"[a-z0-9]+")
SENTENCE = re.compile(r"(?<=[.!?])\\s+")
COMMON = set("a an and are as at be by do does for from how i in is it my of on or the to what"
             " when where which who why with you your".split())


def words(text):
    return {{w for w in WORD.findall(text.lower()) if w not in COMMON}}


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            question, context = text(request, "question")[0], text(request, "context")
            journal({{"id": request.request_id(), "model": self.name, "question": question,
                      "context": context}})
            asked = words(question)
            sentences = [s for p in context for s in SENTENCE.split(p) if s.strip()]
            best = max(sentences, key=lambda s: len(asked & words(s)), default="")
            answer = strings("answer", [best or "I do not know."])
            responses.append(pb_utils.InferenceResponse(output_tensors=[answer]))
        return responses
"""
SPEECH_PY = """
from pocketsphinx import Decoder


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        self.decoder = Decoder(loglevel="FATAL")  # its default: US English, open vocabulary

    def hear(self, data):
        try:
            with wave.open(io.BytesIO(data)) as wav:
                shape = (wav.getframerate(), wav.getnchannels(), wav.getsampwidth())
                samples = wav.readframes(wav.getnframes())
        except (wave.Error, EOFError) as exc:
            raise ValueError(f"audio: not a WAV file: {{exc}}") from None
        if shape != (16000, 1, 2):
            raise ValueError(f"audio: 16 kHz mono 16-bit only, not {{shape}}")
        self.decoder.start_utt()
        self.decoder.process_raw(samples, False, True)
        self.decoder.end_utt()
        hypothesis = self.decoder.hyp()
        return " ".join(hypothesis.hypstr.split()) if hypothesis is not None else ""

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "audio").as_numpy().ravel()[0]
            data = bytes(data)
            journal({{"id": request.request_id(), "model": self.name, "audio_bytes": len(data)}})
            try:
                heard = self.hear(data)
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            sure = pb_utils.Tensor("confidence", np.array([1.0 if heard else 0.0], np.float32))
            outputs = [strings("text", [heard]), sure]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
"""
ANSWER_CONFIG = """
backend: "python"
max_batch_size: 0
input [
  { name: "question" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "context" data_type: TYPE_STRING dims: [ -1 ] optional: true }
]
output [ { name: "answer" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
SPEECH_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "audio" data_type: TYPE_STRING dims: [ 1 ] } ]
output [
  { name: "text" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "confidence" data_type: TYPE_FP32 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""


def server_dir(venv: Path) -> Path:
    """The wheel's ``tritonserver`` directory (bin/, backends/, the stubs) in ``venv``."""
    found = sorted(venv.glob("lib/python3.*/site-packages/pytriton/tritonserver"))
    if not found:
        raise RuntimeError(f"no pytriton in {venv}")
    return found[0]


def ensure_triton(path: Path = VENV, python: Path = SYSTEM_PYTHON) -> Path:
    """The venv with Triton (made from ``python``, the system's; bench/peer.py's
    ``ensure_venv``), with the python backend's stub for its Python in place."""
    if not python.exists():
        raise RuntimeError(f"{python} is missing: Triton's python backend needs the system's")
    ensure_venv(path, PACKAGES, python, STAMP)
    server = server_dir(path)
    version = server.parents[2].name.removeprefix("python")  # lib/python3.X/site-packages
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    placed = server / "backends" / "python" / stub.name
    if not placed.exists():
        if not stub.exists():
            raise RuntimeError(f"the wheel has no python-backend stub for Python {version}")
        # beside the backend, at the depth its $ORIGIN run path expects (the wheel's libraries)
        shutil.copy2(stub, placed)
    return path


def write_model(
    repository: Path,
    name: str,
    source: Path,
    site: Path,
    journal: Path | None = None,
    faults: Path | None = None,
) -> Path:
    """``source`` (a model of our repository: config.pbtxt, labels, its newest version's
    model.onnx) as Triton's python-backend model ``name`` in ``repository``."""
    config = text_format.Parse((source / "config.pbtxt").read_text(), pb.ModelConfig())
    config.name, config.platform, config.backend = name, "", "python"
    del config.instance_group[:]
    config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)
    versions = sorted(
        int(d.name) for d in source.iterdir() if d.name.isdigit() and (d / "model.onnx").exists()
    )
    if not versions:
        raise RuntimeError(f"{source} has no version with a model.onnx")
    model = repository / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(text_format.MessageToString(config))
    for labels in {o.label_filename for o in config.output if o.label_filename}:
        shutil.copy2(source / str(versions[-1]) / labels, model / labels)
    (model / "1" / "model.onnx").symlink_to((source / str(versions[-1]) / "model.onnx").resolve())
    source_code = MODEL_PY.format(
        site=str(site),
        journal=str(journal) if journal else None,
        faults=str(faults) if faults else None,
    )
    (model / "1" / "model.py").write_text(source_code)
    return model


def write_python_model(
    repository: Path, name: str, config: str, source: str, site: Path, journal: Path | None
) -> None:
    """A python-backend model of ours (``config`` without its name, ``source`` after the
    shared prelude)."""
    model = repository / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(f'name: "{name}"' + config)
    prelude = PRELUDE.format(site=str(site), journal=str(journal) if journal else None)
    (model / "1" / "model.py").write_text(prelude + source.format())


def start_triton(
    venv: Path,
    models: dict[str, Path],
    workdir: Path,
    *,
    journal: Path | None = None,
    faults: Path | None = None,
    answer_model: str | None = None,
    speech_model: str | None = None,
    timeout: float = 120.0,
) -> Peer:
    """``tritonserver`` on loopback (HTTP and gRPC on free ports, no metrics port) serving
    ``models`` (name -> a model directory of our repository), and the question-answering and
    speech models under the names given; ready when it returns."""
    server = server_dir(venv)
    site = server.parents[1]
    repository = workdir / "repository"
    repository.mkdir(parents=True)
    for name, source in models.items():
        write_model(repository, name, source, site, journal, faults)
    for name, config, code in (
        (answer_model, ANSWER_CONFIG, ANSWER_PY),
        (speech_model, SPEECH_CONFIG, SPEECH_PY),
    ):
        if name is not None:
            write_python_model(repository, name, config, code, site, journal)
    http_port, grpc_port = free_port(), free_port()
    log = workdir / "tritonserver.log"
    argv = [
        str(server / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={server / 'backends'}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--allow-metrics=false",
        "--exit-timeout-secs=5",
        "--log-verbose=0",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    peer = Peer(proc, "triton", f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log)
    deadline = time.monotonic() + timeout
    while _status(f"127.0.0.1:{http_port}", "/v2/health/ready") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            peer.stop()
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"tritonserver did not become ready:\n{tail}")
        time.sleep(0.2)
    return peer


def metadata(peer: Peer) -> dict[str, object]:
    """Triton's server metadata (``GET /v2``): its name, version and extensions."""
    conn = http.client.HTTPConnection(peer.http_url.removeprefix("http://"), timeout=5)
    try:
        conn.request("GET", "/v2")
        doc: dict[str, object] = json.loads(conn.getresponse().read())
        return doc
    finally:
        conn.close()


def smoke() -> None:
    import tempfile

    venv = ensure_triton()
    with tempfile.TemporaryDirectory() as work:
        peer = start_triton(
            venv, {"intent-classifier": ROOT / "models" / "intent-classifier"}, Path(work)
        )
        try:
            meta = metadata(peer)
            print(f"{meta['name']} {meta['version']} at {peer.http_url} and {peer.grpc_url}")
            body = {
                "inputs": [
                    {
                        "name": "embedding",
                        "shape": [1, 384],
                        "datatype": "FP32",
                        "data": [0.01] * 384,
                    }
                ]
            }
            conn = http.client.HTTPConnection(peer.http_url.removeprefix("http://"), timeout=10)
            conn.request(
                "POST",
                "/v2/models/intent-classifier/infer",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            print(conn.getresponse().read()[:200].decode())
        finally:
            peer.stop()


if __name__ == "__main__":
    smoke()
