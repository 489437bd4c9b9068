#!/usr/bin/env python3
"""A fake ``firecracker`` binary, for hosts where Firecracker cannot run.

It serves Firecracker's HTTP API on ``--api-sock`` and checks every request
body strictly against the swagger definitions of Firecracker
(src/firecracker/swagger/firecracker.yaml at 1.17.0-dev; the driver sends
only fields that 1.8 - 1.16 accept too: snapshot/load's dirty-page tracking as
``enable_diff_snapshots``, not ``track_dirty_pages``, which older releases
reject as unknown): unknown fields, missing required
fields, wrong types and enum values, and requests in the wrong state
(InstanceStart without a boot source, a snapshot load after configuring,
pre-boot calls after boot, ...) get a 400 ``{"fault_message": ...}``, with
Firecracker's wording where it was copied from its source.

What it runs instead of a VM: on InstanceStart, the guest's init as a host
process. Like images/vm.py's /init it takes the agent package from the
second drive (the agent disk, read out of the ext4 image with debugfs) and
the transport from the kernel command line (``sandgate.transport=vsock:N``),
then runs the REAL guest agent on a unix socket. The vsock unix socket
(``uds_path``) does Firecracker's host-initiated handshake (``CONNECT N\\n``
-> ``OK <port>\\n``) and bridges the stream to that agent, or closes the
connection while nothing listens on port N. PATCH /vm Paused stops the agent
and its kernel (SIGSTOP), Resumed continues them.

What it cannot do: snapshots. /snapshot/create validates, writes a
placeholder state file and a sparse memory file of the guest's size, and,
like Firecracker, resets the guest's vsock connections (they close when the
VM resumes). /snapshot/load validates the body and that the files and the
drives recorded in the snapshot exist at the same relative paths, then
refuses with a 400 and exits, as Firecracker exits after a failed load.
There is no kernel, no virtio, no KVM, and the workspace disk is not mounted:
the agent's workspace is a plain directory next to it.

Test hooks (environment): FAKE_FIRECRACKER_LOG=path appends one JSON line
per request (pid, method, path, body, status, fault_message);
FAKE_FIRECRACKER_FAIL="PUT /vsock,PUT /snapshot/create" answers those
(valid) requests with an injected 400 instead, keeping their side effects
that happen before Firecracker could fail (the vsock reset of a snapshot).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

VERSION = "1.13.1-fake"
DIFF_PAGES = (1, 300)  # the pages a Diff snapshot of the fake holds
DESERIALIZE = "An error occurred when deserializing the json body of a request: "


# -- the swagger definitions the fake serves (subset of firecracker.yaml) ----
def obj(props: dict, required=()) -> dict:
    return {"type": "object", "properties": props, "required": list(required)}


STR, BOOL = {"type": "string"}, {"type": "boolean"}


def INT(lo=None, hi=None) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def ENUM(*values) -> dict:
    return {"type": "string", "enum": list(values)}


TOKEN_BUCKET = obj({"one_time_burst": INT(0), "refill_time": INT(0), "size": INT(0)}, ["refill_time", "size"])
RATE_LIMITER = obj({"bandwidth": TOKEN_BUCKET, "ops": TOKEN_BUCKET})
SCHEMAS: Dict[str, dict] = {
    "BootSource": obj({"boot_args": STR, "initrd_path": STR, "kernel_image_path": STR}, ["kernel_image_path"]),
    "Drive": obj({"drive_id": STR, "partuuid": STR, "is_root_device": BOOL, "cache_type": ENUM("Unsafe", "Writeback"),
                  "is_read_only": BOOL, "path_on_host": STR, "rate_limiter": RATE_LIMITER,
                  "io_engine": ENUM("Sync", "Async"), "socket": STR}, ["drive_id", "is_root_device"]),
    "PartialDrive": obj({"drive_id": STR, "path_on_host": STR, "rate_limiter": RATE_LIMITER}, ["drive_id"]),
    "MachineConfiguration": obj({
        "cpu_template": ENUM("C3", "T2", "T2S", "T2CL", "T2A", "V1N1", "None"), "smt": BOOL,
        "mem_size_mib": INT(), "track_dirty_pages": BOOL, "vcpu_count": INT(1, 32),
        "huge_pages": ENUM("None", "Transparent", "2M")}, ["mem_size_mib", "vcpu_count"]),
    "Vsock": obj({"guest_cid": INT(3), "uds_path": STR, "vsock_id": STR}, ["guest_cid", "uds_path"]),
    "InstanceActionInfo": obj({"action_type": ENUM("FlushMetrics", "InstanceStart", "SendCtrlAltDel")},
                              ["action_type"]),
    "Vm": obj({"state": ENUM("Paused", "Resumed")}, ["state"]),
    "SnapshotCreateParams": obj({"mem_file_path": STR, "snapshot_path": STR, "snapshot_type": ENUM("Full", "Diff")},
                                ["mem_file_path", "snapshot_path"]),
    "SnapshotLoadParams": obj({
        "enable_diff_snapshots": BOOL, "track_dirty_pages": BOOL, "mem_file_path": STR,
        "mem_backend": obj({"backend_type": ENUM("File", "Uffd"), "backend_path": STR},
                           ["backend_type", "backend_path"]),
        "snapshot_path": STR, "resume_vm": BOOL,
        "network_overrides": {"type": "array", "items": obj({"iface_id": STR, "host_dev_name": STR},
                                                             ["iface_id", "host_dev_name"])},
        "vsock_override": obj({"uds_path": STR}, ["uds_path"]), "clock_realtime": BOOL,
        "huge_pages": ENUM("Snapshot", "None", "Transparent", "2M")}, ["snapshot_path"]),
    "Logger": obj({"level": ENUM("Error", "Warning", "Info", "Debug", "Trace", "Off"), "log_path": STR,
                   "show_level": BOOL, "show_log_origin": BOOL, "module": STR}),
    "Metrics": obj({"metrics_path": STR}, ["metrics_path"]),
}


class Fault(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check(schema: dict, value: Any, where: str = "") -> None:
    """serde-like strictness: Firecracker's configs are deny_unknown_fields."""
    t = schema["type"]
    if t == "object":
        if not isinstance(value, dict):
            raise Fault(DESERIALIZE + f"invalid type: {json.dumps(value)}, expected a struct{where}.")
        props = schema["properties"]
        for k in value:
            if k not in props:
                expected = ", ".join(f"`{p}`" for p in props)
                raise Fault(DESERIALIZE + f"unknown field `{k}`, expected one of {expected}{where}.")
        for k in schema["required"]:
            if k not in value:
                raise Fault(DESERIALIZE + f"missing field `{k}`{where}.")
        for k, v in value.items():
            check(props[k], v, f" in `{k}`")
    elif t == "array":
        if not isinstance(value, list):
            raise Fault(DESERIALIZE + f"invalid type: {json.dumps(value)}, expected a sequence{where}.")
        for v in value:
            check(schema["items"], v, where)
    elif t == "string":
        if not isinstance(value, str):
            raise Fault(DESERIALIZE + f"invalid type: {json.dumps(value)}, expected a string{where}.")
        if "enum" in schema and value not in schema["enum"]:
            expected = ", ".join(f"`{e}`" for e in schema["enum"])
            raise Fault(DESERIALIZE + f"unknown variant `{value}`, expected one of {expected}{where}.")
    elif t == "boolean":
        if not isinstance(value, bool):
            raise Fault(DESERIALIZE + f"invalid type: {json.dumps(value)}, expected a boolean{where}.")
    elif t == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            raise Fault(DESERIALIZE + f"invalid type: {json.dumps(value)}, expected an integer{where}.")
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if value < 0 or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise Fault(DESERIALIZE + f"invalid value: integer `{value}` out of range [{lo}, {hi}]{where}.")


def log(*args) -> None:
    print("fake-firecracker:", *args, file=sys.stderr, flush=True)


def die_with_parent() -> None:
    """In the child: SIGKILL when the fake dies, as a guest dies with its VMM."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class FakeVM:
    def __init__(self, instance_id: str):
        self.id = instance_id
        self.state = "Not started"
        self.boot_path = False  # a boot-specific resource was configured: no snapshot load any more
        self.boot_source: Optional[dict] = None
        self.drives: List[dict] = []  # root first, then in PUT order, like Firecracker
        self.machine = {"vcpu_count": 1, "mem_size_mib": 128, "smt": False, "track_dirty_pages": False}
        self.vsock: Optional[dict] = None
        self.vsock_server: Optional[asyncio.AbstractServer] = None
        self.bridges: List[asyncio.StreamWriter] = []
        self.reset_pending = False
        self.agent: Optional[subprocess.Popen] = None
        self.agent_port: Optional[int] = None
        self.guest_tmp: Optional[str] = None
        self.janitor: Optional[subprocess.Popen] = None
        self.next_host_port = 1 << 30
        self.failures = {f.strip() for f in os.environ.get("FAKE_FIRECRACKER_FAIL", "").split(",") if f.strip()}

    # -- the API ---------------------------------------------------------
    async def handle(self, method: str, path: str, body: Any) -> Optional[dict]:
        started = self.state != "Not started"
        pre_boot = ("PUT /boot-source", "PUT /drives/", "PUT /machine-config", "PUT /vsock", "PUT /logger",
                    "PUT /metrics", "PUT /snapshot/load", "PATCH /machine-config")
        post_boot = ("PATCH /vm", "PUT /snapshot/create", "PATCH /drives/")
        route = f"{method} {path}"
        if method == "GET" and path == "/":
            return {"app_name": "Firecracker", "id": self.id, "state": self.state, "vmm_version": VERSION}
        if method == "GET" and path == "/version":
            return {"firecracker_version": VERSION}
        if method == "GET" and path == "/machine-config":
            return dict(self.machine)
        schema = {"PUT /boot-source": "BootSource", "PUT /machine-config": "MachineConfiguration",
                  "PUT /vsock": "Vsock", "PUT /actions": "InstanceActionInfo", "PATCH /vm": "Vm",
                  "PUT /snapshot/create": "SnapshotCreateParams", "PUT /snapshot/load": "SnapshotLoadParams",
                  "PUT /logger": "Logger", "PUT /metrics": "Metrics"}.get(route)
        if schema is None and re.fullmatch(r"(PUT|PATCH) /drives/[^/]+", route):
            schema = "Drive" if method == "PUT" else "PartialDrive"
        if schema is None:
            raise Fault(f"Invalid request method and/or path: {method} {path}.")
        if body is None:
            raise Fault(DESERIALIZE + "EOF while parsing a value at line 1 column 0.")
        check(SCHEMAS[schema], body)
        if started and route.startswith(pre_boot):
            raise Fault("The requested operation is not supported after starting the microVM.")
        if not started and route.startswith(post_boot):
            raise Fault("The requested operation is not supported before starting the microVM.")
        if route == "PUT /actions":
            if body["action_type"] != "InstanceStart":
                if not started:
                    raise Fault("The requested operation is not supported before starting the microVM.")
                return None
            if started:
                raise Fault("The requested operation is not supported after starting the microVM.")
        return await getattr(self, "do_" + schema)(body, path, route in self.failures)

    def maybe_fail(self, injected: bool, route: str) -> None:
        if injected:
            raise Fault(f"injected failure (FAKE_FIRECRACKER_FAIL) for {route}")

    async def do_BootSource(self, body, path, injected):
        self.maybe_fail(injected, "PUT /boot-source")
        for key, what in (("kernel_image_path", "The kernel file cannot be opened"),
                          ("initrd_path", "The initrd file cannot be opened due to invalid path or invalid permissions.")):
            if key in body:
                try:
                    open(body[key], "rb").close()
                except OSError as e:
                    raise Fault(f"{what}: {e.strerror} (os error {e.errno})") from None
        self.boot_source, self.boot_path = body, True

    async def do_Drive(self, body, path, injected):
        if path.split("/")[-1] != body["drive_id"]:
            raise Fault("The id from the path does not match the id from the body!")
        if "path_on_host" not in body or "is_read_only" not in body:
            raise Fault("Unable to create the block device: virtio-block needs path_on_host and is_read_only")
        if body["is_root_device"] and any(d["is_root_device"] and d["drive_id"] != body["drive_id"] for d in self.drives):
            raise Fault("Drive config error: A root block device already exists!")
        self.maybe_fail(injected, path)
        try:
            open(body["path_on_host"], "rb" if body["is_read_only"] else "r+b").close()
        except OSError as e:
            raise Fault(f"Unable to create the block device: BackingFile(Os {{ code: {e.errno}, message: "
                        f"\"{e.strerror}\" }}, \"{body['path_on_host']}\")") from None
        self.drives = [d for d in self.drives if d["drive_id"] != body["drive_id"]]
        self.drives.insert(0, body) if body["is_root_device"] else self.drives.append(body)
        self.boot_path = True

    async def do_PartialDrive(self, body, path, injected):
        raise Fault("the fake firecracker does not implement PATCH /drives")

    async def do_MachineConfiguration(self, body, path, injected):
        if body["mem_size_mib"] == 0:
            raise Fault("The memory size (MiB) is either 0, or not a multiple of the configured page size.")
        if body.get("smt") and body["vcpu_count"] > 1 and body["vcpu_count"] % 2:
            raise Fault("The number of vCPUs must be greater than 0, less than 32 and must be 1 or an even "
                        "number if SMT is enabled.")
        self.maybe_fail(injected, "PUT /machine-config")
        self.machine.update(body)
        self.boot_path = True

    async def do_Vsock(self, body, path, injected):
        self.maybe_fail(injected, "PUT /vsock")
        await self.bind_vsock(body["uds_path"])
        self.vsock, self.boot_path = body, True

    async def do_Logger(self, body, path, injected):
        self.maybe_fail(injected, "PUT /logger")

    async def do_Metrics(self, body, path, injected):
        self.maybe_fail(injected, "PUT /metrics")

    async def do_InstanceActionInfo(self, body, path, injected):
        if self.boot_source is None:
            raise Fault("Start microvm error: Cannot start microvm without kernel configuration.")
        with open(self.boot_source["kernel_image_path"], "rb") as f:
            if f.read(4) != b"\x7fELF":  # released x86_64 Firecracker loads ELF kernels only
                raise Fault("Start microvm error: Cannot load kernel due to invalid memory configuration or "
                            "invalid kernel image: Kernel Loader: failed to load ELF kernel image")
        self.maybe_fail(injected, "PUT /actions")
        self.state = "Running"
        self.boot_guest()

    async def do_Vm(self, body, path, injected):
        self.maybe_fail(injected, "PATCH /vm")
        if body["state"] == "Paused":
            self.signal_guest(signal.SIGSTOP)
            self.state = "Paused"
        else:
            self.signal_guest(signal.SIGCONT)
            self.state = "Running"
            if self.reset_pending:  # the guest's vsock driver closes every connection
                self.reset_pending = False
                for w in self.bridges:
                    w.close()

    async def do_SnapshotCreateParams(self, body, path, injected):
        if self.state != "Paused":
            raise Fault("Cannot create snapshot: the microVM is not paused")  # the fake's words
        if body.get("snapshot_type") == "Diff" and not self.machine.get("track_dirty_pages"):
            raise Fault("Diff snapshots are not allowed on uVMs with dirty page tracking disabled.")
        self.reset_pending = self.vsock is not None  # Firecracker sends TRANSPORT_RESET before writing files
        self.maybe_fail(injected, "PUT /snapshot/create")
        with open(body["snapshot_path"], "w") as f:
            json.dump({"fake_firecracker_snapshot": 1, "drives": self.drives, "vsock": self.vsock,
                       "machine": self.machine, "note": "placeholder: a fake cannot snapshot a process"}, f)
        with open(body["mem_file_path"], "wb") as f:
            f.truncate(self.machine["mem_size_mib"] << 20)
            if body.get("snapshot_type") == "Diff":
                # Firecracker's sparse diff: the dirty pages only. The fake calls two pages dirty.
                for page in DIFF_PAGES:
                    f.seek(page * 4096)
                    f.write(b"dirty page %d\n" % page + b"\0" * (4096 - len(b"dirty page %d\n" % page)))

    async def do_SnapshotLoadParams(self, body, path, injected):
        if self.boot_path:
            raise Fault("Loading a microVM snapshot not allowed after configuring boot-specific resources.")
        if ("mem_backend" in body) == ("mem_file_path" in body):
            raise Fault(DESERIALIZE + ("too many fields: either `mem_backend` or `mem_file_path` exclusively is "
                                       "required" if "mem_backend" in body else
                                       "missing field: either `mem_backend` or `mem_file_path` is required") + ".")
        mem = body["mem_backend"]["backend_path"] if "mem_backend" in body else body["mem_file_path"]
        asyncio.get_running_loop().call_later(0.2, os._exit, 1)  # Firecracker exits after a failed load
        try:
            with open(body["snapshot_path"]) as f:
                state = json.load(f)
            open(mem, "rb").close()
        except (OSError, ValueError) as e:
            raise Fault(f"Load snapshot error: Failed to restore from snapshot: {e}") from None
        for d in state.get("drives", []):
            if not os.path.exists(d["path_on_host"]):
                raise Fault(f"Load snapshot error: Failed to restore from snapshot: Cannot open the block device "
                            f"backing file {d['path_on_host']!r} (No such file or directory)")
        uds = (body.get("vsock_override") or state.get("vsock") or {}).get("uds_path")
        if uds and os.path.exists(uds):
            raise Fault(f"Load snapshot error: Failed to restore from snapshot: cannot bind {uds!r}: "
                        "Address in use (os error 98)")
        self.maybe_fail(injected, "PUT /snapshot/load")
        raise Fault("Load snapshot error: the fake firecracker cannot restore a running process from a snapshot "
                    "(the request, its files and the drives at their relative paths were all valid)")

    # -- the "guest" -----------------------------------------------------
    def boot_guest(self) -> None:
        """What images/vm.py's /init would do, with host processes."""
        args = (self.boot_source or {}).get("boot_args", "")
        m = re.search(r"(?:^| )sandgate\.transport=vsock:(\d+)", args)
        if len(self.drives) < 2:
            print("sandgate-init: cannot mount the agent disk", flush=True)
            return
        if not m:  # the agent would listen on virtio-serial, which Firecracker does not have
            print("sandgate-init: no vsock transport on the command line; the agent uses /dev/sandgate", flush=True)
            return
        self.guest_tmp = tempfile.mkdtemp(prefix=f"fakefc-{os.getpid()}-")  # short: zmq ipc paths are limited
        # Firecracker is stopped with SIGKILL: a helper removes the directory once the fake is gone.
        self.janitor = subprocess.Popen(
            [sys.executable, "-c", "import shutil, sys, time; sys.stdin.buffer.read(); time.sleep(1.5); "
             "shutil.rmtree(sys.argv[1], ignore_errors=True)", self.guest_tmp],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        opt = os.path.join(self.guest_tmp, "opt")
        os.makedirs(opt)
        why = "debugfs (e2fsprogs) not found"
        if shutil.which("debugfs"):  # read-only: the agent disk is mounted ro in the guest too
            p = subprocess.run(["debugfs", "-R", f"rdump /sandgate_agent {opt}", self.drives[1]["path_on_host"]],
                               capture_output=True, text=True)
            why = p.stderr.strip().splitlines()[-1:] or "no sandgate_agent on it"
        if not os.path.exists(os.path.join(opt, "sandgate_agent", "agent.py")):
            print(f"sandgate-init: cannot mount the agent disk ({why})", flush=True)
            return
        self.agent_port = int(m.group(1))
        ws = os.path.abspath("guest-workspace")
        os.makedirs(ws, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": ws, "LANG": "C.UTF-8", "PYTHONPATH": opt,
               "PYTHONDONTWRITEBYTECODE": "1"}
        # JPY_PARENT_PID makes ipykernel exit when the agent dies, so a killed fake leaves nothing behind.
        self.agent = subprocess.Popen(
            ["/bin/sh", "-c", 'JPY_PARENT_PID=$$ exec "$0" "$@"', sys.executable, "-m", "sandgate_agent.agent",
             "--transport", "unix:guest-agent.sock", "--workspace", ws,
             "--runtime-dir", os.path.join(self.guest_tmp, "run")],
            env=env, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)

    def guest_pids(self) -> List[int]:
        """The agent and every process under it (its ipykernel), for pausing."""
        if not self.agent:
            return []
        children: Dict[int, List[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        pids, todo = [], [self.agent.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo.extend(children.get(pid, []))
        return pids

    def signal_guest(self, sig: int) -> None:
        for pid in self.guest_pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def bind_vsock(self, uds_path: str) -> None:
        if self.vsock_server:
            self.vsock_server.close()
            if self.vsock:
                try:
                    os.unlink(self.vsock["uds_path"])
                except OSError:
                    pass
        try:
            self.vsock_server = await asyncio.start_unix_server(self.on_vsock, path=uds_path)
        except OSError as e:
            raise Fault(f"Vsock config error: Cannot create backend for vsock device: UnixBind({e})") from None

    async def on_vsock(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Firecracker's host-initiated connection: CONNECT PORT, then OK HOSTPORT and the stream."""
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            m = re.fullmatch(rb"CONNECT (\d+)\n", line)
            if not m or self.state == "Not started" or int(m.group(1)) != self.agent_port:
                writer.close()
                return
            while self.state == "Paused" or self.reset_pending:  # no RX to the guest until it acks the reset
                await asyncio.sleep(0.05)
            try:
                g_reader, g_writer = await asyncio.open_unix_connection("guest-agent.sock", limit=1 << 20)
            except OSError:  # nothing listens on that port (yet): Firecracker closes the connection
                writer.close()
                return
            self.next_host_port += 1
            writer.write(f"OK {self.next_host_port}\n".encode())
            self.bridges.append(writer)
            await asyncio.gather(self.pump(reader, g_writer), self.pump(g_reader, writer))
        except (OSError, asyncio.TimeoutError):
            writer.close()
        finally:
            if writer in self.bridges:
                self.bridges.remove(writer)

    @staticmethod
    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.close()

    def shutdown(self) -> None:
        if self.agent and self.agent.poll() is None:
            self.signal_guest(signal.SIGKILL)
        if self.guest_tmp:
            shutil.rmtree(self.guest_tmp, ignore_errors=True)


# -- HTTP/1.1 on the unix socket, as Firecracker's micro_http answers ------------
def response(status: int, body: Optional[dict]) -> bytes:
    reason = {200: "OK", 204: "No Content", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}
    head = f"HTTP/1.1 {status} {reason.get(status, '')}\r\nServer: Firecracker API\r\nConnection: keep-alive\r\n"
    if body is None:
        return (head + "\r\n").encode()
    data = json.dumps(body).encode()
    return (head + f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def record(entry: dict) -> None:
    path = os.environ.get("FAKE_FIRECRACKER_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


async def serve(vm: FakeVM, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            line = await reader.readline()
            if not line:
                return
            try:
                method, target, _ = line.decode().split(" ", 2)
            except ValueError:
                writer.write(response(400, {"fault_message": "Invalid HTTP request line."}))
                return
            length = 0
            while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = h.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
                if name.strip().lower() == "transfer-encoding":
                    writer.write(response(400, {"fault_message": "Transfer-Encoding is not supported."}))
                    return
            raw = await reader.readexactly(length) if length else b""
            entry: Dict[str, Any] = {"pid": os.getpid(), "t": time.time(), "method": method, "path": target}
            try:
                body = json.loads(raw) if raw else None
                entry["body"] = body
            except ValueError as e:
                entry["body"] = raw.decode(errors="replace")
                body, err = None, Fault(DESERIALIZE + f"{e}.")
            else:
                err = None
            try:
                if err:
                    raise err
                result = await vm.handle(method, target, body)
                status, payload = (200, result) if result is not None else (204, None)
            except Fault as f:
                status, payload = f.status, {"fault_message": str(f)}
            entry.update(status=status, fault_message=(payload or {}).get("fault_message"))
            record(entry)
            writer.write(response(status, payload))
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def main_async(args: argparse.Namespace) -> None:
    vm = FakeVM(args.id)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    server = await asyncio.start_unix_server(lambda r, w: serve(vm, r, w), path=args.api_sock)
    try:
        await stop
    finally:
        server.close()
        vm.shutdown()
        for p in (args.api_sock, (vm.vsock or {}).get("uds_path")):
            if p and os.path.exists(p):
                os.unlink(p)


def main() -> None:
    # The flags Firecracker has; anything else is an error, as it is for Firecracker.
    ap = argparse.ArgumentParser(prog="firecracker", allow_abbrev=False)
    ap.add_argument("--api-sock", default="/run/firecracker.socket")
    ap.add_argument("--id", default="anonymous-instance")
    ap.add_argument("--seccomp-filter")
    ap.add_argument("--level")
    ap.add_argument("--log-path")
    ap.add_argument("--show-level", action="store_true")
    ap.add_argument("--show-log-origin", action="store_true")
    ap.add_argument("--start-time-us")
    ap.add_argument("--start-time-cpu-us")
    ap.add_argument("--no-seccomp", action="store_true")
    ap.add_argument("--version", action="version", version=f"Firecracker v{VERSION}")
    args = ap.parse_args()
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", args.id):
        sys.exit(f"Invalid instance ID: {args.id}")
    if os.path.exists(args.api_sock):
        sys.exit(f"Failed to open the API socket at: {args.api_sock}. Check that it is not already used.")
    print(f"Running Firecracker v{VERSION} (fake)", flush=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
