"""One error taxonomy for every front end.

The core raises these; the HTTP layer maps each class to one status in one
place (api/base.py), an MCP or SDK adapter to its own form. ``code`` is a
stable machine-readable name; the message is for people.
"""

from __future__ import annotations

from typing import Optional


class SandgateError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        if code:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class BadRequest(SandgateError):
    status, code = 400, "bad_request"


class CeilingExceeded(BadRequest):
    """A request asked for more than an operator ceiling allows."""

    code = "above_ceiling"


class Forbidden(SandgateError):
    """Not allowed for this caller or this path (outside the workspace)."""

    status, code = 403, "forbidden"


class NotFound(SandgateError):
    status, code = 404, "not_found"


class Conflict(SandgateError):
    """The sandbox's current state cannot serve the request."""

    status, code = 409, "conflict"

    def __init__(self, message: str, state: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message, code)
        self.state = state


class LimitReached(SandgateError):
    """A quota of the gateway is full (sandbox count, held messages)."""

    status, code = 403, "limit"


class QuotaExceeded(LimitReached):
    """A stored-bytes quota would be passed (a tenant's checkpoint storage): 413, naming it."""

    status, code = 413, "quota"


class Unavailable(SandgateError):
    """The runtime failed: could not start, restore or checkpoint; the message says why."""

    status, code = 503, "unavailable"


class SetupFailed(Unavailable):
    """A restored or pooled sandbox's agent could not take its environment
    (``setup``): this sandbox's failure, not its checkpoint's (a template is kept)."""


class RateLimited(SandgateError):
    """Too many requests of one kind too fast (a tenant's creation rate);
    ``retry_after`` is the seconds until one more is allowed."""

    status, code = 429, "rate_limited"

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class TooLarge(SandgateError):
    """A body, a file or a message past a size bound; the message names the bound."""

    status, code = 413, "too_large"

