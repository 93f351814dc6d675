"""The request context: what one API request carries through every call it makes, in one
context variable (``CONTEXT``; asyncio copies it into each task the request starts):

- ``qos`` (``current_qos()``): its QoS for the scheduler, Triton's ``priority`` and
  ``timeout`` (the deadline);
- ``route`` (``current_route()``, ``set_route``): its routing facts for the router: privacy
  (sticky: once private, every later call of the request is), a route override, the request id
  and every decision taken (the answer's ``route_trace``).

And, for a request made on a stream, ``RESPONSES``: where a decoupled model's responses go.

The log fields (request id, model, route, reason) are ``edged.logs``' own context, shared with
cloudsync.

A leaf: the data plane sets them, the scheduler, the router, the knowledge store and the task
graphs read them.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.errors import InvalidRequest


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
    override: str | None = None  # "local" | "cloud" | "hedged"
    request_id: str = ""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    # edged's own calls (a pipeline's warm-up when it loads): a drain does not stop them, or a
    # pipeline loaded while drained would stay unavailable after the resume
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
        override=None if override == "auto" else override,
        request_id=request_id,
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


@dataclass
class Responses:
    """Where a decoupled model's responses go: the stream that called ``model``. ``send`` takes
    the version that answers and one response's outputs; it waits while the stream's reader
    is behind (back-pressure)."""

    model: str
    send: Callable[[str, dict[str, np.ndarray]], Awaitable[None]]
    taken: bool = False  # a decoupled model answered through it


RESPONSES: contextvars.ContextVar[Responses | None] = contextvars.ContextVar(
    "edged_responses", default=None
)
