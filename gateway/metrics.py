"""Prometheus metrics (prometheus_client), served at ``GET /metrics``.

One registry of the gateway's own (not the library's global one, which
carries process collectors a library user may not want twice). Counters and
histograms are observed where things happen; sandboxes by state are read
from the manager at each scrape, so they are never stale.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

REGISTRY = CollectorRegistry()

# Latencies from a few milliseconds (a cell on a warm kernel) to minutes (a VM restore under TCG).
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

STARTS = Counter("sandgate_sandbox_starts", "Sandboxes started, by how: pool, template, checkpoint or cold",
                 ["driver", "path"], registry=REGISTRY)
RESTORE = Histogram("sandgate_restore_seconds", "Bringing a runtime back from a running-state image "
                    "(resume, fork, start from a checkpoint or the template)", ["driver"], buckets=SECONDS,
                    registry=REGISTRY)
EXECUTE = Histogram("sandgate_execute_seconds", "From an execute_request reaching the gateway to its "
                    "execute_reply leaving the sandbox", ["driver"], buckets=SECONDS, registry=REGISTRY)
CHECKPOINTS = Counter("sandgate_checkpoints", "Checkpoints taken", ["driver"], registry=REGISTRY)
CHECKPOINT_BYTES = Counter("sandgate_checkpoint_bytes", "Bytes checkpoints wrote: running state and the files "
                           "they added to the blob store", ["driver", "kind"], registry=REGISTRY)
FORWARDED = Counter("sandgate_forwarded_requests", "Requests forwarded to the node that holds the sandbox",
                    ["kind"], registry=REGISTRY)
EGRESS_REQUESTS = Counter("sandgate_egress_requests", "Requests the egress proxy decided", ["verdict"],
                          registry=REGISTRY)
EGRESS_BYTES = Counter("sandgate_egress_bytes", "Body bytes through the egress proxy", ["direction"],
                       registry=REGISTRY)
CULLER_PASSES = Counter("sandgate_culler_passes", "Passes of the culler over every sandbox (idle culls and "
                        "pauses, ttls, warm-pool refills)", registry=REGISTRY)
CULLER_FAILURES = Counter("sandgate_culler_failures", "Culler actions that failed, by kind: ttl, pause, cull, "
                          "or a whole pass", ["kind"], registry=REGISTRY)
HTTP_CONNECTIONS = Gauge("sandgate_http_connections", "Client connections still HTTP (a websocket leaves at "
                         "its upgrade), which SANDGATE_HTTP_MAX_CONNECTIONS caps", registry=REGISTRY)
HTTP_REFUSED = Counter("sandgate_http_refused", "Connections refused: over the cap in total, over the cap for "
                       "one client address, or an accept that failed (out of descriptors)", ["reason"],
                       registry=REGISTRY)
for _reason in ("total", "client", "accept"):
    HTTP_REFUSED.labels(_reason)
for _kind in ("ttl", "pause", "cull", "pass"):  # at zero from the start, so rate() sees the first failure
    CULLER_FAILURES.labels(_kind)


CLIENT_BYTES = Gauge("sandgate_client_bytes", "Bytes the gateway holds for its clients: request bodies being read, "
                     "answers not yet flushed, websocket output not yet sent (SANDGATE_CLIENT_MEMORY_MB bounds it)",
                     registry=REGISTRY)
CLIENT_BYTES_LIMIT = Gauge("sandgate_client_bytes_limit", "SANDGATE_CLIENT_MEMORY_MB, in bytes: past it new requests "
                           "get 503", registry=REGISTRY)
BUSY = Counter("sandgate_busy_refusals", "Requests refused with 503 because the gateway held as much for its clients "
               "as it may", registry=REGISTRY)


def watch_budget(budget) -> None:
    """Read the gateway's client budget (api/admission.py) at each scrape."""
    CLIENT_BYTES.set_function(lambda: budget.held)
    CLIENT_BYTES_LIMIT.set(budget.limit)


class SandboxStates:
    """``sandgate_sandboxes{state, driver}``: counted at each scrape from the live manager."""

    def __init__(self) -> None:
        self.manager = None

    def collect(self):
        family = GaugeMetricFamily("sandgate_sandboxes", "Sandboxes on this node, by lifecycle state",
                                   labels=["state", "driver"])
        counts: dict = {}
        for sb in (self.manager.list() if self.manager else []):
            key = (sb.state.value, sb.record.driver)
            counts[key] = counts.get(key, 0) + 1
        for (state, driver), n in sorted(counts.items()):
            family.add_metric([state, driver], n)
        yield family


_states = SandboxStates()
REGISTRY.register(_states)


def watch(manager: Optional[object]) -> None:
    """Count this manager's sandboxes (one manager per gateway process)."""
    _states.manager = manager


def exposition() -> tuple:
    """(body, content type) of a scrape."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
