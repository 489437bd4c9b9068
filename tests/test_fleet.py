"""A gateway on the Redis store, end to end: a real redis-server and a real
`sandgate serve` (runsc sandboxes). Its records and tenants live in Redis, not
in the home's SQLite file, and a restarted gateway reads them back from there."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import websocket

from sandgate_client import SandgateError
from conftest import Gateway, host_processes, wait_for
from test_store import RedisServer


@pytest.fixture
def redis(tmp_path):
    """A redis-server of the test's own, stopped after it."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


FLEET_KEY = "test-fleet-key-0123456789abcdef0123456789abcdef"  # every node of a test fleet has it


def fleet_env(server: RedisServer, **extra) -> dict:
    return {"SANDGATE_REDIS_URL": server.url, "SANDGATE_WARM_START": "false", "SANDGATE_FLEET_KEY": FLEET_KEY,
            **extra}


def test_a_gateway_keeps_its_sandboxes_and_tenants_in_redis(home, tmp_path, redis):
    server = redis
    env = {"SANDGATE_REDIS_URL": server.url, "SANDGATE_NODE_ID": "node-a", "SANDGATE_KEEP_SANDBOXES": "true",
           "SANDGATE_FLEET_KEY": FLEET_KEY}
    g = Gateway(home, tmp_path, env=env)
    g2 = None
    try:
        sid = g.request("POST", "/api/sandboxes", {}).json()["id"]
        r = g.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 41"})
        assert r.status == 200 and r.json()["status"] == "ok", r.body
        token = g.request("POST", "/api/tenants", {"name": "acme"}).json()["token"]
        keys = subprocess.run(["redis-cli", "-s", str(server.sock), "--scan"], capture_output=True, text=True).stdout
        assert f"sandgate:sb:{sid}" in keys.split() and "sandgate:tenant:acme" in keys.split(), keys
        assert not (g.home / "sessions.db").exists()  # nothing in the embedded store
        g.stop()  # SIGTERM: paused to disk, the record says so in Redis
        state = subprocess.run(["redis-cli", "-s", str(server.sock), "hget", f"sandgate:sb:{sid}", "state"],
                               capture_output=True, text=True).stdout.strip()
        assert state == "paused"
        g2 = Gateway(home, tmp_path, own_home=g.home, env=env)
        listed = g2.request("GET", "/api/sandboxes").json()
        assert [s["id"] for s in listed] == [sid] and listed[0]["state"] == "paused"
        r = g2.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x + 1)"})
        assert r.json()["stdout"] == "42\n", r.body
        assert g2.request("GET", "/api/sandboxes", token=token).json() == []  # the tenant, from Redis
        assert g2.request("DELETE", f"/api/sandboxes/{sid}").status == 204
        assert f"sandgate:sb:{sid}" not in subprocess.run(["redis-cli", "-s", str(server.sock), "--scan"],
                                                          capture_output=True, text=True).stdout.split()
    finally:
        g.stop()
        if g2:
            g2.stop()


def test_any_node_serves_a_sandbox_that_lives_on_another(home, tmp_path, redis):
    """Two nodes on one Redis: a client of node A drives a sandbox on node B, REST and websocket
    (legacy and v1), streamed execute and files included; with B gone, A says which node is down."""
    server = redis
    common = fleet_env(server)
    a = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-a"})
    b = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-b"})
    try:
        sid = b.request("POST", "/api/sandboxes", {}).json()["id"]
        got = a.request("GET", f"/api/sandboxes/{sid}")
        assert got.status == 200 and got.json()["id"] == sid, got.body
        r = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 41\nprint(x + 1)"})
        assert r.status == 200 and r.json()["stdout"] == "42\n", r.body
        streamed = a.request("POST", f"/api/sandboxes/{sid}/execute?stream=1", {"code": "print('s')"})
        assert streamed.headers["Content-Type"].startswith("text/event-stream")
        assert b"event: output" in streamed.body and b"event: result" in streamed.body
        assert a.request("PUT", f"/api/sandboxes/{sid}/files/data.txt", raw=b"through node a").status == 201
        assert b.request("GET", f"/api/sandboxes/{sid}/files/data.txt").body == b"through node a"
        for v1 in (False, True):
            c = a.connect(sid, v1=v1)  # the Jupyter websocket, relayed to node B
            assert c.execute("x")["results"][0]["text/plain"] == "41"
            c.close()
        assert a.request("GET", f"/api/kernels/{sid}").json()["id"] == sid
        assert a.request("GET", f"/api/sandboxes/{sid}", token="wrong").status == 401  # auth first, then forwarding
        assert a.request("GET", "/api/sandboxes/00000000-0000-4000-8000-000000000000").status == 404
        forwarded = [line for line in a.request("GET", "/metrics").body.decode().splitlines()
                     if line.startswith("sandgate_forwarded_requests_total")]
        assert any('kind="websocket"' in line and not line.endswith(" 0.0") for line in forwarded), forwarded
        # Node B dies: its heartbeat expires, and A names the node instead of hanging or saying 404.
        b.proc.kill()
        b.proc.wait()
        at_once = a.request("GET", f"/api/sandboxes/{sid}")
        assert at_once.status == 503 and "unreachable" in at_once.json()["message"], at_once.body
        with pytest.raises(SandgateError) as refused:  # an HTTP status, not a 101 and a close (the SDK's error)
            a.connect(sid)
        assert refused.value.status == 503 and "unreachable" in refused.value.message, refused.value
        down = wait_for(lambda: (lambda r: r if "not answering" in r.json()["message"] else None)(
            a.request("GET", f"/api/sandboxes/{sid}")), timeout=30)
        assert down.status == 503 and "node node-b" in down.json()["message"], down.body
        # B comes back on its home: it adopts the sandbox, memory and all, and A serves it again.
        b = Gateway(home, tmp_path, own_home=b.home, env={**common, "SANDGATE_NODE_ID": "node-b"})
        r = wait_for(lambda: (lambda r: r if r.status == 200 else None)(
            a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x)"})), timeout=30)
        assert r.json()["stdout"] == "41\n", r.body
        assert a.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        a.stop()
        b.stop()


def test_new_sandboxes_go_where_there_is_room_and_lists_span_the_fleet(home, tmp_path, redis):
    server = redis
    common = fleet_env(server)
    a = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-a", "SANDGATE_MAX_KERNELS": "2"})
    b = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-b", "SANDGATE_MAX_KERNELS": "8"})
    try:
        r = a.request("POST", "/api/sandboxes", {})  # asked of A, which has less room: made on B
        assert r.status == 201, r.body
        sid = r.json()["id"]
        assert [s["id"] for s in b.request("GET", "/api/sandboxes?").json()] == [sid]
        assert b.request("GET", f"/api/sandboxes/{sid}", headers={"X-Sandgate-Forwarded": "test"}).status == 200
        assert a.request("GET", f"/api/sandboxes/{sid}", headers={"X-Sandgate-Forwarded": "test"}).status == 404
        kid = a.request("POST", "/api/kernels", {"name": "python3"}).json()["id"]  # the Jupyter API too
        for g in (a, b):  # either node lists the whole fleet
            assert sorted(s["id"] for s in g.request("GET", "/api/sandboxes").json()) == sorted([sid, kid])
            assert sorted(k["id"] for k in g.request("GET", "/api/kernels").json()) == sorted([sid, kid])
        for i in (sid, kid):
            assert a.request("DELETE", f"/api/sandboxes/{i}").status == 204
        assert a.request("GET", "/api/sandboxes").json() == []
    finally:
        a.stop()
        b.stop()


def test_a_dead_nodes_sandbox_comes_back_on_another_from_the_shared_checkpoints(home, tmp_path, redis):
    """Three nodes, one Redis, one checkpoint directory: B dies (kill -9) holding a sandbox; the next
    request through A restores it there from its newest checkpoint and says so on iopub; a Redis restart
    costs nothing."""
    server, shared = redis, tmp_path / "checkpoints"
    common = fleet_env(server, SANDGATE_CHECKPOINT_STORE=str(shared))
    a, b, c = (Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": f"node-{n}"}) for n in "abc")
    b2 = None
    try:
        sid = b.request("POST", "/api/sandboxes", {}).json()["id"]  # ties stay on the node asked: B
        assert b.request("GET", f"/api/sandboxes/{sid}", headers={"X-Sandgate-Forwarded": "t"}).status == 200
        r = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 41\nopen('kept.txt', 'w').write('files')"})
        assert r.json()["status"] == "ok", r.body
        cp = a.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "before"}).json()["id"]
        a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 99"})  # after it: lost with B
        b.proc.kill()
        b.proc.wait()
        # Once B's heartbeat has expired, the next request makes the sandbox A's, paused at the checkpoint.
        back = wait_for(lambda: (lambda r: r.json() if r.status == 200 and r.json()["state"] == "paused" else None)(
            a.request("GET", f"/api/sandboxes/{sid}")), timeout=40)
        assert back["resume_from"] == cp and "node-b stopped answering" in back["reason"], back
        assert a.request("GET", f"/api/sandboxes/{sid}", headers={"X-Sandgate-Forwarded": "t"}).status == 200  # A's
        ws = c.connect(sid)  # through C, relayed to A, which holds it now
        got = ws.execute("print(x, open('kept.txt').read())")
        assert got["stdout"] == "41 files\n", got
        notices = [m for m in ws.seen if m["msg_type"] == "stream" and "[sandgate:" in m["content"]["text"]]
        assert notices and f"checkpoint {cp}" in notices[0]["content"]["text"], notices
        ws.close()
        # Redis restarts (its append-only file kept): heartbeats resume and nothing is lost.
        server.stop()  # a server started beside a live one would take its socket path while the first ran on
        server.start()
        r = wait_for(lambda: (lambda r: r if r.status == 200 else None)(
            c.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x + 1)"})), timeout=30)
        assert r.json()["stdout"] == "42\n", r.body
        assert sorted(n for n in wait_for(lambda: (lambda v: v if len(v) == 2 else None)(
            [line for line in server_nodes(server)]), timeout=30)) == ["node-a", "node-c"]
        assert c.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        # B's runtime outlived it; B started again on its home finds no record of its own and reaps it.
        b2 = Gateway(home, tmp_path, own_home=b.home, env={**common, "SANDGATE_NODE_ID": "node-b"})
        for g in (a, b2, c):
            g.stop()


def runtimes_of(gw: Gateway, sid: str = "") -> list:
    """The node's shims and runsc processes (each names its home's runtime directory, runsc's --root),
    or those of one sandbox there (its id names its bundle's directory)."""
    return [p.pid for p in host_processes(str(gw.home / "runtime" / "gvisor"))
            if not sid or any(sid in a for a in p.cmdline())]


def taken_over_by(a: Gateway, sid: str) -> dict:
    """Once the dead node's heartbeat has expired, a request through ``a`` makes the sandbox its own."""
    return wait_for(lambda: (lambda r: r.json() if r.status == 200 and r.json()["state"] in ("paused", "dead")
                             else None)(a.request("GET", f"/api/sandboxes/{sid}")), timeout=60)


def test_a_dead_node_whose_gateway_stays_down_ends_its_runtimes_within_the_lease(home, tmp_path, redis):
    """B dies (kill -9) holding a sandbox A then takes over from its checkpoint: B's runsc sandbox,
    which its shim kept running for a gateway that never comes back, is gone within B's lease."""
    common = fleet_env(redis, SANDGATE_CHECKPOINT_STORE=str(tmp_path / "checkpoints"))
    lease = 15
    a = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-a"})
    b = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-b", "SANDGATE_RUNTIME_LEASE": str(lease)})
    try:
        sid = b.request("POST", "/api/sandboxes", {}).json()["id"]
        assert b.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 41"}).json()["status"] == "ok"
        cp = b.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "c"}).json()["id"]
        assert runtimes_of(b)  # its shim and runsc
        b.proc.kill()
        b.proc.wait()
        killed = time.monotonic()
        assert taken_over_by(a, sid)["resume_from"] == cp
        assert runtimes_of(b)  # still running: its shim waits out the lease for a gateway
        wait_for(lambda: not runtimes_of(b), timeout=lease + 30)  # the lease, its checks, runsc's teardown
        gone_after = time.monotonic() - killed
        assert gone_after >= lease - 1, f"ended after {gone_after:.1f} s, before the {lease} s lease"
        r = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x)"})
        assert r.json()["stdout"] == "41\n", r.body  # the one copy left: A's
        assert a.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        for g in (a, b):
            g.stop()


def test_a_node_that_restarts_reaps_a_runtime_another_node_has_taken_over(home, tmp_path, redis):
    """B dies (kill -9), A takes its sandbox over, B's gateway starts again on its home within the
    lease: it adopts nothing the store says is A's, and reaps that runtime at once."""
    common = fleet_env(redis, SANDGATE_CHECKPOINT_STORE=str(tmp_path / "checkpoints"))
    a = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-a"})
    b_env = {**common, "SANDGATE_NODE_ID": "node-b", "SANDGATE_MAX_KERNELS": "32"}  # the room: both start on B
    b = Gateway(home, tmp_path, env=b_env)
    b2 = None
    try:
        mine = b.request("POST", "/api/sandboxes", {}).json()["id"]  # B's, and stays B's
        sid = b.request("POST", "/api/sandboxes", {}).json()["id"]
        for s in (sid, mine):
            assert b.request("POST", f"/api/sandboxes/{s}/execute", {"code": "x = 7"}).json()["status"] == "ok"
        assert b.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "c"}).status == 201
        assert runtimes_of(b, sid) and runtimes_of(b, mine)
        b.proc.kill()
        b.proc.wait()
        assert taken_over_by(a, sid)["state"] == "paused"
        assert a.request("GET", f"/api/sandboxes/{sid}", headers={"X-Sandgate-Forwarded": "t"}).status == 200  # A's
        b2 = Gateway(home, tmp_path, own_home=b.home, env=b_env)
        # B's own sandbox was adopted, memory and all; the taken-over one's runtime was not.
        r = b2.request("POST", f"/api/sandboxes/{mine}/execute", {"code": "print(x)"})
        assert r.json()["stdout"] == "7\n", r.body
        assert f"sandbox {mine}: adopted its running runtime" in b2.log_text()
        assert f"sandbox {sid}" not in b2.log_text()  # not adopted, not recovered: not B's
        assert not runtimes_of(b2, sid) and runtimes_of(b2, mine)  # reaped before B2 listened
        assert b2.request("GET", f"/api/sandboxes/{sid}", headers={"X-Sandgate-Forwarded": "t"}).status == 404
        assert a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x)"}).json()["stdout"] == "7\n"
    finally:
        for g in (a, b, b2):
            if g:
                g.stop()


def server_nodes(server) -> list:
    out = subprocess.run(["redis-cli", "-s", str(server.sock), "--scan", "--pattern", "sandgate:alive:*"],
                         capture_output=True, text=True).stdout.split()
    return [k.rsplit(":", 1)[1] for k in out]


def test_sandgate_drain_moves_a_nodes_sandboxes_and_stops_it(home, tmp_path, redis):
    server, shared = redis, tmp_path / "checkpoints"
    common = fleet_env(server, SANDGATE_CHECKPOINT_STORE=str(shared))
    a, b = (Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": f"node-{n}"}) for n in "ab")
    try:
        here = {"X-Sandgate-Forwarded": "test"}  # made on B itself, whatever the capacities say
        sids = [b.request("POST", "/api/sandboxes", {}, headers=here).json()["id"] for _ in range(2)]
        for i, sid in enumerate(sids):
            assert a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": f"x = {i}"}).status == 200
        assert b.request("POST", f"/api/sandboxes/{sids[1]}/pause", {"mode": "memory"}).json()["state"] == "frozen"
        drain = subprocess.run([sys.executable, "-m", "sandgate.cli", "drain", "--url", b.url, "--token", b.token],
                               capture_output=True, text=True, timeout=300)
        assert drain.returncode == 0, drain.stderr
        assert "1/2: sandbox" in drain.stdout and "drained: 2 moved, 0 failed" in drain.stdout, drain.stdout
        assert b.proc.wait(60) == 0  # B stopped by itself
        for i, sid in enumerate(sids):  # nothing was lost: each resumes on A with its memory
            r = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x)"})
            assert r.status == 200 and r.json()["stdout"] == f"{i}\n", r.body
            assert "drain" in a.request("GET", f"/api/sandboxes/{sid}").json()["reason"]
        assert sorted(s["id"] for s in a.request("GET", "/api/sandboxes", headers={"X-Sandgate-Forwarded": "t"})
                      .json()) == sorted(sids)
        assert a.request("GET", "/api/fleet").json()["nodes"].keys() == {"node-a"}
        # Without a fleet there is nothing to drain to: a clear 409.
        solo = Gateway(home, tmp_path)
        try:
            r = solo.request("POST", "/api/fleet/drain", {})
            assert r.status == 409 and "SANDGATE_REDIS_URL" in r.json()["message"], r.body
        finally:
            solo.stop()
    finally:
        a.stop()
        b.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_checkpoints_in_an_s3_bucket_bring_a_dead_nodes_sandbox_back(home, tmp_path, redis):
    """The same failure with no shared volume: checkpoints are copied to an S3-compatible bucket
    (moto's server, a real HTTP S3 endpoint on loopback) and the surviving node fetches them."""
    import boto3

    port = free_port()
    moto = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s3env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
             "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=s3env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                      aws_secret_access_key="test", region_name="us-east-1")
    wait_for(lambda: (lambda: (s3.create_bucket(Bucket="sandgate-test"), True)[1])() if _up(port) else None, timeout=30)
    server = redis
    common = fleet_env(server, SANDGATE_CHECKPOINT_STORE="s3://sandgate-test/fleet", **s3env)
    a, b = (Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": f"node-{n}"}) for n in "ab")
    b2 = None
    try:
        here = {"X-Sandgate-Forwarded": "test"}
        sid = b.request("POST", "/api/sandboxes", {}, headers=here).json()["id"]
        assert b.request("POST", f"/api/sandboxes/{sid}/execute",
                         {"code": "x = 41\nopen('kept.txt', 'w').write('files')"}).json()["status"] == "ok"
        cp = b.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()["id"]
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="sandgate-test", Prefix="fleet/")["Contents"]]
        assert f"fleet/items/{cp}/checkpoint.json" in keys and any(k.startswith("fleet/blobs/") for k in keys)
        # Chunked on the node, whole in the bucket (checkpoints/replica.py): the image, assembled.
        assert f"fleet/items/{cp}/state/checkpoint.img" in keys and not any("chunks" in k for k in keys), keys
        b.proc.kill()
        b.proc.wait()
        back = wait_for(lambda: (lambda r: r.json() if r.status == 200 and r.json()["state"] == "paused" else None)(
            a.request("GET", f"/api/sandboxes/{sid}")), timeout=40)
        assert back["resume_from"] == cp, back
        r = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x, open('kept.txt').read())"})
        assert r.json()["stdout"] == "41 files\n", r.body
        assert a.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        b2 = Gateway(home, tmp_path, own_home=b.home, env={**common, "SANDGATE_NODE_ID": "node-b"})
        for g in (a, b2):
            g.stop()
        moto.terminate()
        moto.wait(20)


def _up(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class _RawKernelSocket:
    """A bare websocket-client kernel connection: this test is about the frames themselves, so no
    SDK (whose reader would take them first)."""

    def __init__(self, gw, sid: str, v1: bool):
        import uuid

        from sandgate.api import wire

        self.v1, self.wire, self.session = v1, wire, uuid.uuid4().hex
        url = f"ws://127.0.0.1:{gw.port}/api/kernels/{sid}/channels?session_id={self.session}"
        self.ws = websocket.create_connection(url, header=[f"Authorization: token {gw.token}"],
                                              subprotocols=[wire.V1] if v1 else None, timeout=120)

    def send(self, msg_type: str, content: dict, channel: str = "shell") -> str:
        import uuid

        header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": self.session, "username": "test",
                  "date": "2026-01-01T00:00:00.000000Z", "version": "5.3"}
        if self.v1:
            self.ws.send_binary(self.wire.encode_v1(channel, [json.dumps(x).encode() for x in (header, {}, {}, content)]))
        else:
            self.ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content,
                                     "channel": channel}))
        return header["msg_id"]

    def close(self) -> None:
        self.ws.close()


def _raw_until_idle(client, mid: str, timeout: float = 120) -> list:
    """The frames (opcode, bytes) of ``mid``'s cell a kernel websocket gets, up to its idle status
    (others, such as the replay of what the kernel said before anyone connected, are left out)."""
    import struct
    import time

    import websocket as wsc

    frames, deadline = [], time.monotonic() + timeout
    while True:
        client.ws.settimeout(max(0.1, deadline - time.monotonic()))
        opcode, data = client.ws.recv_data()
        frame = (opcode, data)
        if client.v1:
            n = struct.unpack_from("<Q", data)[0]
            offs = struct.unpack_from(f"<{n}Q", data, 8)
            header, parent, content = (json.loads(data[offs[i]:offs[i + 1]]) for i in (1, 2, 4))
        else:
            if opcode == wsc.ABNF.OPCODE_BINARY:  # legacy with buffers: the JSON is chunk 0
                n = struct.unpack_from("!I", data)[0]
                offs = struct.unpack_from(f"!{n}I", data, 4)
                data = data[offs[0]:offs[1]]
            msg = json.loads(data)
            header, parent, content = msg["header"], msg["parent_header"], msg["content"]
        if parent.get("msg_id") != mid:
            continue
        frames.append(frame)
        if header["msg_type"] == "status" and content.get("execution_state") == "idle":
            return frames


def test_the_websocket_relay_passes_frames_on_byte_for_byte(home, tmp_path, redis):
    """Text and binary frames (a message with buffers), legacy and v1: a client through node A gets
    exactly the frames, type and bytes, that a client on the owner node B gets, from the moment its
    handshake is done (the relay is attached at B before it completes)."""
    common = fleet_env(redis)
    a = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-a"})
    b = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-b"})
    try:
        sid = b.request("POST", "/api/sandboxes", {}, headers={"X-Sandgate-Forwarded": "test"}).json()["id"]
        # stdout, a result, and a comm_open carrying buffers that are not UTF-8 (a binary frame)
        code = ("print('caf\\u00e9')\nfrom ipykernel.comm import Comm\n"
                "Comm(target_name='bench', data={'k': 1}, buffers=[b'\\x03\\xe8\\xff\\x00' * 64])\n42")
        for v1 in (False, True):
            direct, through = _RawKernelSocket(b, sid, v1), _RawKernelSocket(a, sid, v1)
            try:
                mid = direct.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                                      "user_expressions": {}, "allow_stdin": False})
                got_direct, got_through = _raw_until_idle(direct, mid), _raw_until_idle(through, mid)
                binary = [d for op, d in got_direct if op == 2]
                assert binary and any(b"\x03\xe8\xff\x00" in d for d in binary), got_direct  # buffers were sent
                # iopub is broadcast to both; the shell reply goes to its sender only
                assert got_through == [f for f in got_direct if b"execute_reply" not in f[1]], (v1, got_through)
            finally:
                direct.close()
                through.close()
        assert a.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        a.stop()
        b.stop()
