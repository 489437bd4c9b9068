"""The warm pool (core/pool.py) on the fake driver, in-process: its template,
and what happens when the template cannot be made."""

import asyncio
import logging

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
    assert sb.record.origin is None and pool.templates == {}
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
