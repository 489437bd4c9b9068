"""The kernels and gateways the benches drive: ``WSKernel`` (a gateway's websocket, legacy JSON
frames, the bench's own client), ``SDKKernel`` (Sandgate's SDK), ``ZMQKernel`` (a local ipykernel);
and the targets that start them: ``DirectTarget`` (jupyter_client, no gateway),
``KernelGatewayTarget`` (the PyPI Kernel Gateway) and ``SandgateTarget`` (``sandgate serve`` in a
home of its own, with the sandbox API through the SDK)."""

from __future__ import annotations

import datetime as dt
import json
import os
import queue
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from sandgate import __version__

from .harness import (TIMEOUT, BenchError, free_port, need_psutil, own_memory, progress, sandbox_cgroup_memory,
                      tree_memory)

SANDGATE = "sandgate-gvisor"  # the warm gateway's target name
TEMPLATE_WAIT = 300.0  # for a warm gateway's template checkpoint


# -- clients -------------------------------------------------------------------

class WSKernel:
    """A kernel behind a gateway, over its websocket with legacy JSON frames."""

    def __init__(self, port: int, token: str, kernel_id: str):
        import websocket

        self.websocket = websocket
        self.id = kernel_id
        self.session = uuid.uuid4().hex
        url = f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels?session_id={self.session}"
        self.ws = websocket.create_connection(url, header=[f"Authorization: token {token}"], timeout=TIMEOUT)

    def send(self, msg_type: str, content: dict, channel: str = "shell") -> str:
        header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": self.session,
                  "username": "bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(), "version": "5.3"}
        self.ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content,
                                 "channel": channel}))
        return header["msg_id"]

    def recv(self, timeout: float) -> dict:
        """The next message, within ``timeout`` seconds by the clock: the gateway's pings (every 30 s)
        are answered here but do not restart the wait, as they would restart websocket-client's socket
        timeout. A close frame is an error naming its code and reason (its payload is no message)."""
        abnf = self.websocket.ABNF
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.websocket.WebSocketTimeoutException(f"no message within {timeout:g} s")
            self.ws.settimeout(left)
            opcode, data = self.ws.recv_data(control_frame=True)
            if opcode == abnf.OPCODE_CLOSE:
                code = struct.unpack_from("!H", data)[0] if len(data) >= 2 else None
                raise BenchError(f"kernel {self.id}: the gateway closed the websocket (code {code}"
                                 f"{', ' + data[2:].decode(errors='replace') if len(data) > 2 else ''})")
            if opcode not in (abnf.OPCODE_PING, abnf.OPCODE_PONG):
                break
        if opcode == abnf.OPCODE_BINARY:  # legacy frame with buffers: JSON is chunk 0
            n = struct.unpack_from("!I", data)[0]
            offsets = list(struct.unpack_from(f"!{n}I", data, 4)) + [len(data)]
            data = data[offsets[0]:offsets[1]]
        return json.loads(data)

    def execute(self, code: str, on_result=None) -> dict:
        """Run code; return once its execute_reply and idle status have both
        arrived. on_result is called the moment the execute_result arrives."""
        mid = self.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                            "user_expressions": {}, "allow_stdin": False})
        deadline = time.monotonic() + TIMEOUT
        reply, idle, result = None, False, None
        while reply is None or not idle:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"kernel {self.id}: no reply to {code!r} within {TIMEOUT:g} s")
            try:
                m = self.recv(left)
            except self.websocket.WebSocketTimeoutException:
                continue
            if m.get("parent_header", {}).get("msg_id") != mid:
                continue
            t = m.get("msg_type") or m["header"]["msg_type"]
            if t == "execute_result":
                result = m["content"]["data"]
                if on_result:
                    on_result()
            elif t == "execute_reply":
                reply = m["content"]
            elif t == "status" and m["content"].get("execution_state") == "idle":
                idle = True
            elif t == "status" and m["content"].get("execution_state") == "dead":
                raise BenchError(f"kernel {self.id} died while running {code!r}")
        if reply.get("status") != "ok":
            raise BenchError(f"kernel {self.id}: {code!r} failed: {reply.get('ename')}: {reply.get('evalue')}")
        return {"reply": reply, "result": result}

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass


class SDKKernel:
    """A Sandgate sandbox's kernel through the SDK's ``KernelConnection`` (legacy JSON
    frames, as ``WSKernel``). No reconnect: a dropped connection is a failure to report,
    not to hide (the fleet bench counts lost cells)."""

    def __init__(self, url: str, token: str, sandbox_id: str):
        from sandgate_client.kernel import KernelConnection

        self.id = sandbox_id
        self.k = KernelConnection(url, token, sandbox_id, timeout=TIMEOUT, max_reconnects=0)

    def send(self, msg_type: str, content: dict, channel: str = "shell") -> str:
        return self.k.send(msg_type, content, channel=channel)

    def recv(self, timeout: float) -> dict:
        """The next message; ``sandgate_client.Timeout`` if none came in time."""
        return self.k.recv(max(0.1, timeout))

    def execute(self, code: str, on_result=None) -> dict:
        """As ``WSKernel.execute``: once its execute_reply and idle status have both arrived."""
        from sandgate_client import SandgateError

        try:
            ex = self.k.execute(code, timeout=TIMEOUT, on_result=(lambda r: on_result()) if on_result else None)
        except SandgateError as e:
            raise BenchError(f"kernel {self.id}: {code!r}: {type(e).__name__}: {e}") from None
        if ex.status != "ok":
            raise BenchError(f"kernel {self.id}: {code!r} failed: {ex.error}")
        main = next((r.data for r in ex.results if r.is_main_result), None)
        return {"reply": ex.reply, "result": main}

    def close(self) -> None:
        try:
            self.k.close()
        except Exception:
            pass


class ZMQKernel:
    """A local ipykernel driven directly over ZMQ."""

    def __init__(self, km, kc):
        self.km, self.kc = km, kc

    @property
    def id(self) -> str:
        return self.km.kernel_id or "?"

    def execute(self, code: str, on_result=None) -> dict:
        mid = self.kc.execute(code, store_history=True)
        deadline = time.monotonic() + TIMEOUT
        reply, idle, result = None, False, None
        while not idle:
            try:
                m = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"local kernel: no output for {code!r} within {TIMEOUT:g} s") from None
            if m["parent_header"].get("msg_id") != mid:
                continue
            if m["msg_type"] == "execute_result":
                result = m["content"]["data"]
                if on_result:
                    on_result()
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                idle = True
        while reply is None:
            try:
                m = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"local kernel: no execute_reply for {code!r} within {TIMEOUT:g} s") from None
            if m["parent_header"].get("msg_id") == mid:
                reply = m["content"]
        if reply.get("status") != "ok":
            raise BenchError(f"local kernel: {code!r} failed: {reply.get('ename')}: {reply.get('evalue')}")
        return {"reply": reply, "result": result}

    def close(self) -> None:
        try:
            if self.kc is not None:
                self.kc.stop_channels()
        except Exception:
            pass


# -- targets -------------------------------------------------------------------

class Target:
    name = ""

    def setup(self) -> None: ...

    def before_start(self) -> None:
        """Untimed preparation before a measured start."""

    def start_kernel(self): ...

    def memory(self, kernel) -> dict: ...

    def stop_kernel(self, kernel) -> None: ...

    def teardown(self) -> None: ...

    def versions(self) -> dict:
        return {}


class DirectTarget(Target):
    name = "jupyter-client"

    def __init__(self, logdir: Path):
        self.kernels: List[ZMQKernel] = []
        self.log_path = logdir / f"{self.name}.log"

    def start_kernel(self) -> ZMQKernel:
        from jupyter_client.manager import KernelManager

        # What start_new_kernel does, with the manager registered first so
        # that an interrupted start is still cleaned up.
        km = KernelManager(kernel_name="python3")
        k = ZMQKernel(km, None)
        self.kernels.append(k)
        with open(self.log_path, "a") as log:  # the kernel's own output, kept out of the progress lines
            km.start_kernel(stdout=log, stderr=log)
        k.kc = km.client()
        k.kc.start_channels()
        k.kc.wait_for_ready(timeout=TIMEOUT)
        return k

    def memory(self, kernel: ZMQKernel) -> dict:
        psutil = need_psutil()
        pid = kernel.km.provisioner.pid if kernel.km.provisioner else None
        procs = [psutil.Process(pid)] if pid else []
        return {**tree_memory(procs), "gateway_delta": None}

    def stop_kernel(self, kernel: ZMQKernel) -> None:
        kernel.close()
        if kernel in self.kernels:
            self.kernels.remove(kernel)
        if not kernel.km.has_kernel:
            return
        try:
            kernel.km.shutdown_kernel(now=False)
        except Exception:
            try:
                kernel.km.shutdown_kernel(now=True)
            except Exception as e:
                progress(f"warning: could not stop the local kernel: {e}")

    def teardown(self) -> None:
        for k in list(self.kernels):
            self.stop_kernel(k)

    def versions(self) -> dict:
        import ipykernel
        import jupyter_client

        return {"jupyter_client": jupyter_client.__version__, "ipykernel (host)": ipykernel.__version__}


class GatewayTarget(Target):
    """A gateway subprocess with the Jupyter REST API and kernel websocket."""

    startup = 90.0

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.port = free_port()
        self.token = uuid.uuid4().hex
        self.proc: Optional[subprocess.Popen] = None
        self.ps = None  # psutil.Process of the gateway
        self.kernels: Dict[str, WSKernel] = {}
        self.baseline: Dict[str, int] = {}
        self.log_path = logdir / f"{self.name}.log"
        self._log = None

    def command(self) -> List[str]: ...

    def env(self) -> dict:
        return dict(os.environ)

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines)

    def request(self, method: str, path: str, body=None, timeout: float = TIMEOUT):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw else None)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def setup(self) -> None:
        psutil = need_psutil()
        self._log = open(self.log_path, "w")
        # A session of its own: Ctrl-C reaches only the bench, which then
        # stops kernels and gateways in order.
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + self.startup
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with status {self.proc.returncode} while starting:\n"
                                 f"{self.log_tail()}")
            try:
                if self.request("GET", "/api", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise BenchError(f"{self.name} did not answer on port {self.port} within {self.startup:g} s:\n"
                         f"{self.log_tail()}")

    def take_baseline(self) -> None:
        self.baseline = {"rss": own_memory(self.ps),
                         "children": {p.pid for p in self.ps.children()}} if self.ps else {}

    def start_kernel(self) -> WSKernel:
        self.take_baseline()
        try:
            status, body = self.request("POST", "/api/kernels", {"name": "python3"})
        except OSError as e:
            raise BenchError(f"{self.name}: POST /api/kernels failed: {e}\n{self.log_tail()}") from None
        if status != 201:
            raise BenchError(f"{self.name}: POST /api/kernels answered {status}: {body}\n{self.log_tail()}")
        kid = body["id"]
        self.kernels[kid] = None  # registered before connecting, so cleanup deletes it either way
        try:
            k = WSKernel(self.port, self.token, kid)
        except Exception as e:
            raise BenchError(f"{self.name}: websocket to kernel {kid} failed: {e}\n{self.log_tail()}") from None
        self.kernels[kid] = k
        return k

    def kernel_procs(self, kernel: WSKernel) -> list:
        psutil = need_psutil()
        procs = []
        for p in self.ps.children():
            try:
                if kernel.id in " ".join(p.cmdline()):
                    procs.append(p)
            except psutil.Error:
                pass
        return procs

    def memory(self, kernel: WSKernel) -> dict:
        procs = self.kernel_procs(kernel)
        if not procs:
            raise BenchError(f"{self.name}: no process of kernel {kernel.id} found under pid {self.proc.pid}")
        m = tree_memory(procs)
        m["gateway_delta"] = own_memory(self.ps) - self.baseline.get("rss", 0)
        return m

    def stop_kernel(self, kernel_or_id) -> None:
        kid = kernel_or_id if isinstance(kernel_or_id, str) else kernel_or_id.id
        k = self.kernels.pop(kid, None)
        if k:
            k.close()
        if self.proc and self.proc.poll() is None:
            try:
                status, body = self.request("DELETE", f"/api/kernels/{kid}", timeout=60)
                if status not in (204, 404):
                    progress(f"warning: {self.name}: DELETE kernel {kid} answered {status}: {body}")
            except OSError as e:
                progress(f"warning: {self.name}: DELETE kernel {kid} failed: {e}")

    def teardown(self) -> None:
        for kid in list(self.kernels):
            self.stop_kernel(kid)
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                progress(f"warning: {self.name} ignored SIGTERM for 60 s; killing it")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log:
            self._log.close()
            self._log = None


class KernelGatewayTarget(GatewayTarget):
    name = "kernel-gateway"

    def command(self) -> List[str]:
        return [sys.executable, "-m", "kernel_gateway", "--KernelGatewayApp.ip=127.0.0.1",
                f"--KernelGatewayApp.port={self.port}", f"--KernelGatewayApp.auth_token={self.token}",
                "--JupyterWebsocketPersonality.list_kernels=True"]

    def versions(self) -> dict:
        import kernel_gateway

        return {"jupyter-kernel-gateway": kernel_gateway.__version__}


class SandgateTarget(GatewayTarget):
    """``sandgate serve`` in a home of its own (one gateway per home), the
    built image shared with the bench's home by a symlink."""

    def __init__(self, logdir: Path, image_home: Path, name: str = SANDGATE, extra_env: Optional[dict] = None,
                 pool_wait: float = 0.0):
        self.name = name
        super().__init__(logdir)
        self.home = logdir / f"home-{name}"
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "images").symlink_to((image_home / "images").resolve(), target_is_directory=True)
        self.extra_env = extra_env or {}
        self.warm = self.extra_env.get("SANDGATE_WARM_START", "true") != "false"
        self.pool_wait = pool_wait
        self.started_ids: List[str] = []
        self.runtime_ids: List[str] = []
        self.url = f"http://127.0.0.1:{self.port}"
        self.sandboxes: Dict[str, object] = {}  # id: sandgate_client.Sandbox

    def command(self) -> List[str]:
        return [sys.executable, "-m", "sandgate.cli", "serve", "--port", str(self.port), "--token", self.token]

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("SANDGATE_WARM_START", "SANDGATE_POOL_SIZE")}
        return {**env, "SANDGATE_HOME": str(self.home), **self.extra_env}

    def setup(self) -> None:
        super().setup()
        if not self.warm:
            return
        deadline = time.monotonic() + TEMPLATE_WAIT
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if "template checkpoint" in text:
                return
            if "warm start disabled" in text:
                raise BenchError(f"{self.name}: the gateway could not make its template:\n{self.log_tail()}")
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.5)
        raise BenchError(f"{self.name}: no template checkpoint within {TEMPLATE_WAIT:g} s:\n{self.log_tail()}")

    def before_start(self) -> None:
        if self.pool_wait:
            time.sleep(self.pool_wait)  # untimed: the pool refills after the previous start

    def sdk(self, what: str, fn):
        """Call the SDK; its error as a BenchError with the gateway's log."""
        from sandgate_client import SandgateError

        try:
            return fn()
        except SandgateError as e:
            raise BenchError(f"{self.name}: {what}: {type(e).__name__}: {e}\n{self.log_tail()}") from None

    def handle(self, sid: str):
        """The SDK's Sandbox for ``sid``: the one create or fork returned, else looked up."""
        from sandgate_client import Sandbox

        if sid not in self.sandboxes:
            self.sandboxes[sid] = self.sdk(f"find sandbox {sid}", lambda: Sandbox.connect(sid, self.url, self.token))
        return self.sandboxes[sid]

    def start_kernel(self) -> SDKKernel:
        """A sandbox (``Sandbox.create``) and its kernel websocket, both through the SDK."""
        self.take_baseline()
        sid = self.create_sandbox()
        k = self.connect(sid)
        self.kernels[sid] = k
        return k

    def connect(self, sid: str) -> SDKKernel:
        """The kernel websocket of sandbox ``sid`` (the SDK's KernelConnection)."""
        return self.sdk(f"websocket to kernel {sid}", lambda: SDKKernel(self.url, self.token, sid))

    def stop_kernel(self, kernel_or_id) -> None:
        from sandgate_client import NotFound, Sandbox, SandgateError

        kid = kernel_or_id if isinstance(kernel_or_id, str) else kernel_or_id.id
        k = self.kernels.pop(kid, None)
        if k:
            k.close()
        if self.proc and self.proc.poll() is None:
            sb = self.sandboxes.pop(kid, None)
            try:
                (sb or Sandbox.connect(kid, self.url, self.token)).delete(timeout=60)
            except NotFound:
                pass
            except SandgateError as e:
                progress(f"warning: {self.name}: deleting sandbox {kid}: {e}")

    def runtime_id(self, sid: str) -> Optional[str]:
        from sandgate_client import SandgateError

        try:
            rid = self.handle(sid).refresh().raw.get("runtime_id")
        except SandgateError:
            rid = None
        if rid and rid not in self.runtime_ids:
            self.runtime_ids.append(rid)
        return rid

    def kernel_procs(self, kernel) -> list:
        # A kernel taken from the pool runs in a sandbox named after the pool
        # slot, not after the kernel: match its runtime id too.
        psutil = need_psutil()
        kid = kernel if isinstance(kernel, str) else kernel.id
        keys = [kid] + [r for r in [self.runtime_id(kid)] if r]
        procs = []
        for p in self.ps.children():
            try:
                line = " ".join(p.cmdline())
                if any(key in line for key in keys):
                    procs.append(p)
            except psutil.Error:
                pass
        return procs

    def memory(self, kernel: SDKKernel) -> dict:
        m = super().memory(kernel)
        sandbox = self.runtime_id(kernel.id)
        m["sandbox"] = sandbox
        m["cgroup"] = sandbox_cgroup_memory(sandbox) if sandbox else None
        return m

    def teardown(self) -> None:
        super().teardown()
        # The gateway should have destroyed every sandbox; anything left is a leak.
        psutil = need_psutil()
        for p in psutil.process_iter(["cmdline"]):
            line = " ".join(p.info.get("cmdline") or [])
            if (any(f"sg-{kid}" in line for kid in self.started_ids)
                    or any(rid in line for rid in self.runtime_ids)) and p.pid != os.getpid():
                progress(f"warning: sandbox process {p.pid} outlived the gateway; killing it: {line[:120]}")
                try:
                    p.kill()
                except psutil.Error:
                    pass

    def versions(self) -> dict:
        return {"sandgate": __version__}

    # -- the sandbox API, through the SDK ---------------------------------
    def create_sandbox(self, **create_args) -> str:
        from sandgate_client import Sandbox

        sb = self.sdk("create a sandbox", lambda: Sandbox.create(self.url, self.token, timeout=TIMEOUT, **create_args))
        self.sandboxes[sb.id] = sb
        self.kernels[sb.id] = None  # deleted on the way out, whatever happens
        self.started_ids.append(sb.id)
        rid = sb.info.raw.get("runtime_id")  # in create's answer: no extra request inside a timed start
        if rid and rid not in self.runtime_ids:
            self.runtime_ids.append(rid)
        return sb.id

    def run_cell(self, sid: str, code: str):
        """``Sandbox.run_code``: the SDK's Execution."""
        ex = self.sdk(f"{code!r} in sandbox {sid}", lambda: self.handle(sid).run_code(code, timeout=TIMEOUT))
        if ex.status != "ok":
            raise BenchError(f"{self.name}: {code!r} in sandbox {sid} gave {ex.status}: {ex.error}")
        return ex

    def checkpoint(self, sid: str):
        return self.sdk(f"checkpoint {sid}", lambda: self.handle(sid).checkpoint(timeout=TIMEOUT))

    def fork(self, sid: str, checkpoint: Optional[str] = None) -> str:
        child = self.sdk(f"fork {sid}", lambda: self.handle(sid).fork(checkpoint, timeout=TIMEOUT))
        self.sandboxes[child.id] = child
        self.kernels[child.id] = None
        self.started_ids.append(child.id)
        return child.id

    def pause(self, sid: str, mode: str = "disk"):
        return self.sdk(f"pause {sid}", lambda: self.handle(sid).pause(mode, timeout=TIMEOUT))
