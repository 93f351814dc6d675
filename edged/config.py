"""The daemon's configuration: TOML, strictly validated, every key described.

Precedence: embedded defaults < the config file (``--config``, else /etc/edged/edged.toml if it
exists) < command-line flags (``--socket``, ``--state-dir``, ``--models``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from edged.common.settings import (  # the base both daemons' configs share
    EgressConfig,
    LogFormat,
    MetricsConfig,
    Section,
    load_file,
    validate,
)
from edged.routing import conditions
from edged.routing.decide import Policy, Rule

DEFAULT_CONFIG_PATH = Path("/etc/edged/edged.toml")
Provider = Literal["tensorrt", "cuda", "cpu"]
PROVIDER_NAMES: tuple[Provider, ...] = ("tensorrt", "cuda", "cpu")


class ServerConfig(Section):
    """The local API on the Unix socket."""

    socket: Path = Field(Path("/run/edged/edged.sock"), description="Unix socket path")
    socket_mode: int = Field(0o660, description="permission bits of the socket file")
    max_request_bytes: int = Field(
        64 * 1024 * 1024, gt=0, description="largest request body accepted (413 above)"
    )
    max_json_bytes: int = Field(
        2 * 1024 * 1024,
        gt=0,
        description="largest JSON document in a request (413 above): decoded, JSON takes"
        " about 8 times its size in memory, and the event loop waits while it is decoded"
        " (2 MiB of numbers: 39 ms at the 99th percentile, 15 MiB: 181 ms); send large"
        " tensors as binary data",
    )
    max_connections: int = Field(
        256, gt=0, description="open connections to the REST socket (503 above, at once)"
    )
    access_log: Literal["none", "errors", "all"] = Field(
        "errors",
        description="a line at info for each REST request (method, path, status, time, route,"
        " caller; with REQUEST_ID and MODEL as journal fields): errors: those answered 5xx,"
        " and 4xx up to 20 at once and 5 a second (the others counted in the next line);"
        " all: every one (debug logs every one anyway)",
    )
    shm_regions: int = Field(
        64,
        ge=0,
        description="system shared-memory regions registered at once, all callers"
        " together (Triton's extension; 0 turns it off)",
    )
    shm_regions_per_uid: int = Field(
        16,
        ge=1,
        description="system shared-memory regions one uid may hold at once (a 400 above,"
        " naming this key): one uid cannot take all of shm_regions and leave root none",
    )
    shm_memfd_mb_per_uid: int = Field(
        256,
        ge=1,
        description="the sealed memfd regions one uid may hold at once, in MiB in all (a 400"
        " above, naming this key): what edged writes into them (outputs) is charged to edged's"
        " memory, so their size is bounded, not only their number",
    )
    read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a connection handling no request is closed after this long (half-sent"
        " headers, idle keep-alive), and a request body must arrive within it (408)",
    )
    allowed_uids: list[int] = Field(
        default_factory=list,
        description="uids allowed to call, on the REST and the gRPC socket (both lists empty:"
        " anyone who can connect); callers are identified by SO_PEERCRED",
    )
    allowed_gids: list[int] = Field(
        default_factory=list,
        description="gids allowed to call: the caller's primary or any supplementary group"
        " (both lists empty: anyone who can connect)",
    )
    admin_uids: list[int] = Field(
        default_factory=list,
        description="besides root, edged's own uid and admin_group: the uids allowed admin calls"
        " (/v1/admin, repository load and unload on REST and gRPC); empty adds no one",
    )
    admin_gids: list[int] = Field(
        default_factory=list,
        description="besides root, edged's own uid and admin_group: the gids (primary or"
        " supplementary) allowed admin calls; empty adds no one",
    )
    admin_group: str = Field(
        "edged-admin",
        description="a group whose members are admin (the package creates it; add operators"
        " with `usermod -aG edged-admin NAME`); empty: none",
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, description="on SIGTERM, how long in-flight requests may take to finish"
    )
    event_loop: Literal["uvloop", "asyncio"] = Field(
        "uvloop",
        description="the event loop: uvloop (libuv) where it is installed, the standard one"
        " otherwise (its absence is logged): uvloop spent 17% less CPU per REST call and 20%"
        " less per gRPC call (docs/BENCHMARKS.md)",
    )
    grpc: bool = Field(True, description="serve OIP gRPC on a second Unix socket")
    grpc_socket: Path | None = Field(
        None, description="the gRPC socket (default: beside socket, named <name>-grpc.sock)"
    )

    shm_socket: Path | None = Field(
        None,
        description="the region socket, where a local caller gets a sealed memfd region that"
        " edged reads with no copy (default: beside socket, named <name>-shm.sock; none while"
        " shm_regions is 0)",
    )

    def grpc_path(self) -> Path:
        """Where the gRPC socket goes."""
        return self.grpc_socket or self._beside("grpc")

    def shm_path(self) -> Path:
        """Where the region socket goes (edged.server.regions)."""
        return self.shm_socket or self._beside("shm")

    def _beside(self, what: str) -> Path:
        return self.socket.with_name(f"{self.socket.stem}-{what}{self.socket.suffix or '.sock'}")

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _octal(cls, value: Any) -> Any:
        # TOML has no octal strings users expect to write as "0660"; accept both forms.
        if isinstance(value, str):
            try:
                return int(value, 8)
            except ValueError:
                raise ValueError('must be an octal string such as "0660"') from None
        return value


class OnnxRuntimeConfig(Section):
    """ONNX Runtime settings shared by all ONNX models."""

    providers: list[Provider] = Field(
        default_factory=lambda: list(PROVIDER_NAMES),
        description="execution providers in order of preference; missing ones are skipped",
    )
    intra_op_threads: int = Field(0, ge=0, description="threads inside one operator (0: ORT)")
    inter_op_threads: int = Field(0, ge=0, description="threads across operators (0: ORT)")
    allow_spinning: bool = Field(
        False,
        description="let idle ORT threads spin; faster alone, but on a few cores sessions starve",
    )
    tensorrt_cache_dir: Path = Field(
        Path("/var/cache/edged/tensorrt"),
        description="TensorRT engines and timing caches, per model version (built once, minutes"
        " on a Jetson; rebuilt when TensorRT or the device changes)",
    )
    inline_max_us: int = Field(
        500,
        ge=0,
        description="executions that recently took less than this run on the event loop, not"
        " in the thread pool: the hand-off costs about 0.1 ms a call, which tiny models and a"
        " camera frame's quick graph (0.2 ms) save, while others wait at most this long; 0: never",
    )
    precision: Literal["fp16", "fp32", "int8"] = Field(
        "fp16",
        description="what TensorRT builds engines in (FP16 by default, as Jetsons run best);"
        " int8 needs int8_calibration_table in the version directory, else FP16; the CUDA and"
        " CPU providers run the graph as it is",
    )
    int8_calibration_table: str = Field(
        "calibration.flatbuffers",
        description="INT8: the calibration table's file name in each model version directory"
        " (ONNX Runtime's calibration tool writes it)",
    )
    isolation: Literal["auto", "process", "thread"] = Field(
        "auto",
        description="where a session runs: process (a worker subprocess: unloading returns all"
        " its memory, GPU memory too), thread (in the daemon); auto: process when a GPU"
        " provider is in use, else thread",
    )


class ModelsConfig(Section):
    """The model repository."""

    repository: Path = Field(Path("/var/lib/edged/models"), description="Triton-layout repository")
    keep_versions: int = Field(
        3,
        ge=2,
        description="version directories kept on disk per model when a new one is installed"
        " (the newest, and always the active one and the one before it)",
    )
    load: list[str] = Field(
        default_factory=list, description="models to load at start (empty: every model found)"
    )
    max_image_pixels: int = Field(
        40_000_000, gt=0, description="largest decoded image accepted by image pipelines"
    )
    min_free_mb: int = Field(
        128,
        ge=0,
        description="a model load that would leave less memory free than this is refused"
        " (503 with the figures); on a Jetson the GPU's memory is this memory (0: no check)",
    )
    idle_unload_s: float = Field(
        0.0,
        ge=0,
        description="a model not called for this long is unloaded, and loaded again by the next"
        " call (0: never)",
    )
    idle_power_mode: int | None = Field(
        None,
        ge=0,
        description="Jetson: the nvpmodel mode to switch to while every model is idle-unloaded"
        " (the mode before comes back with the first load); unset: leave the power mode alone",
    )


class SchedulerConfig(Section):
    """Limits of the per-model schedulers (each model's config.pbtxt says the rest)."""

    max_queue_size: int = Field(
        256,
        gt=0,
        description="requests that may wait per model and priority level when the model's"
        " queue policy sets no max_queue_size (429 above); bounds memory",
    )


class DeviceConfig(Section):
    """The device load monitor (CPU, memory, GPU, temperature, power)."""

    interval_s: float = Field(1.0, gt=0, description="seconds between samples")


class RuleConfig(Section):
    """One operator rule: for requests of ``task_type`` (and/or ``model``), when ``when`` holds,
    run them as ``action`` says (else as ``otherwise`` says; without it the next rule decides)."""

    task_type: str | None = Field(None, description="the task type it applies to (any if unset)")
    model: str | None = Field(None, description="the model it applies to (any if unset)")
    when: str | None = Field(
        None,
        description="a condition such as 'local_load < 80%' or 'rtt > 150ms and payload >= 1MB'"
        " (always if unset)",
    )
    action: Literal["local", "cloud", "auto"] = Field(
        ..., description="local, cloud, or auto (the cost model decides)"
    )
    otherwise: Literal["local", "cloud", "auto"] | None = Field(
        None, description="the action when 'when' does not hold (unset: the next rule decides)"
    )
    name: str = Field("", description="a name for the reason in answers and metrics")

    @field_validator("when")
    @classmethod
    def _parse_when(cls, value: str | None) -> str | None:
        if value is not None:
            conditions.parse(value)  # ValueError says what is wrong
        return value

    def rule(self) -> Rule:
        when = conditions.parse(self.when) if self.when is not None else None
        return Rule(self.action, self.task_type, self.model, when, self.otherwise, self.name)


class RoutingConfig(Section):
    """The path decision: where each request runs (see docs/ROUTING.md)."""

    rules: list[RuleConfig] = Field(default_factory=list, description="operator rules, in order")
    policy: Literal["cost-model", "learned"] = Field(
        "cost-model",
        description="what decides where no rule does: the cost model (estimates against the"
        " deadline and the local threshold), or the learned policy (Thompson sampling on"
        " 'in time', learning online; see docs/ROUTING.md)",
    )
    max_latency_ms: float = Field(
        500.0, gt=0, description="the deadline of requests that set none (their 'timeout')"
    )
    local_threshold_ms: float = Field(
        100.0,
        gt=0,
        description="a local estimate under this runs locally; above it the cloud is weighed",
    )
    cloud_cost_weight_ms: float = Field(
        0.0, ge=0, description="milliseconds of latency one unit of a cloud model's cost is worth"
    )
    hedging: bool = Field(True, description="run on both tiers when the deadline is tight")
    hedge_margin: float = Field(
        0.2,
        ge=0,
        le=1,
        description="hedge when the local estimate is within this share of the deadline",
    )
    private_models: list[str] = Field(
        default_factory=list, description="models whose inputs never leave the device"
    )

    def to_policy(self) -> Policy:
        return Policy(
            rules=tuple(r.rule() for r in self.rules),
            default_deadline_s=self.max_latency_ms / 1000,
            local_threshold_s=self.local_threshold_ms / 1000,
            cloud_cost_weight_s=self.cloud_cost_weight_ms / 1000,
            hedging=self.hedging,
            hedge_margin=self.hedge_margin,
        )


class CloudModelConfig(Section):
    """A model of the cloud catalog, beyond what the cloud's model index lists."""

    name: str = Field(..., description="the local model name it stands for")
    cloud_name: str | None = Field(None, description="its name on the cloud server (default: name)")
    task_type: str | None = Field(None, description="its task type (default: the local model's)")
    cost: float = Field(0.0, ge=0, description="cost of one call, in the operator's unit")
    b_cloud_name: str | None = Field(
        None, description="A/B: a second version on the cloud server (arm b; cloud_name is a)"
    )
    b_share: float = Field(0.0, ge=0, le=1, description="A/B: the share of calls that go to b")

    @model_validator(mode="after")
    def _ab(self) -> CloudModelConfig:
        if self.b_share > 0 and not self.b_cloud_name:
            raise ValueError("b_share needs b_cloud_name")
        return self


def check_token_transport(url: str, token_file: Path | None, key: str) -> None:
    """A token never travels in clear: with a token, a URL must use TLS (https, grpcs), or be
    on this machine (loopback)."""
    if not url or token_file is None:
        return
    parts = urlsplit(url)
    if parts.scheme in ("https", "grpcs"):
        return
    host = (parts.hostname or "").lower()
    if host == "localhost" or host == "::1" or host.startswith("127."):
        return
    raise ValueError(
        f"{key} is {parts.scheme}:// with a token file: the token would travel in clear;"
        " use https:// or grpcs:// (plain is allowed to loopback only)"
    )


class CloudConfig(Section):
    """The cloud tier: an Open Inference Protocol server (Triton, KServe, MLServer), usually
    behind a gateway."""

    url: str = Field(
        "",
        description="OIP REST base URL with the gateway's path prefix, e.g."
        " https://gw.example.com/api/v1, or OIP gRPC grpcs://host:port (empty: no cloud tier)",
    )
    name: str = Field(
        "cloud",
        pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$",
        description="the tier's name, in routes' reasons and the status (several tiers)",
    )
    cost: float = Field(
        0.0,
        ge=0,
        description="cost of one call on this tier, in the operator's unit (added to a"
        " [[cloud.models]] entry's own)",
    )
    tiers: list[CloudConfig] = Field(
        default_factory=list,
        description="more cloud tiers, [[cloud.tiers]] with these keys (e.g. a cheaper"
        " interruptible one): a call goes to the cheapest tier expected in time (urgent work:"
        " in half its time), else the fastest, and a failing tier's calls to the next",
    )
    auth_header: str = Field(
        "Authorization", description="header (gRPC: metadata key) that carries the token"
    )
    token_file: Path | None = Field(
        None, description="file holding the token (e.g. 'Bearer ...'), read at start"
    )
    ca_file: Path | None = Field(
        None, description="CA bundle to verify the server (default: the system's)"
    )
    cert_file: Path | None = Field(None, description="client certificate for mutual TLS")
    key_file: Path | None = Field(None, description="client key for mutual TLS")
    binary_data: bool | None = Field(
        None,
        description="send tensors with the binary extension (unset: if the server lists it)",
    )
    catalog_timeout_s: float = Field(
        5.0, gt=0, description="limit of each catalog call (model index, metadata, readiness)"
    )
    probe_interval_s: float = Field(0.2, gt=0, description="seconds between link probes")
    probe_timeout_s: float = Field(
        0.25,
        gt=0,
        description="a probe slower than this failed (the next one gets twice as long; a cut"
        " link is down within interval + 3 x this)",
    )
    reconnect_min_s: float = Field(1.0, gt=0, description="first probe backoff once down")
    reconnect_max_s: float = Field(64.0, gt=0, description="longest probe backoff once down")
    max_retries: int = Field(
        2, ge=0, description="retries of a failed call with no local fallback (within deadline)"
    )
    breaker_error_rate: float = Field(
        0.05, gt=0, le=1, description="the circuit opens above this share of failed calls"
    )
    breaker_window_s: float = Field(10.0, gt=0, description="window the error rate is over")
    breaker_min_calls: int = Field(20, gt=0, description="calls in the window before it opens")
    ab_min_calls: int = Field(
        100, ge=1, description="A/B: calls of each arm before the test may decide"
    )
    ab_confidence: float = Field(
        0.95, gt=0.5, lt=1, description="A/B: P(b better), or P(a better), that decides"
    )
    ab_max_calls: int = Field(
        5000, ge=2, description="A/B: calls in all after which an undecided test keeps arm a"
    )
    ab_latency_ms: float = Field(
        0.0, ge=0, description="A/B: a call slower than this is not a good one (0: any in time)"
    )
    ab_min_confidence: float = Field(
        0.0,
        ge=0,
        le=1,
        description="A/B: an answer less sure than this (its confidence output's best score) is"
        " not a good one (0: confidence not counted)",
    )
    ab_min_score: float = Field(
        0.0,
        ge=0,
        le=1,
        description="A/B: an answered call waits for an operator's score of its answer (POST"
        " /v1/admin/cloud/{model}/ab/scores, by request id): at least this is a good one (0:"
        " no scores)",
    )
    ab_score_wait_s: float = Field(
        3600.0, gt=0, le=86400, description="A/B: a call not scored within this is not counted"
    )
    scale_out_error_rate: float = Field(
        0.05,
        gt=0,
        le=1,
        description="the scale-out signal (metric edged_cloud_scale_out, an event) is raised"
        " above this share of failed cloud calls over scale_out_window_s",
    )
    scale_out_window_s: float = Field(
        60.0, ge=1, le=3600, description="the window of the scale-out signal's error rate"
    )
    scale_out_min_calls: int = Field(
        20, gt=0, description="calls in the window before the scale-out signal changes"
    )
    catalog_refresh_s: float = Field(60.0, gt=0, description="re-read the cloud's model index")
    stats_interval_s: float = Field(
        10.0,
        ge=0,
        description="read the cloud's statistics (Triton's extension) this often: its service"
        " time per inference, whoever called it, teaches the routing estimate of a model edged"
        " did not call there meanwhile; 0: never (a server without the extension is asked once)",
    )
    models: list[CloudModelConfig] = Field(
        default_factory=list, description="catalog entries added to the cloud's model index"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https", "grpc", "grpcs") or not parts.netloc:
            raise ValueError("must be http(s)://host[:port][/prefix] or grpc(s)://host[:port]")
        if parts.scheme.startswith("grpc") and parts.path.strip("/"):
            raise ValueError("gRPC has no path prefix (gateways route it by service)")
        return value

    @model_validator(mode="after")
    def _token_in_tls(self) -> CloudConfig:
        check_token_transport(self.url, self.token_file, "url")
        return self

    @model_validator(mode="after")
    def _tiers(self) -> CloudConfig:
        if not self.tiers:
            return self
        if not self.url:
            raise ValueError("tiers: the first tier is [cloud] itself, which needs its url")
        names = [self.name] + [t.name for t in self.tiers]
        if len(set(names)) < len(names):
            raise ValueError(f"tiers: each tier needs a name of its own (names: {names})")
        for tier in self.tiers:
            if tier.tiers:
                raise ValueError(f"tiers: tier '{tier.name}' cannot have tiers of its own")
            if not tier.url:
                raise ValueError(f"tiers: tier '{tier.name}' needs a url")
        return self


class KnowledgeConfig(Section):
    """The knowledge store (docs/API.md, /v1/kb)."""

    uri: str = Field(
        "",
        description="a Milvus URI (http://host:19530) or a Milvus Lite file (default:"
        " state_dir/knowledge.db)",
    )
    token_file: Path | None = Field(None, description="file holding a Milvus server's token")
    index: Literal["FLAT", "HNSW"] = Field(
        "FLAT", description="FLAT: exact search; HNSW: faster on large stores, measure recall"
    )
    embedding_model: str = Field("text-embedding", description="the model that embeds text")
    chunk_size: int = Field(
        500,
        ge=100,
        le=8000,
        description="characters per chunk (500: about the 128 tokens MiniLM was trained on)",
    )
    chunk_overlap: int = Field(80, ge=0, description="characters shared by adjacent chunks")
    embed_batch: int = Field(
        8,
        ge=1,
        le=256,
        description="chunks per embedding call at ingest (CPU, measured: 8 is the fastest and"
        " holds 520 MiB less than 64; a GPU may want more)",
    )
    min_free_mb: int = Field(
        256, ge=0, description="ingest refuses to leave less free space on the store's disk"
    )
    answer_threshold: float = Field(
        0.6,
        ge=-1.0,
        le=1.0,
        description="ask: the best passage's cosine score at which the device answers from it",
    )
    answer_model: str | None = Field(
        None,
        description="ask: the model (OIP: question, context -> answer) that answers what the"
        " store cannot; none: the device answers with its best passage",
    )
    answer_url: str | None = Field(
        None,
        description="ask: an OpenAI-compatible endpoint (https://host/v1) where answer_model"
        " answers, instead of an OIP model through the router",
    )
    answer_token_file: Path | None = Field(
        None, description="file holding the bearer token for answer_url"
    )
    ask_passages: int = Field(4, ge=1, le=20, description="ask: passages sent with a question")
    answer_timeout_s: float = Field(
        30.0,
        gt=0,
        description="ask: how long the answer model may take when the request sets no timeout"
        " (a language model takes seconds, beyond routing.max_latency_ms)",
    )
    private_namespaces: list[str] = Field(
        default_factory=list, description="namespaces whose passages never leave the device"
    )

    @field_validator("answer_url")
    @classmethod
    def _answer_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError("must be http(s)://host[:port][/path], e.g. https://llm/v1")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KnowledgeConfig:
        if self.chunk_overlap >= self.chunk_size:
            raise ValueError("chunk_overlap must be smaller than chunk_size")
        if self.answer_url and not self.answer_model:
            raise ValueError("answer_url needs answer_model: the model that answers there")
        check_token_transport(self.uri, self.token_file, "uri")
        check_token_transport(self.answer_url or "", self.answer_token_file, "answer_url")
        return self


class TasksConfig(Section):
    """Task graphs (/v1/tasks): templates, free text mapped to them, the time budget."""

    deadline_ms: int = Field(
        30_000, gt=0, description="a task's time budget unless the request sets deadline_ms"
    )
    templates: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="templates added to (or replacing) the shipped ones: description, inputs,"
        " nodes (docs/API.md)",
    )
    intents: dict[str, str] = Field(
        default_factory=lambda: {
            "image-report": "image-report",
            "voice-command": "voice-command",
            "ask": "ask",
            "search": "search",
        },
        description="free text: the intent model's label -> the template it asks for",
    )
    min_intent_score: float = Field(
        0.0, ge=0, le=1, description="free text whose intent scores less is refused (400)"
    )


class LogConfig(Section):
    """Logging."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: LogFormat = Field(
        "auto",
        description="journal: journald's native protocol with fields (MODEL, ROUTE, REQUEST_ID);"
        " json: JSON lines with ECS field names; text: plain lines; auto: journal under"
        " journald, text on a terminal, else json",
    )


class Config(Section):
    """The whole configuration file."""

    # [load] was the device load monitor's section, beside [models] load (the models to load)
    RENAMED: ClassVar[dict[str, str]] = {"load": "device"}

    state_dir: Path = Field(
        Path("/var/lib/edged"),
        description="state directory (created at start)",
    )
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    onnxruntime: OnnxRuntimeConfig = Field(default_factory=OnnxRuntimeConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    cloud: CloudConfig = Field(default_factory=CloudConfig)
    knowledge: KnowledgeConfig = Field(default_factory=KnowledgeConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    egress: EgressConfig = Field(default_factory=EgressConfig)
    log: LogConfig = Field(default_factory=LogConfig)


def parse(data: dict[str, Any], source: str = "config") -> Config:
    """Validate a config mapping; ConfigError names each bad key."""
    return validate(Config, data, source)


def load(path: Path | None) -> Config:
    """edged's config file (--config, else /etc/edged/edged.toml), or the embedded defaults."""
    return load_file(Config, path, DEFAULT_CONFIG_PATH)
