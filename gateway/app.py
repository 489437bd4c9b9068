"""The tornado application: routes, settings, and the objects handlers use."""

from __future__ import annotations

import logging

from tornado import web

from .api import channels, jupyter, sandboxes
from .config import Settings
from .drivers import DRIVERS
from .kernelspecs import KernelSpecs
from .sessions import KernelManager

log = logging.getLogger("sandgate")


def available_drivers(settings: Settings) -> dict:
    drivers = {}
    for name, cls in DRIVERS.items():
        ok, why = cls.probe()
        if ok:
            drivers[name] = cls(str(settings.home / "runtime" / name))
        else:
            log.info("driver %s unavailable: %s", name, why)
    return drivers


def make_app(settings: Settings, manager: KernelManager | None = None) -> web.Application:
    if manager is None:
        drivers = available_drivers(settings)
        manager = KernelManager(settings, drivers, KernelSpecs(list(drivers), settings.default_driver))
    routes = sandboxes.routes() + jupyter.routes() + [(rf"/api/kernels/({jupyter.UUID})/channels", channels.ChannelsHandler)]
    return web.Application(
        routes,
        default_handler_class=jupyter.NotFoundHandler,
        sandgate=settings,
        kernel_manager=manager,
        notebook_sessions=jupyter.NotebookSessions(),
        websocket_max_message_size=settings.max_message_mb << 20,
        websocket_ping_interval=30,
    )
