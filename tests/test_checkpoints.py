"""Running-state checkpoints, forks, pause and resume, on real gVisor
sandboxes through the sandbox API (and the Jupyter websocket for forks)."""

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid

import pytest

from conftest import Gateway, host_processes, wait_for


def ex(gw, sid, code, timeout=60):
    return gw.run_code(sid, code, timeout)  # the SDK (conftest); this file's raw calls test the API itself


def create(gw, **body):
    return gw.create(**body)


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("ck"), env={"SANDGATE_MAX_KERNELS": "6"})
    yield g
    g.stop()


def test_fork_running_state_41_42_141_41(gw):
    sb = create(gw, labels={"test": "fork"})
    assert sb["state"] == "running" and sb["kernel_id"] == sb["id"] and sb["parent"] is None
    sid = sb["id"]
    out = ex(gw, sid, """
import threading, time, json, numpy
x = 41
f = open('log.txt', 'w'); f.write('before\\n'); f.flush()
ticks = [0]
def tick():
    while True:
        ticks[0] += 1; time.sleep(0.05)
t = threading.Thread(target=tick, daemon=True); t.start()
print(x)""")
    assert out.stdout == "41\n"
    r = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "x41"})
    assert r.status == 201, r.body
    cp = r.json()
    assert cp["name"] == "x41" and cp["sandbox"] == sid and cp["state_bytes"] > 1 << 20 and cp["file_count"] >= 1
    assert ex(gw, sid, "x += 1; print(x)").stdout == "42\n"

    r = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
    assert r.status == 201, r.body
    fork = r.json()
    assert fork["parent"] == {"sandbox": sid, "checkpoint": cp["id"]} and fork["id"] != sid
    out = ex(gw, fork["id"], """
x += 100
before = ticks[0]; time.sleep(0.5)
f.write('fork\\n'); f.flush()
print(x, t.is_alive(), ticks[0] > before, numpy.__name__, open('log.txt').read().split())""")
    assert out.stdout == "141 True True numpy ['before', 'fork']\n", out
    # Restoring the same checkpoint again gives 41 again; the original is untouched.
    again = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]}).json()
    assert ex(gw, again["id"], "print(x, open('log.txt').read().split())").stdout == "41 ['before']\n"
    assert ex(gw, sid, "print(x)").stdout == "42\n"

    # A fork is a Jupyter kernel too: reachable over the websocket by its id.
    c = gw.connect(fork["id"])
    assert c.execute("x")["results"][0]["text/plain"] == "141"
    c.close()
    assert fork["id"] in [k["id"] for k in gw.request("GET", "/api/kernels").json()]

    tree = gw.request("GET", "/api/sandboxes/tree").json()["nodes"]
    assert {"kind": "sandbox", "id": fork["id"], "parent": cp["id"], "state": "running"} in tree
    for s in (sid, fork["id"], again["id"]):
        assert gw.request("DELETE", f"/api/sandboxes/{s}").status == 204


def without_kept_image(gw, cid: str) -> None:
    """Checkpoint ``cid`` as it was before images were kept assembled: its restore reads its chunks."""
    kept = gw.home / "checkpoints" / "items" / cid / "assembled"
    wait_for(kept.is_dir, timeout=60)  # assembled ahead, in the background, once it was taken
    shutil.rmtree(kept)


def stored_chunks(gw) -> set:
    return {p.name for p in (gw.home / "checkpoints" / "chunks").glob("*/*")}


def referenced_chunks(gw) -> set:
    from sandgate.checkpoints.state_chunks import manifest_keys
    return {k for d in (gw.home / "checkpoints" / "items").iterdir() if (d / "checkpoint.json").is_file()
            for k in manifest_keys(d / "state")}


def test_running_state_checkpoints_store_only_changes(gw):
    """The running state is stored as shared chunks (state_chunks.py): a checkpoint after a small
    change stores a fraction of it; both restore to their own instant; deleting one keeps the other."""
    sid = create(gw)["id"]
    ex(gw, sid, "x = 41")
    cp1 = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    assert ex(gw, sid, "x += 1; print(x)").stdout == "42\n"  # carried on from the assembled image
    cp2 = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    assert cp1["state_bytes"] > 4 << 20 and cp2["state_bytes"] > 4 << 20
    assert cp2["stored_bytes"] < 0.25 * cp2["state_bytes"], cp2
    assert (gw.home / "checkpoints" / "items" / cp2["id"] / "state" / "chunks.json").is_file()
    assert not (gw.home / "checkpoints" / "items" / cp2["id"] / "state" / "checkpoint.img").exists()
    forks = []
    for cp, want in ((cp1, "41"), (cp2, "42")):
        r = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
        assert r.status == 201, r.body
        forks.append(r.json()["id"])
        assert ex(gw, forks[-1], "print(x)").stdout == want + "\n"
        # Restored from the image kept assembled (made ahead once the checkpoint was taken).
        assert f"checkpoint {cp['id']}: assembled image" in gw.log_text()
        assert (gw.home / "checkpoints" / "items" / cp["id"] / "assembled" / "checkpoint.img").is_file()
    assert ex(gw, sid, "print(x)").stdout == "42\n"

    # Another sandbox's checkpoint shares chunks with these (the same interpreter, mostly).
    other = create(gw)["id"]
    ex(gw, other, "x = 7")
    cp3 = gw.request("POST", f"/api/sandboxes/{other}/checkpoints", {}).json()
    mine = set(json_keys(gw, cp3["id"]))
    assert mine & set(json_keys(gw, cp1["id"]))
    before = stored_chunks(gw)
    for s in (*forks, sid):
        assert gw.request("DELETE", f"/api/sandboxes/{s}").status == 204
    ids = [n["id"] for n in gw.request("GET", "/api/sandboxes/tree").json()["nodes"]]
    assert cp1["id"] not in ids and cp2["id"] not in ids and cp3["id"] in ids
    # Swept: exactly the chunks a checkpoint still lists are left, fewer than before; cp3's all there.
    wait_for(lambda: stored_chunks(gw) == referenced_chunks(gw), timeout=30)
    assert stored_chunks(gw) < before and mine <= stored_chunks(gw)
    r = gw.request("POST", f"/api/sandboxes/{other}/fork", {"checkpoint": cp3["id"]})
    assert r.status == 201, r.body
    assert ex(gw, r.json()["id"], "print(x)").stdout == "7\n"
    for s in (r.json()["id"], other):
        gw.request("DELETE", f"/api/sandboxes/{s}")


def test_a_checkpoint_stored_in_the_old_chunk_format_restores(gw):
    """Checkpoints from before stored-block frames keep their gVisor chunks as sync-flushed raw
    deflate (codec deflate-sync): runsc restores them as it did."""
    from sandgate.checkpoints import CheckpointStore
    from unit.test_state_chunks import to_deflate_sync

    sid = create(gw)["id"]
    ex(gw, sid, "x = 41")
    cp = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    without_kept_image(gw, cp["id"])
    to_deflate_sync(CheckpointStore(gw.home / "checkpoints"), cp["id"])
    r = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
    assert r.status == 201, r.body
    assert ex(gw, r.json()["id"], "x += 1; print(x)").stdout == "42\n"
    for s in (r.json()["id"], sid):
        gw.request("DELETE", f"/api/sandboxes/{s}")


def test_the_template_image_is_assembled_once_and_kept(gw):
    """Every start from an empty pool restores the template: its image is assembled at the first
    and kept beside its chunks (checkpoints/items/<id>/assembled) for the next ones."""
    import json
    import struct

    templates = gw.home / "templates.json"
    wait_for(templates.is_file, timeout=300)  # made in the background after the gateway's start
    cid = next(iter(json.loads(templates.read_text()).values()))
    sid = create(gw)["id"]  # taken from the pool, or restored from the template: a refill follows
    image = gw.home / "checkpoints" / "items" / cid / "assembled" / "checkpoint.img"
    wait_for(image.is_file, timeout=120)
    assert (image.parent.parent / "state" / "chunks.json").is_file()  # the chunks stay what is stored
    head = image.read_bytes()[:1 << 16]
    (mlen,) = struct.unpack(">Q", head[8:16])
    assert head[:8] == b"gVisorSF" and head[16 + mlen + 32:16 + mlen + 36] == b"\xff\xff\xff\xff"
    second = create(gw)["id"]  # the next refill restores from the kept image
    wait_for(lambda: f"checkpoint {cid}: assembled image kept" in gw.log_text(), timeout=120)
    assert ex(gw, second, "print(1 + 1)").stdout == "2\n"
    for s in (sid, second):
        gw.request("DELETE", f"/api/sandboxes/{s}")


def test_a_template_stored_in_the_old_chunk_format_is_made_anew(home, tmp_path):
    """A template from before zstd gVisor chunks would be inflated by runsc at every start from an
    empty pool: the next gateway makes a new one (and the old one is collected)."""
    import json

    from sandgate.checkpoints import CheckpointStore
    from unit.test_state_chunks import to_deflate_sync

    g = Gateway(home, tmp_path)
    templates = g.home / "templates.json"
    try:
        wait_for(templates.is_file, timeout=300)
        old = next(iter(json.loads(templates.read_text()).values()))
    finally:
        g.stop()
    to_deflate_sync(CheckpointStore(g.home / "checkpoints"), old)
    g2 = Gateway(home, tmp_path, own_home=g.home)
    try:
        wait_for(lambda: next(iter(json.loads(templates.read_text()).values())) != old, timeout=300)
        assert f"template checkpoint {old} is stored in an older format" in g2.log_text()
        new = next(iter(json.loads(templates.read_text()).values()))
        manifest = json.loads((g.home / "checkpoints" / "items" / new / "state" / "chunks.json").read_text())
        assert manifest["files"]["checkpoint.img"]["codec"] == "zstd"
        sid = create(g2)["id"]
        assert ex(g2, sid, "print(1 + 1)").stdout == "2\n"
        g2.request("DELETE", f"/api/sandboxes/{sid}")
        wait_for(lambda: not (g.home / "checkpoints" / "items" / old).exists(), timeout=120)  # collected
    finally:
        g2.stop()


def test_a_template_that_does_not_restore_is_forgotten_and_the_start_goes_on_cold(home, tmp_path):
    import json

    g = Gateway(home, tmp_path, env={"SANDGATE_POOL_SIZE": "0"})  # every start restores the template
    templates = g.home / "templates.json"
    try:
        wait_for(templates.is_file, timeout=300)
        cid = next(iter(json.loads(templates.read_text()).values()))
        without_kept_image(g, cid)
        keys = list(json_keys(g, cid))
        chunk = g.home / "checkpoints" / "chunks" / keys[0][:2] / keys[0]
        chunk.write_bytes(b"not what was stored")
        r = g.request("POST", "/api/sandboxes", {})
        assert r.status == 201, r.body
        sid = r.json()["id"]
        assert ex(g, sid, "print(1 + 1)").stdout == "2\n"
        log = g.log_text()
        assert f"warm start off for gvisor: its template {cid} did not restore: " in log
        assert f"sandbox {sid} started (gvisor, " in log and "cold: the warm-start template did not restore)" in log
        assert json.loads(templates.read_text()) == {}
        g.request("DELETE", f"/api/sandboxes/{sid}")
    finally:
        g.stop()


def json_keys(gw, cid):
    from sandgate.checkpoints.state_chunks import manifest_keys
    return manifest_keys(gw.home / "checkpoints" / "items" / cid / "state")


def test_kernel_from_jupyter_api_can_fork_from_now(gw):
    kid = gw.start_kernel()
    c = gw.connect(kid)
    c.execute("import random\nseed = 7")
    c.close()
    r = gw.request("POST", f"/api/sandboxes/{kid}/fork", {})
    assert r.status == 201, r.body
    fork = r.json()
    assert ex(gw, fork["id"], "print(seed)").stdout == "7\n"
    assert ex(gw, kid, "print(seed)").stdout == "7\n"
    assert len(gw.request("GET", f"/api/sandboxes/{kid}/checkpoints").json()) == 1
    gw.request("DELETE", f"/api/kernels/{fork['id']}")
    gw.request("DELETE", f"/api/kernels/{kid}")


def test_workspace_snapshots_are_deltas(gw):
    sid = create(gw)["id"]
    ex(gw, sid, "import os\nopen('big.bin', 'wb').write(os.urandom(2_000_000))")
    first = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    assert first["new_bytes"] >= 2_000_000
    ex(gw, sid, "open('small.txt', 'w').write('one more file')")
    second = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    assert second["parent"] == first["id"]
    assert second["files_bytes"] >= 2_000_000  # the whole workspace is in it...
    assert second["new_bytes"] < 200_000  # ...but only what changed was stored again
    listed = gw.request("GET", f"/api/sandboxes/{sid}/checkpoints").json()
    assert [c["id"] for c in listed] == [first["id"], second["id"]]
    assert gw.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    # Nothing references them now: collected, blobs included.
    assert first["id"] not in [n["id"] for n in gw.request("GET", "/api/sandboxes/tree").json()["nodes"]]


def test_pause_frees_memory_and_resume_is_transparent(gw):
    sb = create(gw)
    sid, runtime = sb["id"], sb["runtime_id"]
    ex(gw, sid, "data = list(range(1000)); y = 'kept'")
    c = gw.connect(sid)
    assert subprocess.run(["pgrep", "-f", runtime], capture_output=True).returncode == 0
    r = gw.request("POST", f"/api/sandboxes/{sid}/pause")
    assert r.status == 200 and r.json()["state"] == "paused" and r.json()["runtime_id"] is None
    running = subprocess.run(["pgrep", "-f", runtime], capture_output=True, text=True).stdout
    assert running == ""  # no sandbox process holds memory while paused
    # The same websocket, not reconnected: the next message wakes the sandbox.
    assert c.execute("y + str(len(data))")["results"][0]["text/plain"] == "'kept1000'"
    assert gw.request("GET", f"/api/sandboxes/{sid}").json()["state"] == "running"
    gw.request("POST", f"/api/sandboxes/{sid}/pause")
    assert ex(gw, sid, "print(y)").stdout == "kept\n"  # the API resumes too
    c.close()
    gw.request("DELETE", f"/api/sandboxes/{sid}")


def test_idle_sandboxes_pause_themselves(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_PAUSE_IDLE_TIMEOUT": "2", "SANDGATE_CULL_INTERVAL": "1"})
    try:
        sid = create(g)["id"]
        ex(g, sid, "z = 99")
        wait_for(lambda: g.request("GET", f"/api/sandboxes/{sid}").json()["state"] == "paused", timeout=30)
        assert ex(g, sid, "print(z)").stdout == "99\n"
        # One paused in memory still holds its memory: idle, it goes to disk too.
        assert g.request("POST", f"/api/sandboxes/{sid}/pause", {"mode": "memory"}).json()["pause_mode"] == "memory"
        wait_for(lambda: g.request("GET", f"/api/sandboxes/{sid}").json()["pause_mode"] == "disk", timeout=30)
        assert ex(g, sid, "print(z)").stdout == "99\n"
    finally:
        g.stop()


def test_checkpoint_while_a_cell_runs_captures_it(gw):
    """Documented behaviour: the running cell is captured; the original and
    every fork each finish it."""
    sid = create(gw)["id"]
    result = {}
    t = threading.Thread(target=lambda: result.update(out=ex(gw, sid, "import time\ntime.sleep(3)\nprint('done')")))
    t.start()
    wait_for(lambda: gw.request("GET", f"/api/sandboxes/{sid}").json()["execution_state"] == "busy")
    cp = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    t.join(60)
    assert result["out"].stdout == "done\n"
    fork = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]}).json()
    assert ex(gw, fork["id"], "print('fork alive')").stdout == "fork alive\n"
    gw.request("DELETE", f"/api/sandboxes/{fork['id']}")
    gw.request("DELETE", f"/api/sandboxes/{sid}")


def test_bad_requests(gw):
    unknown = str(uuid.uuid4())
    r = gw.request("POST", f"/api/sandboxes/{unknown}/fork", {})
    assert r.status == 404 and unknown in r.json()["message"]
    sid = create(gw)["id"]
    assert gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": "nope"}).status == 404
    assert gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": 1}).status == 400
    assert gw.request("POST", f"/api/sandboxes/{sid}/execute", {"cod": "1"}).status == 400
    assert gw.request("POST", "/api/sandboxes", {"driver": "nonesuch"}).status == 400
    assert gw.request("POST", "/api/sandboxes", {"checkpoint": "nope"}).status == 404
    r = gw.request("GET", f"/api/sandboxes/{sid}/files/missing.txt")
    assert r.status == 404
    assert gw.request("GET", f"/api/sandboxes/{sid}/files/../../etc/passwd").status in (403, 404)
    out = ex(gw, sid, "import time\nwhile True: time.sleep(0.1)", timeout=2)
    assert out.status == "timeout"
    assert ex(gw, sid, "print('after timeout')").stdout == "after timeout\n"
    cp = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    assert gw.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    # Forking a deleted sandbox is a clear 404, whatever the checkpoint.
    r = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
    assert r.status == 404 and "Sandbox does not exist" in r.json()["message"]


def test_files_api(gw):
    sid = create(gw)["id"]
    blob = bytes(range(256)) * 4096
    r = gw.request("PUT", f"/api/sandboxes/{sid}/files/data/blob.bin", raw=blob,
                   headers={"Content-Type": "application/octet-stream"})
    assert r.status == 201 and r.json()["size"] == len(blob)
    assert gw.request("GET", f"/api/sandboxes/{sid}/files/data/blob.bin").body == blob
    assert ex(gw, sid, "print(len(open('data/blob.bin','rb').read()))").stdout == f"{len(blob)}\n"
    listing = gw.request("GET", f"/api/sandboxes/{sid}/files/data").json()["entries"]
    assert [e["name"] for e in listing] == ["blob.bin"]
    assert gw.request("DELETE", f"/api/sandboxes/{sid}/files/data/blob.bin").status == 204
    assert gw.request("GET", f"/api/sandboxes/{sid}/files/data/blob.bin").status == 404
    gw.request("DELETE", f"/api/sandboxes/{sid}")


def test_execute_outputs(gw):
    sid = create(gw)["id"]
    out = ex(gw, sid, "%matplotlib inline\nimport matplotlib.pyplot as plt\nprint('hi')\nplt.plot([1,2]); plt.show()\n1+1")
    kinds = [o["type"] for o in out.outputs]
    assert out.status == "ok" and "display_data" in kinds and kinds[-1] == "execute_result"
    assert any("image/png" in o["data"] for o in out.outputs if o["type"] == "display_data")
    out = ex(gw, sid, "1/0")
    assert out.status == "error" and out.error.ename == "ZeroDivisionError" and out.error.traceback
    gw.request("DELETE", f"/api/sandboxes/{sid}")


def test_execute_streams_server_sent_events(gw):
    import http.client
    import json as _json

    sid = create(gw)["id"]
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    conn.request("POST", f"/api/sandboxes/{sid}/execute",
                 body=_json.dumps({"code": "import time\nfor i in range(3):\n    print(i, flush=True); time.sleep(0.5)"}),
                 headers={"Authorization": f"token {gw.token}", "Accept": "text/event-stream"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    events = []
    event = None
    while True:
        line = r.fp.readline().decode()
        if not line:
            break
        if line.startswith("event: "):
            event = line[7:].strip()
        elif line.startswith("data: "):
            events.append((event, _json.loads(line[6:]), time.monotonic()))
            if event in ("result", "error"):
                break
    outputs = [e for e in events if e[0] == "output"]
    assert [o[1]["text"] for o in outputs] == ["0\n", "1\n", "2\n"]
    assert outputs[-1][2] - outputs[0][2] > 0.5  # they arrived as they were printed, not at the end
    assert events[-1][0] == "result" and events[-1][1]["stdout"] == "0\n1\n2\n"
    gw.request("DELETE", f"/api/sandboxes/{sid}")


def test_openapi(gw):
    doc = gw.request("GET", "/api/sandboxes/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/api/sandboxes", "/api/sandboxes/{id}/fork", "/api/sandboxes/{id}/execute"} <= set(doc["paths"])
    assert "SandboxModel" in doc["components"]["schemas"]


def test_damaged_checkpoint_is_a_clear_error(gw):
    sid = create(gw)["id"]
    ex(gw, sid, "v = 1")
    cp = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    without_kept_image(gw, cp["id"])
    state = gw.home / "checkpoints" / "items" / cp["id"] / "state"
    keys = list(json_keys(gw, cp["id"]))
    chunk = gw.home / "checkpoints" / "chunks" / keys[len(keys) // 2][:2] / keys[len(keys) // 2]
    chunk.write_bytes(os.urandom(chunk.stat().st_size))  # the image's middle, damaged
    r = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
    assert r.status == 503 and "failed to restore" in r.json()["message"]
    assert ex(gw, sid, "print(v)").stdout == "1\n"  # the source is unharmed
    chunk.unlink()
    r = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
    assert r.status == 503 and f"chunk {chunk.name} is missing" in r.json()["message"], r.body
    (state / "chunks.json").unlink()  # no manifest and no image: as a whole image gone
    r = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
    assert r.status == 503 and "checkpoint image missing" in r.json()["message"]
    gw.request("DELETE", f"/api/sandboxes/{sid}")


def test_disk_full_during_checkpoint(home, tmp_path):
    # Full before the gateway starts: its warm pool's template (a checkpoint made in the background
    # at start) meets the full disk too, and must leave nothing either.
    own = tmp_path / "home"
    small = own / "checkpoints" / "items"
    small.mkdir(parents=True)
    (own / "images").symlink_to(home / "images")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    g = None
    try:
        g = Gateway(home, tmp_path, own_home=own)
        wait_for(lambda: "warm start off for gvisor: could not make a template" in g.log_text(), 120)
        assert "not enough disk space for a checkpoint" in g.log_text()
        sid = create(g)["id"]
        ex(g, sid, "w = 'still here'")
        r = g.request("POST", f"/api/sandboxes/{sid}/checkpoints", {})
        assert r.status == 503 and "checkpoint" in r.json()["message"]
        assert g.request("GET", f"/api/sandboxes/{sid}/checkpoints").json() == []
        assert ex(g, sid, "print(w)").stdout == "still here\n"
        assert list(small.iterdir()) == []  # nothing half-written is left
    finally:
        if g:
            g.stop()
        subprocess.run(["umount", str(small)])


def test_gateway_killed_mid_checkpoint(home, tmp_path):
    g = Gateway(home, tmp_path)
    items = g.home / "checkpoints" / "items"
    wait_for((g.home / "templates.json").is_file, timeout=300)  # the template's checkpoint is whole
    sid = create(g)["id"]
    ex(g, sid, "q = 5")
    done = g.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "good"}).json()
    before = set(items.iterdir())

    def unfinished():
        """The doomed checkpoint's directory once runsc has begun its image, before it is committed."""
        for d in set(items.iterdir()) - before:
            state = d / "state"
            with contextlib.suppress(FileNotFoundError):
                if any(state.iterdir()) and not (d / "checkpoint.json").exists():
                    return d
        return None

    def doomed():
        try:
            g.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}, timeout=30)
        except OSError:
            pass  # the gateway dies under it

    t = threading.Thread(target=doomed)
    t.start()
    half = wait_for(unfinished, timeout=60, interval=0.01)
    g.proc.send_signal(signal.SIGKILL)
    g.proc.wait()
    t.join(60)
    assert half and half.is_dir() and not (half / "checkpoint.json").exists()  # killed mid-checkpoint
    # Its `runsc checkpoint` outlives the gateway: the sweep below is tested once nothing writes there.
    wait_for(lambda: not host_processes(str(half)), timeout=120)
    # Same home, new gateway: it reclaims the orphans; every listed checkpoint restores.
    g.log.close()
    g2 = Gateway(home, tmp_path, own_home=g.home)
    try:
        assert not half.exists()  # swept at the start
        listed = [n for n in g2.request("GET", "/api/sandboxes/tree").json()["nodes"] if n["kind"] == "checkpoint"]
        assert done["id"] in [c["id"] for c in listed]
        for c in listed:  # ours, and the warm-start template
            r = g2.request("POST", "/api/sandboxes", {"checkpoint": c["id"]})
            assert r.status == 201, r.body
            code = "print(q)" if c["sandbox"] == sid else "print(5)"
            assert ex(g2, r.json()["id"], code).stdout == "5\n"
    finally:
        g2.stop()
