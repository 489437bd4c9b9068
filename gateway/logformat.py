"""Log lines as JSON objects (``--log-format json`` / ``SANDGATE_LOG_FORMAT=json``), one per line, for
log pipelines: time, level, logger, message, the sandbox and tenant ids a line names, and the id of the
HTTP request (or websocket) the line was logged for, as fields."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from typing import Optional

# Credentials a log line can carry, wherever it comes from (tornado's access, general and application
# loggers quote the request's URL; an exception's text can too): query values named token, access_token
# or api_key, a tenant's token (sgt.<name>.<secret>), an E2B-shaped key, and the serve token itself.
SECRET_QUERY = re.compile(r"([?&](?:token|access_token|api_key)=)[^&\s'\"#]*", re.I)
TENANT_TOKEN = re.compile(r"\bsgt\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
E2B_KEY = re.compile(r"\be2b_[0-9a-f]{8,}")
REDACTED = "[redacted]"
_secrets: set = set()  # literal values (the serve token): add_secret
SANDBOX = re.compile(r"\bsandbox ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b")
TENANT = re.compile(r"\btenant ([A-Za-z0-9_.-]+)\b")
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
# The request being served in this task (api/base.py sets it); a forwarded request keeps its id.
request_id: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("request_id", default=None)


def new_request_id(given: Optional[str]) -> str:
    """The client's ``X-Request-Id`` if it is a plain token, else a fresh one; set for this task."""
    rid = given if given and REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]
    request_id.set(rid)
    return rid


def add_secret(value: Optional[str]) -> None:
    """A value never to be logged as it is (the serve token), whatever carries it."""
    if value:
        _secrets.add(value)


def redact(text: str) -> str:
    text = SECRET_QUERY.sub(r"\1" + REDACTED, text)
    text = TENANT_TOKEN.sub(REDACTED, E2B_KEY.sub(REDACTED, text))
    for value in _secrets:
        text = text.replace(value, REDACTED)
    return text


class RedactSecrets(logging.Filter):
    """On every root handler (``setup``): each record's message, and its traceback, redacted before
    any formatter sees it, so no logger (tornado's, sandgate's, a library's) writes a credential."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "message": message}
        for name, pattern in (("sandbox", SANDBOX), ("tenant", TENANT)):
            found = pattern.search(message)
            if found:
                line[name] = found.group(1)
        rid = request_id.get()
        if rid:
            line["request"] = rid
        if record.exc_info or record.exc_text:  # exc_text: the traceback as RedactSecrets left it
            line["traceback"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(line)


def setup(level: str, fmt: str) -> None:
    if fmt == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level.upper(), handlers=[handler])
    else:
        logging.basicConfig(level=level.upper(), format="[%(levelname).1s %(asctime)s %(name)s] %(message)s",
                            datefmt="%H:%M:%S")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactSecrets())
