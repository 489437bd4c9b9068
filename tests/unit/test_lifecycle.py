"""The core's lifecycle on the fake driver: every transition and the races
between messages and lifecycle operations, in seconds. The same behaviours
run end to end against real sandboxes in test_restart.py and test_checkpoints.py."""

from __future__ import annotations

import asyncio
import datetime
import logging

import pytest

from core_harness import Client, driver_of, make, run, start
from sandgate.core import states
from sandgate.core.errors import CeilingExceeded, Conflict, Unavailable
from sandgate.core.service import LimitsRequest, StartRequest
from sandgate.core.states import State


def test_the_table_covers_every_state_and_refuses_the_rest():
    assert set(states.TRANSITIONS) == set(State)
    states.check(State.RUNNING, State.CHECKPOINTING)
    with pytest.raises(states.IllegalTransition):
        states.check(State.PAUSED, State.CHECKPOINTING)  # it must resume first
    with pytest.raises(states.IllegalTransition):
        states.check(State.DELETED, State.RUNNING)
    assert states.TRANSITIONS[State.DELETED] == frozenset()


@run
async def test_cells_sent_during_a_checkpoint_all_run_in_order(tmp_path, caplog):
    caplog.set_level(logging.INFO, "sandgate.sandbox")
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    await c.replies([c.execute("n = 0")])
    drv = driver_of(svc)
    drv.gates["checkpoint"] = asyncio.Event()
    cp = asyncio.ensure_future(svc.checkpoint(sb.id))
    await drv.entered["checkpoint"].wait()
    assert sb.state == State.CHECKPOINTING
    ids = [c.execute("n += 1\nn") for _ in range(8)]  # the 8 cells, all while it checkpoints
    assert len(sb.held) == 8
    drv.gates["checkpoint"].set()
    await cp
    got = await c.replies(ids)
    assert got["order"] == ids and all(got[i]["status"] == "ok" for i in ids)
    assert [got[i]["outputs"] for i in ids] == [[str(k)] for k in range(1, 9)]
    assert sb.state == State.RUNNING
    moves = [r.getMessage() for r in caplog.records if sb.id in r.getMessage() and "->" in r.getMessage()]
    assert any("running -> checkpointing" in m for m in moves) and any("checkpointing -> running" in m for m in moves)


@run
async def test_held_messages_are_bounded_and_the_excess_answered(tmp_path):
    svc = make(tmp_path, held_messages=3)
    sb = await start(svc)
    c = Client(sb)
    drv = driver_of(svc)
    drv.gates["checkpoint"] = asyncio.Event()
    cp = asyncio.ensure_future(svc.checkpoint(sb.id))
    await drv.entered["checkpoint"].wait()
    ids = [c.execute(f"{k}") for k in range(5)]
    refused = await c.replies(ids[3:])  # answered at once, not after the checkpoint
    assert all(refused[i]["status"] == "error" and refused[i]["ename"] == "SandboxBusy" for i in ids[3:])
    assert "at most 3" in refused[ids[3]]["evalue"]
    drv.gates["checkpoint"].set()
    await cp
    got = await c.replies(ids[:3])
    assert [got[i]["outputs"] for i in ids[:3]] == [["0"], ["1"], ["2"]]


@run
async def test_messages_during_pause_and_resume_wake_it_and_run_in_order(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    await c.replies([c.execute("x = 41")])
    drv = driver_of(svc)
    drv.gates["checkpoint"] = asyncio.Event()
    pause = asyncio.ensure_future(svc.pause(sb.id))
    await drv.entered["checkpoint"].wait()
    assert sb.state == State.PAUSING
    first = c.execute("x += 1\nx")  # arrives while pausing: held, then it wakes the sandbox again
    drv.gates["checkpoint"].set()
    await pause
    drv.gates["restore"] = asyncio.Event()
    await drv.entered["restore"].wait()  # the held message woke it
    assert sb.state == State.RESUMING
    second = c.execute("x += 1\nx")  # arrives while resuming
    drv.gates["restore"].set()
    got = await c.replies([first, second])
    assert got["order"] == [first, second] and [got[first]["outputs"], got[second]["outputs"]] == [["42"], ["43"]]
    assert sb.state == State.RUNNING and sb.record.paused_image is None


@run
async def test_frozen_sandbox_thaws_for_a_message(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    await c.replies([c.execute("y = 'kept'")])
    await svc.pause(sb.id, "memory")
    assert sb.state == State.FROZEN and sb.record.pause_mode == "memory" and sb.runtime is not None
    got = await c.replies([c.execute("y")])
    assert got[got["order"][0]]["outputs"] == ["'kept'"]
    assert sb.state == State.RUNNING and sb.record.pause_mode is None


@run
async def test_delete_during_pause_waits_for_it_and_answers_what_waits(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    drv = driver_of(svc)
    drv.gates["checkpoint"] = asyncio.Event()
    pause = asyncio.ensure_future(svc.pause(sb.id))
    await drv.entered["checkpoint"].wait()
    held = c.execute("1")
    delete = asyncio.ensure_future(svc.delete(sb.id))
    await asyncio.sleep(0)  # delete is now waiting for the lock (a pass of the loop, not a timing)
    assert not delete.done() and sb.state == State.PAUSING
    drv.gates["checkpoint"].set()
    await pause
    await delete
    assert sb.state == State.DELETED and await svc.manager.store.get(sb.id) is None
    got = await c.replies([held])
    assert got[held]["status"] == "error" and "deleted" in got[held]["evalue"]
    assert not (tmp_path / "paused" / sb.id).exists() and not sb.workspace.exists()
    with pytest.raises(Conflict):
        c.execute("1")


@run
async def test_checkpoint_during_resume_waits_and_then_succeeds(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    await c.replies([c.execute("z = 5")])
    await svc.pause(sb.id)
    drv = driver_of(svc)
    drv.gates["restore"] = asyncio.Event()
    resume = asyncio.ensure_future(svc.resume(sb.id))
    await drv.entered["restore"].wait()
    cp = asyncio.ensure_future(svc.checkpoint(sb.id, "after resume"))
    await asyncio.sleep(0)
    assert sb.state == State.RESUMING and not cp.done()
    drv.gates["restore"].set()
    await resume
    taken = await cp
    assert taken.name == "after resume" and sb.record.head == taken.id and sb.state == State.RUNNING


@run
async def test_a_failed_checkpoint_leaves_it_running(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    await c.replies([c.execute("w = 1")])
    driver_of(svc).fail["checkpoint"] = "disk on fire"
    with pytest.raises(Unavailable, match="disk on fire"):
        await svc.checkpoint(sb.id)
    assert sb.state == State.RUNNING
    got = await c.replies([c.execute("w")])
    assert got[got["order"][0]]["outputs"] == ["1"]


@run
async def test_a_checkpoint_that_fails_after_the_stop_is_dead_with_the_reason(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    driver_of(svc).fail["checkpoint_after_stop"] = "image write failed"
    with pytest.raises(Unavailable, match="image write failed"):
        await svc.checkpoint(sb.id)
    assert sb.state == State.DEAD and "image write failed" in sb.record.reason
    with pytest.raises(Conflict, match="is dead"):
        await svc.checkpoint(sb.id)


@run
async def test_a_dying_sandbox_answers_pending_cells_and_restart_revives_it(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    drv = driver_of(svc)
    mid = c.execute("#block forever\n1")
    await drv.at_gate["forever"].wait()
    sb.runtime.crash("out of memory")
    got = await c.replies([mid])
    assert got[mid]["ename"] == "DeadKernelError" and "out of memory" in got[mid]["evalue"]
    assert sb.state == State.DEAD and "out of memory" in sb.record.reason
    assert (await svc.manager.store.get(sb.id)).state == State.DEAD
    with pytest.raises(Conflict) as e:
        c.execute("1")
    assert e.value.state == "dead"
    with pytest.raises(Conflict, match="restart it instead"):
        await svc.resume(sb.id)
    await svc.restart(sb.id)
    assert sb.state == State.RUNNING and sb.record.reason is None
    got = await c.replies([c.execute("2")])
    assert got[got["order"][0]]["outputs"] == ["2"]


@run
async def test_limits_have_ceilings_and_forks_inherit(tmp_path):
    svc = make(tmp_path, max_memory_mb=2048, max_ttl=600)
    with pytest.raises(CeilingExceeded, match="memory_mb 1000000 .* ceiling of 2048 .*SANDGATE_MAX_MEMORY_MB"):
        await svc.start(StartRequest(limits=LimitsRequest(memory_mb=1_000_000)))
    with pytest.raises(CeilingExceeded, match="cpus 256 .*SANDGATE_MAX_CPUS"):
        await svc.start(StartRequest(limits=LimitsRequest(cpus=256)))
    with pytest.raises(CeilingExceeded, match="SANDGATE_MAX_TTL"):
        await svc.start(StartRequest(ttl=601))
    sb = await svc.start(StartRequest(limits=LimitsRequest(memory_mb=512, pids=64)))
    assert (sb.record.limits.memory_mb, sb.record.limits.pids, sb.record.limits.cpus) == (512, 64, 1.0)
    assert sb.record.expires is not None  # the lifetime ceiling applies without a ttl
    fork = await svc.fork(sb.id)
    assert fork.record.limits == sb.record.limits and fork.record.parent == sb.id


@run
async def test_max_sandboxes(tmp_path):
    svc = make(tmp_path, max_kernels=1)
    await start(svc)
    with pytest.raises(Exception, match=r"Maximum number of sandboxes \(1\)"):
        await start(svc)


@run
async def test_gateway_restart_keeps_paused_and_running_sandboxes(tmp_path):
    svc = make(tmp_path)
    running, paused, dead = await start(svc), await start(svc), await start(svc)
    for sb, code in ((running, "x = 41"), (paused, "x = 7"), (dead, "x = 0")):
        c = Client(sb)
        await c.replies([c.execute(code)])
    await svc.pause(paused.id)
    dead.runtime.crash("gone")
    while dead.state != State.DEAD:  # the watcher marks it
        await asyncio.sleep(0.01)
    await svc.manager.suspend_all()  # SIGTERM
    await svc.manager.store.close()

    again = make(tmp_path)  # the next `serve` on the same home
    await again.manager.recover()
    st = {sb.id: sb.state for sb in again.list()}
    assert st == {running.id: State.PAUSED, paused.id: State.PAUSED, dead.id: State.DEAD}
    for sid, want in ((running.id, "41"), (paused.id, "7")):
        c = Client(again.get(sid))
        got = await c.replies([c.execute("x")])  # resumed on first use, with its running state
        assert got[got["order"][0]]["outputs"] == [want]
        assert again.get(sid).state == State.RUNNING
    assert "gone" in again.get(dead.id).record.reason


@run
async def test_after_a_kill_a_sandbox_resumes_from_its_newest_checkpoint_or_is_dead(tmp_path):
    svc = make(tmp_path)
    saved, unsaved = await start(svc), await start(svc)
    c = Client(saved)
    await c.replies([c.execute("x = 41")])
    cp = await svc.checkpoint(saved.id)
    await c.replies([c.execute("x = 99")])  # lost with the kill: only the checkpoint remains
    # SIGKILL: nothing is paused; the store still says running.
    again = make(tmp_path)
    await again.manager.recover()
    back = again.get(saved.id)
    assert back.state == State.PAUSED and back.record.resume_from == cp.id
    assert cp.id in back.record.reason and "lost" in back.record.reason
    c2 = Client(back)
    got = await c2.replies([c2.execute("x")])
    assert got[got["order"][0]]["outputs"] == ["41"] and back.state == State.RUNNING
    lost = again.get(unsaved.id)
    assert lost.state == State.DEAD and "no checkpoint" in lost.record.reason
    for sb in svc.list():  # the first "gateway"'s fake runtimes
        await sb.teardown()


def culler_failures(kind: str) -> float:
    from sandgate.metrics import REGISTRY
    return REGISTRY.get_sample_value("sandgate_culler_failures_total", {"kind": kind}) or 0


@run
async def test_the_culler_survives_a_failure(tmp_path, monkeypatch):
    from sandgate.core.culler import Culler

    svc = make(tmp_path, cull_interval=0.01)
    sb = await svc.start(StartRequest(ttl=1))
    sb.record = sb.record.model_copy(update={"expires": 1.0})  # long past
    culler = Culler(svc.manager)
    failed = culler_failures("ttl")
    real_delete, calls = svc.manager.delete, []

    async def flaky_delete(sid):
        calls.append(sid)
        if len(calls) == 1:
            raise RuntimeError("injected")
        await real_delete(sid)

    monkeypatch.setattr(svc.manager, "delete", flaky_delete)
    culler.start()
    while sb.id in svc.manager.sandboxes:  # the next pass deletes it
        await asyncio.sleep(0.01)
    await culler.stop()
    assert culler.failures["ttl"] == 1 and len(calls) == 2
    assert culler_failures("ttl") == failed + 1  # sandgate_culler_failures_total, as /metrics shows it


@run
async def test_a_failing_pass_does_not_end_the_loop(tmp_path, monkeypatch):
    from sandgate.core.culler import Culler

    svc = make(tmp_path, cull_interval=0.01)
    culler = Culler(svc.manager)
    real, seen = culler.run_once, []
    failed = culler_failures("pass")

    async def boom():
        seen.append(1)
        if len(seen) == 1:
            raise RuntimeError("injected")
        await real()

    monkeypatch.setattr(culler, "run_once", boom)
    culler.start()
    while culler.passes < 2:
        await asyncio.sleep(0.01)
    await culler.stop()
    assert culler.failures["pass"] == 1 and culler_failures("pass") == failed + 1


@run
async def test_idle_sandboxes_pause_and_frozen_ones_go_to_disk(tmp_path):
    from sandgate.core.culler import Culler

    svc = make(tmp_path, pause_idle_timeout=0.01)
    sb = await start(svc)
    await svc.pause(sb.id, "memory")
    sb.last_activity -= datetime.timedelta(seconds=1)  # idle for longer than the timeout
    await Culler(svc.manager).run_once()
    assert sb.state == State.PAUSED and sb.record.pause_mode == "disk" and sb.runtime is None


@run
async def test_a_failed_resume_stays_paused_and_answers_the_waiting(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    await svc.pause(sb.id)
    driver_of(svc).fail["restore"] = "image unreadable"
    mid = c.execute("1")
    got = await c.replies([mid])
    assert got[mid]["ename"] == "SandboxUnavailable" and "image unreadable" in got[mid]["evalue"]
    assert "still paused, its state kept" in got[mid]["evalue"]
    assert sb.state == State.PAUSED and "image unreadable" in sb.record.reason
    await svc.resume(sb.id)  # the image was left whole: the next try works
    assert sb.state == State.RUNNING


@run
async def test_the_store_holds_every_state_it_passes(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    store = svc.manager.store
    assert (await store.get(sb.id)).state == State.RUNNING
    await svc.pause(sb.id)
    rec = await store.get(sb.id)
    assert rec.state == State.PAUSED and rec.paused_image and rec.version >= 3
    # compare-and-set: a write expecting a state the store no longer holds is refused
    assert not await store.compare_and_set(rec.model_copy(update={"state": State.RESUMING}), State.RUNNING)
    await svc.delete(sb.id)
    assert await store.get(sb.id) is None


@run
async def test_the_culler_leaves_a_sandbox_that_is_still_starting(tmp_path):
    from sandgate.core.culler import Culler

    svc = make(tmp_path, cull_idle_timeout=0.001)
    drv = driver_of(svc)
    drv.gates["create"] = asyncio.Event()
    starting = asyncio.ensure_future(start(svc))
    await drv.entered["create"].wait()
    (sid,) = svc.manager.sandboxes
    svc.get(sid).last_activity -= datetime.timedelta(seconds=10)
    await Culler(svc.manager).run_once()
    assert sid in svc.manager.sandboxes  # mid-start: not idle, whatever its clock says
    drv.gates["create"].set()
    sb = await starting
    assert sb.state == State.RUNNING and (datetime.datetime.now(datetime.timezone.utc) - sb.last_activity).total_seconds() < 5


@run
async def test_a_disk_size_is_refused_where_the_workspace_is_a_fixed_vm_disk(tmp_path):
    from sandgate.core.errors import BadRequest

    svc = make(tmp_path)  # the fake, like a VM driver, keeps its workspace as a plain directory
    with pytest.raises(BadRequest, match="disk_mb cannot be set for the fake driver"):
        await svc.start(StartRequest(limits=LimitsRequest(disk_mb=64)))


@run
async def test_sigterm_during_a_culler_pause_finishes_it_and_stops(tmp_path):
    from sandgate.core.culler import Culler

    svc = make(tmp_path, pause_idle_timeout=0.001, cull_interval=0.01)
    sb = await start(svc)
    sb.last_activity -= datetime.timedelta(seconds=10)
    drv = driver_of(svc)
    drv.gates["checkpoint"] = asyncio.Event()
    culler = Culler(svc.manager)
    culler.start()
    await drv.entered["checkpoint"].wait()  # the culler is pausing it
    stopping = asyncio.ensure_future(culler.stop())
    await asyncio.sleep(0)
    assert not stopping.done()  # waits for the pause in flight instead of cutting it
    drv.gates["checkpoint"].set()
    await stopping
    assert sb.state == State.PAUSED


@run
async def test_nothing_wakes_or_starts_while_the_gateway_suspends(tmp_path):
    svc = make(tmp_path)
    kept, gone = await start(svc), await start(svc)
    c = Client(kept)
    await c.replies([c.execute("x = 1")])
    drv = driver_of(svc)
    drv.gates["checkpoint"] = asyncio.Event()
    deleting = asyncio.ensure_future(svc.delete(gone.id))  # in flight when SIGTERM comes
    suspend = asyncio.ensure_future(svc.manager.suspend_all())
    await drv.entered["checkpoint"].wait()
    with pytest.raises(Unavailable, match="shutting down"):
        await start(svc)
    drv.gates["checkpoint"].set()
    await asyncio.gather(suspend, deleting)
    assert kept.state == State.PAUSED
    with pytest.raises(Unavailable, match="shutting down"):
        await svc.execute(kept.id, "x", 10)  # a request on a kept connection does not undo the pause
    assert kept.state == State.PAUSED and (await svc.manager.store.get(kept.id)).state == State.PAUSED
    assert await svc.manager.store.get(gone.id) is None  # the delete is not undone


@run
async def test_a_cell_running_through_a_checkpoint_shows_busy_after_it(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    drv = driver_of(svc)
    mid = c.execute("#block long\n7")
    await drv.at_gate["long"].wait()
    await svc.checkpoint(sb.id)
    assert sb.state == State.RUNNING and sb.execution_state == "busy"
    drv.cell_gates["long"].set()
    got = await c.replies([mid])
    assert got[mid]["outputs"] == ["7"]


@run
async def test_a_fork_is_set_up_once_inside_reconnect_or_else_after_it(tmp_path):
    """An agent that sets up inside `reconnect` gets no second `setup`; one from
    before (the fake's default) says nothing of it and gets `setup` after, once."""
    for inside in (False, True):
        svc = make(tmp_path / f"inside-{inside}")
        driver_of(svc).setup_on_reconnect = inside
        sb = await svc.start(StartRequest(env={"KERNEL_K": "v"}))
        agent = (await svc.fork(sb.id)).runtime.agent
        assert (agent.setups, agent.setups_on_reconnect) == ((0, 1) if inside else (1, 0))


@run
async def test_a_fork_whose_setup_fails_is_a_503_and_leaves_nothing(tmp_path):
    """Both ways: inside `reconnect` (the agent says setup_error) and as its own request."""
    from sandgate.core.errors import SetupFailed

    svc = make(tmp_path)
    drv = driver_of(svc)
    sb = await svc.start(StartRequest(env={"KERNEL_K": "v"}))
    for inside in (True, False):
        drv.setup_on_reconnect, drv.fail_setup = inside, "no room for the environment"
        with pytest.raises(SetupFailed, match="could not take its environment: .*no room for the environment"):
            await svc.fork(sb.id)
        assert [s.id for s in svc.list()] == [sb.id]
    drv.fail_setup = None
    assert (await svc.fork(sb.id)).state == State.RUNNING


@run
async def test_bad_env_names_are_a_400_not_an_agent_failure(tmp_path):
    from sandgate.core.errors import BadRequest

    svc = make(tmp_path)
    for env in ({"KERNEL_A=B": "x"}, {"KERNEL_A": "nul\0byte"}, {"": "x"}):
        with pytest.raises(BadRequest, match="env"):
            await svc.start(StartRequest(env=env))
    assert svc.list() == []


@run
async def test_a_checkpoint_is_deleted_only_when_nothing_needs_it(tmp_path):
    """On the core: a layered driver's (qemu's) newer checkpoint needs its parent;
    a whole one's (gVisor's) does not; a sandbox resuming from a checkpoint needs it."""
    svc = make(tmp_path)
    sb = await start(svc)
    c1 = await svc.checkpoint(sb.id)
    c2 = await svc.checkpoint(sb.id)
    c3 = await svc.checkpoint(sb.id)
    driver_of(svc).layered_checkpoints = True
    with pytest.raises(Conflict, match=f"checkpoint {c2.id} is layered on it") as e:
        await svc.delete_checkpoint(sb.id, c1.id)
    assert e.value.code == "in_use"
    driver_of(svc).layered_checkpoints = False
    await svc.delete_checkpoint(sb.id, c1.id)
    assert [c["id"] for c in svc.checkpoints(sb.id)] == [c2.id, c3.id]
    assert svc.manager.checkpoints.get(c2.id).parent is None
    sb.record.resume_from = c2.id  # as after a crash: it resumes from c2
    with pytest.raises(Conflict, match=f"sandbox {sb.id} resumes from it"):
        await svc.delete_checkpoint(sb.id, c2.id)
    with pytest.raises(Conflict, match="newest checkpoint"):
        await svc.delete_checkpoint(sb.id, c3.id)


# -- hostile lifecycle races and failures; end to end in tests/security/test_hostile_lifecycle.py
@run
async def test_a_checkpoint_or_pause_that_kills_the_sandbox_says_it_died_not_that_it_runs_on(tmp_path):
    svc = make(tmp_path)
    drv = driver_of(svc)
    for op in (svc.checkpoint, svc.pause):
        sb = await start(svc)
        drv.fail["checkpoint_and_die"] = "panic: an io_uring cannot be saved"
        with pytest.raises(Unavailable) as e:
            await op(sb.id)
        assert "runs on" not in str(e.value) and "died" in str(e.value) and "io_uring" in str(e.value)
        assert sb.state == State.DEAD and "io_uring" in sb.record.reason  # when answered, not later
        assert (await svc.manager.store.get(sb.id)).state == State.DEAD


@run
async def test_a_resume_or_restart_that_waited_for_a_delete_is_not_found(tmp_path):
    from sandgate.core.errors import NotFound

    svc = make(tmp_path)
    sb = await start(svc)
    drv = driver_of(svc)
    drv.gates["checkpoint"] = asyncio.Event()
    pause = asyncio.ensure_future(svc.pause(sb.id))
    await drv.entered["checkpoint"].wait()  # the pause holds the lock; the rest queue behind it in order
    delete = asyncio.ensure_future(svc.delete(sb.id))
    resume = asyncio.ensure_future(svc.resume(sb.id))
    restart = asyncio.ensure_future(svc.restart(sb.id))
    await asyncio.sleep(0)
    drv.gates["checkpoint"].set()
    await pause
    await delete
    for late in (resume, restart):
        with pytest.raises(NotFound, match=sb.id):
            await late
    with pytest.raises(NotFound):
        await svc.resume(sb.id)


@run
async def test_a_gateway_killed_mid_resume_finds_the_sandbox_paused_with_its_image(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    c = Client(sb)
    await c.replies([c.execute("x = 41")])
    await svc.pause(sb.id)
    drv = driver_of(svc)
    drv.gates["restore"] = asyncio.Event()
    resuming = asyncio.ensure_future(svc.resume(sb.id))
    await drv.entered["restore"].wait()
    assert (await svc.manager.store.get(sb.id)).state == State.RESUMING
    again = make(tmp_path)  # SIGKILL here: the next `serve` on the same home
    await again.manager.recover()
    back = again.get(sb.id)
    assert back.state == State.PAUSED and back.record.paused_image and back.record.pause_mode == "disk"
    c2 = Client(back)
    got = await c2.replies([c2.execute("x + 1")])
    assert got[got["order"][0]]["outputs"] == ["42"] and back.state == State.RUNNING
    assert not (tmp_path / "paused" / sb.id).exists()
    resuming.cancel()
    for s in (sb, back):
        await s.teardown()


@run
async def test_a_gateway_killed_mid_delete_finishes_it_at_the_next_start(tmp_path):
    from sandgate.core.errors import NotFound

    svc = make(tmp_path)
    sb, other = await start(svc), await start(svc)
    cp = await svc.checkpoint(sb.id)
    drv = driver_of(svc)
    drv.gates["destroy"] = asyncio.Event()
    drv.entered["destroy"].clear()  # the checkpoint's stop destroyed the runtime it replaced
    deleting = asyncio.ensure_future(svc.delete(sb.id))
    await drv.entered["destroy"].wait()  # mid-teardown
    again = make(tmp_path)  # SIGKILL here: the next `serve` on the same home
    await again.manager.recover()
    with pytest.raises(NotFound):
        again.get(sb.id)
    assert [s.id for s in again.list()] == [other.id]
    assert not (tmp_path / "workspaces" / sb.id).exists() and not (tmp_path / "sandboxes" / sb.id).exists()
    with pytest.raises(KeyError):
        again.manager.checkpoints.get(cp.id)  # collected, as the delete would have
    deleting.cancel()
    for s in (sb, other, again.get(other.id)):
        drv.gates.pop("destroy", None)
        await s.teardown()


@run
async def test_an_execute_waits_across_a_pause_and_says_so_if_still_paused_at_its_timeout(tmp_path):
    svc = make(tmp_path)
    sb = await start(svc)
    drv = driver_of(svc)
    for mode in ("disk", "memory"):  # paused and resumed within the call's timeout: it gets the output
        drv.cell_gates[mode] = asyncio.Event()
        call = asyncio.ensure_future(svc.execute(sb.id, f"#block {mode}\nprint('{mode}')", 20))
        await drv.at_gate[mode].wait()
        await svc.pause(sb.id, mode)
        await svc.resume(sb.id)
        drv.cell_gates[mode].set()
        out = await call
        assert out["status"] == "ok" and out["stdout"] == f"{mode}\n", out
    drv.cell_gates["kept"] = asyncio.Event()
    call = asyncio.ensure_future(svc.execute(sb.id, "#block kept\nprint('kept')", 1))
    await drv.at_gate["kept"].wait()
    await svc.pause(sb.id)
    out = await asyncio.wait_for(call, 5)  # at its timeout, not ten seconds after it
    assert out["status"] == "timeout" and out["error"]["ename"] == "SandboxPaused", out
    assert "not interrupted" in out["error"]["evalue"] and sb.state == State.PAUSED
    c = Client(sb)
    drv.cell_gates["kept"].set()
    got = await c.replies([c.execute("1 + 1")])  # wakes it; the kept cell ends first
    assert got[got["order"][0]]["outputs"] == ["2"]


@run
async def test_an_egress_change_that_fails_or_is_refused_changes_nothing(tmp_path):
    from sandgate.core.tunnel import EgressHook
    from sandgate.egress.policy import EgressPolicy

    svc = make(tmp_path)
    published = []
    svc.manager.egress = EgressHook(connect=None, set_policy=lambda sid, policy, *a: published.append(policy),
                                    forget=lambda sid: published.append(None))
    sb = await start(svc)
    with pytest.raises(Unavailable, match="left as it was"):  # the fake agent cannot open a listener
        await svc.set_egress(sb.id, EgressPolicy(allow=["example.com"]))
    assert sb.record.egress is None and sb.record.egress_port is None and published[-1] is None
    assert (await svc.manager.store.get(sb.id)).egress is None
    await svc.pause(sb.id)  # paused: applied at its resume
    await svc.set_egress(sb.id, EgressPolicy(allow=["example.com"]))
    assert (await svc.manager.store.get(sb.id)).egress.allow == ["example.com"]
    dead = await start(svc)
    dead.runtime.crash("gone")
    while dead.state != State.DEAD:
        await asyncio.sleep(0.01)
    for had in (None, EgressPolicy(allow=["kept.example"])):  # without egress, and with it
        dead.record = dead.record.model_copy(update={"egress": had, "egress_port": had and 3128})
        await dead.save()
        with pytest.raises(Conflict, match="dead"):
            await svc.set_egress(dead.id, EgressPolicy(allow=["example.com"]))
        dump = lambda p: p and p.model_dump()  # noqa: E731
        assert dump(dead.record.egress) == dump(had) == dump((await svc.manager.store.get(dead.id)).egress)
