"""A sandbox's lifecycle: one enum and one transition table.

Every change of state goes through ``Lifecycle.check``; a move the table does
not allow is a bug in the core, not a user error, and raises. Requests that
arrive while a sandbox is in a *transient* state are held and delivered once
it runs again; a request the current state cannot serve at all gets a 409
naming the state (see errors.Conflict).
"""

from __future__ import annotations

import enum
from typing import Dict, FrozenSet


class State(str, enum.Enum):
    STARTING = "starting"  # the runtime is being created (cold, from a checkpoint or the pool)
    RUNNING = "running"  # the agent answers; messages flow
    CHECKPOINTING = "checkpointing"  # running state and files being saved; it runs again after
    PAUSING = "pausing"  # on its way to paused (disk) or frozen (memory)
    PAUSED = "paused"  # running state on disk, no runtime, no memory held
    FROZEN = "frozen"  # paused in memory: runtime kept, CPU stopped
    RESUMING = "resuming"  # back from paused or frozen
    RESTARTING = "restarting"  # ipykernel (or the whole runtime) restarting, files kept
    DEAD = "dead"  # the runtime is gone or the kernel gave up; the reason says why; restart revives it
    DELETED = "deleted"  # removed for good; the record is gone

    def __str__(self) -> str:  # log lines and messages read "state paused", not "State.PAUSED"
        return self.value


S = State
TRANSITIONS: Dict[State, FrozenSet[State]] = {
    S.STARTING: frozenset({S.RUNNING, S.DEAD}),
    S.RUNNING: frozenset({S.CHECKPOINTING, S.PAUSING, S.RESTARTING, S.DEAD, S.DELETED}),
    # A failed checkpoint leaves the sandbox running, or dead if the runtime stopped first; paused
    # (from the image it took) if it stopped the runtime and could not restore it from that image.
    S.CHECKPOINTING: frozenset({S.RUNNING, S.PAUSED, S.DEAD}),
    # A failed pause leaves it running (or dead); the gateway's shutdown pauses to disk.
    S.PAUSING: frozenset({S.PAUSED, S.FROZEN, S.RUNNING, S.DEAD}),
    S.PAUSED: frozenset({S.RESUMING, S.DELETED}),
    # Frozen to disk goes through running (thawed, then checkpointed).
    S.FROZEN: frozenset({S.RESUMING, S.DEAD, S.DELETED}),
    # A failed resume leaves the image whole (paused again) or the runtime frozen (frozen again),
    # and the next call retries.
    S.RESUMING: frozenset({S.RUNNING, S.PAUSED, S.FROZEN, S.DEAD}),
    S.RESTARTING: frozenset({S.RUNNING, S.DEAD}),
    S.DEAD: frozenset({S.RESTARTING, S.DELETED}),
    S.DELETED: frozenset(),
}

# Messages that arrive in these states wait (bounded) and are delivered in order
# once the sandbox is running; paused and frozen ones also wake the sandbox.
HOLDING: FrozenSet[State] = frozenset({S.STARTING, S.CHECKPOINTING, S.PAUSING, S.PAUSED, S.FROZEN,
                                       S.RESUMING, S.RESTARTING})
WAKES: FrozenSet[State] = frozenset({S.PAUSED, S.FROZEN})
# States a record can be left in by a gateway that stopped; anything else was mid-flight.
AT_REST: FrozenSet[State] = frozenset({S.PAUSED, S.DEAD})


class IllegalTransition(RuntimeError):
    pass


def check(old: State, new: State) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{old} -> {new} is not a lifecycle transition")


def table_markdown() -> str:
    """The table as docs/architecture.md shows it (kept in sync by a test)."""
    rows = ["| from | to |", "| --- | --- |"]
    for old, targets in TRANSITIONS.items():
        rows.append(f"| {old} | {', '.join(t.value for t in State if t in targets) or '(final)'} |")
    return "\n".join(rows)
