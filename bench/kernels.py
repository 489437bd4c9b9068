"""`sandgate bench`: Sandgate beside a plain local kernel and the PyPI Kernel Gateway.

Five targets are measured in one run, interleaved so that drift on a noisy
host hits them all alike:

* ``jupyter-client``: a local ipykernel driven over ZMQ by a
  ``BlockingKernelClient``, no gateway at all (the baseline);
* ``kernel-gateway``: ``jupyter kernelgateway`` from PyPI, driven over REST and
  the websocket (legacy JSON frames) by the bench's own plain client (``WSKernel``);
* ``sandgate-gvisor``: ``sandgate serve`` with warm start (the default), driven
  through Sandgate's SDK as a user would: ``Sandbox.create`` and the kernel
  websocket's ``KernelConnection`` (legacy JSON frames too); each start waits
  ``POOL_WAIT`` s first, so it takes a kernel from the refilled pool;
* ``sandgate-template``: warm start with ``SANDGATE_POOL_SIZE=0``: every start
  restores the template checkpoint (the pool-empty case);
* ``sandgate-cold``: ``SANDGATE_WARM_START=false``: every start boots Python.

Each Sandgate gateway has a home of its own (one gateway per home), sharing the
built image by a symlink; warm targets are measured only once their gateway
logged "template checkpoint ... made".

Metrics: kernel start (request to the first ``1+1`` execute_result, median of
``START_REPS``), the ``1+1`` execute round trip (request until both its
execute_reply and its idle status arrived; p50 and p99 after ``WARMUP``
warmup runs, in batches of ``BATCH`` alternating between targets), and the
memory one idle kernel adds (RSS and PSS summed over its process tree, from
psutil). Every kernel and subprocess is stopped on the way out, Ctrl-C and
errors included.

The checkpoint section runs on ``sandgate-gvisor`` over the sandbox API (the SDK):
checkpoint time and size after ``x = 41``, fork to the fork's first ``1+1``
result, pause, the execute that resumes a paused sandbox, and what a paused
sandbox holds in memory (its runtime processes) and on disk.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import queue
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from sandgate import __version__

START_REPS = 3
WARMUP = 5
BATCH = 20
IDLE_WAIT = 3.0  # seconds an idle kernel settles before its memory is read
TIMEOUT = 180.0  # any single kernel start or execute
TARGETS = ("jupyter-client", "kernel-gateway", "sandgate-gvisor", "sandgate-template", "sandgate-cold")
SANDGATE = "sandgate-gvisor"
SANDGATE_TEMPLATE = "sandgate-template"
SANDGATE_COLD = "sandgate-cold"
POOL_WAIT = 3.0  # seconds before a warm start, for the pool to refill
TEMPLATE_WAIT = 300.0  # for a warm gateway's template checkpoint
CHECKPOINT_REPS = 3
CODE = "1+1"

_t0 = time.monotonic()


class BenchError(Exception):
    """A precondition or a target failed; the message says what to do."""


def progress(msg: str) -> None:
    print(f"[bench {time.monotonic() - _t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def conclude(failed: Optional[str], logdir: Path, output: str, report: dict, render) -> int:
    """A bench mode's end: why it failed (its logs kept), or its JSON written, its logs removed
    and ``render(report)`` printed; the exit status either way."""
    if failed:
        print(f"sandgate bench: {failed}\n  logs: {logdir}", file=sys.stderr)
        return 130 if failed == "interrupted" else 1
    Path(output).write_text(json.dumps(report, indent=1))
    shutil.rmtree(logdir, ignore_errors=True)
    print(render(report))
    print(f"\nraw numbers: {output}")
    return 0


def need_psutil():
    try:
        import psutil
    except ImportError:
        raise BenchError("psutil is not installed; it measures kernel memory: "
                         "pip install psutil (or pip install -e '.[test]')") from None
    return psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: List[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- memory ------------------------------------------------------------------

def tree_memory(procs) -> Dict[str, Optional[int]]:
    """RSS and PSS in bytes summed over processes and all their descendants.
    RSS counts pages shared between processes once per process; PSS splits them."""
    psutil = need_psutil()
    seen, rss, pss = set(), 0, 0
    for p in procs:
        try:
            members = [p] + p.children(recursive=True)
        except psutil.Error:
            continue
        for q in members:
            if q.pid in seen:
                continue
            seen.add(q.pid)
            try:
                rss += q.memory_info().rss
            except psutil.Error:
                continue
            if pss is not None:
                try:
                    pss += q.memory_full_info().pss
                except (psutil.Error, AttributeError):
                    pss = None  # not root, or no smaps: report RSS only
    return {"rss": rss, "pss": pss, "processes": len(seen)}


def own_memory(proc) -> int:
    psutil = need_psutil()
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def sandbox_cgroup_memory(sandbox_id: str) -> Optional[int]:
    """What the sandbox's cgroup is charged (includes its page cache)."""
    for path in (f"/sys/fs/cgroup/memory/sandgate/{sandbox_id}/memory.usage_in_bytes",
                 f"/sys/fs/cgroup/sandgate/{sandbox_id}/memory.current"):
        try:
            return int(Path(path).read_text())
        except (OSError, ValueError):
            continue
    return None


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


def cell_result(ex) -> Optional[str]:
    """The text/plain of a cell's value (an SDK Execution)."""
    return ex.text


def dir_bytes(path: Path) -> Optional[int]:
    if not path.exists():
        return None
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def runtime_memory(keys: List[str]) -> dict:
    """RSS of every process whose command line names one of keys, with descendants."""
    psutil = need_psutil()
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info.get("cmdline") or [])
        if p.pid != os.getpid() and any(k and k in line for k in keys):
            procs.append(p)
    return tree_memory(procs)


def measure_checkpoints(t: SandgateTarget) -> dict:
    """Checkpoint, fork, pause and resume on one warm sandbox over the sandbox API."""
    raw = {"checkpoint_s": [], "state_bytes": [], "files_bytes": [], "new_bytes": [], "stored_bytes": [], "fork_s": [],
           "fork_sees_x": [], "pause_s": [], "resume_execute_s": [], "paused_rss": [], "paused_processes": [],
           "paused_disk_bytes": []}
    t.before_start()
    sid = t.create_sandbox()
    time.sleep(POOL_WAIT)  # let the pool refill before timing anything
    t.run_cell(sid, "x = 41")
    cps = []
    for i in range(CHECKPOINT_REPS):
        t0 = time.perf_counter()
        cp = t.checkpoint(sid).raw
        raw["checkpoint_s"].append(time.perf_counter() - t0)
        for key in ("state_bytes", "files_bytes", "new_bytes", "stored_bytes"):
            raw[key].append(cp.get(key))
        cps.append(cp["id"])
        progress(f"checkpoint {i + 1}/{CHECKPOINT_REPS}: {raw['checkpoint_s'][-1]:.2f} s, "
                 f"state {mib(cp.get('state_bytes') or 0):.1f} MiB, stored {mib(cp.get('stored_bytes') or 0):.2f} MiB "
                 f"(new workspace data {cp.get('new_bytes')} B)")
    for i in range(CHECKPOINT_REPS):
        t0 = time.perf_counter()
        fork = t.fork(sid, cps[i])
        out = t.run_cell(fork, CODE)
        raw["fork_s"].append(time.perf_counter() - t0)
        if cell_result(out) != "2":
            raise BenchError(f"{t.name}: 1+1 in fork {fork} gave {out!r}")
        raw["fork_sees_x"].append(cell_result(t.run_cell(fork, "x + 1")) == "42")
        t.runtime_id(fork)
        t.stop_kernel(fork)
        progress(f"fork {i + 1}/{CHECKPOINT_REPS}: {raw['fork_s'][-1]:.2f} s to the first 1+1")
    for i in range(CHECKPOINT_REPS):
        rid = t.runtime_id(sid)
        t0 = time.perf_counter()
        m = t.pause(sid)
        raw["pause_s"].append(time.perf_counter() - t0)
        if m.state != "paused":
            raise BenchError(f"{t.name}: sandbox {sid} is {m.state!r} after pause")
        time.sleep(1.0)
        mem = runtime_memory([rid, sid])
        raw["paused_rss"].append(mem["rss"])
        raw["paused_processes"].append(mem["processes"])
        raw["paused_disk_bytes"].append(dir_bytes(t.home / "paused" / sid))
        t0 = time.perf_counter()
        out = t.run_cell(sid, CODE)
        raw["resume_execute_s"].append(time.perf_counter() - t0)
        if cell_result(out) != "2":
            raise BenchError(f"{t.name}: 1+1 after resume gave {out!r}")
        progress(f"pause {i + 1}/{CHECKPOINT_REPS}: {raw['pause_s'][-1]:.2f} s, paused RSS "
                 f"{mib(mem['rss']):.1f} MiB in {mem['processes']} processes, on disk "
                 f"{mib(raw['paused_disk_bytes'][-1] or 0):.1f} MiB; execute that resumes: "
                 f"{raw['resume_execute_s'][-1]:.2f} s")
    t.stop_kernel(sid)
    return raw


def summarize_checkpoints(raw: dict) -> dict:
    def med(key, scale=1.0):
        vals = [v for v in raw.get(key, []) if v is not None]
        return statistics.median(vals) * scale if vals else None

    def first(key, scale=1.0):
        vals = raw.get(key) or []
        return vals[0] * scale if vals and vals[0] is not None else None

    return {"checkpoint_median_s": med("checkpoint_s"), "state_mib": med("state_bytes", 2**-20),
            "files_bytes": med("files_bytes"), "new_bytes": med("new_bytes"),
            "stored_mib": med("stored_bytes", 2**-20), "first_stored_mib": first("stored_bytes", 2**-20),
            "fork_to_first_result_median_s": med("fork_s"), "pause_median_s": med("pause_s"),
            "resume_execute_median_s": med("resume_execute_s"), "paused_rss_mib": med("paused_rss", 2**-20),
            "paused_processes": med("paused_processes"), "paused_disk_mib": med("paused_disk_bytes", 2**-20),
            "fork_sees_x": all(raw.get("fork_sees_x") or [False])}


CHECKPOINT_ROWS = [
    ("checkpoint_median_s", "checkpoint after `x = 41`, median (s)", "{:.2f}"),
    ("state_mib", "checkpoint state_bytes, median (MiB)", "{:.1f}"),
    ("first_stored_mib", "first checkpoint stored_bytes, state and files (MiB)", "{:.2f}"),
    ("stored_mib", "checkpoint stored_bytes, median (MiB)", "{:.2f}"),
    ("new_bytes", "checkpoint new_bytes (workspace files only), median (B)", "{:.0f}"),
    ("fork_to_first_result_median_s", "fork to its first 1+1 result, median (s)", "{:.2f}"),
    ("pause_median_s", "pause, median (s)", "{:.2f}"),
    ("resume_execute_median_s", "1+1 on a paused sandbox (resume round trip), median (s)", "{:.2f}"),
    ("paused_rss_mib", "paused sandbox RSS, its runtime processes (MiB)", "{:.1f}"),
    ("paused_disk_mib", "paused sandbox on disk, paused/<id> (MiB)", "{:.1f}"),
]


def goals(summary: dict) -> dict:
    def start(name):
        return summary.get(name, {}).get("start_median_s")

    def ratio(a, b):
        return start(a) / start(b) if start(a) is not None and start(b) else None

    out = {
        "cold/warm (pool)": ratio(SANDGATE_COLD, SANDGATE),
        "cold/warm (template, pool empty)": ratio(SANDGATE_COLD, SANDGATE_TEMPLATE),
        "warm (pool)/kernel-gateway": ratio(SANDGATE, "kernel-gateway"),
        "warm (template, pool empty)/kernel-gateway": ratio(SANDGATE_TEMPLATE, "kernel-gateway"),
    }
    met = {k: (None if v is None else v >= 3 if k.startswith("cold/") else v < 1) for k, v in out.items()}
    return {"ratios": out, "met": met, "goal": "cold/warm >= 3 and warm/kernel-gateway < 1"}


def checkpoint_table(cs: dict, g: dict) -> str:
    rows = [[label, "-" if cs.get(key) is None else fmt.format(cs[key])] for key, label, fmt in CHECKPOINT_ROWS]
    for k, v in g["ratios"].items():
        goal = "goal >= 3x" if k.startswith("cold/") else "goal < 1x"
        met = g["met"][k]
        rows.append([f"start ratio {k} ({goal})",
                     "-" if v is None else f"{v:.2f}x ({'met' if met else 'not met'})"])
    head = ["metric (sandgate-gvisor, warm)", "value"]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(2)]
    line = lambda r: f"| {r[0].ljust(widths[0])} | {r[1].rjust(widths[1])} |"
    return "\n".join([line(head), f"|{'-' * (widths[0] + 2)}|{'-' * (widths[1] + 1)}:|"] + [line(r) for r in rows])


# -- the run ---------------------------------------------------------------------

def preflight(home: Path) -> None:
    from sandgate_images import rootfs as images

    from sandgate.drivers.gvisor import runsc_path

    need_psutil()
    missing = [m for m in ("websocket", "jupyter_client", "ipykernel", "kernel_gateway")
               if not _importable(m)]
    if missing:
        raise BenchError(f"missing Python packages: {', '.join(missing)}; pip install -e '.[test]'")
    if not runsc_path(os.environ.get("SANDGATE_RUNSC", "")):
        raise BenchError("runsc not found: install gVisor (apt-get install runsc), then `sandgate doctor`")
    if not images.is_built(home):
        flag = f" --home {home}" if home != _default_home() else ""
        raise BenchError(f"the sandbox image is not built in {home}: run `sandgate image build{flag}`")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _default_home() -> Path:
    from sandgate.config import default_home

    return default_home()


def runsc_version() -> str:
    from sandgate.drivers.gvisor import runsc_path

    try:
        out = subprocess.run([runsc_path(os.environ.get("SANDGATE_RUNSC", "")) or "runsc", "--version"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def measure_start(target: Target) -> dict:
    """Start a kernel, time it to its first 1+1 result, then read its idle memory."""
    target.before_start()
    t0 = time.perf_counter()
    got: List[float] = []
    kernel = target.start_kernel()
    try:
        out = kernel.execute(CODE, on_result=lambda: got.append(time.perf_counter()))
        if not got or out["result"].get("text/plain") != "2":
            raise BenchError(f"{target.name}: 1+1 gave {out['result']!r}")
        start = got[0] - t0
        time.sleep(IDLE_WAIT)
        mem = target.memory(kernel)
    finally:
        target.stop_kernel(kernel)
    return {"start_s": start, "memory": mem}


def kernel_versions(kernel) -> dict:
    out = kernel.execute("import sys, ipykernel; (sys.version.split()[0], ipykernel.__version__)")
    text = (out["result"] or {}).get("text/plain", "")
    try:
        py, ipk = eval(text, {})  # a tuple of two string literals
        return {"python": py, "ipykernel": ipk}
    except Exception:
        return {"raw": text}


def mib(b) -> Optional[float]:
    return None if b is None else b / 2**20


def summarize(results: dict) -> dict:
    s = {}
    for name, r in results.items():
        rt = r["roundtrip_s"]
        mem = r["memory"]

        def med(key):
            vals = [m[key] for m in mem if m.get(key) is not None]
            return statistics.median(vals) if vals else None

        s[name] = {
            "start_median_s": statistics.median(r["start_s"]) if r["start_s"] else None,
            "roundtrip_p50_ms": percentile(rt, 50) * 1e3 if rt else None,
            "roundtrip_p99_ms": percentile(rt, 99) * 1e3 if rt else None,
            "roundtrip_mean_ms": statistics.mean(rt) * 1e3 if rt else None,
            "idle_rss_mib": mib(med("rss")),
            "idle_pss_mib": mib(med("pss")),
            "gateway_delta_mib": mib(med("gateway_delta")),
            "cgroup_mib": mib(med("cgroup")),
        }
    return s


ROWS = [  # key, label, format
    ("start_median_s", "start to first result, median (s)", "{:.2f}"),
    ("roundtrip_p50_ms", "1+1 round trip p50 (ms)", "{:.2f}"),
    ("roundtrip_p99_ms", "1+1 round trip p99 (ms)", "{:.2f}"),
    ("idle_rss_mib", "idle kernel RSS, process tree (MiB)", "{:.1f}"),
    ("idle_pss_mib", "idle kernel PSS, process tree (MiB)", "{:.1f}"),
    ("gateway_delta_mib", "gateway process growth per kernel (MiB)", "{:.1f}"),
]


def ratios(summary: dict) -> dict:
    out = {}
    sg = summary.get(SANDGATE, {})
    for base in ("jupyter-client", "kernel-gateway"):
        b = summary.get(base, {})
        out[f"sandgate/{base}"] = {key: (sg[key] / b[key] if sg.get(key) is not None and b.get(key) else None)
                                   for key, _, _ in ROWS}
    return out


def table(summary: dict, rat: dict) -> str:
    cols = list(TARGETS) + list(rat)
    head = ["metric"] + cols
    rows = []
    for key, label, fmt in ROWS:
        row = [label]
        for name in TARGETS:
            v = summary.get(name, {}).get(key)
            row.append("-" if v is None else fmt.format(v))
        for r in rat.values():
            v = r.get(key)
            row.append("-" if v is None else f"{v:.2f}x")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def trace_breakdown(t: "SandgateTarget") -> dict:
    """Median span per message type from a traced gateway's log (all its
    traced cells: starts, warmup and round trips)."""
    from sandgate import trace

    try:
        with open(t.log_path, errors="replace") as f:
            return trace.summarize(f)
    except OSError:
        return {}


def trace_table(breakdown: dict) -> str:
    from sandgate import trace

    rows = sorted(breakdown.items(), key=lambda kv: kv[1].get("gw_sent", 0))
    hops = [h for h in trace.ORDER if any(h in r for _, r in rows)]
    out = ["| message | " + " | ".join(hops) + " | n |", "|---|" + "---:|" * (len(hops) + 1)]
    for name, r in rows:
        out.append(f"| {name} | " + " | ".join(f"{r[h]:.2f}" if h in r else "-" for h in hops) + f" | {r['n']} |")
    return "\n".join(out)


def run(args) -> int:
    home = Path(args.home) if args.home else _default_home()
    runs = max(1, args.runs)
    try:
        preflight(home)
    except BenchError as e:
        print(f"sandgate bench: {e}", file=sys.stderr)
        return 1

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-"))
    # --trace: every Sandgate gateway logs its spans (gateway/trace.py); the
    # breakdown of sandgate-gvisor's round trips is reported beside the table.
    tr = {"SANDGATE_TRACE": "1"} if getattr(args, "trace", False) else {}
    targets: List[Target] = [
        DirectTarget(logdir), KernelGatewayTarget(logdir),
        SandgateTarget(logdir, home, SANDGATE, {"SANDGATE_WARM_START": "true", **tr}, pool_wait=POOL_WAIT),
        SandgateTarget(logdir, home, SANDGATE_TEMPLATE, {"SANDGATE_WARM_START": "true", "SANDGATE_POOL_SIZE": "0", **tr}),
        SandgateTarget(logdir, home, SANDGATE_COLD, {"SANDGATE_WARM_START": "false", **tr}),
    ]
    breakdown: dict = {}
    nt = len(targets)
    checkpoint_raw: dict = {}
    results = {t.name: {"start_s": [], "memory": [], "roundtrip_s": [], "kernel": {}} for t in targets}
    live: Dict[str, object] = {}
    failed = None
    try:
        for t in targets:
            if isinstance(t, GatewayTarget):
                progress(f"starting {t.name} on port {t.port} (log {t.log_path})")
            t.setup()

        for rep in range(START_REPS):
            order = targets[rep % nt:] + targets[:rep % nt]
            for t in order:
                m = measure_start(t)
                results[t.name]["start_s"].append(m["start_s"])
                results[t.name]["memory"].append(m["memory"])
                progress(f"start {rep + 1}/{START_REPS} {t.name}: {m['start_s']:.2f} s, "
                         f"idle RSS {mib(m['memory']['rss']):.0f} MiB")

        for t in targets:
            k = t.start_kernel()
            live[t.name] = k
            results[t.name]["kernel"] = kernel_versions(k)
            for _ in range(WARMUP):
                k.execute(CODE)
        progress(f"round trips: {runs} per target after {WARMUP} warmup runs, in batches of {BATCH}")
        done, rnd = 0, 0
        while done < runs:
            n = min(BATCH, runs - done)
            order = targets[rnd % nt:] + targets[:rnd % nt]
            for t in order:
                k, rt = live[t.name], results[t.name]["roundtrip_s"]
                for _ in range(n):
                    t0 = time.perf_counter()
                    k.execute(CODE)
                    rt.append(time.perf_counter() - t0)
            done += n
            rnd += 1
            progress(f"round trips {done}/{runs}: " + ", ".join(
                f"{t.name} p50 {percentile(results[t.name]['roundtrip_s'], 50) * 1e3:.2f} ms" for t in targets))

        if tr:
            breakdown = trace_breakdown(next(t for t in targets if t.name == SANDGATE))
        for t in targets:  # the checkpoint section uses the warm gateway alone
            k = live.pop(t.name, None)
            if k is not None:
                t.stop_kernel(k)
        progress(f"checkpoints, forks, pause and resume on {SANDGATE}")
        checkpoint_raw = measure_checkpoints(next(t for t in targets if t.name == SANDGATE))
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    except Exception as e:  # a target misbehaved in a way not foreseen: still clean up
        failed = f"{type(e).__name__}: {e}"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        progress("stopping kernels and gateways")
        for t in targets:
            k = live.pop(t.name, None)
            try:
                if k is not None:
                    t.stop_kernel(k)
                t.teardown()
            except Exception as e:
                progress(f"warning: cleanup of {t.name}: {e}")
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if failed:
        print(f"sandgate bench: {failed}", file=sys.stderr)
        print(f"  gateway logs: {logdir}", file=sys.stderr)
        return 130 if failed == "interrupted" else 1

    summary = summarize(results)
    rat = ratios(summary)
    cs = summarize_checkpoints(checkpoint_raw)
    g = goals(summary)
    versions = {}
    for t in targets:
        versions.update(t.versions())
    report = {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "platform": platform.platform(), "runsc": runsc_version(),
                 "runsc_platform": os.environ.get("SANDGATE_RUNSC_PLATFORM", "ptrace"), **versions},
        "config": {"runs": runs, "warmup": WARMUP, "batch": BATCH, "start_reps": START_REPS,
                   "idle_wait_s": IDLE_WAIT, "code": CODE, "home": str(home), "pool_wait_s": POOL_WAIT,
                   "checkpoint_reps": CHECKPOINT_REPS,
                   "targets_env": {t.name: t.extra_env for t in targets if isinstance(t, SandgateTarget)}},
        "summary": summary,
        "ratios": rat,
        "checkpoints": cs,
        "goals": g,
        "raw": results,
        "raw_checkpoints": checkpoint_raw,
        "trace": breakdown,
    }
    Path(args.output).write_text(json.dumps(report, indent=1))
    shutil.rmtree(logdir, ignore_errors=True)
    print(table(summary, rat))
    print()
    print(checkpoint_table(cs, g))
    if breakdown:
        print(f"\n{SANDGATE}, where a 1+1 round trip goes (median ms since the websocket frame arrived):")
        print(trace_table(breakdown))
    print(f"\nraw numbers: {args.output}")
    return 0
