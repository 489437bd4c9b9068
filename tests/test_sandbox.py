"""What a kernel can and cannot see: the sandbox boundary, tested from inside
real gVisor kernels."""

import json
import os

from conftest import Gateway, wait_for


def run(gateway, kid, code):
    c = gateway.connect(kid)
    try:
        return c.execute(code)
    finally:
        c.close()


def test_no_network(gateway, kernel):
    out = run(gateway, kernel, """
import socket, os
res = []
for host in [("1.1.1.1", 53), ("127.0.0.1", 22)]:
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect(host); res.append("connected")
    except OSError as e:
        res.append(type(e).__name__)
print(res, sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else 'no-sysfs-net')
""")
    assert "connected" not in out["stdout"], out
    assert "OSError" in out["stdout"] or "Error" in out["stdout"]


def test_host_is_invisible(gateway, kernel, tmp_path, home):
    marker = tmp_path / "host-secret.txt"
    marker.write_text("host only")
    out = run(gateway, kernel, f"""
import os, json
print(json.dumps({{
  "marker": os.path.exists({str(marker)!r}),
  "project": os.path.exists({os.getcwd()!r}),
  "image_cache": os.path.exists({str(home / "images")!r}),
  "uid": os.getuid(),
  "mounts": sorted(l.split()[4] for l in open('/proc/self/mountinfo')),
}}))
""")
    info = json.loads(out["stdout"])
    assert info["marker"] is False and info["project"] is False
    assert info["image_cache"] is False
    assert info["uid"] != 0
    assert set(info["mounts"]) <= {"/", "/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/net", "/tmp", "/workspace",
                                   "/opt/sandgate", "/sys"}  # /dev/net: an empty tmpfs hiding tun


def test_root_is_read_only_workspace_is_not(gateway, kernel):
    out = run(gateway, kernel, """
import os
try:
    open('/usr/evil', 'w'); print('root-writable')
except OSError as e:
    print('root', type(e).__name__)
open('/workspace/ok.txt', 'w').write('x'); print('workspace', os.path.exists('/workspace/ok.txt'))
print('cwd', os.getcwd())
""")
    assert "root-writable" not in out["stdout"]
    assert "workspace True" in out["stdout"] and "cwd /workspace" in out["stdout"]


def test_memory_limit_kills_only_that_sandbox(home, tmp_path):
    gw = Gateway(home, tmp_path, env={"SANDGATE_MEMORY_MB": "200"})
    try:
        victim, bystander = gw.start_kernel(), gw.start_kernel()
        c = gw.connect(victim)
        c.execute("import os; open('notes.txt', 'w').write('kept')")
        out = c.execute("x = bytearray(300 * 1024 * 1024)\nx[::4096] = b'1' * len(x[::4096])", timeout=120)
        assert out["reply"]["status"] == "error" and out["reply"]["ename"] == "DeadKernelError"
        model = wait_for(lambda: (m := gw.request("GET", f"/api/kernels/{victim}").json())["execution_state"] == "dead" and m)
        assert "killed" in model["reason"] or "status" in model["reason"]
        assert "memory limit" in gw.log_text() or "exited with status" in gw.log_text()
        # The gateway and the other kernel carry on.
        assert run(gw, bystander, "'ok'")["results"][0]["text/plain"] == "'ok'"
        # Restart brings the dead kernel back in a new sandbox over the same workspace.
        assert gw.request("POST", f"/api/kernels/{victim}/restart", {}).status == 200
        assert run(gw, victim, "print(open('notes.txt').read())")["stdout"] == "kept\n"
    finally:
        gw.stop()


def test_pids_limit_contains_a_fork_bomb(home, tmp_path):
    """Under the ptrace platform every sandbox thread is a host thread, so the
    pids limit is reached either as a failed fork inside the sandbox or as
    the sandbox being stopped; either way it is contained and reported."""
    gw = Gateway(home, tmp_path, env={"SANDGATE_PIDS": "128"})
    try:
        kid, other = gw.start_kernel(), gw.start_kernel()
        c = gw.connect(kid)
        out = c.execute("""
import subprocess
procs, err = [], None
try:
    for i in range(300):
        procs.append(subprocess.Popen(['sleep', '30']))
except OSError as e:
    err = type(e).__name__
print(len(procs), err)
for p in procs: p.kill()
""")
        if out["reply"]["status"] == "ok":
            started, err = out["stdout"].split()
            assert int(started) < 128 and err != "None"
        else:
            assert out["reply"]["ename"] == "DeadKernelError"
            model = wait_for(lambda: (m := gw.request("GET", f"/api/kernels/{kid}").json())["execution_state"] == "dead" and m)
            assert "sandbox exited" in model["reason"] or "killed" in model["reason"]
        assert run(gw, other, "'unaffected'")["results"][0]["text/plain"] == "'unaffected'"
    finally:
        gw.stop()


def test_files_and_commands_stay_per_sandbox(gateway):
    a, b = gateway.start_kernel(), gateway.start_kernel()
    try:
        run(gateway, a, "open('mine.txt', 'w').write('a')")
        assert "False" in run(gateway, b, "import os; print(os.path.exists('mine.txt'))")["stdout"]
    finally:
        gateway.request("DELETE", f"/api/kernels/{a}")
        gateway.request("DELETE", f"/api/kernels/{b}")


def test_the_kernel_cannot_reach_the_agent_stream(gateway, kernel):
    """The agent is the sandbox's PID 1 and owns the stream to the gateway;
    the kernel runs as another user and cannot open it through /proc/1/fd
    (were it able to, the gateway stops a sandbox whose stream turns to garbage)."""
    out = run(gateway, kernel, """
import os
opened = []
for fd in os.listdir('/proc/1/fd'):
    try:
        w = os.open(f'/proc/1/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)
        os.write(w, b'\\xff' * 64)
        opened.append(fd)
    except OSError:
        pass
print(len(opened), os.getuid(), os.getppid())
""")
    opened, uid, _ = out["stdout"].split()
    assert opened == "0" and uid != "0"
    assert run(gateway, kernel, "'still fine'")["results"][0]["text/plain"] == "'still fine'"
    assert gateway.request("GET", f"/api/kernels/{kernel}").json()["execution_state"] != "dead"


def test_the_kernel_runs_in_a_pid_namespace_without_the_agent_whose_init_reaps_orphans(gateway, kernel):
    """The kernel's /proc is its own PID namespace's: the agent (and its spawner) are not in it, pid 1 is
    a reaper that is no copy of the agent, and an orphan that exits is reaped rather than left a zombie
    (a sandbox's pids limit counts zombies)."""
    out = run(gateway, kernel, """
import json, os, subprocess, time
def procs():
    found = {}
    for p in os.listdir('/proc'):
        if p.isdigit():
            try:
                with open(f'/proc/{p}/cmdline', 'rb') as f:
                    cmd = f.read()
                with open(f'/proc/{p}/stat') as f:
                    state = f.read().rsplit(')', 1)[1].split()[0]
            except OSError:
                continue  # gone meanwhile
            found[int(p)] = (cmd.replace(b'\\0', b' ').decode(errors='replace')[:80], state)
    return found
before = procs()
# sh starts sleep in the background and exits: sleep is reparented to the namespace's init.
orphan = int(subprocess.run(['sh', '-c', 'sleep 10 >/dev/null 2>&1 & echo $!'], capture_output=True, text=True).stdout)
seen = orphan in procs()
deadline = time.monotonic() + 60
while time.monotonic() < deadline and orphan in procs():
    time.sleep(0.1)
with open('/proc/1/environ', 'rb') as f:
    init_env = f.read()
print(json.dumps({'before': before, 'orphan_seen': seen, 'orphan_gone': orphan not in procs(),
                  'me': os.getpid(), 'ppid': os.getppid(), 'init_env': init_env.decode()}))
""")
    got = json.loads(out["stdout"])
    cmds = [cmd for cmd, _ in got["before"].values()]
    assert not [c for c in cmds if "sandgate_agent.agent" in c], cmds  # no agent, no spawner (a fork of it)
    assert got["before"]["1"][0].startswith("/usr/bin/python3 -I -S -c import os, signal"), got["before"]["1"]
    assert got["init_env"] == ""  # nothing of the agent's environment either
    assert got["ppid"] == 0, got  # its parent (the spawner) is outside the namespace
    assert got["orphan_seen"] and got["orphan_gone"], got
