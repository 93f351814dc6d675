"""Errors that carry their transport status; each transport maps them once."""

from __future__ import annotations

import math


class EdgedError(Exception):
    """Base error: a message for the user and the HTTP status that fits it."""

    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(EdgedError):
    """The request is malformed: bad JSON, wrong dtype or shape, missing input."""

    status = 400


class Forbidden(EdgedError):
    """The caller's uid/gid is not allowed by the server's configuration."""

    status = 403


class NotFound(EdgedError):
    """Unknown model or version."""

    status = 404


class Conflict(EdgedError):
    """The request cannot be done in the state things are in (another part depends on it)."""

    status = 409


class RequestTimeout(EdgedError):
    """The request did not arrive in time (a body sent too slowly)."""

    status = 408


class PayloadTooLarge(EdgedError):
    """The body is over the configured limit."""

    status = 413


class Unavailable(EdgedError):
    """The server or the model is not ready (still loading, failed to load, unloaded)."""

    status = 503


class InsufficientStorage(EdgedError):
    """A write would fill the disk: refused before anything is written."""

    status = 507


class Overloaded(EdgedError):
    """Admission control refused the request: a full queue, or a timeout that cannot be met.

    ``retry_after`` (seconds) estimates when the queue will have room; it becomes Retry-After.
    """

    status = 429

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(EdgedError):
    """The request's timeout expired before it could run."""

    status = 504


class ModelLoadError(EdgedError):
    """A model could not be loaded; the reason says why (corrupt file, missing dependency)."""

    status = 503


class ConfigError(EdgedError):
    """The daemon's configuration or a model's config.pbtxt is invalid."""

    status = 400


def retry_after(error: EdgedError) -> int | None:
    """Whole seconds for Retry-After: the scheduler's estimate when overloaded, 1 while the
    server or the model is not ready; None for errors that retrying does not mend."""
    if isinstance(error, Overloaded):
        return max(1, math.ceil(error.retry_after))
    if isinstance(error, Unavailable):
        return 1
    return None
