"""The data plane: every API operation, independent of the transport that carries it.

REST over the Unix socket is a thin adapter over this (and gRPC will be another).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from edged import __version__
from edged.errors import InvalidRequest, NotFound, Unavailable
from edged.models.repository import ModelManager, State
from edged.protocol.tensors import InferRequest, InferResponse, classify

EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_repository",
    "model_configuration",
    "edged_tasks",
]


def parse_version(version: str | None) -> int | None:
    """A version path segment as an integer (None: the newest ready version)."""
    if version is None or version == "":
        return None
    if not version.isdigit():
        raise InvalidRequest(f"model version must be a positive integer, got '{version}'")
    return int(version)


class DataPlane:
    """Health, metadata, inference, repository control and the task API."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager
        self.ready = False
        self.inflight = 0
        self.started = time.monotonic()

    # ---- health and metadata ---------------------------------------------------------------

    def server_metadata(self) -> dict[str, Any]:
        """GET /v2."""
        return {"name": "edged", "version": __version__, "extensions": EXTENSIONS}

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        """GET /v2/models/{m}[/versions/{v}]."""
        entry = self.manager.entry(name)
        wanted = parse_version(version)
        if wanted is not None and wanted not in entry.versions:
            raise NotFound(f"model '{name}' has no version {wanted}")
        if entry.config is None:
            raise Unavailable(f"model '{name}' is unavailable: {entry.error}")
        config = entry.config
        versions = [str(v) for v in (entry.ready_versions if wanted is None else [wanted])]
        meta: dict[str, Any] = {
            "name": name,
            "versions": versions,
            "platform": config.platform,
            "inputs": [t.metadata(config.max_batch_size) for t in config.inputs],
            "outputs": [t.metadata(config.max_batch_size) for t in config.outputs],
        }
        ready = entry.ready_versions if wanted is None else [wanted]
        if ready and entry.versions[ready[-1]].runtime is not None:
            runtime = entry.versions[ready[-1]].runtime
            assert runtime is not None
            meta["parameters"] = runtime.metadata()
        return meta

    def model_ready(self, name: str, version: str | None) -> bool:
        """GET /v2/models/{m}[/versions/{v}]/ready."""
        entry = self.manager.entry(name)
        wanted = parse_version(version)
        if wanted is None:
            return bool(entry.ready_versions)
        mv = entry.versions.get(wanted)
        if mv is None:
            raise NotFound(f"model '{name}' has no version {wanted}")
        return mv.state is State.READY

    def model_config(self, name: str) -> dict[str, Any]:
        """GET /v2/models/{m}/config (Triton's model configuration extension)."""
        entry = self.manager.entry(name)
        if entry.config is None:
            raise Unavailable(f"model '{name}' has no valid config: {entry.error}")
        return entry.config.as_json()

    def status(self) -> dict[str, Any]:
        """GET /v1/status: readiness, in-flight requests and every model's state."""
        return {
            "name": "edged",
            "version": __version__,
            "ready": self.ready,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "inflight": self.inflight,
            "models": self.manager.index(),
        }

    # ---- inference -------------------------------------------------------------------------

    async def infer(
        self, name: str, version: str | None, request: InferRequest
    ) -> tuple[InferResponse, dict[str, bool]]:
        """POST /v2/models/{m}[/versions/{v}]/infer; returns the response and which outputs go
        as binary data."""
        if not self.ready:
            raise Unavailable("edged is starting: models are still loading")
        entry, served, outputs = await self.manager.infer(
            name, parse_version(version), request.inputs, request.parameters
        )
        assert entry.config is not None
        binary: dict[str, bool] = {}
        if request.outputs:
            chosen: dict[str, np.ndarray] = {}
            specs = {s.name: s for s in entry.config.outputs}
            for wanted in request.outputs:
                if wanted.name not in outputs:
                    raise InvalidRequest(
                        f"model '{name}' has no output '{wanted.name}'; its outputs are:"
                        f" {', '.join(outputs)}"
                    )
                array = outputs[wanted.name]
                if wanted.classification:
                    labels = None
                    if wanted.name in specs:
                        version_dir = entry.directory / str(served)
                        labels = entry.config.labels(specs[wanted.name], version_dir)
                    array = classify(array, wanted.classification, labels)
                chosen[wanted.name] = array
                binary[wanted.name] = (
                    request.binary_output if wanted.binary is None else wanted.binary
                )
            outputs = chosen
        else:
            binary = dict.fromkeys(outputs, request.binary_output)
        response = InferResponse(
            model_name=name, model_version=str(served), outputs=outputs, id=request.id
        )
        return response, binary

    async def run(
        self, name: str, inputs: dict[str, np.ndarray], params: Mapping[str, Any]
    ) -> tuple[int, dict[str, np.ndarray]]:
        """Run a model for the task API: (served version, outputs)."""
        if not self.ready:
            raise Unavailable("edged is starting: models are still loading")
        _, served, outputs = await self.manager.infer(name, None, inputs, params)
        return served, outputs

    # ---- repository ------------------------------------------------------------------------

    def repository_index(self) -> list[dict[str, Any]]:
        """POST /v2/repository/index."""
        return self.manager.index()

    async def load(self, name: str) -> None:
        """POST /v2/repository/models/{m}/load."""
        await self.manager.load(name)

    async def unload(self, name: str) -> None:
        """POST /v2/repository/models/{m}/unload."""
        await self.manager.unload(name)
