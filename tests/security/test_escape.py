"""The escape and abuse suite: every attempt in escape_attempts.py, from inside a
sandbox (or through the files API at it), against each driver. Each asserts that the attack fails and
that the gateway and a second sandbox stay healthy: the gateway answers GET /api, the second sandbox
answers 1+1 and its workspace is exactly what it was.

Per driver, one gateway with egress on (test services on 127.0.0.3 and 127.0.0.4, names through
SANDGATE_EGRESS_HOSTS) and three sandboxes shared by the module: the attacker (with an egress policy and a
secret), the victim (no egress, one workspace file), and a bomb sandbox for the resource bombs.
Addresses outside loopback appear only as policy inputs the proxy must refuse before connecting."""

from __future__ import annotations

import os
import socket
import string
import subprocess
import threading
import tempfile
import time
import uuid

import pytest

from security import escape_attempts as A
from conftest import DRIVERS, Gateway, wait_for
from sandgate.drivers.base import tag
from test_egress_proxy import PLAIN_IP, TLS_IP, upstream  # noqa: F401 (the HTTPS/HTTP servers, a fixture)

MARKER = uuid.uuid4().hex
VICTIM_FILE = f"victim-{MARKER[:12]}.txt"
VICTIM_CONTENT = f"the victim's own bytes {MARKER}\n"
SECRET = f"sk-escape-{MARKER[:16]}"
PLANTED = uuid.uuid4().hex  # the content of files the files API attempts try to plant

HOSTS = {"secure.test": TLS_IP, "other.test": TLS_IP, "plain.test": PLAIN_IP, "deny.evil.test": TLS_IP,
         "lo.evil.test": "127.0.0.1", "lo3.evil.test": PLAIN_IP, "meta.evil.test": "169.254.169.254",
         "priv.evil.test": "10.0.0.1", "zero.evil.test": "0.0.0.0", "cgnat.evil.test": "100.64.0.1",
         "doc.evil.test": "192.0.2.1", "mapped.evil.test": "::ffff:127.0.0.3", "v6lo.evil.test": "::1",
         "nat64.evil.test": "64:ff9b::7f00:3", "sixto4.evil.test": "2002:7f00:3::1", "ll6.evil.test": "fe80::1",
         "ula.evil.test": "fd00::1", "metav6.evil.test": "fd00:ec2::254"}


class Env:
    """One driver's gateway, its three sandboxes and the host-side bait."""


def ex(gw, sid, code, timeout=240) -> dict:
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code, "timeout": timeout}, timeout=timeout + 60)
    assert r.status == 200, r.body
    return r.json()


def create(gw, body) -> str:
    r = gw.request("POST", "/api/sandboxes", body, timeout=300)
    assert r.status == 201, r.body
    return r.json()["id"]


@pytest.fixture(autouse=True)
def known_finding(request):
    """An attempt that succeeds on a driver (escape_attempts.FINDINGS) is xfail(strict=True) there: the test
    still asserts the safe behaviour, and fails once the finding is fixed."""
    params = getattr(request.node, "callspec", None) and request.node.callspec.params
    if params and "env" in params:
        item = next(v for k, v in params.items() if k != "env")
        reason = A.FINDINGS.get((item[0], params["env"]))
        if reason:
            request.node.add_marker(pytest.mark.xfail(strict=True, reason=f"finding: {reason}"))


def ids(items):
    return [i[0] for i in items]


@pytest.fixture(scope="module", params=DRIVERS)
def env(request, home, upstream, tmp_path_factory):
    driver = request.param
    if driver == "qemu":
        from sandgate_images import vm

        vm.build(home)
    tmp = tmp_path_factory.mktemp(f"escape-{driver}")
    e = Env()
    e.driver, e.upstream = driver, upstream
    e.marker_path = tmp / f"host-marker-{MARKER}"
    e.marker_path.write_text(MARKER)
    # An abstract unix socket and a UDP socket on the host, for the sandbox to reach if it could.
    e.abstract = f"sandgate-escape-{driver}-{MARKER}"
    e.unix = socket.socket(socket.AF_UNIX)
    e.unix.bind("\0" + e.abstract)
    e.unix.listen()
    e.unix.setblocking(False)
    e.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    e.udp.bind((PLAIN_IP, 0))
    e.udp.setblocking(False)
    e.gw = Gateway(home, tmp, env={
        "SANDGATE_WARM_START": "false", "SANDGATE_EGRESS_CA_BUNDLE": str(upstream["ca"]),
        "SANDGATE_EGRESS_HOSTS": ",".join(f"{k}={v}" for k, v in HOSTS.items())})
    e.gw.driver = driver
    policy = {"allow": [f"secure.test:{upstream['https']}", f"{TLS_IP}/32:{upstream['https']}", "*.evil.test"],
              "deny": ["deny.evil.test"]}
    secrets = [{"host": "secure.test", "header": "Authorization", "value": SECRET}]
    try:
        e.victim = create(e.gw, {"driver": driver})
        r = e.gw.request("PUT", f"/api/sandboxes/{e.victim}/files/{VICTIM_FILE}", raw=VICTIM_CONTENT.encode())
        assert r.status == 201, r.body
        e.victim_listing = listing(e.gw, e.victim)
        e.attacker = create(e.gw, {"driver": driver, "egress": policy, "secrets": secrets})
        bomb_limits = {"memory_mb": 512, "pids": 128, "disk_mb": 64} if driver == "gvisor" else {"memory_mb": 512}
        e.bomb = create(e.gw, {"driver": driver, "egress": policy, "limits": bomb_limits})
        e.host_sockets = host_sockets(e.gw)
        assert e.host_sockets, "no host unix socket to aim at"
        e.vars = {"GW_PORT": e.gw.port, "VICTIM": e.victim, "VICTIM_FILE": VICTIM_FILE, "HOME": str(e.gw.home),
                  "MARKER_PATH": str(e.marker_path), "MARKER_NAME": e.marker_path.name, "MARKER": MARKER,
                  "ABSTRACT": e.abstract, "UDP_PORT": e.udp.getsockname()[1], "HOST_SOCKETS": repr(e.host_sockets),
                  "HTTP": upstream["http"], "HTTPS": upstream["https"], "SECRET": SECRET}
        e.started = time.monotonic()
        yield e
    finally:
        print(f"\n{driver}: escape suite module took {time.monotonic() - getattr(e, 'started', time.monotonic()):.0f} s")
        e.gw.stop()
        e.unix.close()
        e.udp.close()


def host_sockets(gw) -> list:
    """Unix sockets the host listens on for this gateway's sandboxes: the gVisor shims', qemu's QMP and
    serial sockets (drivers/base.socket_dir: /tmp/sg<kind>-<home tag>-<id tag>/)."""
    prefixes = tuple(f"{tempfile.gettempdir()}/sg{kind}-{tag(str(gw.home))}-" for kind in "gq")
    paths = []
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[7].startswith(prefixes + (str(gw.home),)):
            paths.append(f[7])
    return sorted(set(paths))[:40]


def listing(gw, sid) -> list:
    r = gw.request("GET", f"/api/sandboxes/{sid}/files/")
    assert r.status == 200, r.body
    return sorted((x["name"], x["type"], x["size"]) for x in r.json()["entries"] if x["name"] != ".ipython")


def assert_healthy(e: Env):
    """The gateway answers, the second sandbox answers 1+1, its workspace and the host's bait are untouched."""
    r = e.gw.request("GET", "/api")
    assert r.status == 200 and "version" in r.json(), r.body
    out = ex(e.gw, e.victim, "1+1", timeout=120)
    assert out["status"] == "ok" and out["outputs"][-1]["data"] == {"text/plain": "2"}, out
    r = e.gw.request("GET", f"/api/sandboxes/{e.victim}/files/{VICTIM_FILE}")
    assert r.status == 200 and r.body == VICTIM_CONTENT.encode(), r.body
    assert listing(e.gw, e.victim) == e.victim_listing
    assert e.marker_path.read_text() == MARKER
    with pytest.raises(BlockingIOError):  # nothing reached the host's sockets
        e.udp.recv(4096)
    with pytest.raises(BlockingIOError):
        e.unix.accept()


def snippet(e: Env, code: str) -> str:
    return A.PRELUDE + string.Template(code).substitute(e.vars)


def verdict(out: dict) -> str:
    lines = [l for l in out["stdout"].splitlines() if l.startswith(("BLOCKED", "ESCAPED"))]
    assert out["status"] == "ok" and len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("attempt", A.ATTEMPTS, ids=ids(A.ATTEMPTS))
def test_attempt_from_inside_fails(env, attempt):
    name, category, code = attempt
    v = verdict(ex(env.gw, env.attacker, snippet(env, code)))
    print(f"{env.driver}: {name}: {v[:200]}")
    assert v.startswith("BLOCKED"), f"{env.driver}: {name}: {v}"
    if name == "dns-exfil-name-refused-unresolved":
        log = env.gw.log_text()
        assert f"CONNECT exfil-{MARKER}.attacker.test:443 refused" in log and "cannot resolve" not in log
    assert_healthy(env)


@pytest.mark.parametrize("path_attempt", A.FILES, ids=ids(A.FILES))
def test_files_api_attempt_fails(env, path_attempt):
    name, method, path = path_attempt
    assert verdict(ex(env.gw, env.attacker, snippet(env, A.FILES_SETUP))).startswith("BLOCKED")
    path = string.Template(path).substitute(env.vars)
    url = f"/api/sandboxes/{env.attacker}/files/{path}"
    body = f"planted {PLANTED}".encode() if method == "PUT" else None
    r = env.gw.request(method, url, raw=body)
    assert 400 <= r.status < 500, (name, r.status, r.body[:300])
    leaks = (VICTIM_CONTENT.encode(), MARKER.encode() if method == "GET" else PLANTED.encode(), b"root:", b"PATH=")
    assert not any(x in r.body for x in leaks), r.body[:300]
    # Nothing planted outside the workspace, the targets of the links intact.
    check = ex(env.gw, env.attacker, "import glob, os\n"
                                     "print(glob.glob('/tmp/planted-*') + glob.glob('/planted-*'), "
                                     "len(os.listdir('/opt/sandgate')) > 0, os.path.exists('/opt/sandgate/sandgate_agent'))")
    assert check["stdout"].strip() == "[] True True", check
    assert_healthy(env)


def revive(e: Env, sid: str, name: str) -> str:
    """After a bomb: the bomb sandbox answers, or it is dead for a reason that says so and restarts."""
    sb = e.gw.request("GET", f"/api/sandboxes/{sid}").json()
    if sb["execution_state"] != "dead":
        out = ex(e.gw, sid, "1+1", timeout=180)
        if out["status"] == "ok":
            return "alive"
    sb = e.gw.request("GET", f"/api/sandboxes/{sid}").json()
    assert sb["execution_state"] == "dead" and sb["reason"], (name, sb)
    if name in ("memory-bomb", "tmpfs-bomb"):
        assert any(w in sb["reason"].lower() for w in ("memory", "killed", "137", "-9")), (name, sb["reason"])
    # Else the pids limit: under ptrace every sandbox thread is a host thread, so hitting it can stop the
    # sandbox as a whole (docs/security.md, cgroup limits): contained, and reported dead.
    r = e.gw.request("POST", f"/api/kernels/{sid}/restart", timeout=300)
    assert r.status == 200, r.body
    out = ex(e.gw, sid, "1+1", timeout=180)
    assert out["status"] == "ok" and out["outputs"][-1]["data"] == {"text/plain": "2"}, out
    return f"dead ({sb['reason'][:80]}), restarted"


@pytest.mark.parametrize("bomb", A.BOMBS, ids=ids(A.BOMBS))
def test_bomb_is_contained(env, bomb):
    """The bomb runs in its own sandbox while the second sandbox is checked, during and after."""
    name, code = bomb
    revive(env, env.bomb, "before " + name)  # one bomb's death is not the next one's failure
    result = {}

    def run():
        try:
            result["out"] = ex(env.gw, env.bomb, snippet(env, code), timeout=300)
        except Exception as exc:  # the assertion below reports it
            result["exc"] = exc

    t = threading.Thread(target=run)
    t.start()
    try:
        assert_healthy(env)  # while it runs
    finally:
        t.join(420)
    assert not t.is_alive(), f"{name}: the execute did not return"
    assert "exc" not in result, result
    out = result["out"]
    if name == "output-bomb":
        assert out["truncated"] is True and len(out["stdout"]) <= 17 << 20, (out["truncated"], len(out["stdout"]))
    elif out["status"] == "ok":
        v = verdict(out)
        print(f"{env.driver}: {name}: {v[:200]}")
        assert v.startswith("BLOCKED"), f"{env.driver}: {name}: {v}"
    else:
        # Killed by its limit mid-way: a dead kernel, reported as such (the sandbox's memory limit).
        assert out["error"] is not None, out
    state = revive(env, env.bomb, name)
    print(f"{env.driver}: {name}: {state}")
    assert_healthy(env)


@pytest.mark.parametrize("forged", A.FORGED_ATTEMPTS, ids=ids(A.FORGED_ATTEMPTS))
def test_forged_kernel_messages_to_the_agent(env, forged):
    """Code in a cell holds the kernel's sockets: what it forges there reaches the agent and, through it,
    the gateway. Nothing may follow from it: the sandbox runs on and the second is untouched."""
    out = ex(env.gw, env.attacker, string.Template(A.FORGED).substitute(env.vars))
    assert verdict(out).startswith("BLOCKED"), out
    out = ex(env.gw, env.attacker, "1+1")
    assert out["status"] == "ok" and out["outputs"][-1]["data"] == {"text/plain": "2"}, out
    sb = env.gw.request("GET", f"/api/sandboxes/{env.attacker}").json()
    assert sb["execution_state"] != "dead", sb
    assert_healthy(env)


@pytest.mark.parametrize("forged", A.ROOT_GUEST_ATTEMPTS, ids=ids(A.ROOT_GUEST_ATTEMPTS))
def test_forged_frames_from_a_root_guest_reach_only_its_own_link(env, forged):
    """A guest that took over the agent writes frames of its choosing on its stream. Valid but hostile ones
    (a response for an unknown id, one for an id the gateway may have asked, tunnel frames without egress,
    a `dropped` event with absurd counts) change nothing; a malformed one closes that link only."""
    name = forged[0]
    if (name, env.driver) in A.NOT_ON:
        pytest.skip(A.NOT_ON[(name, env.driver)])
    sid = create(env.gw, {"driver": env.driver})
    try:
        rid = env.gw.request("GET", f"/api/sandboxes/{sid}").json()["runtime_id"]
        kind = "hostile" if name == "root-guest-hostile-frames" else "malformed"
        owner = os.stat("/dev/null").st_uid
        p = subprocess.run(["runsc", "--root", str(env.gw.home / "runtime" / "gvisor"), "--network=none",
                            "--platform=ptrace", "exec", rid, "python3", "-c", A.FORGE_FRAMES, kind],
                           input="", capture_output=True, text=True, timeout=120)
        # input="": stdin is a pipe. runsc exec hands the sandbox user its stdio files: given the
        # test's stdin (CI's /dev/null) it would chown the host's /dev/null to nobody.
        assert p.returncode == 0 and p.stdout.startswith("BLOCKED"), (p.stdout, p.stderr[-1000:])
        assert os.stat("/dev/null").st_uid == owner, "runsc exec was given the host's /dev/null and chowned it"
        if kind == "hostile":
            out = ex(env.gw, sid, "1+1", timeout=120)  # the link carries on
            assert out["status"] == "ok" and out["outputs"][-1]["data"] == {"text/plain": "2"}, out
            assert env.gw.request("GET", f"/api/sandboxes/{sid}/files/").status == 200
        else:
            sb = wait_for(lambda: (s := env.gw.request("GET", f"/api/sandboxes/{sid}").json())["execution_state"]
                          == "dead" and s, timeout=120)
            assert "agent stream lost" in sb["reason"], sb
        assert_healthy(env)
    finally:
        env.gw.request("DELETE", f"/api/sandboxes/{sid}")
