"""The request context: what one API request carries through every call it makes, in one
context variable (``CONTEXT``; asyncio copies it into each task the request starts):

- ``qos`` (``current_qos()``): its QoS for the scheduler, Triton's ``priority`` and
  ``timeout`` (the deadline);
- ``route`` (``current_route()``, ``set_route``): its routing facts for the router: privacy
  (sticky: once private, every later call of the request is), a route override, the request id
  and every decision taken (the answer's ``route_trace``).

And, for a request made on a stream, ``RESPONSES``: where a decoupled model's responses go.

The log fields (request id, model, route, reason) are ``edged.common.logs``' own context,
shared with cloudsync.

A leaf: the data plane sets them, the scheduler, the router, the knowledge store and the task
graphs read them.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.common.errors import InvalidRequest


@dataclass(frozen=True)
class RequestQos:
    """What a request asks of the scheduler: its priority level and its deadline."""

    priority: int = 0  # 0: the model's default level
    deadline: float | None = None  # time.monotonic() by which the answer is of use


def qos_from_parameters(parameters: Mapping[str, Any]) -> RequestQos:
    """Triton's request parameters ``priority`` and ``timeout`` (microseconds)."""

    def count(key: str) -> int:
        value = parameters.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise InvalidRequest(f"parameter '{key}' must be a non-negative integer")
        if isinstance(value, float) and not value.is_integer():
            raise InvalidRequest(f"parameter '{key}' must be a non-negative integer")
        return int(value)

    priority, timeout_us = count("priority"), count("timeout")
    deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
    return RequestQos(priority, deadline)


ROUTE_PARAMETERS = ("private", "route", "explain")


@dataclass
class RouteContext:
    """Routing facts of one API request, shared with the steps of a pipeline."""

    deadline: float  # time.monotonic()
    private: bool = False  # once true, for every later call of the request (make_private)
    private_why: str = ""
    # the caller said ``private: false``: inputs of ``privacy: default-private`` models may leave
    released: bool = False
    override: str | None = None  # "local" | "cloud" | "hedged"
    request_id: str = ""
    uid: int | None = None  # the caller's (SO_PEERCRED), for the egress ledger
    decisions: list[dict[str, Any]] = field(default_factory=list)
    # edged's own calls (a pipeline's warm-up when it loads, an install's smoke test): a drain
    # does not stop them, or a pipeline loaded while drained would stay unavailable after the
    # resume; and no statistics count them, since no caller made them (own_call)
    internal: bool = False

    def make_private(self, why: str) -> None:
        """From now on everything this request derives stays on the device (never undone)."""
        if not self.private:
            self.private, self.private_why = True, why

    def summary(self) -> dict[str, Any]:
        """The decision that tells most about where the work ran: the first that left the
        device, else the first one that had a choice, else the first."""
        if not self.decisions:
            return {}
        for row in self.decisions:
            if row["route"] != "local":
                return row
        for row in self.decisions:
            if row["basis"] != "unavailable":
                return row
        return self.decisions[0]


# the uid of the process that made the current request (REST and gRPC set it per call)
CALLER: contextvars.ContextVar[int | None] = contextvars.ContextVar("edged_caller", default=None)


def route_context(
    parameters: Mapping[str, Any],
    default_deadline_s: float,
    request_id: str = "",
    deadline: float | None = None,
) -> RouteContext:
    """Read ``private`` and ``route`` from request parameters; the deadline is the QoS's
    (``deadline``), else ``default_deadline_s`` from now."""
    private = parameters.get("private", False)
    if not isinstance(private, bool):
        raise InvalidRequest("parameter 'private' must be true or false")
    override = parameters.get("route", "auto")
    if override not in ("local", "cloud", "hedged", "auto"):
        raise InvalidRequest("parameter 'route' must be 'auto', 'local', 'cloud' or 'hedged'")
    if deadline is None:
        deadline = time.monotonic() + default_deadline_s
    return RouteContext(
        deadline=deadline,
        private=private,
        private_why="the request is private" if private else "",
        released="private" in parameters and private is False,
        override=None if override == "auto" else override,
        request_id=request_id,
        uid=CALLER.get(),
    )


@dataclass(frozen=True)
class RequestContext:
    """One request's context: its QoS for the scheduler and its routing facts for the router
    (None for edged's own calls outside a request, until the router gives them some)."""

    qos: RequestQos = field(default_factory=RequestQos)
    route: RouteContext | None = None


CONTEXT: contextvars.ContextVar[RequestContext] = contextvars.ContextVar(
    "edged_request",
    default=RequestContext(),  # noqa: B039 (frozen: immutable)
)


def enter(qos: RequestQos, route: RouteContext) -> contextvars.Token[RequestContext]:
    """The context of a request that starts here (its pipeline steps inherit it)."""
    return CONTEXT.set(RequestContext(qos, route))


def current_qos() -> RequestQos:
    return CONTEXT.get().qos


def current_route() -> RouteContext | None:
    return CONTEXT.get().route


def set_route(ctx: RouteContext) -> contextvars.Token[RequestContext]:
    """Routing facts for what follows in this context (the QoS kept); ``CONTEXT.reset`` with
    the token puts the ones before back."""
    return CONTEXT.set(RequestContext(CONTEXT.get().qos, ctx))


def own_call() -> bool:
    """Whether the call running now is edged's own, not a caller's: the statistics and the
    request metrics leave it out, so that they show what callers asked for."""
    route = current_route()
    return route is not None and route.internal


@contextlib.contextmanager
def own_calls(deadline_s: float = 60.0) -> Iterator[None]:
    """Mark the model calls made inside as edged's own (a check it runs at load), with their
    own deadline, ``deadline_s`` from now; the context before comes back after."""
    token = set_route(RouteContext(deadline=time.monotonic() + deadline_s, internal=True))
    try:
        yield
    finally:
        CONTEXT.reset(token)


SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")  # Triton's names
MAX_SEQUENCE_ID = 256  # characters of a string sequence id


@dataclass
class Sequence:
    """One sequence of a stateful model on a stream: the model's own state between requests."""

    id: int | str
    state: dict[str, Any] = field(default_factory=dict)
    used: float = field(default_factory=time.monotonic)
    end: bool = False  # this request is the sequence's last


class Sequences:
    """The open sequences of one stream (Triton's sequence batching, kept per stream): a
    sequence lives on the stream that started it, at most ``limit`` at once per model, and is
    dropped when it ends, when it has been idle for its model's ``max_sequence_idle`` or when
    the stream goes (no other caller can reach it)."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self.open: dict[tuple[str, int | str], Sequence] = {}

    def take(self, model: str, parameters: Mapping[str, Any], idle_s: float) -> Sequence:
        """The sequence a request of ``model`` belongs to, started by ``sequence_start``;
        InvalidRequest naming the parameter when it has none, or one not open."""
        sid = parameters.get("sequence_id")
        if not (
            (isinstance(sid, int) and not isinstance(sid, bool) and sid > 0)
            or (isinstance(sid, str) and 0 < len(sid) <= MAX_SEQUENCE_ID)
        ):
            raise InvalidRequest(
                f"model '{model}' is stateful: parameter 'sequence_id' must be an integer > 0"
                f" or a string of 1 to {MAX_SEQUENCE_ID} characters"
            )
        flags = [parameters.get(key, False) for key in SEQUENCE_PARAMETERS[1:]]
        if not all(isinstance(flag, bool) for flag in flags):
            raise InvalidRequest("parameters 'sequence_start' and 'sequence_end' must be booleans")
        start, end = flags
        now = time.monotonic()
        for key, open_one in list(self.open.items()):
            if key[0] == model and now - open_one.used > idle_s:
                del self.open[key]
        key = (model, sid)
        if start:
            self.open.pop(key, None)  # a start on an open sequence starts it again
            if sum(k[0] == model for k in self.open) >= self.limit:
                raise InvalidRequest(
                    f"model '{model}': {self.limit} sequences are open on this stream already;"
                    " end one (sequence_end) first"
                )
            self.open[key] = Sequence(sid)
        found = self.open.get(key)
        if found is None:
            raise InvalidRequest(
                f"model '{model}': sequence {sid!r} is not open on this stream (it never"
                f" started, ended, or was idle for over {idle_s:g} s): start it with"
                " sequence_start"
            )
        found.used, found.end = now, end
        if end:
            del self.open[key]
        return found


@dataclass
class Responses:
    """Where a decoupled model's responses go: the stream that called ``model``. ``send`` takes
    the version that answers and one response's outputs; it waits while the stream's reader
    is behind (back-pressure). ``sequences`` holds the stream's open sequences."""

    model: str
    send: Callable[[str, dict[str, np.ndarray]], Awaitable[None]]
    sequences: Sequences | None = None
    taken: bool = False  # a decoupled model answered through it


RESPONSES: contextvars.ContextVar[Responses | None] = contextvars.ContextVar(
    "edged_responses", default=None
)
