"""Log lines as JSON objects (``--log-format json`` / ``SANDGATE_LOG_FORMAT=json``), one per line, for
log pipelines: time, level, logger, message, and the sandbox and tenant ids a line names, as fields."""

from __future__ import annotations

import json
import logging
import re
import time

SANDBOX = re.compile(r"\bsandbox ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b")
TENANT = re.compile(r"\btenant ([A-Za-z0-9_.-]+)\b")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "message": message}
        for name, pattern in (("sandbox", SANDBOX), ("tenant", TENANT)):
            found = pattern.search(message)
            if found:
                line[name] = found.group(1)
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
