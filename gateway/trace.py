"""Opt-in spans of kernel messages, for finding where a round trip's time goes.

The `trace` setting (``SANDGATE_TRACE=1``) turns it on (``enable``, at start); off, each hook
is one attribute test. The gateway stamps a client's request when its
websocket frame arrives (``gw_ws_in``) and when it is written to the agent's
stream (``gw_out``) and sends both along in the kernel frame's ``trace``
field; a traced frame makes the agent stamp too: when its stdin thread read
the request (``ag_read``), when the event loop had it (``ag_in``; when the
stdin thread sends a shell request itself, ShellFastPath, when that thread
had it parsed), when it was on the way to the kernel (``ag_zmq``: its pipe, or
a ZMQ socket; the name is older than the pipe); and for each message from the
kernel, when the agent had read it (``ag_recv``) and when it went to the
stream (``ag_out``), together with the stamps of the request it answers. The gateway
adds when it read that frame (``gw_in``) and when it had written it to the
websockets (``gw_sent``), and logs one line per message on the
``sandgate.trace`` logger: every stamp in ms since ``gw_ws_in``, plus ``k``,
the kernel's own header date (when ipykernel made the message), and ``t0``,
``gw_ws_in`` itself (epoch seconds, to line a message up with other logs).

All stamps are wall-clock (``time.time()``): a gVisor sandbox reads the host's
clock. A VM's clock is set from the host's at boot and restore, so its stamps
may be off by a few ms. ``summarize`` turns the log lines into medians.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import re
import statistics
import time
from typing import Dict, Iterable, List, Optional

log = logging.getLogger("sandgate.trace")
ENABLED = False  # set once at start from the settings (enable)
ORDER = ("gw_ws_in", "gw_out", "ag_read", "ag_in", "ag_zmq", "k", "ag_recv", "ag_out", "gw_in", "gw_sent")
_received: "collections.OrderedDict[str, float]" = collections.OrderedDict()  # msg_id -> gw_ws_in


def enable(on: bool) -> None:
    global ENABLED
    ENABLED = on


def ws_received(header: dict) -> None:
    """A client's message arrived on a websocket."""
    msg_id = header.get("msg_id")
    if ENABLED and isinstance(msg_id, str):
        _received[msg_id] = time.time()
        while len(_received) > 256:
            _received.popitem(last=False)


def request_stamps(parts: List[bytes]) -> Optional[Dict[str, float]]:
    """The stamps a request carries to the agent (None: not tracing)."""
    if not ENABLED:
        return None
    now = time.time()
    try:
        t = _received.pop(json.loads(parts[0])["msg_id"], now)
    except (ValueError, KeyError, TypeError, IndexError):
        t = now
    return {"gw_ws_in": t, "gw_out": now}


def _epoch(date) -> Optional[float]:
    try:
        return dt.datetime.fromisoformat(str(date).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def delivered(channel: str, parts: List[bytes], stamps: Dict[str, float], gw_in: float) -> None:
    """A traced message from the kernel went out to the websockets."""
    stamps = {**stamps, "gw_in": gw_in, "gw_sent": time.time()}
    try:
        header, parent = json.loads(parts[0]), json.loads(parts[1])
    except (ValueError, IndexError):
        return
    k = _epoch(header.get("date"))
    if k is not None:
        stamps["k"] = k
    t0 = stamps.get("gw_ws_in")
    if t0 is None:  # not an answer to a traced request (e.g. output between cells)
        return
    line = {"parent": parent.get("msg_id"), "channel": channel, "msg_type": header.get("msg_type"), "t0": t0}
    if header.get("msg_type") == "status":
        try:
            line["msg_type"] = "status:" + json.loads(parts[3]).get("execution_state", "?")
        except (ValueError, IndexError, AttributeError):
            pass
    line.update({k: round((stamps[k] - t0) * 1e3, 2) for k in ORDER if stamps.get(k)})
    log.info("trace %s", json.dumps(line, separators=(",", ":")))


_LINE = re.compile(r"trace (\{.*\})")


def summarize(lines: Iterable[str]) -> Dict[str, Dict[str, float]]:
    """Median stamp (ms since gw_ws_in) per message type, from trace log lines."""
    by_type: Dict[str, Dict[str, List[float]]] = {}
    for text in lines:
        m = _LINE.search(text)
        if not m:
            continue
        try:
            rec = json.loads(m.group(1))
        except ValueError:
            continue
        row = by_type.setdefault(rec.get("msg_type", "?"), {})
        for k in ORDER:
            if k in rec:
                row.setdefault(k, []).append(rec[k])
    return {t: {k: round(statistics.median(v), 2) for k, v in row.items()} | {"n": len(row.get("gw_sent", []))}
            for t, row in by_type.items()}
