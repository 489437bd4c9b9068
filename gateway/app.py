"""The tornado application: routes, settings, and the service handlers call."""

from __future__ import annotations

import logging
from typing import Optional

from tornado import web
from tornado.log import access_log

from . import logformat, metrics
from .api import channels, e2b, jupyter, sandboxes, tenants
from .api import fleet as fleet_api
from .api import health
from .api.admission import Budget, SandgateApplication
from .api import metrics as metrics_api
from .config import Settings
from .core.manager import SandboxManager
from .core.service import SandboxService
from .core.tunnel import EgressHook
from .egress.proxy import EgressProxy, table_resolver
from .drivers import DRIVERS
from .drivers.base import RuntimeLease
from .kernelspecs import KernelSpecs
from .store.redis import RedisStore
from .store.seal import Sealer
from .store.sqlite import SQLiteStore

log = logging.getLogger("sandgate")


def available_drivers(settings: Settings) -> dict:
    drivers = {}
    for name, cls in DRIVERS.items():
        ok, why = cls.probe(settings)
        if ok:
            drivers[name] = cls(str(settings.home / "runtime" / name), settings)
        else:
            log.info("driver %s unavailable: %s", name, why)
    return drivers


def make_service(settings: Settings, lease: Optional[RuntimeLease] = None) -> SandboxService:
    """``lease``: the one `serve` renews, given to the drivers whose runtimes outlive the gateway."""
    drivers = available_drivers(settings)
    for driver in drivers.values() if lease else ():
        driver.lease = lease
    if settings.redis_url:
        # Records move between nodes: their secret values are sealed with a key from the fleet key.
        key = settings.fleet_secret()
        store = RedisStore(settings.redis_url, node=settings.node_id, prefix=settings.redis_prefix,
                           sealer=Sealer.from_fleet_key(key) if key else None, tls=settings.redis_tls())
    else:
        store = SQLiteStore(settings.home / "sessions.db")  # sealed with the home's secrets.key
    manager = SandboxManager(settings, drivers, KernelSpecs(list(drivers), settings.default_driver), store)
    metrics.watch(manager)
    return SandboxService(manager)


async def start_egress(settings: Settings, manager: SandboxManager) -> EgressProxy:
    """The egress proxy, in this process's loop, installed on the manager (core/tunnel.py)."""
    proxy = EgressProxy(settings.home, settings.egress_ca_bundle, resolver=table_resolver(settings.egress_hosts))
    await proxy.start()
    manager.egress = EgressHook(connect=proxy.open, ca_pem=proxy.ca_certificate_pem().decode(),
                                set_policy=proxy.set_policy, forget=proxy.forget)
    return proxy


def log_request(handler: web.RequestHandler) -> None:
    """tornado's access log line, with credentials in the query string redacted."""
    status = handler.get_status()
    method = access_log.info if status < 400 else access_log.warning if status < 500 else access_log.error
    uri = logformat.redact(handler.request.uri or "")  # also done by the log handlers' filter: for an app without it
    method("%d %s %s (%s) %.2fms", status, handler.request.method, uri, handler.request.remote_ip,
           1000.0 * handler.request.request_time())


def make_app(settings: Settings, service: SandboxService) -> web.Application:
    routes = (health.routes() + sandboxes.routes() + tenants.routes() + metrics_api.routes() + fleet_api.routes() + jupyter.routes()
              + [(rf"/api/kernels/({jupyter.UUID})/channels", channels.ChannelsHandler)])
    routes += e2b.routes()  # the E2B-compatible API under /e2b (docs/e2b.md)
    budget = Budget(settings.client_memory_mb << 20)
    metrics.watch_budget(budget)
    return SandgateApplication(
        routes,
        default_handler_class=jupyter.NotFoundHandler,
        sandgate=settings,
        service=service,
        budget=budget,  # what the gateway holds for its clients (api/admission.py)
        fleet=None,  # a core.fleet.Fleet once serving on a shared store
        stopping=False,  # set once the gateway shuts down: /healthz answers 503
        shutdown=lambda: None,  # stops the gateway (a drain ends with it); set by `sandgate serve`
        websocket_max_message_size=settings.max_message_mb << 20,
        websocket_ping_interval=30,
        log_function=log_request,
    )
