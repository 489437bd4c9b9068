"""Named fault points: where a test makes the gateway SIGKILL itself, or fail one call, on purpose.

Each point is declared once, at module level beside the code that passes it, with the
operations that reach it and the error its call raises::

    DRIVER_CHECKPOINT = faults.point("driver.checkpoint", "checkpoint", "pause_disk", error=SandboxError)
    ...
    DRIVER_CHECKPOINT()          # before the call
    await self.driver.checkpoint(...)

So importing the core lists every point (``points()``: ``"<operation>/<step>"``) without
running anything, and a test walks them all: a point added later is walked with no new
test code. A lifecycle method names its operation (``with operation("checkpoint"):``);
a point acts only inside one of its own operations, so a shared step (a driver call used
by a checkpoint and a pause) is two points, walked once each.

The switch, for tests only: ``SANDGATE_FAULT`` = comma-separated
``<operation>/<step>:kill|fail[:<n>]``, read once, here, at import. ``kill``: SIGKILL the
gateway the n-th time (default the first) it passes the point; ``fail``: raise, once, the
error the call after it would raise. Unset, a point costs one attribute check.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
from typing import Dict, Iterator, List, Optional, Tuple, Type

log = logging.getLogger("sandgate.faults")

ENV = "SANDGATE_FAULT"
# Every operation a point may name, in the order a walk takes them.
OPERATIONS = ("start", "checkpoint", "fork", "pause_disk", "pause_memory", "resume", "restart", "delete",
              "recover", "drain", "gc")

_operation: contextvars.ContextVar[str] = contextvars.ContextVar("sandgate_fault_operation", default="")
_points: Dict[str, "Point"] = {}


class InjectedFault(Exception):
    """What a ``fail`` raises where the point names no error of its own."""


class Point:
    __slots__ = ("step", "ops", "error", "armed", "_plans")

    def __init__(self, step: str, ops: Tuple[str, ...], error: Type[BaseException]):
        self.step, self.ops, self.error = step, ops, error
        self._plans: Dict[str, list] = {}  # operation -> [action, nth, seen]
        self.armed = False  # the one check a point costs when no test set a plan

    def __call__(self) -> None:
        if self.armed:
            self._hit()

    def _hit(self) -> None:
        op = _operation.get()
        plan = self._plans.get(op)
        if plan is None or plan[2] >= plan[1]:
            return
        plan[2] += 1
        if plan[2] != plan[1]:
            return
        where = f"{op}/{self.step}"
        if plan[0] == "kill":
            log.warning("fault point %s: killing the gateway (%s)", where, ENV)
            for h in logging.getLogger().handlers:  # that line is the last this process writes
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        log.warning("fault point %s: failing the call (%s)", where, ENV)
        raise self.error(f"injected fault at {where} ({ENV})")


def point(step: str, *ops: str, error: Type[BaseException] = InjectedFault) -> Point:
    """Declare the point ``step`` of operations ``ops`` (at module level); ``error``: what the
    call it stands before raises, for ``fail``."""
    unknown = [o for o in ops if o not in OPERATIONS]
    if unknown or not ops:
        raise ValueError(f"fault point {step}: unknown operations {unknown or '(none)'}")
    p = _points.get(step)
    if p is None:
        p = _points[step] = Point(step, tuple(ops), error)
    else:  # the same step declared again elsewhere: one point, the union of its operations
        p.ops = tuple(dict.fromkeys(p.ops + ops))
    _arm(p)
    return p


def points() -> List[str]:
    """Every point, ``<operation>/<step>``, by operation (OPERATIONS' order), then step."""
    return sorted((f"{op}/{p.step}" for p in _points.values() for op in p.ops),
                  key=lambda s: (OPERATIONS.index(s.split("/")[0]), s))


@contextlib.contextmanager
def operation(name: str) -> Iterator[None]:
    """The lifecycle operation running in this task, for the points it passes."""
    token = _operation.set(name)
    try:
        yield
    finally:
        _operation.reset(token)


def parse(text: str) -> Dict[str, Tuple[str, int]]:
    """``SANDGATE_FAULT``'s value: ``{"<op>/<step>": (action, nth)}``; ValueError saying what is wrong."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or "/" not in parts[0] or parts[1] not in ("kill", "fail") or (
                len(parts) == 3 and not (parts[2].isdigit() and int(parts[2]) > 0)):
            raise ValueError(f"{ENV}: {item!r} is not '<operation>/<step>:kill|fail[:<n>]'")
        out[parts[0]] = (parts[1], int(parts[2]) if len(parts) == 3 else 1)
    return out


def check_plan() -> Optional[str]:
    """Once every module is imported: what in the plan names no point (None: all fine)."""
    missing = sorted(set(_plan) - set(points()))
    return f"{ENV} names no fault point: {', '.join(missing)} (see faults.points())" if missing else None


def _arm(p: Point) -> None:
    for where, (action, nth) in _plan.items():
        op, _, step = where.partition("/")
        if step == p.step and op in p.ops:
            p._plans[op] = [action, nth, 0]
            p.armed = True


try:
    _plan = parse(os.environ.get(ENV, ""))
    _plan_error: Optional[str] = None
except ValueError as e:  # reported by check_plan's caller as a clear error, not at import
    _plan, _plan_error = {}, str(e)


def plan_error() -> Optional[str]:
    return _plan_error or check_plan()
