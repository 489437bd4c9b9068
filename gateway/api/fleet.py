"""The fleet's own endpoints (admin only): ``GET /api/fleet`` (this node and the live ones)
and ``POST /api/fleet/drain``, which hands every sandbox of this node off to the others and
then stops this gateway, streaming one JSON line of progress per sandbox."""

from __future__ import annotations

import json

from ..core.errors import Conflict, Forbidden
from .base import APIHandler


class FleetHandler(APIHandler):
    def fleet(self):
        if not self.who.admin:
            raise Forbidden("the fleet's endpoints are the admin's (the gateway's token)")
        fleet = self.settings.get("fleet")
        if fleet is None:
            raise Conflict("this gateway is not part of a fleet (SANDGATE_REDIS_URL is not set)")
        return fleet

    async def get(self):
        fleet = self.fleet()
        self.reply({"node": fleet.store.node, "draining": fleet.draining, "nodes": await fleet.nodes()})


class DrainHandler(FleetHandler):
    async def post(self):
        fleet = self.fleet()
        steps = fleet.drain()
        first = await steps.__anext__() if self.service.list(self.who) else None  # a Conflict is still a JSON error
        self.set_header("Content-Type", "application/x-ndjson")
        moved = failed = 0
        step = first
        while True:
            if step is not None:
                moved, failed = moved + ("error" not in step), failed + ("error" in step)
                self.write(json.dumps(step) + "\n")
                await self.flush()
            try:
                step = await steps.__anext__()
            except StopAsyncIteration:
                break
        self.write(json.dumps({"drained": True, "moved": moved, "failed": failed}) + "\n")
        self.finish()
        self.settings["shutdown"]()  # this node has nothing left to serve


def routes() -> list:
    return [(r"/api/fleet/?", FleetHandler), (r"/api/fleet/drain", DrainHandler)]
