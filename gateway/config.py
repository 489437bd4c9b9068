"""Gateway settings: one model, filled from SANDGATE_* variables, then flags."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import ClassVar, Dict, List, Optional

from pydantic import BaseModel, Field, FilePath, SecretStr, ValidationError, field_validator

from .drivers.base import Limits


def default_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sandgate"


def parse_hosts(text: str) -> Dict[str, str]:
    """``name=address,name=address`` (SANDGATE_EGRESS_HOSTS) as a dict; checked by the field's validator."""
    table = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, address = item.partition("=")
        if not sep:
            raise SystemExit(f"sandgate: invalid setting: egress_hosts: {item!r} is not name=address")
        table[name.strip()] = address.strip()
    return table


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
    limits: Limits = Limits()  # per-sandbox defaults
    # Operator ceilings: a request above one gets 400 naming it.
    max_memory_mb: int = Field(8192, ge=64)
    max_cpus: float = Field(4, gt=0, allow_inf_nan=False)
    max_pids: int = Field(4096, ge=16)
    max_disk_mb: int = Field(10240, ge=16)
    max_ttl: float = Field(0, ge=0, allow_inf_nan=False)  # seconds a sandbox may live; 0 = no ceiling
    held_messages: int = Field(1000, ge=1)  # per sandbox, while it is not running
    held_mb: int = Field(64, ge=1)
    shutdown_parallel: int = Field(4, ge=1, le=64)  # sandboxes paused at once on exit
    checkpoint_max_bytes: int = Field(16 << 30, ge=0)  # a workspace snapshot's logical size
    checkpoint_max_new_bytes: int = Field(4 << 30, ge=0)  # what one snapshot may add to the blob store
    checkpoint_max_files: int = Field(100_000, ge=0)
    # Checkpoints a fleet's nodes share: a directory on a shared volume, or s3://bucket/prefix (each
    # node's own in its home, copied to the bucket); "": the home's own, for this node alone.
    checkpoint_store: str = ""
    # Checkpoints' running-state images kept assembled (about state_bytes each, uncompressed) so
    # that a fork restores without assembling: at most this much disk, least recently used dropped
    # first (and while the disk has under 1 GiB free); templates' are kept beside it. 0: assembled at
    # each restore. Not with a shared store.
    kept_images_mb: int = Field(1024, ge=0)
    execute_output_mb: int = Field(16, ge=1)  # what one POST /execute collects; the rest is cut, marked
    client_buffer_mb: int = Field(32, ge=1)  # unsent output per websocket before it is dropped as too slow
    iopub_msg_rate: float = Field(1000, ge=0, allow_inf_nan=False)  # per client, messages/s; 0 = no limit
    iopub_data_rate: float = Field(10_000_000, ge=0, allow_inf_nan=False)  # per client, stream bytes/s
    keep_sandboxes: bool = True  # at exit, pause sandboxes to disk for the next start; false deletes them
    env_allow: List[str] = []  # env names passed to kernels besides KERNEL_*
    max_message_mb: int = Field(64, ge=1, le=256)  # websocket message and HTTP body bound
    # What a client's connection may hold (connections.py): a request's headers must be in within
    # http_idle_timeout of its connection's accept or previous answer, its body within http_body_timeout;
    # connections not yet a websocket are capped in total and per client address (503 over either).
    http_idle_timeout: float = Field(30, gt=0, allow_inf_nan=False)
    http_body_timeout: float = Field(300, gt=0, allow_inf_nan=False)
    http_max_connections: int = Field(2048, ge=1)  # at most half the descriptor limit (lowered to it at start)
    http_max_connections_per_client: int = Field(256, ge=1)
    max_code_mb: int = Field(16, ge=1, le=128)  # the body of an execute call (its code, JSON-escaped)
    # What the gateway holds for its clients at once (request bodies being read, answers not yet
    # flushed, websocket output not yet sent); past it a new request gets 503 with Retry-After.
    client_memory_mb: int = Field(128, ge=16)
    max_clients_per_kernel: int = Field(16, ge=1)  # websockets attached to one kernel; more are refused
    replay_messages: int = Field(2000, ge=0)  # kept per kernel while no client is connected
    kernel_start_timeout: float = Field(120, gt=0)
    # Tenants (core/tenants.py): defaults for every tenant, overridable per tenant at its creation; 0 = no quota.
    tenant_max_sandboxes: int = Field(8, ge=0)  # sandboxes a tenant may have at once (any state)
    tenant_max_memory_mb: int = Field(16384, ge=0)  # the sum of its sandboxes' limits.memory_mb
    # what its checkpoints store on disk (blobs, state chunks and files, each counted once)
    tenant_max_checkpoint_mb: int = Field(10240, ge=0)
    tenant_create_rate: float = Field(30, ge=0, allow_inf_nan=False)  # creations per minute, per tenant; 0 = no limit
    tenant_create_burst: int = Field(10, ge=1)  # creations a tenant may make at once before the rate applies
    # The HMAC key tenant tokens are hashed with (core/tenants.py token_key); "": in a fleet derived from the
    # fleet key, alone a random one in home/tenant.key.
    tenant_key: str = ""
    # extra CAs (PEM) the egress proxy trusts upstream besides the system store: private services
    egress_ca_bundle: Optional[FilePath] = None
    # names the egress proxy resolves to fixed addresses before DNS ("name=ip,name=ip"): private services
    egress_hosts: Dict[str, str] = {}
    # The fleet (store/redis.py): sandbox records and tenants in one Redis shared by every node; "" keeps
    # them in the embedded SQLite file under the home.
    redis_url: str = ""
    redis_prefix: str = "sandgate:"  # key prefix: fleets (or test runs) sharing one Redis
    node_id: str = Field(default_factory=socket.gethostname, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    node_url: str = ""  # how other nodes reach this one; "" = http://<ip>:<port> as served
    # The gateway process's own memory limit, a cgroup of its own (confine.py); its sandboxes and their
    # shims are outside it. 0: none (the service manager's, if any).
    gateway_memory_mb: int = Field(0, ge=0)
    # Seconds a runtime (gVisor's shim) waits for a gateway when none is connected and none renews the home's
    # lease file: past it the runtime ends, so a node whose gateway stays down keeps no copy of sandboxes other
    # nodes took over. Longer than a gateway restart takes to start adopting. 0: runtimes wait forever.
    runtime_lease: float = Field(120, ge=0, allow_inf_nan=False)
    # The fleet's shared key (core/fleetauth.py): signs heartbeats and forwarded requests, and seals secret
    # values at rest. Every node of a fleet has the same; a fleet node does not start without it.
    fleet_key: Optional[SecretStr] = None
    fleet_key_file: Optional[FilePath] = None  # the key in a file instead (its first line)
    # TLS to Redis (a rediss:// URL): the CA that signed the server's certificate, and a client certificate.
    redis_ca_file: Optional[FilePath] = None
    redis_cert_file: Optional[FilePath] = None
    redis_key_file: Optional[FilePath] = None

    MIN_FLEET_KEY: ClassVar[int] = 32

    def fleet_secret(self) -> Optional[str]:
        """The fleet key (from SANDGATE_FLEET_KEY or its file); None when neither is set.
        SystemExit when it is too short to be a key."""
        key = self.fleet_key.get_secret_value() if self.fleet_key else None
        if self.fleet_key_file is not None:
            lines = self.fleet_key_file.read_text().splitlines()
            key = lines[0].strip() if lines else ""
        if key is not None and len(key) < self.MIN_FLEET_KEY:
            raise SystemExit(f"sandgate: invalid setting: the fleet key has {len(key)} characters, at least "
                             f"{self.MIN_FLEET_KEY} are needed (e.g. `openssl rand -hex 32`)")
        return key

    def redis_tls(self) -> dict:
        """redis-py's ssl_* options for a rediss:// URL."""
        opts = {"ssl_ca_certs": self.redis_ca_file, "ssl_certfile": self.redis_cert_file,
                "ssl_keyfile": self.redis_key_file}
        return {k: str(v) for k, v in opts.items() if v is not None}

    @field_validator("egress_hosts")
    @classmethod
    def _hosts(cls, table: Dict[str, str]) -> Dict[str, str]:
        for name, address in table.items():
            ipaddress.ip_address(address)  # ValueError names it
            if not name or not all(c.isalnum() or c in "-." for c in name):
                raise ValueError(f"{name!r} is not a host name")
        return {name.lower().rstrip("."): address for name, address in table.items()}

    ENV: ClassVar[Dict[str, str]] = {  # field -> variable; every flag of `sandgate serve` has one
        "ip": "SANDGATE_IP", "port": "SANDGATE_PORT", "token": "SANDGATE_TOKEN",
        "allow_origin": "SANDGATE_ALLOW_ORIGIN", "max_kernels": "SANDGATE_MAX_KERNELS",
        "cull_idle_timeout": "SANDGATE_CULL_IDLE_TIMEOUT", "cull_interval": "SANDGATE_CULL_INTERVAL",
        "pause_idle_timeout": "SANDGATE_PAUSE_IDLE_TIMEOUT",
        "warm_start": "SANDGATE_WARM_START", "pool_size": "SANDGATE_POOL_SIZE",
        "default_driver": "SANDGATE_DRIVER", "home": "SANDGATE_HOME", "env_allow": "SANDGATE_ENV_ALLOW",
        "max_message_mb": "SANDGATE_MAX_MESSAGE_MB", "max_code_mb": "SANDGATE_MAX_CODE_MB",
        "client_memory_mb": "SANDGATE_CLIENT_MEMORY_MB", "max_clients_per_kernel": "SANDGATE_MAX_CLIENTS_PER_KERNEL",
        "kernel_start_timeout": "SANDGATE_KERNEL_START_TIMEOUT",
        "http_idle_timeout": "SANDGATE_HTTP_IDLE_TIMEOUT", "http_body_timeout": "SANDGATE_HTTP_BODY_TIMEOUT",
        "http_max_connections": "SANDGATE_HTTP_MAX_CONNECTIONS",
        "http_max_connections_per_client": "SANDGATE_HTTP_MAX_CONNECTIONS_PER_CLIENT",
        "max_memory_mb": "SANDGATE_MAX_MEMORY_MB", "max_cpus": "SANDGATE_MAX_CPUS", "max_pids": "SANDGATE_MAX_PIDS",
        "max_disk_mb": "SANDGATE_MAX_DISK_MB", "max_ttl": "SANDGATE_MAX_TTL",
        "held_messages": "SANDGATE_HELD_MESSAGES", "held_mb": "SANDGATE_HELD_MB",
        "shutdown_parallel": "SANDGATE_SHUTDOWN_PARALLEL", "keep_sandboxes": "SANDGATE_KEEP_SANDBOXES",
        "checkpoint_max_bytes": "SANDGATE_CHECKPOINT_MAX_BYTES",
        "checkpoint_max_new_bytes": "SANDGATE_CHECKPOINT_MAX_NEW_BYTES",
        "checkpoint_max_files": "SANDGATE_CHECKPOINT_MAX_FILES", "checkpoint_store": "SANDGATE_CHECKPOINT_STORE",
        "kept_images_mb": "SANDGATE_KEPT_IMAGES_MB",
        "execute_output_mb": "SANDGATE_EXECUTE_OUTPUT_MB", "client_buffer_mb": "SANDGATE_CLIENT_BUFFER_MB",
        "iopub_msg_rate": "SANDGATE_IOPUB_MSG_RATE", "iopub_data_rate": "SANDGATE_IOPUB_DATA_RATE",
        "tenant_max_sandboxes": "SANDGATE_TENANT_MAX_SANDBOXES", "tenant_max_memory_mb": "SANDGATE_TENANT_MAX_MEMORY_MB",
        "tenant_max_checkpoint_mb": "SANDGATE_TENANT_MAX_CHECKPOINT_MB",
        "tenant_create_rate": "SANDGATE_TENANT_CREATE_RATE", "tenant_create_burst": "SANDGATE_TENANT_CREATE_BURST",
        "tenant_key": "SANDGATE_TENANT_KEY",
        "egress_ca_bundle": "SANDGATE_EGRESS_CA_BUNDLE", "egress_hosts": "SANDGATE_EGRESS_HOSTS",
        "redis_url": "SANDGATE_REDIS_URL", "redis_prefix": "SANDGATE_REDIS_PREFIX", "node_id": "SANDGATE_NODE_ID",
        "node_url": "SANDGATE_NODE_URL", "gateway_memory_mb": "SANDGATE_GATEWAY_MEMORY_MB",
        "runtime_lease": "SANDGATE_RUNTIME_LEASE",
        "fleet_key": "SANDGATE_FLEET_KEY", "fleet_key_file": "SANDGATE_FLEET_KEY_FILE",
        "redis_ca_file": "SANDGATE_REDIS_CA_FILE", "redis_cert_file": "SANDGATE_REDIS_CERT_FILE",
        "redis_key_file": "SANDGATE_REDIS_KEY_FILE",
    }
    LIMIT_ENV: ClassVar[Dict[str, str]] = {"memory_mb": "SANDGATE_MEMORY_MB", "cpus": "SANDGATE_CPUS",
                                           "pids": "SANDGATE_PIDS", "disk_mb": "SANDGATE_DISK_MB"}
    # limit field -> the ceiling's setting
    CEILINGS: ClassVar[Dict[str, str]] = {"memory_mb": "max_memory_mb", "cpus": "max_cpus", "pids": "max_pids",
                                          "disk_mb": "max_disk_mb"}

    @classmethod
    def load(cls, **overrides) -> "Settings":
        """Environment first, then explicit overrides (flags); None means unset."""
        values: dict = {}
        for field, var in cls.ENV.items():
            if var in os.environ:
                values[field] = os.environ[var]
        if isinstance(values.get("env_allow"), str):
            values["env_allow"] = [v for v in values["env_allow"].split(",") if v]
        for key in ("egress_hosts",):
            if isinstance(overrides.get(key), str):
                values[key] = overrides.pop(key)
        if isinstance(values.get("egress_hosts"), str):
            values["egress_hosts"] = parse_hosts(values["egress_hosts"])
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
            settings = cls(**values)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise SystemExit(f"sandgate: invalid setting: {problems}") from None
        for field, ceiling in cls.CEILINGS.items():
            if getattr(settings.limits, field) > getattr(settings, ceiling):
                raise SystemExit(f"sandgate: invalid setting: the default {field} ({getattr(settings.limits, field)}) "
                                 f"is above its ceiling {cls.ENV[ceiling]} ({getattr(settings, ceiling)})")
        return settings
