"""The warm pool (core/pool.py) on the fake driver, in-process: its template,
and what happens when the template cannot be made."""

import asyncio
import logging

import pytest

from core_harness import driver_of, make, run, start
from sandgate.core import pool as pool_module


async def settled(service) -> None:
    """Until no refill is in flight."""
    while service.manager.pool._tasks:
        await asyncio.gather(*list(service.manager.pool._tasks), return_exceptions=True)


@run
async def test_a_template_that_could_not_be_made_is_tried_again_after_a_wait(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, "sandgate.pool")
    clock = [1000.0]
    monkeypatch.setattr(pool_module, "_clock", lambda: clock[0])
    service = make(tmp_path, warm_start=True, pool_size=1)
    pool, drv = service.manager.pool, driver_of(service)
    drv.fail["checkpoint"] = "No space left on device"

    pool.refill("fake")
    await settled(service)
    assert "warm start off for fake: could not make a template: " in caplog.text
    assert "trying again in 60 s" in caplog.text
    assert pool.templates == {} and pool.ready["fake"] == []
    # Meanwhile sandboxes start cold, and starting one does not try again.
    sb = await start(service)
    await settled(service)
    assert drv.restored == 0 and pool.templates == {}  # cold: no restore of anything
    assert caplog.text.count("could not make a template") == 1

    # A second failure waits twice as long.
    clock[0] += 61
    drv.fail["checkpoint"] = "No space left on device"
    pool.refill("fake")
    await settled(service)
    assert "trying again in 120 s" in caplog.text and pool.templates == {}

    # Once the cause is gone, the next try makes it and fills the pool.
    clock[0] += 121
    pool.refill("fake")
    await settled(service)
    assert list(pool.templates.values()) and len(pool.ready["fake"]) == 1
    assert "template checkpoint" in caplog.text
    assert pool.enabled("fake") and pool._retry == {}
    await service.manager.delete_all()
    assert not driver_of(service).live


@run
async def test_a_template_that_does_not_restore_is_made_anew_and_starts_go_cold_meanwhile(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, "sandgate")
    clock = [1000.0]
    monkeypatch.setattr(pool_module, "_clock", lambda: clock[0])
    service = make(tmp_path, warm_start=True, pool_size=0)  # every start restores the template
    pool, drv = service.manager.pool, driver_of(service)
    pool.refill("fake")
    await settled(service)
    (old,) = pool.templates.values()
    first = await start(service)
    assert drv.restored == 1 and drv.created == 1  # the template's own boot, then a restore of it

    # The template's image no longer restores: the start still succeeds, cold, and the template is forgotten.
    drv.fail["restore"] = "the image is damaged"
    second = await start(service)
    await settled(service)
    assert second.state.value == "running" and drv.created == 2 and drv.restored == 1
    assert "cold: the warm-start template did not restore" in caplog.text
    assert f"its template {old} did not restore: " in caplog.text and "a new one is made in 60 s" in caplog.text
    assert pool.templates == {}
    assert (tmp_path / "templates.json").read_text() == "{}"  # a restarted gateway forgets it too
    pool.template_failed("fake", old, Exception("met by a second start at once"))  # one wait, not two
    assert caplog.text.count(f"its template {old} did not restore") == 1 and pool._retry["fake"][1] == 60
    third = await start(service)  # within the wait: cold, nothing else tried
    await settled(service)
    assert drv.created == 3 and drv.restored == 1 and pool.templates == {}

    # After the wait, a new template is made and starts restore it again.
    clock[0] += 61
    pool.refill("fake")
    await settled(service)
    (new,) = pool.templates.values()
    assert new != old
    fourth = await start(service)
    assert drv.restored == 2 and drv.created == 4
    for sb in (first, second, third, fourth):
        out = await service.execute(sb.id, "print(6 * 7)", 10)
        assert out["stdout"] == "42\n", out
    await service.manager.delete_all()
    assert not drv.live


@run
async def test_a_template_start_whose_setup_fails_fails_that_start_and_keeps_the_template(tmp_path):
    """A setup that fails (a timeout on a loaded host, say) is the sandbox's failure: the template
    restored fine and stays, warm start stays on."""
    from sandgate.core.errors import SetupFailed

    service = make(tmp_path, warm_start=True, pool_size=0)  # every start restores the template
    pool, drv = service.manager.pool, driver_of(service)
    pool.refill("fake")
    await settled(service)
    (template,) = pool.templates.values()
    for inside in (True, False):
        drv.setup_on_reconnect, drv.fail_setup = inside, "the kernel did not answer"
        with pytest.raises(SetupFailed, match="could not take its environment: .*the kernel did not answer"):
            await start(service)
        assert list(pool.templates.values()) == [template] and "fake" not in pool._retry
    drv.fail_setup = None
    assert (await start(service)).state.value == "running" and list(pool.templates.values()) == [template]
