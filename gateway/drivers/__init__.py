"""Sandbox drivers. A new backend is one module plus one line in DRIVERS."""

from .base import Driver, Limits, Sandbox, SandboxError, SandboxSpec
from .gvisor import GVisorDriver

DRIVERS = {GVisorDriver.name: GVisorDriver}

__all__ = ["DRIVERS", "Driver", "Limits", "Sandbox", "SandboxError", "SandboxSpec"]
