"""Kernelspecs: one per driver this gateway can run, so a JupyterLab user
picks the isolation (gVisor container, microVM) from the launcher."""

from __future__ import annotations

from typing import Dict, List

from pydantic import BaseModel

DISPLAY = {"gvisor": "gVisor sandbox", "qemu": "QEMU microVM", "firecracker": "Firecracker microVM"}


class KernelSpec(BaseModel):
    name: str
    driver: str

    def model(self) -> dict:
        # The shape of a kernel.json: clients read display_name and language.
        spec = {
            "argv": ["sandgate-agent", "--driver", self.driver],
            "display_name": f"Python 3 ({DISPLAY.get(self.driver, self.driver)})",
            "language": "python",
            "interrupt_mode": "message",
            "env": {},
            "metadata": {"sandgate": {"driver": self.driver}, "debugger": False},
        }
        return {"name": self.name, "spec": spec, "resources": {}}


class KernelSpecs:
    """``python3`` is the default driver; every driver also has ``python3-<driver>``."""

    def __init__(self, drivers: List[str], default_driver: str):
        if default_driver not in drivers:
            raise ValueError(f"default driver {default_driver!r} is not available (have: {', '.join(drivers) or 'none'})")
        self.specs: Dict[str, KernelSpec] = {"python3": KernelSpec(name="python3", driver=default_driver)}
        for d in drivers:
            self.specs[f"python3-{d}"] = KernelSpec(name=f"python3-{d}", driver=d)
        self.default = "python3"

    def get(self, name: str) -> KernelSpec:
        return self.specs[name]

    def model(self) -> dict:
        return {"default": self.default, "kernelspecs": {n: s.model() for n, s in self.specs.items()}}
