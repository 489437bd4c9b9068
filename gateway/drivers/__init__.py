"""Sandbox drivers. A new backend is one module plus one line in DRIVERS."""

from .base import Driver, Limits, Sandbox, SandboxError, SandboxSpec
from .firecracker import FirecrackerDriver
from .gvisor import GVisorDriver
from .qemu import QemuDriver

DRIVERS = {GVisorDriver.name: GVisorDriver, QemuDriver.name: QemuDriver, FirecrackerDriver.name: FirecrackerDriver}

__all__ = ["DRIVERS", "Driver", "Limits", "Sandbox", "SandboxError", "SandboxSpec"]
