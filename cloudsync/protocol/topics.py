"""Every topic of the fleet contract, built and parsed here and nowhere else.

    edge/v1/{fleet}/{node}/status            retained online/offline (birth, last will)
    edge/v1/{fleet}/{node}/heartbeat         every 10 s
    edge/v1/{fleet}/{node}/telemetry         records from the outbox
    edge/v1/{fleet}/{node}/events            events and alerts from the outbox
    edge/v1/{fleet}/{node}/cmd/{id}          a signed command, operator -> node
    edge/v1/{fleet}/{node}/cmd/{id}/result   its result, node -> operator
    edge/v1/{fleet}/{node}/desired/models    retained desired model versions, operator -> node
    edge/v1/{fleet}/{node}/desired/trust     retained trust document (keys, revocations)
    edge/v1/{fleet}/{node}/renew             a node's request for its next certificate
    edge/v1/{fleet}/{node}/renew/cert        the fleet's answer

    edge/v1/{fleet}/_fleet/rollouts/{id}     retained record of a canary rollout (operators)
    edge/v1/{fleet}/_enrol/{rid}             a new device's certificate request (claim)
    edge/v1/{fleet}/_enrol/{rid}/cert        the fleet's answer to it

Fleet and node names are 1 to 64 letters, digits, ``_`` or ``-``, not starting with ``_`` (those
are the fleet's own levels, such as ``_fleet``): never ``/`` or the MQTT wildcards ``+`` and
``#``, so that a name can never reach into another node's topics (the broker's ACLs grant a
node ``edge/v1/+/{its name}/#`` only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "edge/v1"
NAME = re.compile(r"^[A-Za-z0-9-][A-Za-z0-9_-]{0,63}\Z")  # a leading _ is the fleet's (_fleet)
CMD_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
LEAVES = ("status", "heartbeat", "telemetry", "events")


class TopicError(ValueError):
    """A topic or a name that is not part of the contract."""


def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise TopicError(f"{kind} '{value}': 1 to 64 letters, digits, _ or -, not first _")
    return value


@dataclass(frozen=True)
class Topic:
    """A parsed topic: ``kind`` is one of status, heartbeat, telemetry, events, cmd,
    cmd-result, desired-models, desired-trust, renew, renew-answer; ``cmd_id`` is set for cmd and
    cmd-result."""

    fleet: str
    node: str
    kind: str
    cmd_id: str | None = None


@dataclass(frozen=True)
class Topics:
    """The topics of one node."""

    fleet: str
    node: str

    def __post_init__(self) -> None:
        check_name("fleet", self.fleet)
        check_name("node", self.node)

    @property
    def base(self) -> str:
        return f"{PREFIX}/{self.fleet}/{self.node}"

    @property
    def status(self) -> str:
        return f"{self.base}/status"

    @property
    def heartbeat(self) -> str:
        return f"{self.base}/heartbeat"

    @property
    def telemetry(self) -> str:
        return f"{self.base}/telemetry"

    @property
    def events(self) -> str:
        return f"{self.base}/events"

    @property
    def desired_models(self) -> str:
        return f"{self.base}/desired/models"

    @property
    def desired_trust(self) -> str:
        return f"{self.base}/desired/trust"

    def cmd(self, cmd_id: str) -> str:
        return f"{self.base}/cmd/{_cmd_id(cmd_id)}"

    def cmd_result(self, cmd_id: str) -> str:
        return f"{self.base}/cmd/{_cmd_id(cmd_id)}/result"

    @property
    def renew(self) -> str:
        return f"{self.base}/renew"

    @property
    def renew_answer(self) -> str:
        return f"{self.base}/renew/cert"

    @property
    def commands(self) -> str:
        """What the node subscribes to for its commands."""
        return f"{self.base}/cmd/+"

    @property
    def everything(self) -> str:
        """The node's whole subtree (its ACL)."""
        return f"{self.base}/#"


def client_id(fleet: str, node: str) -> str:
    """A node's MQTT client id (its session on the broker): ``{fleet}.{node}``."""
    return f"{fleet}.{node}"


def barrier(fleet: str) -> str:
    """Where an operator's tool publishes a marker after subscribing to the fleet's statuses
    (``fleet_filter(fleet, "status")`` matches it; no node is named ``_fleet``): the broker
    queues a new subscription's retained messages before what comes after, so the marker
    coming back says every retained status has come, and not coming back says some were not
    (a broker that drops what its queue cannot hold drops the marker too)."""
    return f"{PREFIX}/{check_name('fleet', fleet)}/_fleet/status"


def fleet_filter(fleet: str, kind: str) -> str:
    """An operator's subscription to one leaf of every node of a fleet (``status``...)."""
    if kind not in LEAVES:
        raise TopicError(f"kind '{kind}': one of {', '.join(LEAVES)}")
    return f"{PREFIX}/{check_name('fleet', fleet)}/+/{kind}"


ENROL_ID = re.compile(r"^[0-9a-f]{32}\Z")


def enrol_request(fleet: str, rid: str) -> str:
    """Where a device that has only the claim credential asks for its certificate (request id
    ``rid``: 32 hex digits it draws)."""
    return f"{PREFIX}/{check_name('fleet', fleet)}/_enrol/{_enrol_id(rid)}"


def enrol_answer(fleet: str, rid: str) -> str:
    """Where the fleet answers that request."""
    return f"{enrol_request(fleet, rid)}/cert"


def enrol_filter(fleet: str) -> str:
    """The fleet service's subscription to every request of the fleet."""
    return f"{PREFIX}/{check_name('fleet', fleet)}/_enrol/+"


def parse_enrol(topic: str) -> tuple[str, str]:
    """(fleet, request id) of an enrolment request's topic, or TopicError."""
    parts = topic.split("/")
    if len(parts) != 5 or "/".join(parts[:2]) != PREFIX or parts[3] != "_enrol":
        raise TopicError(f"'{topic}' is not an enrolment request")
    return check_name("fleet", parts[2]), _enrol_id(parts[4])


def _enrol_id(value: str) -> str:
    if not isinstance(value, str) or not ENROL_ID.match(value):
        raise TopicError(f"enrolment request id '{value}': 32 hex digits")
    return value


def parse(topic: str) -> Topic:
    """A topic of the contract as a ``Topic``, or TopicError."""
    parts = topic.split("/")
    if len(parts) < 5 or "/".join(parts[:2]) != PREFIX:
        raise TopicError(f"'{topic}' is not an {PREFIX} topic")
    fleet, node, rest = parts[2], parts[3], parts[4:]
    check_name("fleet", fleet)
    check_name("node", node)
    if len(rest) == 1 and rest[0] in LEAVES:
        return Topic(fleet, node, rest[0])
    if rest == ["desired", "models"]:
        return Topic(fleet, node, "desired-models")
    if rest == ["desired", "trust"]:
        return Topic(fleet, node, "desired-trust")
    if rest == ["renew"]:
        return Topic(fleet, node, "renew")
    if rest == ["renew", "cert"]:
        return Topic(fleet, node, "renew-answer")
    if len(rest) in (2, 3) and rest[0] == "cmd" and CMD_ID.match(rest[1]):
        if len(rest) == 2:
            return Topic(fleet, node, "cmd", rest[1])
        if rest[2] == "result":
            return Topic(fleet, node, "cmd-result", rest[1])
    raise TopicError(f"'{topic}' is not a topic of the contract")


def _cmd_id(value: str) -> str:
    if not isinstance(value, str) or not CMD_ID.match(value):
        raise TopicError(f"command id '{value}': 1 to 64 letters, digits, _ or -")
    return value
