"""The cloud tier: an Open Inference Protocol server (Triton, KServe, MLServer) behind a gateway.

One ``CloudEndpoint`` per configured URL. It speaks OIP REST (``http://``, ``https://``) or OIP
gRPC (``grpc://``, ``grpcs://``) through tritonclient's asyncio clients. A REST base URL may carry
the gateway's path prefix (``https://gw/api/v1`` sends ``POST /api/v1/v2/models/{m}/infer``); a
token goes in a header (gRPC metadata); https requires TLS 1.3; both TLS schemes can present a
client certificate (mutual TLS). gRPC's Python API cannot refuse TLS 1.2 (the server's choice
stands), which is logged at start: use https where TLS 1.3 must be enforced. Each call carries
the time the request has left, as the OIP ``timeout`` parameter for the server and as its own
limit here (the gRPC deadline too). Around the calls:

- a ``LinkMonitor`` probes ``/v2/health/ready`` and is fed by the calls (a connection error or a
  timeout is a link failure), so routing knows RTT, bandwidth and up/down;
- a ``CircuitBreaker`` counts the outcomes (5xx, timeouts and connection errors are failures;
  4xx are the request's fault, not the endpoint's); when the link comes back after an outage
  it closes at once (its probes proved the endpoint), so traffic returns in one step;
- the calls of a model split between two versions (an A/B test) have a breaker per arm as well
  (``arm_fault`` says which failures are an arm's): a failing arm is refused on its own, its
  share going to the other arm, while the tier's breaker counts only the tier's failures;
- the catalog: the models the server lists in its repository index (re-read every
  ``catalog_refresh_s`` and when the link comes back), plus those the config names;
- the server's own service time per model, from its statistics (``stats_interval_s``,
  edged.served), told to the router (``on_service``) for the models edged did not call
  meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import tritonclient.http.aio as triton
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from edged import wire
from edged.background import Background
from edged.breaker import ArmBreakers, CircuitBreaker, ScaleOut
from edged.common.abtest import ABTest
from edged.common.backoff import backoff_delay
from edged.common.digits import whole
from edged.common.egress import Ledger, digest
from edged.common.errors import ConfigError
from edged.config import CloudConfig
from edged.link import LinkMonitor
from edged.oip.tensors import confidence
from edged.served import ServiceTimes

log = logging.getLogger(__name__)

Tensors = dict[str, np.ndarray]
RETRYABLE_STATUS = {429, 502, 503, 504}
# gRPC status codes as the HTTP status that means the same
GRPC_STATUS = {
    "StatusCode.INVALID_ARGUMENT": 400,
    "StatusCode.UNAUTHENTICATED": 401,
    "StatusCode.PERMISSION_DENIED": 403,
    "StatusCode.NOT_FOUND": 404,
    "StatusCode.RESOURCE_EXHAUSTED": 429,
    "StatusCode.INTERNAL": 500,
    "StatusCode.UNKNOWN": 500,
    "StatusCode.UNIMPLEMENTED": 501,
    "StatusCode.UNAVAILABLE": 503,
    "StatusCode.DEADLINE_EXCEEDED": 504,
}
JSON = "application/json"
GATEWAY_STATUS = {502, 504}  # a gateway's word that the server behind it did not answer


def http_status(exc: InferenceServerException) -> int | None:
    """The HTTP status of tritonclient's error (a gRPC code as the status that means the same;
    None: neither)."""
    code = str(exc.status() or "")
    return GRPC_STATUS.get(code) or whole(code, 3)


def arm_fault(status: int | None, grpc: bool) -> bool:
    """Whether a failed call of an A/B arm failed for its version rather than for the tier.

    The server answered, naming the version called: a 5xx of its own (the version is broken or
    overloaded) or a 404 (no such version), is the arm's, and counts in the arm's breaker only.
    What says nothing of one version is the tier's and counts in the tier's breaker: no answer
    at all (refused, reset, TLS, a timeout: ``status`` None), a gateway's 502 or 504 (the
    server behind it did not answer), and over gRPC UNAVAILABLE and DEADLINE_EXCEEDED (503,
    504), which grpc also gives for a lost connection."""
    if status is None or status in GATEWAY_STATUS or (grpc and status == 503):
        return False
    return status == 404 or status >= 500


class CloudError(Exception):
    """A cloud call that did not give an answer.

    ``endpoint_fault``: the endpoint failed (counts against its breaker); ``link_fault``: the
    network failed (counts against the link); ``retryable``: the same call may succeed later;
    ``refused``: the endpoint would not take it now (its circuit open) or did not answer in the
    time it had: another tier may.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        endpoint_fault: bool = True,
        link_fault: bool = False,
        retryable: bool = False,
        refused: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.endpoint_fault = endpoint_fault
        self.link_fault = link_fault
        self.retryable = retryable
        self.refused = refused

    @property
    def tier_fault(self) -> bool:
        """The tier's doing, not the request's: the next tier may answer."""
        return self.endpoint_fault or self.link_fault or self.refused


class Unrecorded(Exception):
    """The egress ledger could not record a call: it must not be made."""


@dataclass(frozen=True)
class CatalogEntry:
    """A model the cloud serves, under the local name it stands for."""

    name: str  # local name
    cloud_name: str
    task_type: str | None = None
    cost: float = 0.0


def check_tls_files(config: CloudConfig) -> None:
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(config, name)
        if path is not None and not path.is_file():
            raise ConfigError(f"cloud.{name} {path} is not a readable file")


def tls_context(config: CloudConfig) -> ssl.SSLContext:
    """TLS 1.3 at least, the configured CA (else the system's), a client certificate if set."""
    try:
        context = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        if config.cert_file is not None:
            key = str(config.key_file) if config.key_file else None
            context.load_cert_chain(str(config.cert_file), key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cloud TLS settings: {exc}") from None
    return context


def read_token(path: Path | None) -> str | None:
    """A token from its file (None without one); ConfigError if it cannot be read or is empty."""
    if path is None:
        return None
    try:
        info = path.stat()
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror}") from None
    if info.st_mode & 0o027:  # like ssh's keys: the owner's (and its group may read)
        raise ConfigError(
            f"the token file {path} is readable or writable by others (mode"
            f" {info.st_mode & 0o777:04o}): chmod 0600 (or 0640 for the edged group)"
        )
    if not token:
        raise ConfigError(f"the token file {path} is empty")
    return token


def is_ready(row: dict[str, Any]) -> bool:
    """A repository index row that serves: state READY (MLServer's gRPC says "State.READY"),
    or no state at all (KServe lists only what it serves)."""
    return str(row.get("state", "READY")).rsplit(".", 1)[-1].upper() == "READY"


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """BYTES outputs come back as str from JSON: give bytes, as local models do."""
    if array.dtype == object:
        out = np.empty(array.shape, dtype=object)
        out.ravel()[:] = [v.encode() if isinstance(v, str) else v for v in array.ravel()]
        return out
    return array


class CloudEndpoint(Background):
    """Calls to one OIP endpoint, with its link monitor, breaker and catalog."""

    def __init__(
        self,
        config: CloudConfig,
        local_names: Callable[[], Iterable[str]] = lambda: (),
        ledger: Ledger | None = None,
    ) -> None:
        """``local_names``: the models of the local repository, to look for in the cloud when
        it does not serve its repository index; ``ledger``: the egress ledger every call is
        recorded in before it leaves (None: none kept)."""
        self.config = config
        self.name = config.name
        self.local_names = local_names
        parts = urlsplit(config.url)  # checked by the config
        self.grpc = parts.scheme.startswith("grpc")
        self.url = config.url.rstrip("/")
        self.address = parts.netloc + parts.path.rstrip("/")  # tritonclient takes no scheme
        self.secure = parts.scheme in ("https", "grpcs")
        if self.secure:
            check_tls_files(config)
        self.tls = tls_context(config) if parts.scheme == "https" else None
        token = read_token(config.token_file)
        header = config.auth_header.lower() if self.grpc else config.auth_header  # gRPC metadata
        self.headers = {header: token} if token else {}
        self.client: Any = None
        self.session: aiohttp.ClientSession | None = None  # REST calls (the client: the rest)
        self.ledger = ledger
        self.module: Any = triton
        self.binary = True if self.grpc else config.binary_data
        self.catalog: dict[str, CatalogEntry] = {}
        # A/B: local name -> (the b version's cloud name, the share of calls it gets)
        self.splits: dict[str, tuple[str, float]] = {}
        self.tests: dict[str, ABTest] = {}  # model -> its A/B test, while it runs
        self.decisions: dict[str, ABTest] = {}  # model -> its last decided test (the status)
        # where a decision is kept (the admin state): model, arm b's name, its new share
        self.on_decided: Callable[[str, str | None, float], None] | None = None
        # every call an A/B test counts: model, the arm's cloud name, good (the metrics)
        self.on_counted: Callable[[str, str, bool], None] | None = None
        self.breaker = self._new_breaker()
        self.arm_breakers = ArmBreakers(self._new_breaker)  # an A/B test's arms, each its own
        for m in config.models:
            if m.b_cloud_name:
                self.set_split(m.name, m.b_cloud_name, m.b_share)
        self.rng = random.Random()
        self.scale = ScaleOut(
            error_rate=config.scale_out_error_rate,
            window=config.scale_out_window_s,
            min_calls=config.scale_out_min_calls,
        )
        self._scale_watch: asyncio.Task[None] | None = None
        # the server's service time (its statistics), and the calls edged made meanwhile
        self.service = ServiceTimes()
        self.called: Counter[str] = Counter()
        self.on_service: Callable[[str, float, int], None] | None = None
        self._stats_watch: asyncio.Task[None] | None = None
        self.link = LinkMonitor(
            self.url,
            self._probe,
            interval=config.probe_interval_s,
            timeout=config.probe_timeout_s,
            backoff_min=config.reconnect_min_s,
            backoff_max=config.reconnect_max_s,
            on_change=self._link_changed,
        )
        self.task_name = f"catalog:{self.url}"

    def _new_breaker(self) -> CircuitBreaker:
        config = self.config
        return CircuitBreaker(
            error_rate=config.breaker_error_rate,
            window=config.breaker_window_s,
            min_calls=config.breaker_min_calls,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Open the client (it needs the running loop), start probing and reading the catalog."""
        if self.client is None and self.grpc:
            import tritonclient.grpc.aio as triton_grpc

            self.module = triton_grpc
            self.client = wire.grpc_client(self.address, self._grpc_credentials())
        elif self.client is None:
            # the calls' own session: their bodies are made here, for the egress ledger
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=100, ssl=self.tls or False)
            )
            self.client = triton.InferenceServerClient(
                self.address,
                ssl=self.secure,
                ssl_context=self.tls,
                # every call has its own limit (its deadline, or catalog_timeout_s); this
                # session-wide one only bounds what nothing else does
                conn_timeout=600.0,
            )
        self.link.start()
        super().start()
        loop = asyncio.get_running_loop()
        if self._scale_watch is None:
            self._scale_watch = loop.create_task(self._watch_scale(), name="scale-out")
        if self._stats_watch is None and self.config.stats_interval_s > 0:
            self._stats_watch = loop.create_task(self._watch_service(), name="cloud statistics")

    async def stop(self) -> None:
        await super().stop()
        for task in (self._scale_watch, self._stats_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._scale_watch = self._stats_watch = None
        await self.link.stop()
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _grpc_credentials(self) -> Any:
        """grpcs: the CA, and the client certificate for mutual TLS (None: plain gRPC)."""
        if not self.secure:
            return None
        import grpc

        log.warning(
            "cloud %s: gRPC's Python API cannot refuse TLS 1.2; use https:// where TLS 1.3 must"
            " be enforced",
            self.url,
        )
        config = self.config

        def read(path: Path | None) -> bytes | None:
            return path.read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(config.ca_file),
            private_key=read(config.key_file),
            certificate_chain=read(config.cert_file),
        )

    def _link_changed(self, up: bool) -> None:
        if up:  # what the outage made fail says nothing of the endpoint; the probes passed
            self.breaker.reset()
            self.arm_breakers.reset()

    async def _probe(self) -> None:
        assert self.client is not None
        if not await self.client.is_server_ready(headers=self.headers):
            raise ConnectionError("GET v2/health/ready did not answer 200")

    async def _run(self) -> None:
        """Keep the catalog fresh: at start, when the link comes back, and periodically."""
        while True:
            await self.link.wait_until(True)
            await self.refresh_catalog()
            down = asyncio.ensure_future(self.link.wait_until(False))
            try:
                await asyncio.wait_for(asyncio.shield(down), self.config.catalog_refresh_s)
            except asyncio.TimeoutError:
                continue
            finally:
                down.cancel()

    async def refresh_catalog(self) -> None:
        """The server's repository index (READY models); where the index is not served (MLServer
        wants a body tritonclient does not send; gateways often keep the repository API
        inside), the local models the server says are ready. Plus the configured entries."""
        assert self.client is not None
        found: dict[str, CatalogEntry] = {}
        limit = self.config.catalog_timeout_s
        try:
            if self.binary is None:
                metadata = await asyncio.wait_for(
                    self.client.get_server_metadata(headers=self.headers), limit
                )
                self.binary = "binary_tensor_data" in metadata.get("extensions", [])
            try:
                kwargs = {"as_json": True} if self.grpc else {}
                index = await asyncio.wait_for(
                    self.client.get_model_repository_index(headers=self.headers, **kwargs), limit
                )
                if self.grpc:
                    index = index.get("models", [])
                names = [r["name"] for r in index if r.get("name") and is_ready(r)]
            except InferenceServerException:
                names = [
                    name
                    for name in self.local_names()
                    if await asyncio.wait_for(
                        self.client.is_model_ready(name, headers=self.headers), limit
                    )
                ]
        except Exception as exc:  # keep what it served last time: a hiccup is not an empty cloud
            log.warning(
                "cloud %s: cannot read its models (keeping the last list): %s", self.url, exc
            )
            names = [e.cloud_name for e in self.catalog.values()]
        for name in names:
            found[name] = CatalogEntry(name, name)
        for model in self.config.models:
            found[model.name] = CatalogEntry(
                model.name, model.cloud_name or model.name, model.task_type, model.cost
            )
        if found.keys() != self.catalog.keys():
            log.info("cloud %s serves: %s", self.url, ", ".join(sorted(found)) or "nothing")
        self.catalog = found

    # ---- calls -----------------------------------------------------------------------------

    def set_split(
        self,
        model: str,
        b_cloud_name: str | None,
        share: float,
        by_fleet: bool = False,
        latency_ms: float | None = None,
        min_confidence: float | None = None,
        min_score: float | None = None,
    ) -> None:
        """A/B: ``share`` of ``model``'s cloud calls go to ``b_cloud_name`` (0 or None: none).
        A split between two arms (0 < share < 1) with a new arm b starts a new test, decided
        here or, ``by_fleet``, by the fleet service (this node counts); ``latency_ms``,
        ``min_confidence`` and ``min_score``: what a good call is, when not the config's."""
        if b_cloud_name and share > 0:
            self.splits[model] = (b_cloud_name, share)
        else:
            self.splits.pop(model, None)
        self.tests.pop(model, None)
        self.arm_breakers.forget(model)
        if b_cloud_name and 0 < share < 1:  # two arms: a test, from the first call on
            config = self.config
            latency = config.ab_latency_ms if latency_ms is None else latency_ms
            sure = config.ab_min_confidence if min_confidence is None else min_confidence
            scored = config.ab_min_score if min_score is None else min_score
            self.tests[model] = ABTest(
                b_cloud_name,
                min_calls=config.ab_min_calls,
                confidence=config.ab_confidence,
                max_calls=config.ab_max_calls,
                latency_s=latency / 1000 or None,
                min_confidence=sure or None,
                decides=not by_fleet,
                min_score=scored or None,
                score_wait_s=config.ab_score_wait_s,
            )

    def cost(self, model: str) -> float:
        """What one call of ``model`` costs on this tier: its cost per call plus the model's
        [[cloud.models]] cost."""
        entry = self.catalog.get(model)
        return self.config.cost + (entry.cost if entry else 0.0)

    def arm(self, model: str) -> tuple[str, str, str]:
        """Which version a call of ``model`` goes to: ("a" or "b", its name on the server, why
        it is not the arm drawn: "" when it is). Under an A/B test, a call drawn for an arm
        whose own circuit is open goes to the other arm, and the test counts it as a bad call
        of the drawn one (it could not take it)."""
        entry = self.catalog.get(model)
        names = {"a": entry.cloud_name if entry else model, "b": model}
        split = self.splits.get(model)
        drawn = "a"
        if split is not None:
            names["b"] = split[0]
            drawn = "b" if self.rng.random() < split[1] else "a"
        test = self.tests.get(model)
        if test is None:  # one arm: its failures are the tier's
            return drawn, names[drawn], ""
        other = "a" if drawn == "b" else "b"
        chosen = self.arm_breakers.choose(model, names[drawn], names[other])
        if chosen is None or chosen == names[drawn]:
            return drawn, names[drawn], ""
        self._counted(model, test, drawn, names[drawn], False, refused=True)
        why = f"arm {drawn}'s circuit ({names[drawn]}) is open: arm {other} took it"
        return other, names[other], why

    def unavailable(self, model: str) -> str:
        """Why ``model`` cannot go to the cloud now ("" when it can). Takes no breaker slot."""
        if not self.link.up:
            return f"link to {self.url} is down"
        if model not in self.catalog:
            return f"the cloud does not serve '{model}'"
        if not self.breaker.would_allow():
            return f"the circuit to {self.url} is open"
        split = self.splits.get(model)
        if split is not None and model in self.tests:
            a_name = self.catalog[model].cloud_name
            if self.arm_breakers.choose(model, a_name, split[0]) is None:
                return f"the circuits of both A/B arms of '{model}' on {self.url} are open"
        return ""

    async def infer(
        self,
        model: str,
        inputs: Tensors,
        outputs: list[str],
        timeout: float,
        request_id: str = "",
        payload: int = 0,
        cloud_name: str | None = None,
        confidence_output: str | None = None,
        egress: dict[str, Any] | None = None,
    ) -> Tensors:
        """One call; CloudError says why it failed. ``timeout`` (s) bounds it, here and on the
        server (as the OIP ``timeout`` parameter). ``cloud_name``: the version to call (an A/B
        arm; default the catalog's); ``confidence_output``: the output whose best score an
        A/B test weighs; ``egress``: the ledger entry's fields from the caller (its ``seq``
        is set here once the entry is written)."""
        if self.client is None:
            raise CloudError("the cloud client is not started", refused=True, endpoint_fault=False)
        if timeout <= 0:
            raise CloudError("no time left for the cloud", endpoint_fault=False)
        if not self.breaker.allow():
            raise CloudError(
                f"the circuit to {self.url} is open", endpoint_fault=False, refused=True
            )
        entry = self.catalog.get(model)
        if self._stats_watch is not None and not self._stats_watch.done():
            self.called[model] += 1  # emptied at each read of the statistics: only while read
        binary = bool(self.binary)
        module = self.module
        request = []
        for name, array in inputs.items():
            tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            try:
                if self.grpc:
                    tensor.set_data_from_numpy(array)
                else:
                    tensor.set_data_from_numpy(array, binary_data=binary)
            except InferenceServerException as exc:  # bytes that are not UTF-8, as JSON
                raise CloudError(
                    f"input '{name}' cannot be sent to {self.url}: {exc.message()}",
                    endpoint_fault=False,
                ) from None
            request.append(tensor)
        name = cloud_name or (entry.cloud_name if entry else model)
        # an A/B test's call: its version's own failures count against its arm, not the tier
        circuit = self.arm_breakers.of(model, name) if model in self.tests else None
        if circuit is not None and not circuit.allow():
            self.breaker.release()
            raise CloudError(
                f"the circuit of A/B arm {name} on {self.url} is open",
                endpoint_fault=False,
                retryable=True,  # a retry draws its arm again: the other one's may be closed
                refused=True,
            )
        record = self._recorder(model, name, request_id, egress)
        limit_us = max(1, int(timeout * 1e6))  # the server may drop it after this
        started = time.perf_counter()
        timed_out = False
        try:
            if self.grpc:
                wanted = [module.InferRequestedOutput(n) for n in outputs]
                sending = wire.SENDING.set(record)
                try:
                    call = self.client.infer(
                        name,
                        request,
                        outputs=wanted or None,
                        request_id=request_id,
                        timeout=limit_us,
                        client_timeout=timeout,
                        headers=self.headers,
                    )
                    result = await asyncio.wait_for(call, timeout)
                finally:
                    wire.SENDING.reset(sending)
            else:
                assert self.session is not None
                wanted = [module.InferRequestedOutput(n, binary_data=binary) for n in outputs]
                body, sizes = wire.rest_body(request, wanted, request_id, limit_us)
                record(body)  # before it leaves
                kind = "application/octet-stream" if binary else JSON
                headers = {**self.headers, **sizes, "Content-Type": kind}
                base = f"{'https' if self.secure else 'http'}://{self.address}"
                call = wire.rest_infer(self.session, base, name, body, headers)
                result = await asyncio.wait_for(call, timeout)
        except asyncio.TimeoutError:
            timed_out = True
            meaningful = self.link.silence_is_failure(timeout)
            error = CloudError(
                f"the cloud did not answer within {timeout * 1000:.0f} ms",
                endpoint_fault=meaningful,
                link_fault=meaningful,
                retryable=meaningful,
                refused=True,
            )
        except InferenceServerException as exc:
            code = str(exc.status() or "")
            status = http_status(exc)
            error = CloudError(
                f"the cloud answered {code or 'an error'}: {exc.message()}",
                status=status,
                endpoint_fault=status is None or status >= 500,
                link_fault=status in (503, 504) and self.grpc,  # gRPC's lost connection
                retryable=status in RETRYABLE_STATUS,
            )
        except Unrecorded as exc:  # nothing was sent
            self.breaker.release()
            if circuit is not None:
                circuit.release()
            raise CloudError(str(exc), endpoint_fault=False, refused=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            error = CloudError(
                f"cannot reach the cloud: {exc or type(exc).__name__}",
                link_fault=True,
                retryable=True,
            )
        else:
            elapsed = time.perf_counter() - started
            self.breaker.record(True)
            if circuit is not None:
                circuit.record(True)
            self._scaled(self.scale.record(True))
            self.link.observe(elapsed, payload, rtt=False)
            response = result.get_response()
            if self.grpc:
                names = [o.name for o in response.outputs]
            else:
                names = [o["name"] for o in response.get("outputs", [])]
            out = {n: _as_bytes(result.as_numpy(n)) for n in names}
            sure = out.get(confidence_output or "")
            quality = None if sure is None or sure.dtype == object else confidence(sure)
            self._tested(model, cloud_name, True, elapsed, quality, request_id)
            return out
        armed = circuit is not None and arm_fault(error.status, self.grpc)
        if circuit is None:
            self.breaker.record(not error.endpoint_fault)
        elif armed:  # the server answered for this version: the tier works, the arm failed
            self.breaker.record(True)
            circuit.record(False)
        else:  # the tier's failure (or the request's): nothing said of the arm
            self.breaker.record(not error.endpoint_fault)
            circuit.release()
        self._scaled(self.scale.record(not error.endpoint_fault))
        if error.endpoint_fault or timed_out or armed:  # not the request's own faults (a 4xx)
            self._tested(model, cloud_name, False, time.perf_counter() - started)
        if error.link_fault:
            self.link.observe(None)
        raise error

    def _recorder(
        self, model: str, name: str, request_id: str, egress: dict[str, Any] | None
    ) -> Callable[[bytes], None]:
        """What records a call's bytes in the egress ledger before they leave (Unrecorded: the
        ledger cannot take the entry, and the call is not made)."""

        def record(data: bytes) -> None:
            if self.ledger is None:
                return
            fields = {k: v for k, v in (egress or {}).items() if k != "seq"}
            try:
                head = self.ledger.record(
                    "cloud-infer",
                    **fields,
                    request_id=request_id,
                    model=model,
                    cloud_model=name,
                    endpoint=self.url,
                    tier=self.name,
                    protocol="grpc" if self.grpc else "rest",
                    bytes=len(data),
                    sha256=digest(data),
                )
            except (OSError, ValueError) as exc:
                raise Unrecorded(
                    f"the egress ledger cannot record this call ({exc}): it is not sent"
                ) from None
            if egress is not None:
                egress["seq"] = head.seq

        return record

    def _tested(
        self,
        model: str,
        cloud_name: str | None,
        ok: bool,
        seconds: float,
        quality: float | None = None,
        request_id: str = "",
    ) -> None:
        """One call of an A/B test's model (an answered one waits for its score when the
        test takes scores)."""
        test = self.tests.get(model)
        if test is None:
            return
        entry = self.catalog.get(model)
        name = cloud_name or (entry.cloud_name if entry else model)
        arm = "b" if cloud_name == test.b_name else "a"
        good = test.good(ok, seconds, quality)
        if good and test.min_score is not None:
            test.wait(request_id, arm, name, time.monotonic())
        else:
            self._counted(model, test, arm, name, good)

    def score(self, model: str, request_id: str, score: float) -> bool:
        """An operator's score of a call's answer (0-1): counted by the model's A/B test
        (False: no call of the test waits for it)."""
        test = self.tests.get(model)
        if test is None or test.min_score is None:
            return False
        found = test.scored(request_id, time.monotonic())
        if found is not None:
            self._counted(model, test, *found, score >= test.min_score)
        return found is not None

    def _counted(
        self, model: str, test: ABTest, arm: str, name: str, good: bool, refused: bool = False
    ) -> None:
        """One call counted (``refused``: by an arm whose circuit is open); a decision
        promotes its winner (all calls)."""
        decided = test.count(arm, good, refused)
        if self.on_counted is not None:
            self.on_counted(model, name, good)
        if decided is None:
            return
        self.tests.pop(model)
        self.decisions[model] = test
        share = 1.0 if decided == "b" else 0.0
        if decided == "b":
            verdict = f"arm b ({test.b_name}) is better: it gets every call"
        elif decided == "a":
            verdict = f"arm a is better: arm b ({test.b_name}) gets no more calls"
        else:
            verdict = f"no difference after {test.max_calls} calls: arm a stays, b gets none"
        log.warning("cloud A/B of %s decided: %s (%s)", model, verdict, test.summary())
        if self.on_decided is not None:
            self.on_decided(model, test.b_name, share)
        else:
            self.set_split(model, test.b_name, share)

    async def _watch_scale(self) -> None:
        """Lower the scale-out signal once the window has no calls or enough good ones, even
        while nothing is being called."""
        while True:
            await asyncio.sleep(1.0)
            try:
                self._scaled(self.scale.check())
            except Exception:  # a bug here must not end the watch (nor take the loop down)
                log.exception("cloud %s: the scale-out watch failed", self.url)

    async def _watch_service(self) -> None:
        """Read the server's statistics every ``stats_interval_s`` while the link is up; a
        server that does not serve them (MLServer) is left alone after the first refusal."""
        kwargs = {"as_json": True} if self.grpc else {}
        while True:
            await self.link.wait_until(True)
            try:
                doc = await asyncio.wait_for(
                    self.client.get_inference_statistics(headers=self.headers, **kwargs),
                    self.config.catalog_timeout_s,
                )
            except InferenceServerException as exc:
                if http_status(exc) in (400, 404, 405, 501):
                    log.info(
                        "cloud %s serves no statistics (%s): routing learns its service time"
                        " from edged's own calls only",
                        self.url,
                        exc.message(),
                    )
                    return
                log.debug("cloud %s: its statistics: %s", self.url, exc)
            except Exception as exc:  # a hiccup of the link: the next read
                log.debug("cloud %s: its statistics: %s", self.url, exc)
            else:
                try:
                    self._served(doc)
                except Exception:  # a bug here must not end the watch (nor take the loop down)
                    log.exception("cloud %s: its statistics could not be used", self.url)
            await asyncio.sleep(self.config.stats_interval_s)

    def _served(self, doc: Any) -> None:
        """Tell the router each model's service time since the last read, where edged did not
        call the model there meanwhile (its own calls, which include the transfer, teach it)."""
        times = self.service.update(doc)
        called, self.called = self.called, Counter()
        if self.on_service is None:
            return
        for model, entry in list(self.catalog.items()):
            found = times.get(entry.cloud_name)
            if found is not None and not called[model]:
                self.on_service(model, *found)

    def _scaled(self, raised: bool | None) -> None:
        """Say (an event, which reaches the fleet) that the scale-out signal changed."""
        if raised is None:
            return
        calls, failures = self.scale.counts()
        share = f"{failures} of {calls} calls failed in the last {self.scale.window:.0f} s"
        if raised:
            log.warning(
                "cloud %s: scale out: %s, more than %.1f%% (the metric edged_cloud_scale_out is 1)",
                self.url,
                share,
                100 * self.scale.error_rate,
            )
        else:
            log.warning("cloud %s: scale-out signal lowered: %s", self.url, share)

    def backoff(self, attempt: int) -> float:
        """Pause before retry ``attempt`` (1, 2, ...) of one request: 50 ms doubling, with
        jitter (the caller stops when the deadline would pass)."""
        return backoff_delay(attempt - 1, 0.05, self.config.reconnect_max_s)

    def state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "cost": self.config.cost,
            "link": self.link.state().as_dict(),
            "breaker": self.breaker.current().value,
            "breaker_cooldown_s": self.breaker.cooldown,
            "breaker_opened": self.breaker.opened,
            "breaker_trials": self.breaker.trials,
            "error_rate": round(self.breaker.failure_rate(), 4),
            "scale_out": self._scale_state(),
            "catalog": sorted(self.catalog),
            "service_ms": self.service.as_ms(),
            "ab": {m: {"b_cloud_name": b, "b_share": s} for m, (b, s) in self.splits.items()},
            "ab_tests": {
                m: self._test_state(m, t) for m, t in {**self.decisions, **self.tests}.items()
            },
        }

    def _test_state(self, model: str, test: ABTest) -> dict[str, Any]:
        """A test as the status shows it; a running one with each arm's circuit."""
        shown = test.as_dict()
        entry = self.catalog.get(model)
        if self.tests.get(model) is test:
            names = {"a": entry.cloud_name if entry else model, "b": test.b_name}
            for arm, name in names.items():
                shown[arm]["circuit"] = self.arm_breakers.of(model, name).current().value
        return shown

    def _scale_state(self) -> dict[str, Any]:
        calls, failures = self.scale.counts()
        return {
            "needed": self.scale.raised,
            "calls": calls,
            "failures": failures,
            "window_s": self.scale.window,
            "threshold": self.scale.error_rate,
        }
