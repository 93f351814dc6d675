"""What a program on the device does, run inside the field tree by the package's own Python
(/usr/lib/edged/bin/python) as the user the test names: one JSON object on stdout.

    probe.py rest N     N fresh connections to the REST socket, each one call (/v2/health/live)
    probe.py grpc N     N fresh tritonclient gRPC channels, each one ServerLive
    probe.py admin      GET /v1/admin/routing: the status it gets (200, 403, or 0: no access)
    probe.py infer      the intent and embedding models over REST, text-embedding over gRPC
    probe.py missing    an inference with a request id for a model that does not exist

Only what the package ships is imported: edged's client, tritonclient, numpy.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

REST = "/run/edged/edged.sock"
GRPC = "/run/edged/edged-grpc.sock"


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
    doc = {"id": request_id, "inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                         "data": [0.0]}]}  # fmt: skip
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
    return {"answers": answers, "seconds": timings}


def main() -> None:
    kind = sys.argv[1]
    if kind in ("rest", "grpc"):
        found = {"rest": rest, "grpc": grpc}[kind](int(sys.argv[2]))
    else:
        found = {"admin": admin, "infer": infer, "missing": missing}[kind]()
    print(json.dumps(found))


if __name__ == "__main__":
    main()
