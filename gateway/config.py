"""Gateway settings: one model, filled from SANDGATE_* variables, then flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Dict, List, Optional

from pydantic import BaseModel, Field, ValidationError

from .drivers.base import Limits


def default_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sandgate"


class Settings(BaseModel):
    ip: str = "127.0.0.1"
    port: int = Field(8888, ge=0, le=65535)
    token: Optional[str] = None  # None: generate one and print it
    allow_origin: str = ""  # CORS: "" (off), "*", or one origin
    max_kernels: int = Field(16, ge=1)
    cull_idle_timeout: float = Field(0, ge=0)  # seconds without activity or connection; 0 = never
    cull_interval: float = Field(60, gt=0)
    warm_start: bool = True  # restore new kernels from a template checkpoint
    pool_size: int = Field(1, ge=0, le=64)  # kernels kept restored and ready
    pause_idle_timeout: float = Field(0, ge=0)  # pause (state to disk) after this idle time; 0 = never
    default_driver: str = "gvisor"
    home: Path = Field(default_factory=default_home)
    limits: Limits = Limits()
    env_allow: List[str] = []  # env names passed to kernels besides KERNEL_*
    max_message_mb: int = Field(64, ge=1, le=256)  # websocket message and HTTP body bound
    replay_messages: int = Field(2000, ge=0)  # kept per kernel while no client is connected
    kernel_start_timeout: float = Field(120, gt=0)

    ENV: ClassVar[Dict[str, str]] = {  # field -> variable; every flag of `sandgate serve` has one
        "ip": "SANDGATE_IP", "port": "SANDGATE_PORT", "token": "SANDGATE_TOKEN",
        "allow_origin": "SANDGATE_ALLOW_ORIGIN", "max_kernels": "SANDGATE_MAX_KERNELS",
        "cull_idle_timeout": "SANDGATE_CULL_IDLE_TIMEOUT", "cull_interval": "SANDGATE_CULL_INTERVAL",
        "pause_idle_timeout": "SANDGATE_PAUSE_IDLE_TIMEOUT",
        "warm_start": "SANDGATE_WARM_START", "pool_size": "SANDGATE_POOL_SIZE",
        "default_driver": "SANDGATE_DRIVER", "home": "SANDGATE_HOME", "env_allow": "SANDGATE_ENV_ALLOW",
        "max_message_mb": "SANDGATE_MAX_MESSAGE_MB", "kernel_start_timeout": "SANDGATE_KERNEL_START_TIMEOUT",
    }
    LIMIT_ENV: ClassVar[Dict[str, str]] = {"memory_mb": "SANDGATE_MEMORY_MB", "cpus": "SANDGATE_CPUS", "pids": "SANDGATE_PIDS"}

    @classmethod
    def load(cls, **overrides) -> "Settings":
        """Environment first, then explicit overrides (flags); None means unset."""
        values: dict = {}
        for field, var in cls.ENV.items():
            if var in os.environ:
                values[field] = os.environ[var]
        if isinstance(values.get("env_allow"), str):
            values["env_allow"] = [v for v in values["env_allow"].split(",") if v]
        limits = {f: os.environ[v] for f, v in cls.LIMIT_ENV.items() if v in os.environ}
        for key, value in overrides.items():
            if value is None:
                continue
            if key in cls.LIMIT_ENV:
                limits[key] = value
            else:
                values[key] = value
        values["limits"] = limits
        try:
            return cls(**values)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise SystemExit(f"sandgate: invalid setting: {problems}") from None
