"""``GET /metrics``: the Prometheus exposition (gateway/metrics.py), for the admin's token only:
counts across every tenant would tell one tenant about the others."""

from __future__ import annotations

from .. import metrics
from ..core.errors import Forbidden
from .base import APIHandler


class MetricsHandler(APIHandler):
    def get(self):
        if not self.who.admin:
            raise Forbidden("metrics are the admin's (the gateway's token)")
        body, content_type = metrics.exposition()
        self.set_header("Content-Type", content_type)
        self.finish(body)


def routes() -> list:
    return [(r"/metrics", MetricsHandler)]
