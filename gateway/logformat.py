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
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup(level: str, fmt: str) -> None:
    if fmt == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level.upper(), handlers=[handler])
    else:
        logging.basicConfig(level=level.upper(), format="[%(levelname).1s %(asctime)s %(name)s] %(message)s",
                            datefmt="%H:%M:%S")
