"""The data plane: every API operation, independent of the transport that carries it.

REST and gRPC over Unix sockets are thin adapters over this.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from edged import __version__
from edged.common import logs
from edged.common.digits import whole
from edged.common.egress import Ledger
from edged.common.errors import InvalidRequest, NotFound, Unavailable
from edged.common.events import EventLog
from edged.device import LoadMonitor
from edged.models.model_config import ModelConfig
from edged.models.repository import ModelManager, State
from edged.oip.shm import Bound, Regions
from edged.oip.tensors import InferRequest, InferResponse, classify, is_count
from edged.request import (
    RESPONSES,
    ROUTE_PARAMETERS,
    RequestQos,
    Responses,
    RouteContext,
    Sequences,
    enter,
    qos_from_parameters,
    route_context,
)
from edged.routing.router import Router

# Taken out of a request's parameters before its model sees them: the QoS, the routing facts
# and Triton's stream flag (whether a decoupled request's end is sent as an empty response).
EMPTY_FINAL = "triton_enable_empty_final_response"
TAKEN_PARAMETERS = ("priority", "timeout", *ROUTE_PARAMETERS, EMPTY_FINAL)
FINAL = "triton_final_response"  # in each response on a stream: the request's last or not
# what a stream's writer is: one response of a decoupled model, and its binary outputs
Send = Callable[[InferResponse, dict[str, bool]], Awaitable[None]]

EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_repository",
    "model_configuration",
    "statistics",
    "system_shared_memory",
    "edged_tasks",
]


def parse_served(served: str) -> int | None:
    """The local version that served (None when the cloud did)."""
    return whole(served)


def route_parameters(route: RouteContext, explain: bool, text: bool = True) -> dict[str, Any]:
    """Where the work ran and why, for the answer's parameters; with ``explain``, every
    decision of the request as ``route_trace`` (as JSON text when ``text``: OIP parameter values
    are scalars)."""
    main = route.summary()
    if not main:
        return {}
    out: dict[str, Any] = {"route": main["route"], "reason": main["reason"]}
    if route.private:  # by the request's word or a private model it reached
        out["private"] = True
    for key in ("predicted_ms", "actual_ms"):
        if main.get(key) is not None:
            out[key] = main[key]
    if explain:
        out["route_trace"] = json.dumps(route.decisions) if text else route.decisions
    return out


def parse_version(version: str | None) -> int | None:
    """A version path segment as an integer (None: the newest ready version)."""
    if version is None or version == "":
        return None
    if not is_count(version):
        raise InvalidRequest(f"model version must be a positive integer, got '{version}'")
    return int(version)


class DataPlane:
    """Health, metadata, inference and repository control, whatever the transport."""

    def __init__(
        self,
        manager: ModelManager,
        router: Router,
        monitor: LoadMonitor | None = None,
        events: EventLog | None = None,
        shm_regions: int = 64,
        shm_regions_per_uid: int = 16,
        ledger: Ledger | None = None,
    ) -> None:
        """The manager's metrics also count the API requests in flight; ``router`` decides where
        each call runs; ``monitor`` gives the device's load for the status; ``events``: the
        daemon's event log (/v1/events); ``shm_regions`` and ``shm_regions_per_uid``: the
        shared-memory regions held at once, in all and of one uid (server.*); ``ledger``: the
        egress ledger, its head in the status."""
        self.manager = manager
        self.router = router
        self.monitor = monitor
        self.events = events
        self.ready = False
        self.stopping = False
        self.inflight = 0
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        self.started = time.monotonic()
        manager.metrics.inflight.set_function(lambda: self.inflight)
        # Triton's system shared memory (edged.oip.shm)
        self.shm = Regions(shm_regions, shm_regions_per_uid)
        self.ledger = ledger

    def shared_memory(self, caller: Any, limit: int) -> Bound:
        """The shared-memory regions as ``caller`` (a socket's ``Peer``; None: not a local
        caller) may use them, ``limit`` bytes a read."""
        return Bound(self.shm, caller, limit)

    def begin(self) -> None:
        """A request started."""
        self.inflight += 1
        self.idle.clear()

    def end(self) -> None:
        """A request finished (answered, failed or cancelled)."""
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    def check_ready(self) -> None:
        """Unavailable while models load at start and while draining at stop."""
        if self.stopping:
            raise Unavailable("edged is shutting down")
        if not self.ready:
            raise Unavailable("edged is starting: models are still loading")

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
        shown = entry.versions.get(wanted) if wanted is not None else self.manager.serving(entry)
        # The serving version's config: after a reload, entry.config may be one still loading.
        config = shown.config if shown is not None and shown.config else entry.config
        if config is None:
            raise Unavailable(f"model '{name}' is unavailable: {entry.error}")
        meta: dict[str, Any] = {
            "name": name,
            "versions": [str(v) for v in (entry.ready_versions if wanted is None else [wanted])],
            "platform": config.platform,
            "inputs": [t.metadata(config.max_batch_size) for t in config.inputs],
            "outputs": [t.metadata(config.max_batch_size) for t in config.outputs],
        }
        if shown is not None and shown.runtime is not None:
            meta["parameters"] = shown.runtime.metadata()
        return meta

    def statistics(self, name: str | None, version: str | None) -> dict[str, Any]:
        """GET /v2/models[/{m}[/versions/{v}]]/stats (Triton's statistics extension): every
        ready model version's, or those of ``name`` (NotFound: no such model or version)."""
        entries = sorted(self.manager.entries.items())  # what is loaded: no repository scan
        if name is not None:
            entries = [(name, self.manager.entry(name))]  # NotFound: no such model
        pairs = [(n, str(v)) for n, entry in entries for v in entry.ready_versions]
        wanted = parse_version(version) if name is not None else None
        if wanted is not None:
            pairs = [p for p in pairs if p[1] == str(wanted)]
            if not pairs:
                raise NotFound(f"model '{name}' has no version {wanted} ready")
        return {"model_stats": self.manager.metrics.statistics(pairs)}

    def model_ready(self, name: str, version: str | None) -> bool:
        """GET /v2/models/{m}[/versions/{v}]/ready."""
        try:
            self.manager.resolve(name, parse_version(version))
        except Unavailable:
            return False
        return True

    def model_config(self, name: str, version: str | None = None) -> ModelConfig:
        """GET /v2/models/{m}/config (Triton's model configuration extension; REST sends
        ``as_json()``, gRPC the ``proto``): the config of the version that serves a call naming
        none, or of ``version``, which is the version's own config.pbtxt when it came with one;
        the model's while none serves."""
        entry = self.manager.entry(name)
        wanted = parse_version(version)
        if wanted is not None:
            shown = entry.versions.get(wanted)
            if shown is None:
                raise NotFound(f"model '{name}' has no version {wanted}")
            if shown.state is not State.READY or shown.config is None:
                raise Unavailable(f"model '{name}' version {wanted} is not ready: {shown.reason}")
            return shown.config
        serving = self.manager.serving(entry)
        config = serving.config if serving is not None and serving.config else entry.config
        if config is None:
            raise Unavailable(f"model '{name}' has no valid config: {entry.error}")
        return config

    def status(self) -> dict[str, Any]:
        """GET /v1/status: readiness, in-flight requests and every model's state."""
        return {
            "name": "edged",
            "version": __version__,
            "ready": self.ready,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "epoch": self.events.epoch if self.events else None,  # this run of the daemon
            "inflight": self.inflight,
            "drained": self.router.drained,  # why the local tier takes no new work, or None
            "load": self.monitor.latest.as_dict() if self.monitor else None,
            "cloud": self.router.cloud.state() if self.router.cloud else None,
            "cloud_tiers": [t.state() for t in self.router.clouds],  # [cloud] first
            "egress": self.ledger.state() if self.ledger is not None else None,
            "models": self.manager.index(),
        }

    def events_after(self, cursor: str, limit: str) -> dict[str, Any]:
        """GET /v1/events?after=N&limit=M."""
        if not is_count(cursor):
            raise InvalidRequest("'after' must be an event id (0 for the first)")
        if not is_count(limit) or not 1 <= int(limit) <= 10_000:
            raise InvalidRequest("'limit' must be 1 to 10000")
        if self.events is None:
            raise Unavailable("this edged keeps no events")
        return self.events.after(int(cursor), int(limit))

    def capabilities(self) -> list[dict[str, Any]]:
        """GET /v1/capabilities: task types, the models serving them and on which tier."""
        return self.router.capabilities()

    # ---- inference -------------------------------------------------------------------------

    async def infer(
        self,
        name: str,
        version: str | None,
        request: InferRequest,
        deadline: float | None = None,
        send: Send | None = None,
        sequences: Sequences | None = None,
    ) -> tuple[InferResponse, dict[str, bool]]:
        """POST /v2/models/{m}[/versions/{v}]/infer (or gRPC ModelInfer, whose deadline comes
        along); returns the response and which outputs go as binary data.

        A call on a stream passes ``send``: a decoupled model's responses go there as they
        come (``triton_final_response`` false in each), and the response returned is the
        final one, with no outputs (its ``triton_final_response`` true); any other model's
        one response is returned, final. ``sequences`` are the stream's open sequences, for
        stateful models. The call counts in the model's statistics however it ends, refused here
        or on the way (``edged.models.calls``)."""
        with self.manager.calls.call(name) as call:
            self.check_ready()
            call.named = parse_version(version)
            if request.refused is not None:  # a shared-memory region it names was refused
                raise request.refused
            return await self._infer(name, call.named, request, deadline, send, sequences)

    async def _infer(
        self,
        name: str,
        version: int | None,
        request: InferRequest,
        deadline: float | None,
        send: Send | None,
        sequences: Sequences | None,
    ) -> tuple[InferResponse, dict[str, bool]]:
        # Not reset on return: the request's task ends with it, and the transport's own log
        # lines about this request (errors, the access line) come after the return.
        logs.set_fields(request_id=request.id or logs.short_id(), model=name)
        parameters, route = self.take_parameters(request.parameters, deadline, request.id)
        explain = request.parameters.get("explain") is True
        sink = None
        if send is not None:

            async def partial(served: str, outputs: dict[str, np.ndarray]) -> None:
                response, binary = self._answer(name, served, outputs, request, route, explain)
                response.parameters[FINAL] = False
                await send(response, binary)

            sink = Responses(name, partial, sequences)
        token = RESPONSES.set(sink)
        try:
            served, outputs = await self.router.infer(name, version, request.inputs, parameters)
        finally:
            RESPONSES.reset(token)
        main = route.summary()  # where it ran, for the transport's access line
        logs.set_fields(route=main.get("route"), reason=main.get("reason"))
        if sink is not None and sink.taken:  # decoupled: its responses went out already
            response = InferResponse(name, served, {}, request.id, route_parameters(route, explain))
            binary: dict[str, bool] = {}
        else:
            response, binary = self._answer(name, served, outputs, request, route, explain)
        if send is not None:
            response.parameters[FINAL] = True
        return response, binary

    def _answer(
        self,
        name: str,
        served: str,
        outputs: dict[str, np.ndarray],
        request: InferRequest,
        route: RouteContext,
        explain: bool,
    ) -> tuple[InferResponse, dict[str, bool]]:
        """A response with the outputs the request asked for (all when it named none, as
        classifications where it asked that), and which go as binary data."""
        binary: dict[str, bool] = {}
        if request.outputs:
            chosen: dict[str, np.ndarray] = {}
            for wanted in request.outputs:
                if wanted.name not in outputs:
                    raise InvalidRequest(
                        f"model '{name}' has no output '{wanted.name}'; its outputs are:"
                        f" {', '.join(outputs)}"
                    )
                array = outputs[wanted.name]
                if wanted.classification:
                    labels = self.manager.labels_of(name, wanted.name, parse_served(served))
                    array = classify(array, wanted.classification, labels)
                chosen[wanted.name] = array
                binary[wanted.name] = (
                    request.binary_output if wanted.binary is None else wanted.binary
                )
            outputs = chosen
        else:
            binary = dict.fromkeys(outputs, request.binary_output)
        response = InferResponse(
            model_name=name,
            model_version=served,
            outputs=outputs,
            id=request.id,
            parameters=route_parameters(route, explain),
        )
        return response, binary

    async def run(
        self, name: str, inputs: dict[str, np.ndarray], params: Mapping[str, Any]
    ) -> tuple[str, dict[str, np.ndarray], dict[str, Any]]:
        """Run a model for the task API: (served version, outputs, route parameters); counted
        as ``infer`` counts its calls."""
        with self.manager.calls.call(name):
            self.check_ready()
            logs.set_fields(
                model=name, request_id=logs.bound().get("request_id") or logs.short_id()
            )
            parameters, route = self.take_parameters(params)
            served, outputs = await self.router.infer(name, None, inputs, parameters)
        return served, outputs, route_parameters(route, params.get("explain") is True, text=False)

    def take_parameters(
        self,
        parameters: Mapping[str, Any],
        deadline: float | None = None,
        request_id: str | None = None,
    ) -> tuple[dict[str, Any], RouteContext]:
        """Set this request's priority and timeout for the scheduler and its routing facts
        (private, route, deadline) for the router, in context variables that the steps of a
        pipeline inherit; return the other parameters and the routing context. ``deadline`` is
        the transport's own (a gRPC deadline), if any: the earlier one wins."""
        qos = qos_from_parameters(parameters)
        if deadline is not None and (qos.deadline is None or deadline < qos.deadline):
            qos = RequestQos(qos.priority, deadline)
        default = self.router.policy.default_deadline_s
        route = route_context(parameters, default, request_id or "", qos.deadline)
        enter(qos, route)
        return {k: v for k, v in parameters.items() if k not in TAKEN_PARAMETERS}, route

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
