"""The fleet service's configuration: TOML (``edgefleet serve --config``, else
/etc/edgefleet/edgefleet.toml), strictly validated, every key described; unknown keys are errors
that name the key."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from cloudsync.protocol.topics import check_name
from edged.common.settings import LogFormat, Section, load_file

DEFAULT_CONFIG_PATH = Path("/etc/edgefleet/edgefleet.toml")
MIN_CERT_S = 30.0
# The operators' CN in docs/PROTOCOL.md's ACL (and operator-NAME, for a fleet that gives each
# operator a certificate of their own, with the same rights).
RESERVED = ["operator", "operator-*"]
Role = Literal["viewer", "operator", "admin"]


class ServiceConfig(Section):
    """The service: which fleet, where its state lives."""

    fleet: str = Field("default", description="the fleet it serves (one service per fleet)")
    replica: str = Field(
        "", description="this replica's name (default: the host name): the runner lease's holder"
    )
    state_dir: Path = Field(Path("/var/lib/edgefleet"), description="its state (SQLite file)")
    database: str = Field(
        "",
        description="sqlite:///path, or postgresql://... for several replicas (default: "
        "sqlite:///{state_dir}/fleet.db)",
    )
    offline_after_s: float = Field(
        30.0, gt=0, description="an online node without a heartbeat this long is 'stale'"
    )
    reconcile_s: float = Field(
        30.0, gt=0, description="a full pass of the deployments over every node, this often"
    )
    lease_s: float = Field(
        15.0,
        ge=3,
        description="the runner's lease: another replica takes over this long after"
        " the runner stops renewing it",
    )
    trust_dir: Path | None = Field(
        None,
        description="the fleet's public keys ({kid}.pub): a deployment's manifests must verify"
        " against them (as nodes will); none: checked for form only",
    )
    deploy_key: Path | None = Field(
        None,
        description="the deploy key (PEM Ed25519) that signs a rollout's rollback commands and"
        " the fleet's A/B splits (cloud-ab); nodes trust it with a scope file ({kid}.commands:"
        " rollback, and cloud-ab where the fleet may run A/B tests), so it signs nothing else"
        " and no manifest (docs/SECURITY.md); none: no rollouts, no fleet A/B tests",
    )
    deploy_kid: str = Field("deploy-1", description="its name in the nodes' trust directory")
    identity: str = Field(
        "edgefleet", description="the sender of the desired states it publishes (envelope node)"
    )

    @field_validator("fleet")
    @classmethod
    def _fleet(cls, value: str) -> str:
        return check_name("fleet", value)

    def replica_name(self) -> str:
        return self.replica or socket.gethostname()

    def database_url(self) -> str:
        return self.database or f"sqlite://{self.state_dir / 'fleet.db'}"


class BrokerConfig(Section):
    """The fleet's broker, as an operator (its certificate's CN has the operators' ACL)."""

    host: str = Field("localhost", description="broker host name (the certificate names it)")
    port: int = Field(8883, gt=0, lt=65536, description="MQTT over TLS")
    ca_file: Path | None = Field(None, description="the fleet CA (default: the system's)")
    cert_file: Path | None = Field(None, description="the service's client certificate")
    key_file: Path | None = Field(None, description="its private key")
    share_group: str = Field(
        "edgefleet",
        description="the MQTT 5 shared subscription group ($share/{group}/...) that replicas"
        " split heartbeats and events in",
    )
    session_expiry_s: int = Field(
        0,
        ge=0,
        description="the broker keeps this replica's session this long after it goes: its"
        " share of the shared subscriptions waits there for it (Mosquitto keeps giving a gone"
        " member its share), so keep 0 with several replicas; what a 0 loses comes again"
        " (statuses and desired states are retained, heartbeats are periodic, a rollout reads"
        " versions from heartbeats too)",
    )
    receive_maximum: int = Field(
        10000, ge=1, le=65535, description="messages the broker sends before the service acks"
    )

    @field_validator("share_group")
    @classmethod
    def _group(cls, value: str) -> str:
        return check_name("share_group", value)


class Token(Section):
    """An API token: its SHA-256, never the token (``edgefleet token`` makes one)."""

    name: str = Field(description="who holds it (the audit log's actor)")
    role: Role = Field(description="viewer: reads; operator: labels, deployments; admin: all")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the token")


class ApiConfig(Section):
    """The HTTP API (JSON; docs/fleet-api.json)."""

    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8480, ge=0, lt=65536, description="listen port (0: any free port)")
    tls_cert: Path | None = Field(None, description="serve HTTPS (TLS 1.3) with this certificate")
    tls_key: Path | None = Field(None, description="its private key")
    tokens: list[Token] = Field(default_factory=list, description="who may call it, as what")
    max_body_kb: int = Field(1024, ge=1, description="a larger request body is refused (413)")
    max_connections: int = Field(
        512,
        ge=1,
        le=60000,
        description="open connections (503 above, at once; the unit's LimitNOFILE is 8192)",
    )
    idle_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="a connection handling no request is closed after this long (half-sent"
        " headers, idle keep-alive, a TLS handshake not done), and a request body must arrive"
        " within it (408)",
    )
    public_url: str = Field(
        "", description="the URL people reach the service at (the alerts link the console)"
    )


class AlertsConfig(Section):
    """Device alerts to Prometheus Alertmanager (API v2), by the replica holding the runner
    lease."""

    alertmanagers: list[str] = Field(
        default_factory=list,
        description="Alertmanager base URLs (http(s)://host:9093), each one of a cluster: the"
        " alerts go to every one (none: alerts are kept and shown, not sent)",
    )
    resend_s: float = Field(
        30.0, ge=1, description="firing alerts are sent again this often (endsAt: 4 times it)"
    )
    ca_file: Path | None = Field(None, description="the CA of an https Alertmanager")

    @field_validator("alertmanagers")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r}: an http:// or https:// URL")
        return value


class EventsConfig(Section):
    """Nodes' events: kept for the console, and written as ECS JSON lines for a shipper."""

    ecs_file: str = Field(
        "",
        description="write each node event once as an ECS JSON line to this file (reopened"
        " when logrotate moves it), or '-' for stdout; '' writes none",
    )
    keep_days: float = Field(
        7.0, gt=0, description="events (and resolved alerts) older than this are forgotten"
    )
    checkpoint_s: float = Field(
        3600.0,
        gt=0,
        description="a node's egress ledgers' heads (from its heartbeats) kept this often: the"
        " anchors its ledgers must still hold (edgectl egress verify --checkpoint)",
    )
    checkpoint_keep_days: float = Field(
        90.0, gt=0, description="egress checkpoints older than this are forgotten"
    )


class EnrolmentConfig(Section):
    """New devices' certificates (docs/PROTOCOL.md, "Enrolment"): signed by the fleet's issuing
    CA for a one-time token, or once an operator approves."""

    ca_cert: Path | None = Field(
        None, description="the issuing CA's certificate (PEM; the broker trusts it); none: off"
    )
    ca_key: Path | None = Field(None, description="its private key (PEM, the service's only)")
    cert_days: float = Field(
        90.0,
        ge=MIN_CERT_S / 86400,
        le=825,
        description="a node certificate's lifetime (at least 30 s: a node renews at a share of"
        " it, and reconnects each time)",
    )
    reserved: list[str] = Field(
        default_factory=lambda: list(RESERVED),
        description="names no node may have, shell patterns (the broker's ACL gives them other"
        " rights): never issued, whatever the token or approval. The service's own names are"
        " added: [service] identity and the CN of [mqtt] cert_file",
    )
    crl_file: Path | None = Field(
        None,
        description="the CRL of revoked node certificates, signed by the issuing CA, written at"
        " start, daily and at each revocation (mosquitto.conf's crlfile; SIGHUP reloads it)",
    )
    acl_file: Path | None = Field(
        None,
        description="the broker's ACL file (mosquitto.conf's acl_file), written at start and at"
        " each revocation and reinstatement by name: acl_base's rules, then each barred name"
        " denied every topic (SIGHUP reloads it: a session open under the name, whatever its"
        " client id, can then neither publish nor receive)",
    )
    acl_base: Path | None = Field(
        None, description="the fleet's ACL rules that acl_file is made from (with acl_file)"
    )

    @model_validator(mode="after")
    def _acl_pair(self) -> EnrolmentConfig:
        if (self.acl_file is None) != (self.acl_base is None):
            raise ValueError("acl_file and acl_base: both or neither")
        if self.acl_file is not None and self.acl_file == self.acl_base:
            raise ValueError("acl_file: not acl_base itself (the service writes it)")
        return self


class LogConfig(Section):
    format: LogFormat = Field("auto", description="auto, journal, json or text")
    level: str = Field("info", description="debug, info, warning, error")


class FleetServiceConfig(Section):
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    mqtt: BrokerConfig = Field(default_factory=BrokerConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    enrolment: EnrolmentConfig = Field(default_factory=EnrolmentConfig)
    log: LogConfig = Field(default_factory=LogConfig)


def load(path: Path | None) -> FleetServiceConfig:
    return load_file(FleetServiceConfig, path, DEFAULT_CONFIG_PATH)
