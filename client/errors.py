"""Typed errors, mapped from the gateway's ``{"reason", "message", "code"[, "state"]}``
(docs/api.md, "Errors"). Every one carries the server's ``status``, ``code``,
``reason`` and ``message``; ``str(e)`` is the message."""

from __future__ import annotations

import json
from typing import Optional


class SandgateError(Exception):
    """Base class: anything the SDK raises on purpose."""

    def __init__(self, message: str = "", *, status: Optional[int] = None, code: Optional[str] = None,
                 reason: Optional[str] = None, state: Optional[str] = None, body: Optional[dict] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.reason = reason
        self.state = state
        self.body = body or {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status}, code={self.code!r})"


class BadRequest(SandgateError):
    """400: validation, unknown driver, a limit above a ceiling (``code`` above_ceiling),
    a file op on a directory (``IsADirectoryError`` / ``NotADirectoryError``)."""


class AuthError(SandgateError):
    """401: no token, or a wrong one."""


class Forbidden(SandgateError):
    """403 ``forbidden``: the sandbox refused a file operation, or an admin-only call."""


class LimitReached(SandgateError):
    """403 ``limit``: SANDGATE_MAX_KERNELS, a tenant quota, a checkpoint bound, a full workspace."""


class QuotaExceeded(LimitReached):
    """413 ``quota``: a tenant's checkpoints would store more than its max_checkpoint_mb."""


class NotFound(SandgateError):
    """404: no such sandbox, checkpoint, file, tenant (or another tenant's)."""


class Conflict(SandgateError):
    """409: the sandbox's lifecycle state (``state``) cannot serve the request; also ``exists``."""


class SandboxDied(Conflict):
    """The sandbox is dead (409 with state ``dead``), or it died while running a cell
    (``execution`` then holds what the cell produced before)."""

    execution = None


class RateLimited(SandgateError):
    """429: a tenant created sandboxes too fast; ``retry_after`` is in seconds."""

    retry_after: Optional[float] = None


class Unavailable(SandgateError):
    """503: the runtime failed (start, restore, checkpoint, pause); or the gateway cannot be reached."""


class ServerError(SandgateError):
    """500: an unexpected error in the gateway."""


class Timeout(SandgateError):
    """A call did not finish in its timeout. For ``run_code``, the cell was
    interrupted by the gateway and ``execution`` holds its output so far."""

    execution = None


BY_CODE = {
    "bad_request": BadRequest, "above_ceiling": BadRequest, "IsADirectoryError": BadRequest,
    "NotADirectoryError": BadRequest, "forbidden": Forbidden, "limit": LimitReached, "quota": QuotaExceeded,
    "not_found": NotFound, "conflict": Conflict, "exists": Conflict, "in_use": Conflict, "rate_limited": RateLimited, "unavailable": Unavailable,
    "internal": ServerError,
}
BY_STATUS = {400: BadRequest, 401: AuthError, 403: Forbidden, 404: NotFound, 409: Conflict, 413: QuotaExceeded,
             429: RateLimited,
             500: ServerError, 501: Unavailable, 502: Unavailable, 503: Unavailable, 504: Timeout}


def error_from(status: Optional[int], body: bytes | dict | None, headers=None) -> SandgateError:
    """The typed error for an error answer (or an SSE ``error`` event: no status)."""
    if isinstance(body, (bytes, bytearray)):
        try:
            data = json.loads(body)
        except ValueError:
            data = {"message": body.decode("utf-8", "replace")[:2000]}
    else:
        data = body or {}
    if not isinstance(data, dict):
        data = {"message": str(data)}
    code, state = data.get("code"), data.get("state")
    cls = BY_CODE.get(code) or BY_STATUS.get(status or 0) or SandgateError
    if status == 401:
        cls = AuthError
    if cls is Conflict and state == "dead":
        cls = SandboxDied
    message = data.get("message") or data.get("reason") or f"HTTP {status}"
    err = cls(message, status=status, code=code, reason=data.get("reason"), state=state, body=data)
    if isinstance(err, RateLimited):
        ra = data.get("retry_after")
        if ra is None and headers is not None:
            ra = headers.get("Retry-After")
        try:
            err.retry_after = float(ra) if ra is not None else None
        except (TypeError, ValueError):
            err.retry_after = None
    return err
