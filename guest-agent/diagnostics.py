"""The agent's log lines (on stderr) and the switch of its opt-in spans."""

from __future__ import annotations

import sys


class TRACE:
    """Opt-in spans, switched by the gateway (see Agent.trace_in)."""
    on = False
    read_at = 0.0  # when the stdin thread last read from the stream


def log(*args) -> None:
    print("sandgate-agent:", *args, file=sys.stderr, flush=True)
