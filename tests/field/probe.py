"""What a program on the device does, run inside the field tree by the package's own Python
(/usr/lib/edged/bin/python) as the user the test names: one JSON object on stdout.

    probe.py rest N     N fresh connections to the REST socket, each one call (/v2/health/live)
    probe.py grpc N     N fresh tritonclient gRPC channels, each one ServerLive
    probe.py admin      GET /v1/admin/routing: the status it gets (200, 403, or 0: no access)
    probe.py infer      the intent and embedding models over REST, text-embedding over gRPC,
                        the intent classifier reading a sealed memfd region (the region socket)
    probe.py missing    an inference with a request id for a model that does not exist
    probe.py versions MODEL   the model's versions (an admin call: active, serving, damaged...)
    probe.py records PREFIX N  N telemetry records to cloudsync's local API, ids PREFIX-0...,
                        in batches of 10, a batch retried (same ids) until it is stored
    probe.py api METHOD PATH [JSON]   a call to the fleet service's API on this box with the
                        token in /field/admin.token: {"status", "body"}

Only what the package ships is imported: edged's client, tritonclient, numpy.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

REST = "/run/edged/edged.sock"
GRPC = "/run/edged/edged-grpc.sock"
LOCAL = "/run/edged/cloudsync.sock"
FLEET_API = "http://127.0.0.1:8480"


def failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def rest(count: int) -> dict[str, Any]:
    from edged.client import Client

    answered, errors = 0, []
    for _ in range(count):
        try:
            answered += Client(REST, timeout=30).live()
        except Exception as exc:  # every failure is the finding: name it
            errors.append(failure(exc))
    return {"answered": answered, "errors": errors[:5], "failed": len(errors)}


def grpc(count: int) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient

    answered, errors = 0, []
    for _ in range(count):
        client = grpcclient.InferenceServerClient(url=f"unix://{GRPC}")
        try:
            answered += client.is_server_live()
        except Exception as exc:
            errors.append(failure(exc))
        finally:
            client.close()
    return {"answered": answered, "errors": errors[:5], "failed": len(errors)}


def admin() -> dict[str, Any]:
    from edged.client import Client, ClientError

    try:
        Client(REST, timeout=30).routing()
    except ClientError as exc:
        return {"status": exc.status, "message": exc.message}
    return {"status": 200}


def missing() -> dict[str, Any]:
    import secrets

    from edged.client import Client, ClientError

    request_id = f"field-{secrets.token_hex(4)}"
    doc = {
        "id": request_id,
        "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [0.0]}],
    }
    try:
        Client(REST, timeout=30).call("POST", "/v2/models/no-such-model/infer", doc)
    except ClientError as exc:
        return {"status": exc.status, "request_id": request_id, "message": exc.message}
    return {"status": 200, "request_id": request_id}


def infer() -> dict[str, Any]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    from edged.client import Client

    client = Client(REST, timeout=120)
    timings: dict[str, float] = {}
    answers: dict[str, Any] = {}

    def timed(name: str, call: Any) -> Any:
        started = time.monotonic()
        answer = call()
        timings[name] = round(time.monotonic() - started, 3)
        return answer

    intent = timed("intent", lambda: client.intent(["Scan this invoice and write me a report"]))
    answers["intent"] = intent[0]
    vector = timed("embed", lambda: client.embed(["the device answers locally"]))
    answers["embed"] = list(vector.shape)
    triton = grpcclient.InferenceServerClient(url=f"unix://{GRPC}")
    try:
        text = grpcclient.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"where did this run"], dtype=object))
        result = timed("grpc", lambda: triton.infer("text-embedding", [text]))
        answers["grpc"] = list(result.as_numpy("embedding").shape)
    finally:
        triton.close()
    # the embedding through a region edged made and reads in place; the answer written there
    embedding = vector[:1].astype(np.float32)
    direct = client.infer("intent-classifier", {"embedding": embedding})["probabilities"]
    with client.shared_region("field", embedding.nbytes + direct.nbytes) as region:
        region.array(embedding.shape, np.float32)[...] = embedding
        doc = {
            "inputs": [region.input("embedding", "FP32", embedding.shape, embedding.nbytes)],
            "outputs": [
                {
                    "name": "probabilities",
                    "parameters": {
                        "shared_memory_region": "field",
                        "shared_memory_byte_size": direct.nbytes,
                        "shared_memory_offset": embedding.nbytes,
                    },
                }
            ],
        }
        timed("region", lambda: client.infer_json("intent-classifier", doc))
        placed = region.array(direct.shape, np.float32, embedding.nbytes)
        answers["region"] = bool(np.allclose(placed, direct, atol=1e-6))
    return {"answers": answers, "seconds": timings}


def records(prefix: str, count: int) -> dict[str, Any]:
    from edged.client import Client, ClientError

    retries, started = 0, time.monotonic()
    for first in range(0, count, 10):
        batch = [
            {"kind": "telemetry", "id": f"{prefix}-{i}", "body": {"prefix": prefix, "i": i}}
            for i in range(first, min(first + 10, count))
        ]
        while True:
            try:
                stored = Client(LOCAL, timeout=30).call("POST", "/v1/records", {"records": batch})
                assert stored == {"stored": len(batch), "dropped": 0}, stored
                break
            except ClientError as exc:  # 0: cloudsync is restarting; 503: busy. Again
                if exc.status not in (0, 503):
                    raise
                retries += 1
                if time.monotonic() - started > 120:
                    raise
                time.sleep(0.2)
    return {"stored": count, "retries": retries}


def api(method: str, path: str, body: str | None) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    with open("/field/admin.token") as token:
        headers = {
            "Authorization": f"Bearer {token.read().strip()}",
            "Content-Type": "application/json",
        }
    request = urllib.request.Request(
        FLEET_API + path, body.encode() if body else None, headers, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return {"status": reply.status, "body": json.loads(reply.read() or b"null")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode(errors="replace")}
    except OSError as exc:
        return {"status": 0, "body": failure(exc)}


def main() -> None:
    kind = sys.argv[1]
    if kind in ("rest", "grpc"):
        found = {"rest": rest, "grpc": grpc}[kind](int(sys.argv[2]))
    elif kind == "versions":
        from edged.client import Client

        found = Client(REST, timeout=30).model_versions(sys.argv[2])
    elif kind == "records":
        found = records(sys.argv[2], int(sys.argv[3]))
    elif kind == "api":
        found = api(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
    else:
        found = {"admin": admin, "infer": infer, "missing": missing}[kind]()
    print(json.dumps(found))


if __name__ == "__main__":
    main()
