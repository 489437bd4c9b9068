"""Jupyter messages the gateway makes itself, and the sandbox API's view of
kernel output. Messages are lists of parts: header, parent header, metadata,
content (JSON bytes), then buffers."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import List, Optional

from sandgate_wire import ABORTED, output_of  # noqa: F401 (the sandbox API's output dict, as the SDK's)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def iso(t: dt.datetime) -> str:
    # The exact form jupyter_server's GatewayClient parses: %Y-%m-%dT%H:%M:%S.%fZ
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def iso_epoch(t: float) -> str:
    return iso(dt.datetime.fromtimestamp(t, dt.timezone.utc))


def message(msg_type: str, content: dict, parent: Optional[dict] = None) -> List[bytes]:
    header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "sandgate",
              "session": (parent or {}).get("session", "sandgate"), "date": iso(utcnow()), "version": "5.3"}
    return [json.dumps(header).encode(), json.dumps(parent or {}).encode(), b"{}", json.dumps(content).encode()]


def status_message(state: str, parent: Optional[dict] = None) -> List[bytes]:
    return message("status", {"execution_state": state}, parent)


def error_reply(parent: dict, ename: str, evalue: str) -> List[bytes]:
    """An execute_reply the gateway gives in the kernel's place (the sandbox
    died, was deleted, or could not take the request)."""
    return message("execute_reply", {"status": "error", "ename": ename, "evalue": evalue,
                                     "traceback": [f"{ename}: {evalue}"], "execution_count": None}, parent)


