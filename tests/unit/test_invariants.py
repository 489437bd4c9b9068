"""The invariant checker's ledger (bench/invariants.py), in-process: what a client's
acknowledged executes, checkpoints, restarts and deletes allow a counter to be."""

from __future__ import annotations

from sandgate_bench.invariants import COUNTER_CELL, Ledger, Violation


def test_acknowledged_executes_pin_the_counter_and_a_repeat_is_a_violation():
    led = Ledger()
    led.created("a")
    for n in (1, 2):
        led.sent("a")
        led.acked("a", n)
    assert led.exact("a") == 2 and not led.problems
    led.sent("a")
    led.acked("a", 4)  # ran twice, or one unseen run: nothing explains it
    assert [p.kind for p in led.problems] == ["counter"]
    assert "allow 3" in str(led.problems[0])


def test_an_unanswered_execute_may_or_may_not_have_run():
    led = Ledger()
    led.created("a")
    led.sent("a")
    led.unanswered("a")
    led.sent("a")
    led.acked("a", 2)  # the first one did run
    led.sent("a")
    led.acked("a", 3)
    assert not led.problems and led.exact("a") == 3
    led2 = Ledger()
    led2.created("b")
    led2.sent("b")
    led2.unanswered("b")
    led2.sent("b")
    led2.acked("b", 1)  # it did not
    assert not led2.problems


def test_going_back_to_a_checkpoint_is_a_claim_the_gateway_must_confirm():
    led = Ledger()
    led.created("a")
    led.sent("a")
    led.acked("a", 1)
    led.checkpointed("a", "c1")
    led.sent("a")
    led.acked("a", 2)
    led.sent("a")
    led.acked("a", 2)  # back at c1's 1, plus this cell
    assert not led.problems and led.claims == {"a": "c1"}


def test_a_fork_starts_from_its_checkpoint_and_a_restart_from_zero():
    led = Ledger()
    led.created("a")
    led.sent("a")
    led.acked("a", 1)
    led.checkpointed("a", "c1")
    led.forked("f", "c1")
    assert led.exact("f") == 1
    led.restarted("a", acknowledged=False)
    led.sent("a")
    led.acked("a", 1)  # the restart happened after all
    led.restarted("f")
    assert led.exact("f") == 0 and not led.problems
    assert "+ 1" in COUNTER_CELL and str(Violation("leak", "x")) == "leak: x"
