"""Every setting the gateway reads, declared once: its type, default, bounds, environment variable,
flag and help are one field below. From those fields come the `serve` flags (`add_flags`), the
environment reading, validated at start (`Settings.load`), and the settings tables of
docs/operations.md (`markdown`; `python -m sandgate.config docs/operations.md` writes them).

A new setting is one field in `Settings` (or in `CommandSettings`, for the `sandgate` command itself)
made with `setting(...)`; the other modules get the `Settings` object, never the environment."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Literal, Optional, Type, get_args

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, Field, FilePath, SecretStr, ValidationError, field_validator
from pydantic.fields import FieldInfo

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


def setting(default: Any = None, *, help: str, env: Optional[str] = "", flag: Optional[str] = "",
            shown: str = "", **field: Any) -> Any:
    """One setting: a pydantic field (default or default_factory, bounds) and what the command line and
    the docs show. env: its variable, "" for SANDGATE_<NAME>, None for none; flag: "" for --<name>, None
    for none (secrets: a flag shows in ps); shown: the default as the docs say it, when its value does
    not say it well (computed, or with a unit)."""
    extra = {"help": help, "env": env, "flag": flag, "shown": shown}
    if "default_factory" in field:
        return Field(**field, json_schema_extra=extra)
    return Field(default, **field, json_schema_extra=extra)


BOOL_WORDS = ("true", "false", "1", "0", "yes", "no", "on", "off")


def auto_or_bool(value: str) -> str:
    value = value.strip().lower()
    if value != "auto" and value not in BOOL_WORDS:
        raise ValueError("must be auto, true or false")
    return value


class Settings(BaseModel):
    # -- the server
    ip: str = setting("127.0.0.1", help="listen address")
    port: int = setting(8888, ge=0, le=65535, help="port; `0` picks a free one")
    token: Optional[str] = setting(None, shown="generated", help=(
        "API token; an empty value turns auth **off**; generated and printed when unset"))
    allow_origin: str = setting("", shown="empty (no CORS)", help="CORS: `*` or one origin")
    home: Path = setting(default_factory=default_home, shown="`$XDG_CACHE_HOME/sandgate`, else `~/.cache/sandgate`",
                         help="all state")
    default_driver: str = setting("gvisor", env="SANDGATE_DRIVER", flag="--driver", help=(
        'default driver for `python3` and for sandboxes created without `"driver"` (`gvisor`, `qemu`, '
        "`firecracker`; each available one also has its kernelspec `python3-<driver>`)"))
    max_kernels: int = setting(16, ge=1, help=(
        "sandboxes at once, paused and dead ones included; pool sandboxes are not counted"))
    keep_sandboxes: bool = setting(True, help=(
        "at exit, pause every sandbox to disk for the next start; `false` deletes them"))
    shutdown_parallel: int = setting(4, ge=1, le=64, help="sandboxes paused at once at exit")
    kernel_start_timeout: float = setting(120, gt=0, help="seconds for a sandbox's agent to become ready")
    # -- the culler and the warm pool
    cull_idle_timeout: float = setting(0, ge=0, shown="`0` (never)", help=(
        "delete sandboxes idle this long (seconds) with no connection"))
    cull_interval: float = setting(60, gt=0, help=(
        "seconds from the end of one culler pass (ttls, idle culls and pauses, pool refills) to the start of "
        "the next, at most 10 (ttls are kept to within that)"))
    pause_idle_timeout: float = setting(0, ge=0, shown="`0` (never)", help=(
        "pause idle sandboxes (and those paused in memory) to disk after this many seconds"))
    warm_start: bool = setting(True, help="restore new sandboxes from a template checkpoint")
    pool_size: int = setting(1, ge=0, le=64, help="sandboxes kept restored and ready, per driver")
    # -- operator ceilings: a request above one gets 400 naming it
    max_memory_mb: int = setting(8192, ge=64, help="ceiling on a sandbox's `limits.memory_mb`")
    max_cpus: float = setting(4, gt=0, allow_inf_nan=False, help="ceiling on `limits.cpus`")
    max_pids: int = setting(4096, ge=16, help="ceiling on `limits.pids`")
    max_disk_mb: int = setting(10240, ge=16, help="ceiling on `limits.disk_mb`")
    max_ttl: float = setting(0, ge=0, allow_inf_nan=False, shown="`0` (no ceiling)", help=(
        "ceiling on a sandbox's `ttl` in seconds; when set, it is also the ttl of a sandbox created without one"))
    # per-sandbox defaults: LIMIT_HELP below, their values and bounds are Limits'
    limits: Limits = Field(default_factory=Limits)
    # -- messages and clients
    held_messages: int = setting(1000, ge=1, help="client messages held per sandbox while it is not running")
    held_mb: int = setting(64, ge=1, help="bytes of held messages per sandbox, in MiB")
    replay_messages: int = setting(2000, ge=0, env=None, flag=None, help=(
        "kernel messages kept per sandbox while no client is connected (and at most 64 MiB)"))
    execute_output_mb: int = setting(16, ge=1, help=(
        "output one `POST .../execute` collects; the rest is cut and marked (`truncated`)"))
    client_buffer_mb: int = setting(32, ge=1, help=(
        "unsent output per websocket before a client that stops reading is closed (1008)"))
    iopub_msg_rate: float = setting(1000, ge=0, allow_inf_nan=False, help=(
        "iopub messages/s per websocket client before its output is dropped; `0` = no limit"))
    iopub_data_rate: float = setting(10_000_000, ge=0, allow_inf_nan=False, help=(
        "stream output bytes/s per websocket client; `0` = no limit"))
    env_allow: List[str] = setting(default_factory=list, shown="empty", help=(
        "comma-separated env names clients may pass besides `KERNEL_*`"))
    max_message_mb: int = setting(64, ge=1, le=256, help=(
        "largest websocket message and HTTP body (a file upload, inflated if gzipped, too); a larger body gets "
        "413 naming it, before it is read"))
    max_code_mb: int = setting(16, ge=1, le=128, help=(
        "largest body of an execute call (`POST /api/sandboxes/{id}/execute`, E2B's `/execute`): its code, "
        "JSON-escaped; a larger one gets 413 naming it, before it is read"))
    max_clients_per_kernel: int = setting(16, ge=1, help=(
        "websockets attached to one kernel; one more is refused with 403 naming the setting (an execute call "
        "is not a websocket)"))
    # -- what a client's connection may hold (connections.py)
    http_idle_timeout: float = setting(30, gt=0, allow_inf_nan=False, help=(
        "seconds a connection has to send a request's headers, counted from its accept or from the end of its "
        "previous answer (keep-alive); then it is closed ([security.md](security.md#connections))"))
    http_body_timeout: float = setting(300, gt=0, allow_inf_nan=False, help=(
        "seconds a request has to send its whole body once its headers are in"))
    http_max_connections: int = setting(2048, ge=1, help=(
        "client connections still HTTP (a kernel websocket leaves the count at its upgrade), in total; over it a "
        "new one is answered 503 and closed. At most half the descriptor limit: a larger value is lowered to "
        "that at start, with a warning"))
    http_max_connections_per_client: int = setting(256, ge=1, help=(
        "the same, per client address (an IPv6 client's /64). Behind a reverse proxy every client is the "
        "proxy's address: raise it to the total there, and let the proxy limit clients"))
    client_memory_mb: int = setting(128, ge=16, help=(
        "what the gateway holds for its clients at once: request bodies being read (as they arrive), answers "
        "written but not yet flushed, websocket output not yet sent (`sandgate_client_bytes` in `/metrics`); "
        "past it every new request but `/metrics`, `/healthz` and `/livez` gets **503** with `Retry-After: 1`, "
        "and a websocket holding output it has not drained for half a second is closed at its next message "
        "(1008); the default keeps `sandgate bench --hostile` under +256 MiB (it is counted as sent, and the "
        "gateway holds about a quarter more; 192 measured +245 MiB in the 2-minute run and +273 in the short "
        "one of the tests)"))
    # -- checkpoints
    checkpoint_max_bytes: int = setting(16 << 30, ge=0, shown="`17179869184` (16 GiB)", help=(
        "logical size (holes included) of the workspace one checkpoint may hold"))
    checkpoint_max_new_bytes: int = setting(4 << 30, ge=0, shown="`4294967296` (4 GiB)", help=(
        "new data one checkpoint may add to the blob store"))
    checkpoint_max_files: int = setting(100_000, ge=0, help="regular files one checkpoint may hold")
    checkpoint_store: str = setting("", shown="`$SANDGATE_HOME/checkpoints`", help=(
        "checkpoints a fleet's nodes share, so a dead node's sandboxes can be restored on another: a directory "
        "on a shared volume, or `s3://bucket/prefix` (each node keeps its own and copies every one to the "
        "bucket; boto3's `AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION` and credentials)"))
    kept_images_mb: int = setting(1024, ge=0, help=(
        "disk for checkpoints' running-state images kept assembled so a fork restores without assembling them "
        "(about 80 MB each under gVisor), least recently restored dropped first, and while the disk has under "
        "1 GiB free; templates' are kept beside it; 0 keeps none; none with a shared `SANDGATE_CHECKPOINT_STORE` "
        "([checkpoints.md](checkpoints.md))"))
    # -- tenants (core/tenants.py): defaults for every tenant, overridable per tenant at its creation
    tenant_max_sandboxes: int = setting(8, ge=0, help=(
        "sandboxes a tenant may have at once (any state), unless set for it; `0` = no quota ([tenants](#tenants))"))
    tenant_max_memory_mb: int = setting(16384, ge=0, help=(
        "the sum of a tenant's sandboxes' `limits.memory_mb`, unless set for it; `0` = no quota"))
    tenant_max_checkpoint_mb: int = setting(10240, ge=0, help=(
        "what a tenant's checkpoints may store on disk (blobs, state chunks and files kept whole, each once), "
        "unless set for it; past it a checkpoint is 413 `quota`; `0` = no quota "
        "([checkpoints.md](checkpoints.md#deleting-a-checkpoint-and-the-tenant-quota))"))
    tenant_create_rate: float = setting(30, ge=0, allow_inf_nan=False, help=(
        "sandbox creations per minute per tenant (forks included); `0` = no limit"))
    tenant_create_burst: int = setting(10, ge=1, help=(
        "creations a tenant may make at once before the rate applies"))
    tenant_key: str = setting("", flag=None, shown="none", help=(
        "the key tenant tokens are hashed with (HMAC-SHA-256); none: on a node of a fleet derived from "
        "`SANDGATE_FLEET_KEY`, alone 32 random bytes made once in `$SANDGATE_HOME/tenant.key` (0600). Every node "
        "of a fleet needs the same one; changing it makes every tenant's token fail "
        "([security.md](security.md#tenants))"))
    # -- egress
    egress_ca_bundle: Optional[FilePath] = setting(None, help=(
        "PEM file of extra CAs the egress proxy trusts upstream, besides the system store (private services) "
        "([egress.md](egress.md))"))
    egress_hosts: Dict[str, str] = setting(default_factory=dict, shown="none", help=(
        "`name=address,...` the egress proxy resolves without DNS, as an `/etc/hosts` of its own; the address "
        "is still checked (a loopback or private one needs a rule naming it)"))
    # -- the fleet (store/redis.py, core/fleet.py, core/fleetauth.py)
    redis_url: str = setting("", shown="none", help=(
        "keep sandbox records and tenants in this Redis (`redis://host:port/0`, `unix:///path`), shared by a "
        "fleet; none: SQLite under the home (`store/redis.py`). Passed to redis-py as it is: "
        "`redis://user:password@host:port/0` logs in (AUTH, or an ACL user), `rediss://` is TLS (below). The "
        "password is never logged (messages show `[redacted]`); prefer the variable to the flag, which `ps` shows"))
    redis_prefix: str = setting("sandgate:", help="prefix of every key, so fleets (or test runs) can share one Redis")
    node_id: str = setting(default_factory=socket.gethostname, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                           shown="the host name", help=(
                               "this gateway's name in the fleet: records carry it, and a gateway recovers only "
                               "its own node's"))
    runtime_lease: Optional[float] = setting(None, ge=0, allow_inf_nan=False, shown="`120` in a fleet, else `0`", help=(
        "seconds a sandbox runtime (gVisor's shim) waits for a gateway when none is connected and none renews the "
        "home's lease file; past it the runtime ends, so a node whose gateway stays down keeps no second copy of "
        "sandboxes other nodes took over. `0`: runtimes wait for the next gateway however long it takes (alone, "
        "nobody else takes them over: a gateway down for an hour still adopts them)"))
    node_url: str = setting("", shown="`http://<ip>:<port>` as served", help=(
        "how the other nodes reach this one (its heartbeat carries it)"))
    fleet_key: Optional[SecretStr] = setting(None, flag=None, help=(
        "the fleet's shared secret, at least 32 characters (`openssl rand -hex 32`), the same on every node: it "
        "signs heartbeats and forwarded requests and seals secret values in Redis "
        "([security.md](security.md#the-fleet-and-redis)). A node with `SANDGATE_REDIS_URL` does not start "
        "without it. Changing it needs every node stopped (the records' sealed values need the old key: see below)"))
    fleet_key_file: Optional[FilePath] = setting(None, help=(
        "the fleet key from a file's first line instead (a mounted secret)"))
    redis_ca_file: Optional[FilePath] = setting(None, shown="the system's CAs", help=(
        "with `rediss://`: the CA (PEM) that signed the Redis server's certificate; the certificate must name "
        "the URL's host"))
    redis_cert_file: Optional[FilePath] = setting(None, help=(
        "with `rediss://`: a client certificate, for a Redis with `tls-auth-clients yes` (not tested here)"))
    redis_key_file: Optional[FilePath] = setting(None, help="with `rediss://`: the client certificate's key")
    # -- the gateway process
    gateway_memory_mb: int = setting(0, ge=0, shown="`0` (none)", help=(
        "the gateway process's own memory limit: at start it moves itself into a cgroup of its own "
        "(`sandgate-gateway-<hash of the home>`, under the one it was started in; cgroup v2 or v1's memory "
        "hierarchy) with this limit, and the processes it leaves running (gVisor shims, Firecracker and "
        "unprivileged qemu VMs) into `sandgate-released` beside it, so the limit bounds the gateway alone and "
        "does not grow with its sandboxes. Past it the kernel's OOM killer ends the gateway, not the node; its "
        "sandboxes outlive it and the next start adopts them. A host where it cannot be done (no cgroups, not "
        "root) refuses to start with the reason. The systemd unit and deploy/k8s set 1024 "
        "([systemd](#systemd), [performance.md](performance.md))"))
    sandbox_uid: Optional[int] = setting(None, gt=0, lt=0xFFFFFFFF, shown="the first unused uid down from 61183",
                                         help=("host uid of sandbox files; refused if a user or group has it "
                                               "([security.md](security.md#host-uid-and-workspace-disks))"))
    trace: bool = setting(False, help=(
        "log one `sandgate.trace` line per kernel message answering a websocket request, with its time at each "
        "hop (gateway, agent, kernel); see [performance.md](performance.md#issue-15-the-cell-round-trip)"))
    fault: str = setting("", flag=None, shown="off", help=(
        "tests only: `<operation>/<step>:kill|fail[:<n>]`, comma-separated: the gateway SIGKILLs itself, or "
        "fails the call, at that fault point ([after SIGKILL or a crash](#after-sigkill-or-a-crash))"))
    # -- the gVisor driver (drivers/gvisor.py)
    runsc: str = setting("", shown="`runsc` on `PATH`", help="runsc binary")
    runsc_platform: str = setting("ptrace", help="runsc `--platform`")
    runsc_reclaim: str = setting("auto", help=(
        "`true`: run runsc with `--profile` and, after each restore, the Sentry's garbage collector (3 "
        "heap-profile requests, written to a file in the sandbox's socket directory and removed): ~70 MiB per "
        "restored sandbox back at once, not in 4-5 minutes. `auto`: on as root with a runsc older than 2023 "
        "(Debian 12's); off rootless or with a newer runsc, where `--profile` would weaken the Sentry's "
        "confinement or is not verified ([security.md](security.md))"))
    checkpoint_in_place: str = setting("auto", help=(
        "`false`: never checkpoint in place, even with a runsc that can "
        "([checkpoints.md](checkpoints.md#checkpoints-in-place))"))
    runsc_compression: str = setting("", shown="runsc's (`flate-best-speed`)", help=(
        "runsc `checkpoint --compression` (`none` or `flate-best-speed`), for a runsc that has the option"))
    # -- the qemu driver (drivers/qemu.py)
    qemu_accel: Optional[Literal["kvm", "tcg"]] = setting(None, shown="trial boot", help=(
        "force qemu's `-accel` (`kvm` or `tcg`); unset, KVM is used only if a trial boot under it reaches the "
        "guest's userspace within 10 s, remembered in `images/qemu-accel.json` ([drivers.md](drivers.md))"))
    qemu_append: str = setting("", help="extra guest kernel command line for qemu VMs (debugging; e.g. `loglevel=7`)")
    # -- the Firecracker driver (drivers/firecracker.py, [firecracker.md](firecracker.md))
    firecracker_bin: str = setting("", env="FIRECRACKER_BIN", shown="`firecracker` on `PATH`",
                                   help="the firecracker binary ([firecracker.md](firecracker.md))")
    firecracker_jailer: str = setting("", shown="none", help="the jailer binary; when set, every VM runs through it")
    firecracker_uid: int = setting(1000, ge=0, help="the user the jailer drops to")
    firecracker_gid: Optional[int] = setting(None, ge=0, shown="the uid", help="the group the jailer drops to")
    firecracker_chroot_base: str = setting("", shown="`<state_dir>/jail`, per VM",
                                           help="the jailer's `--chroot-base-dir`")
    firecracker_jailer_args: str = setting("", help=(
        "extra jailer arguments, shell-split (`--cgroup-version 2 --cgroup cpu.max=...`)"))
    firecracker_image: str = setting("", shown="the one `images/vm.py` builds", help=(
        "a VM image directory to use instead (same file names)"))

    MIN_FLEET_KEY: ClassVar[int] = 32
    # the per-sandbox defaults (`limits`), one setting each; their values and bounds are Limits' own
    LIMIT_HELP: ClassVar[Dict[str, str]] = {
        "memory_mb": "default memory limit per sandbox, in MiB", "cpus": "default CPU quota per sandbox",
        "pids": "default pids limit per sandbox", "disk_mb": "default workspace size per sandbox, in MiB"}
    # limit field -> the ceiling's setting
    CEILINGS: ClassVar[Dict[str, str]] = {"memory_mb": "max_memory_mb", "cpus": "max_cpus", "pids": "max_pids",
                                          "disk_mb": "max_disk_mb"}
    ENV: ClassVar[Dict[str, str]]  # field -> variable, made from the declarations below the class
    LIMIT_ENV: ClassVar[Dict[str, str]]

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

    @property
    def lease_seconds(self) -> float:
        """The runtime lease in force: the setting, else 120 s in a fleet and none alone."""
        if self.runtime_lease is not None:
            return self.runtime_lease
        return 120.0 if self.redis_url else 0.0

    @field_validator("fault")
    @classmethod
    def _fault(cls, value: str) -> str:
        from .faults import parse

        parse(value)  # ValueError says what is wrong
        return value

    @field_validator("runsc_reclaim", "checkpoint_in_place")
    @classmethod
    def _auto(cls, value: str) -> str:
        return auto_or_bool(value)

    @classmethod
    def load(cls, **overrides) -> "Settings":
        """The environment, then explicit overrides (flags; None means unset), validated: SystemExit with one
        line naming the setting for a bad value."""
        return load(cls, overrides)


class CommandSettings(BaseModel):
    """The `sandgate` command's own settings, before its subcommand; the user commands' gateway."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = setting("INFO", help="log level")
    log_format: Literal["text", "json"] = setting("text", help=(
        "`json`: one JSON object per line, with sandbox and tenant ids as fields ([logs](#logs))"))
    url: str = setting("http://127.0.0.1:8888", help=(
        "the gateway the user commands (`sandgate ls`, `tree`, `exec`, `drain`, `mcp`) talk to"))
    # the same variable as the gateway's token: the user commands send it
    token: Optional[str] = setting(None, env="SANDGATE_TOKEN", help="the token the user commands send")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @classmethod
    def load(cls, **overrides) -> "CommandSettings":
        return load(cls, overrides)


@dataclass(frozen=True)
class Declared:
    """One setting as the command line and the docs see it."""

    name: str  # the field (for a per-sandbox default: the Limits field)
    env: Optional[str]
    flag: Optional[str]
    help: str
    shown: str
    field: FieldInfo
    limit: bool = False

    @property
    def is_bool(self) -> bool:
        return self.field.annotation is bool

    def parse(self, raw: Any) -> Any:
        """A variable's (or flag's) text in the shape the field takes; pydantic checks the rest."""
        if not isinstance(raw, str):
            return raw
        annotation = str(self.field.annotation)
        if annotation.startswith(("typing.List", "list")):
            return [v.strip() for v in raw.split(",") if v.strip()]
        if annotation.startswith(("typing.Dict", "dict")):
            return parse_hosts(raw)
        if raw == "" and "str" not in annotation.lower():
            return None  # an empty number, boolean, file or choice is unset: "" means something only to text
        return raw

    def default_text(self) -> str:
        if self.shown:
            return self.shown
        if self.field.default_factory is not None:
            value = self.field.default_factory()
        else:
            value = self.field.default
        if value is None or value == {}:
            return "none"
        if value in ("", []):
            return "empty"
        text = f"`{str(value).lower() if isinstance(value, bool) else value}`"
        return text + bounds_text(self.field)


def bounds_text(field: FieldInfo) -> str:
    """A number's bounds as the docs say them: (16 to 256), (min 1), (over 0), (over 0, at most 256)."""
    ge = next((m.ge for m in field.metadata if isinstance(m, Ge)), None)
    gt = next((m.gt for m in field.metadata if isinstance(m, Gt)), None)
    le = next((m.le for m in field.metadata if isinstance(m, Le)), None)
    if ge is not None:
        return f" ({ge} to {le})" if le is not None else f" (min {ge})"
    if gt is not None:
        return f" (over {gt}, at most {le})" if le is not None else f" (over {gt})"
    return f" (max {le})" if le is not None else ""


def declarations(model: Type[BaseModel]) -> List[Declared]:
    """The model's settings in their order, with variable and flag names made from the field's name."""
    out = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        if not isinstance(extra, dict):
            if model is Settings and name == "limits":
                out += [Declared(limit, f"SANDGATE_{limit.upper()}", f"--{limit.replace('_', '-')}",
                                 Settings.LIMIT_HELP[limit], "", Limits.model_fields[limit], limit=True)
                        for limit in Limits.model_fields]
            continue
        env = f"SANDGATE_{name.upper()}" if extra["env"] == "" else extra["env"]
        flag = f"--{name.replace('_', '-')}" if extra["flag"] == "" else extra["flag"]
        out.append(Declared(name, env, flag, extra["help"], extra["shown"], field))
    return out


SETTINGS = declarations(Settings)
COMMAND = declarations(CommandSettings)
Settings.ENV = {d.name: d.env for d in SETTINGS if d.env and not d.limit}
Settings.LIMIT_ENV = {d.name: d.env for d in SETTINGS if d.env and d.limit}


def load(model: Type[BaseModel], overrides: Dict[str, Any]) -> Any:
    declared = SETTINGS if model is Settings else COMMAND
    unknown = set(overrides) - {d.name for d in declared}
    if unknown:
        raise TypeError(f"not settings of {model.__name__}: {sorted(unknown)}")
    values: Dict[str, Any] = {}
    limits: Dict[str, Any] = {}
    for d in declared:
        raw = overrides.get(d.name)
        if raw is None and d.env and d.env in os.environ:
            raw = os.environ[d.env]
        if raw is not None:
            value = d.parse(raw)
            if value is not None:
                (limits if d.limit else values)[d.name] = value
    if model is Settings:
        values["limits"] = limits
    try:
        settings = model(**values)
    except ValidationError as e:
        by_name = {d.name: d for d in declared}
        problems = []
        for err in e.errors():
            name = str(err["loc"][-1] if err["loc"][:1] == ("limits",) else err["loc"][0])
            d = by_name.get(name)
            where = ", ".join(filter(None, (d.env, d.flag))) if d else ""
            problems.append(f"{name} ({where}): {err['msg']}" if where else f"{name}: {err['msg']}")
        raise SystemExit(f"sandgate: invalid setting: {'; '.join(problems)}") from None
    if model is Settings:
        for field, ceiling in Settings.CEILINGS.items():
            if getattr(settings.limits, field) > getattr(settings, ceiling):
                raise SystemExit(f"sandgate: invalid setting: the default {field} ({getattr(settings.limits, field)}) "
                                 f"is above its ceiling {Settings.ENV[ceiling]} ({getattr(settings, ceiling)})")
    return settings


def plain(text: str) -> str:
    """Markdown as --help shows it: links as their text, no backticks or bold; % for argparse."""
    text = re.sub(r"\s*\(\[[^\]]+\]\([^)]*\)(, \[[^\]]+\]\([^)]*\))*\)", "", text)  # "(see [x](y))" asides
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)
    return text.replace("`", "").replace("**", "").replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, declared: List[Declared]) -> None:
    """One flag per declared setting that has one (default None: unset, the variable or the default
    applies); settings with no flag are listed after the flags."""
    for d in declared:
        if not d.flag:
            continue
        where = f"{d.env}; default {plain(d.default_text())}" if d.env else f"default {plain(d.default_text())}"
        kwargs: Dict[str, Any] = {"dest": d.name, "default": None, "help": f"{plain(d.help)} ({where})"}
        if d.is_bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kinds = (d.field.annotation, *get_args(d.field.annotation))  # Optional[int] too
            kwargs["metavar"] = "N" if int in kinds else "X" if float in kinds else "VALUE"
        parser.add_argument(d.flag, **kwargs)
    unflagged = [d.env for d in declared if d.env and not d.flag]
    if unflagged:
        parser.epilog = ("Set only in the environment: "
                         + ", ".join(unflagged) + ". docs/operations.md lists every setting.")


def flag_values(args: argparse.Namespace, declared: List[Declared]) -> Dict[str, Any]:
    return {d.name: getattr(args, d.name) for d in declared if d.flag and hasattr(args, d.name)}


TABLE_HEAD = "| variable | flag | default | meaning |\n| --- | --- | --- | --- |"
BEGIN = "<!-- settings tables: written by `python -m sandgate.config docs/operations.md` from gateway/config.py -->"
END = "<!-- /settings tables -->"


def table(declared: List[Declared], skip: frozenset = frozenset()) -> str:
    rows = [TABLE_HEAD]
    for d in declared:
        if d.env in skip or not (d.env or d.flag):
            continue
        flag = ""
        if d.flag:
            flag = f"`{d.flag}` / `--no-{d.flag[2:]}`" if d.is_bool else f"`{d.flag}`"
        rows.append(f"| `{d.env}` | {flag} | {d.default_text()} | {d.help} |" if d.env
                    else f"| | {flag} | {d.default_text()} | {d.help} |")
    return "\n".join(rows)


def markdown() -> str:
    """The settings tables of docs/operations.md: the gateway's (`serve`), then the command's own."""
    fixed = "; ".join(f"`{d.name}`, {d.default_text()}: {d.help}" for d in SETTINGS if not (d.env or d.flag))
    served = {d.env for d in SETTINGS if d.env}
    return "\n".join([
        BEGIN,
        table(SETTINGS),
        "",
        f"Neither variable nor flag sets {fixed}. "
        "Booleans take `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`); an empty variable of a number, "
        "a boolean, a file or a choice is unset. The `sandgate` command's own, given before its subcommand (`sandgate "
        "--log-format json serve`) or, for the user commands, after it:",
        "",
        table(COMMAND, skip=frozenset(served)),
        END])


def write_docs(path: Path) -> bool:
    """Replace the settings tables in path (docs/operations.md); True if it changed."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + markdown() + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    if len(sys.argv) > 1:
        changed = write_docs(Path(sys.argv[1]))
        print(f"{sys.argv[1]}: {'written' if changed else 'already up to date'}")
    else:
        print(markdown())
