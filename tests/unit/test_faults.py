"""The fault points themselves (gateway/faults.py), in-process: the switch's form, and a point
acting only in its own operation, at the pass it names, with its call's error."""

from __future__ import annotations

import pytest

from sandgate import faults
from sandgate.app import make_service  # noqa: F401  (imports the core: every point declared)
from sandgate.drivers.base import SandboxError


def test_every_lifecycle_operation_has_points_and_names_are_operation_slash_step():
    ops = {p.split("/")[0] for p in faults.points()}
    assert ops == set(faults.OPERATIONS)
    assert "checkpoint/driver.checkpoint" in faults.points(failing=True)
    assert "checkpoint/driver.checkpoint.done" not in faults.points(failing=True)  # no call after it to fail


@pytest.mark.parametrize("bad", ["checkpoint", "checkpoint/driver.checkpoint", "a/b:explode", "a/b:kill:0",
                                 "a/b:kill:x", "a/b:kill:1:2"])
def test_a_malformed_switch_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="SANDGATE_FAULT"):
        faults.parse(bad)


def test_a_fail_point_raises_its_calls_error_at_the_nth_pass_of_its_own_operation_only():
    try:
        faults.install("checkpoint/driver.checkpoint:fail:2")
        point = faults.point("driver.checkpoint", "checkpoint", error=SandboxError)  # the declared one
        point()  # outside any operation: nothing
        with faults.operation("pause_disk"):
            point()
            point()  # another operation's passes do not count
        with faults.operation("checkpoint"):
            point()
            with pytest.raises(SandboxError, match="injected fault at checkpoint/driver.checkpoint"):
                point()
            point()  # once only
        assert faults.check_plan() is None
        faults.install("checkpoint/no.such.step:kill")
        assert "checkpoint/no.such.step" in faults.check_plan()
    finally:
        faults.install("")
    assert not any(p.armed for p in faults._points.values())
