"""Probes, without auth: they tell only that this process answers and whether it takes work.

``GET /healthz`` (readiness): 200 ``{"status": "ok", "node": <id>}``, or 503
``{"status": "stopping", "node": <id>}`` once the gateway is shutting down (SIGTERM, or the
end of a drain) or while a drain is moving its sandboxes away: take it out of a load balancer.

``GET /livez`` (liveness): 200 with the same body whenever the process answers, a drain
included; a liveness probe that failed during a long drain would restart the gateway midway.

Nothing else is revealed: no version, no counts, no sandbox ids.
"""

from __future__ import annotations

from tornado import web


class HealthHandler(web.RequestHandler):
    ready_only = True  # /healthz: a stopping gateway is a 503

    def stopping(self) -> bool:
        fleet = self.settings.get("fleet")
        return bool(self.settings.get("stopping")) or bool(fleet is not None and fleet.draining)

    def get(self):
        stopping = self.stopping()
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        if stopping and self.ready_only:
            self.set_status(503)
        self.finish({"status": "stopping" if stopping else "ok", "node": self.settings["sandgate"].node_id})


class LiveHandler(HealthHandler):
    ready_only = False


def routes() -> list:
    return [(r"/healthz", HealthHandler), (r"/livez", LiveHandler)]
