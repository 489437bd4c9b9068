"""Fixtures that run the real thing: a `sandgate serve` process whose kernels
are runsc sandboxes built from the real image, driven by real clients."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sandgate.config import default_home
from sandgate_client import Execution, Sandbox, SandboxDied, SandboxInfo, Timeout
from sandgate_client.sandbox import HTTP
from sandgate_client.kernel import KernelConnection
from sandgate_images import rootfs as images

HOME = Path(os.environ.get("SANDGATE_HOME") or default_home())

# What runs after the core: microVM boots (TCG here), the second runsc, multi-node fleets,
# benches, a browser and notebooks. `pytest -m "not slow"` runs the core alone.
SLOW_FILES = ("test_qemu", "test_qemu_confinement", "test_fleet", "test_fleet_executions",
              "test_fleet_sessions", "test_bench_density", "test_bench_egress", "test_bench_fleet", "test_bench_hostile",
              "test_bench_load", "test_jupyterlab_browser", "test_notebooks", "test_hostile_trust_fleet")
SLOW_PARAMS = ("qemu", "gvisor-runsc-trixie")


# The three tiers, each runnable alone: tests/unit (in-process, the fake driver, no runsc), the
# integration tests beside it (real gVisor), and the slow ones (marked, or named above).
UNIT = Path(__file__).resolve().parent / "unit"


def tier(item) -> int:
    if item.get_closest_marker("slow") is not None:
        return 2
    return 0 if item.path.is_relative_to(UNIT) else 1


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.path.stem in SLOW_FILES or any(v in SLOW_PARAMS for v in params.values()):
            item.add_marker(pytest.mark.slow)
    # A stable sort keeps each tier in file order, so a module-scoped gateway per driver is still
    # started once; the fast tiers' failures show up in the first minutes, not the last.
    items.sort(key=tier)


@pytest.fixture(scope="session")
def home() -> Path:
    """The image cache, built once (about 2 minutes on a fresh machine)."""
    images.build(HOME)
    return HOME


@contextlib.contextmanager
def environment(env: dict):
    """``env`` in os.environ for as long as the block runs (a value of None: unset), then as it was."""
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Response:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


LIVE_GATEWAYS: list = []  # for the log tails a failing test's report carries


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure in CI is often seen once: its report carries the last lines of every
    gateway still running, which say what the gateway and its sandboxes did."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for gw in list(LIVE_GATEWAYS):
            if gw.log.closed:
                continue  # killed, and its test is done with it
            try:
                tail = "\n".join(gw.log_text().splitlines()[-80:])
            except Exception as e:  # the report goes on without it
                tail = f"(unreadable: {e})"
            code = gw.proc.poll()
            state = "running" if code is None else f"exited with status {code}"
            report.sections.append((f"gateway on port {gw.port} ({state}), its log's last lines", tail))


class Gateway:
    """A running `sandgate serve` and a small HTTP client for it."""

    def __init__(self, home: Path, tmp: Path, token="test-token", env=None, args=(), own_home=None):
        self.port = free_port()
        self.token = token
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"gateway-{self.port}.log"
        # A home of its own (a gateway reclaims its home's sandboxes at start),
        # sharing the built image.
        self.home = own_home or tmp / f"home-{self.port}"
        if own_home is None:
            self.home.mkdir()
            (self.home / "images").symlink_to(home / "images")
        # Kept sandboxes are paused to disk at every stop: only the restart tests want that.
        full_env = {**os.environ, "SANDGATE_HOME": str(self.home), "SANDGATE_TOKEN": token,
                    "SANDGATE_KEEP_SANDBOXES": "false", **(env or {})}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "sandgate.cli", "serve", "--port", str(self.port), *args],
                                     env=full_env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        LIVE_GATEWAYS.append(self)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                LIVE_GATEWAYS.remove(self)  # its log is in the error
                raise RuntimeError(f"gateway exited: {self.log_text()}")
            try:
                if self.request("GET", "/api").status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        LIVE_GATEWAYS.remove(self)
        raise RuntimeError(f"gateway did not come up: {self.log_text()}")

    def metrics(self) -> dict:
        """``GET /metrics``, parsed: {(sample name, its labels sorted): value}."""
        r = self.request("GET", "/metrics")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain"), r.body
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(r.body.decode()) for s in family.samples}

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def request(self, method, path, body=None, token=None, headers=None, raw=None, timeout=180) -> Response:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json", **(headers or {})}
        tok = self.token if token is None else token
        if tok:
            h["Authorization"] = f"token {tok}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return Response(r.status, r.headers, r.read())
        except urllib.error.HTTPError as e:
            return Response(e.code, e.headers, e.read())

    def sandbox(self, sid: str) -> Sandbox:
        """The SDK's handle on sandbox ``sid`` (no request: every call names the id)."""
        return Sandbox(SandboxInfo.from_json({"id": sid}), HTTP(self.url, self.token, timeout=180))

    def create(self, **body) -> dict:
        """A sandbox through the SDK (``Sandbox.create``); the API's answer as a dict."""
        return Sandbox.create(self.url, self.token, timeout=300, **body).info.raw

    def run_code(self, sid: str, code: str, timeout: float = 60) -> Execution:
        """A cell through the SDK's ``run_code``. A cell that timed out or whose sandbox died
        comes back as its Execution (``status`` timeout, ``error.ename`` DeadKernelError) for
        the test to look at, rather than raised."""
        try:
            return self.sandbox(sid).run_code(code, timeout=timeout)
        except (Timeout, SandboxDied) as e:
            if getattr(e, "execution", None) is None:
                raise
            return e.execution

    def start_kernel(self, name="python3", env=None) -> str:
        r = self.request("POST", "/api/kernels", {"name": name, **({"env": env} if env else {})})
        assert r.status == 201, r.body
        return r.json()["id"]

    def connect(self, kernel_id, v1=False, session=None) -> "KernelClient":
        return KernelClient(self, kernel_id, v1=v1, session=session)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        if self in LIVE_GATEWAYS:
            LIVE_GATEWAYS.remove(self)


class KernelClient:
    """The SDK's KernelConnection (legacy or v1 frames), answering with the dict these tests
    read. No reconnect: a dropped connection is a failure the test should see."""

    def __init__(self, gw: Gateway, kernel_id: str, v1=False, session=None):
        self.seen = []  # every message received, in order
        self.k = KernelConnection(gw.url, gw.token, kernel_id, timeout=120, session=session,
                                  protocol="v1" if v1 else "legacy", on_message=self.seen.append, max_reconnects=0)
        self.session = self.k.session
        self.ws = self.k.ws  # the raw socket, for the tests that send bad frames at the edge

    def send(self, msg_type, content, channel="shell", parent=None) -> str:
        return self.k.send(msg_type, content, channel=channel, parent=parent)

    def recv(self, timeout=120) -> dict:
        return self.k.recv(timeout)

    def execute(self, code, timeout=120, stdin_reply=None) -> dict:
        """Run a cell; its iopub output and reply once it is idle."""
        try:
            ex = self.k.execute(code, timeout=timeout,
                                on_input=None if stdin_reply is None else lambda prompt, password: stdin_reply)
        except SandboxDied as e:  # these tests look at what the wire said about the death
            ex = e.execution
        msgs = ex.messages
        of = lambda kind: [m["content"] for m in msgs if m["msg_type"] == kind]  # noqa: E731
        return {"msgs": msgs, "stdout": ex.stdout, "stderr": ex.stderr, "reply": ex.reply,
                "results": [c["data"] for c in of("execute_result")], "displays": [c["data"] for c in of("display_data")],
                "errors": of("error")}

    def close(self):
        self.k.close()


@pytest.fixture(scope="module")
def gateway(home, tmp_path_factory):
    gw = Gateway(home, tmp_path_factory.mktemp("gw"), env={"SANDGATE_MAX_KERNELS": "4"})
    yield gw
    gw.stop()


DRIVERS = ["gvisor", "qemu"]
# The driver suite runs gVisor twice: with the system's runsc (Debian 12's stops a sandbox to
# checkpoint it) and with Debian 13's, fetched under the home as `sandgate image runsc` does,
# which checkpoints in place.
DRIVER_VARIANTS = ["gvisor", "gvisor-runsc-trixie", "qemu"]


@pytest.fixture(scope="module", params=DRIVER_VARIANTS)
def driver_gw(request, home, tmp_path_factory):
    """A gateway per driver (cold starts, so a boot is a boot), ``.driver`` naming it."""
    if request.param == "qemu":
        from sandgate_images import vm

        vm.build(home)
    env = {"SANDGATE_WARM_START": "false"}
    if request.param == "gvisor-runsc-trixie":
        from sandgate_images import runsc

        env["SANDGATE_RUNSC"] = str(runsc.fetch(home))
    g = Gateway(home, tmp_path_factory.mktemp(request.param), env=env)
    g.driver = request.param.split("-")[0]
    g.in_place = request.param == "gvisor-runsc-trixie"  # its checkpoints leave the sandbox running
    yield g
    g.stop()


@pytest.fixture(scope="module")
def kernel(gateway):
    kid = gateway.start_kernel()
    yield kid
    gateway.request("DELETE", f"/api/kernels/{kid}")


def host_processes(name: str) -> list:
    """Host processes with ``name`` in their command line: a sandbox's id names its directory
    in every one of its processes' command lines, a checkpoint's directory its runsc's."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(name in a for a in (p.info["cmdline"] or [])):
            found.append(p)
    return found


def wait_for(predicate, timeout=60, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


ANSI = re.compile(r"\x1b\[[0-9;]*m")
