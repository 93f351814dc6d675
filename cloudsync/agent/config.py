"""cloudsync's configuration: TOML (``--config``, else /etc/edged/cloudsync.toml), strictly
validated, every key described; unknown keys are errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from cloudsync.protocol.labels import check_labels
from cloudsync.protocol.topics import check_name
from edged.common.settings import EgressConfig, LogFormat, MetricsConfig, Section, load_file

DEFAULT_CONFIG_PATH = Path("/etc/edged/cloudsync.toml")


class NodeConfig(Section):
    """Who this device is in the fleet."""

    fleet: str = Field("default", description="the fleet's name (a topic level)")
    name: str = Field("", description="this node's name (default: the host name)")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="this node's labels (site, tier...): the fleet service's deployments select"
        " nodes by them; up to 32, keys and values 1 to 63 of letters, digits, . _ / -",
    )

    @field_validator("fleet", "name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name("name", value) if value else value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return check_labels(value)


class MqttConfig(Section):
    """The fleet's broker."""

    host: str = Field("localhost", description="broker host name (the certificate names it)")
    port: int = Field(8883, gt=0, lt=65536, description="8883: MQTT over TLS; 443/8884: wss")
    transport: Literal["tcp", "websockets"] = Field(
        "tcp", description="websockets: MQTT over wss, for networks that let only HTTPS out"
    )
    websockets_path: str = Field("/mqtt", description="the wss endpoint's path")
    ca_file: Path | None = Field(None, description="the fleet CA (default: the system's)")
    cert_file: Path | None = Field(None, description="this node's certificate (its CN: the node)")
    key_file: Path | None = Field(None, description="its private key")
    keepalive_s: int = Field(30, ge=5, description="MQTT keep-alive")
    session_expiry_s: int = Field(
        7 * 24 * 3600, ge=0, description="the broker keeps the session (QoS 1 queue) this long"
    )
    reconnect_min_s: float = Field(1.0, gt=0, description="first reconnect delay")
    reconnect_max_s: float = Field(64.0, gt=0, description="reconnect delays double up to this")


class OutboxConfig(Section):
    """The store-and-forward outbox."""

    path: Path = Field(Path("/var/lib/edged/outbox.db"), description="the SQLite file")
    budget_mb: int = Field(256, gt=0, description="records beyond this are dropped, counted")
    telemetry_ttl_s: float | None = Field(
        7 * 24 * 3600.0, gt=0, description="telemetry older than this is dropped unsent"
    )
    max_inflight: int = Field(
        200, ge=1, description="records published and not yet acknowledged at once"
    )


class HeartbeatConfig(Section):
    """The heartbeat."""

    interval_s: float = Field(10.0, ge=1.0, description="seconds between heartbeats")


class TelemetryConfig(Section):
    """edged's metrics as telemetry records (cloudsync.protocol.telemetry)."""

    interval_s: float = Field(
        60.0,
        ge=0,
        description="seconds between records of what edged served (requests, errors, latency"
        " percentiles, routes per model version); 0: none",
    )


class DeliveryConfig(Section):
    """Model delivery (cloudsync.agent.delivery): manifests, downloads, installs, health."""

    staging_dir: Path = Field(
        Path("/var/lib/edged/staging"),
        description="downloads land here (best on the model repository's file system: then a"
        " version moves in by a rename)",
    )
    spool_dir: Path = Field(
        Path("/var/lib/edged/updates"),
        description="packages of the software (package manifests) are downloaded here and"
        " handed to edged-updater (request.json; its result.json comes back here)",
    )
    package_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="how long a package handed to edged-updater may go unanswered"
        " before the delivery is reported failed (is edged-updater.path enabled?)",
    )
    ca_file: Path | None = Field(None, description="CA of the download server (default: system)")
    allow_http_loopback: bool = Field(
        False,
        description="also take plain http:// URLs whose host is loopback (127.0.0.0/8, ::1,"
        " localhost): for tests; otherwise every URL must be https:// (TLS 1.3)",
    )
    state_file: Path | None = Field(
        None,
        description="each model's delivery state (the rollback floor: the highest version"
        " accepted; the version that failed), JSON, kept apart from the outbox (default:"
        " delivery.json beside the outbox's file, /var/lib/edged/delivery.json)",
    )
    threshold: int = Field(
        1, ge=1, description="distinct fleet keys (not kids) that must have signed a manifest"
    )
    timeout_s: float = Field(30.0, gt=0, description="a download stalled this long is retried")
    attempts: int = Field(5, ge=1, description="tries of a file before the step fails")
    retry_s: float = Field(300.0, gt=0, description="a failed delivery is tried again after this")
    min_free_mb: int = Field(64, ge=0, description="free space a download must leave")
    install_timeout_s: float = Field(
        600.0, gt=0, description="how long edged may take to install (load, smoke test)"
    )
    health_window_s: float = Field(
        60.0, ge=0, description="after a switch, how long the new version's errors are watched"
    )
    health_min_requests: int = Field(20, ge=1, description="calls before its error rate counts")
    max_error_rate: float = Field(
        0.05, ge=0, le=1, description="above this error rate the version before comes back"
    )


class EdgedConfig(Section):
    """The local edged."""

    socket: Path = Field(Path("/run/edged/edged.sock"), description="edged's Unix socket")
    timeout_s: float = Field(2.0, gt=0, description="a call to edged gives up after this")


class CommandsConfig(Section):
    """Signed commands (docs/PROTOCOL.md)."""

    trust_dir: Path = Field(
        Path("/etc/edged/trust"), description="the fleet's public keys: {kid}.pub (PEM Ed25519)"
    )
    max_lifetime_s: float = Field(
        3600.0, gt=0, description="commands valid for longer than this are refused"
    )
    journal_units: list[str] = Field(
        ["edged.service", "cloudsync.service", "edged-updater.service"],
        description="the units whose journal lines (and systemd's about them) the logs command"
        " may send: nothing else of the journal leaves the device",
    )
    journal_dir: Path | None = Field(
        None, description="read the journal files here instead of the system's journal"
    )


class LocalConfig(Section):
    """The local API: programs on the device hand records to the outbox."""

    socket: Path = Field(
        Path("/run/edged/cloudsync.sock"), description="Unix socket of the local API"
    )
    socket_mode: int = Field(0o660, description="permission bits of the socket file")
    read_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="a request that stalls this long, or whose body takes longer, is a 408",
    )
    max_connections: int = Field(
        32, ge=1, le=4096, description="connections served at once; more are answered 503"
    )


class AlertsConfig(Section):
    """Alerts evaluated on the device (cloudsync.agent.alerts), so they fire while offline: each
    change (firing, resolved) is an event through the outbox. The Prometheus rules shipped in
    docs/monitoring/ are the same alerts with these defaults."""

    enabled: bool = Field(True, description="evaluate the alerts (every heartbeat interval)")
    for_s: float = Field(
        300.0, ge=0, description="how long a condition must hold before its alert fires"
    )
    local_load_ratio: float = Field(
        0.9, gt=0, le=1, description="EdgedLocalLoadHigh: edged's local load above this"
    )
    cloud_error_ratio: float = Field(
        0.05, ge=0, le=1, description="EdgedCloudErrorsHigh: cloud calls failing above this"
    )
    window_s: float = Field(
        300.0, gt=0, description="the window over which the cloud's error rate is taken"
    )
    offline_for_s: float = Field(
        300.0, ge=0, description="NodeOffline: the broker unreachable for this long"
    )
    outbox_max_age_s: float = Field(
        3600.0, gt=0, description="OutboxStale: the oldest record waiting longer than this"
    )
    rollback_window_s: float = Field(
        600.0, gt=0, description="ModelRolledBack: stays firing this long after a rollback"
    )


class EnrolConfig(Section):
    """Enrolment (docs/PROTOCOL.md, "Enrolment"): with a claim credential and no certificate
    at ``[mqtt] cert_file`` yet, cloudsync makes its key at ``[mqtt] key_file`` and asks the
    fleet for its certificate before it starts."""

    claim_cert: Path | None = Field(
        None, description="the fleet's claim certificate (its CN holds a +; it can only enrol)"
    )
    claim_key: Path | None = Field(None, description="its private key")
    token_file: Path | None = Field(
        None,
        description="a one-time enrolment token for this node (edgefleet enrol token): the"
        " certificate comes at once; without one an operator approves the request",
    )
    timeout_s: float = Field(
        0.0, ge=0, description="give up (exit 1) after this long without a certificate; 0: wait"
    )
    renew_after: float = Field(
        2 / 3,
        ge=0,
        lt=1,
        description="ask the fleet service for the next certificate this far into the current"
        " one's life (0: never)",
    )


class Config(Section):
    """The whole cloudsync configuration file."""

    node: NodeConfig = Field(default_factory=NodeConfig)
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    outbox: OutboxConfig = Field(default_factory=OutboxConfig)
    heartbeat: HeartbeatConfig = Field(default_factory=HeartbeatConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)
    edged: EdgedConfig = Field(default_factory=EdgedConfig)
    local: LocalConfig = Field(default_factory=LocalConfig)
    commands: CommandsConfig = Field(default_factory=CommandsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    enrol: EnrolConfig = Field(default_factory=EnrolConfig)
    egress: EgressConfig = Field(
        default_factory=EgressConfig,
        description="the uplink's egress ledger: every message published to the broker,"
        " recorded first (directory default: beside the outbox, uplink/)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: LogFormat = Field(
        "auto",
        description="journal: journald's native protocol with fields; json: JSON lines with ECS"
        " field names; text: plain lines; auto: journal under journald, text on a terminal,"
        " else json",
    )


def load(path: Path | None) -> Config:
    """cloudsync's config file (--config, else /etc/edged/cloudsync.toml), or the defaults."""
    return load_file(Config, path, DEFAULT_CONFIG_PATH)
