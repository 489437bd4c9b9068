"""Checkpoint storage a tenant can be made to pay for, and can free.

Quota: a tenant's checkpoints are bounded by its quota (max_checkpoint_mb), refused with 413 `quota` naming
it and storing nothing; a checkpoint can be deleted (DELETE /api/sandboxes/{id}/checkpoints/{cp}): 409
`in_use` while a fork from it, the sandbox's newest or a sandbox resuming from it needs it; otherwise
what only it stored goes and what other checkpoints share stays.
Hard links: stored once and restored as links, so a file with ten names in a small workspace
checkpoints as one file, and its fork fits that workspace (stored as ten files it gets ENOSPC).

Real gateway, real gVisor sandboxes (unit tests of the store: tests/test_checkpoint_store.py)."""

import hashlib
import random

import pytest

from conftest import Gateway
from sandgate.checkpoints import blob_key

MiB = 1 << 20


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    gw = Gateway(home, tmp_path_factory.mktemp("hostile-cp"), env={"SANDGATE_WARM_START": "false"})
    yield gw
    gw.stop()


def tenant(gw, name, **quota) -> str:
    r = gw.request("POST", "/api/tenants", {"name": name, **quota})
    assert r.status == 201, r.body
    return r.json()["token"]


def create(gw, token, **body) -> str:
    r = gw.request("POST", "/api/sandboxes", body, token=token, timeout=300)
    assert r.status == 201, r.body
    return r.json()["id"]


def ex(gw, token, sid, code) -> str:
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code, "timeout": 180}, token=token, timeout=300)
    assert r.status == 200, r.body
    out = r.json()
    assert out["status"] == "ok", out
    return out["stdout"]


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


WRITE = "import random\nopen('/workspace/{name}', 'wb').write(random.Random({seed}).randbytes({size}))\n"


def checkpoint(gw, token, sid):
    return gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}, token=token, timeout=300)


def chunk_files(gw) -> set:
    return {p.name for p in (gw.home / "checkpoints" / "chunks").glob("*/*")}


def test_deleting_a_checkpoint_frees_what_only_it_stored_and_is_refused_while_needed(gw):
    tok = tenant(gw, "deleter")
    other = tenant(gw, "bystander")
    sid = create(gw, tok)
    blob = lambda seed, size: gw.home / "checkpoints" / "blobs" / (  # noqa: E731
        k := blob_key("deleter", hashlib.sha256(content(seed, size)).hexdigest()))[:2] / k
    ex(gw, tok, sid, WRITE.format(name="only-c1", seed=1, size=3 * MiB) + WRITE.format(name="shared", seed=2, size=MiB))
    r = checkpoint(gw, tok, sid)
    assert r.status == 201, r.body
    c1 = r.json()["id"]
    ex(gw, tok, sid, "import os\nos.remove('/workspace/only-c1')\n" + WRITE.format(name="only-c2", seed=3, size=MiB))
    r = checkpoint(gw, tok, sid)
    assert r.status == 201, r.body
    c2 = r.json()["id"]
    assert blob(1, 3 * MiB).is_file() and blob(2, MiB).is_file()
    fork = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": c1}, token=tok, timeout=300)
    assert fork.status == 201, fork.body
    fid = fork.json()["id"]

    url = f"/api/sandboxes/{sid}/checkpoints"
    r = gw.request("DELETE", f"{url}/{c1}", token=tok)
    assert r.status == 409 and r.json()["code"] == "in_use" and f"sandbox {fid} was forked from it" in r.json()["message"], r.body
    r = gw.request("DELETE", f"{url}/{c2}", token=tok)
    assert r.status == 409 and f"sandbox {sid}'s newest checkpoint" in r.json()["message"], r.body
    assert gw.request("DELETE", f"{url}/{c1}", token=other).status == 404  # another tenant's: not even seen
    assert gw.request("DELETE", f"/api/sandboxes/{fid}/checkpoints/{c1}", token=tok).status == 404  # not the fork's

    assert gw.request("DELETE", f"/api/sandboxes/{fid}", token=tok).status == 204
    before = gw.request("GET", "/api/tenants/deleter").json()["checkpoint_bytes"]
    chunks = chunk_files(gw)
    r = gw.request("DELETE", f"{url}/{c1}", token=tok)
    assert r.status == 204, r.body
    assert [c["id"] for c in gw.request("GET", url, token=tok).json()] == [c2]
    assert gw.request("GET", "/api/sandboxes/tree", token=tok).json()["nodes"][0]["parent"] is None  # re-parented
    assert not blob(1, 3 * MiB).exists(), "the blob only the deleted checkpoint had is still stored"
    assert blob(2, MiB).is_file(), "a blob the remaining checkpoint shares was removed"
    assert chunk_files(gw) < chunks, "no state chunk of the deleted checkpoint was freed"
    after = gw.request("GET", "/api/tenants/deleter").json()["checkpoint_bytes"]
    assert after <= before - 3 * MiB, (before, after)
    # What is left still restores whole: files and memory.
    fork = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": c2}, token=tok, timeout=300)
    assert fork.status == 201, fork.body
    got = ex(gw, tok, fork.json()["id"], "import hashlib, os\nprint(sorted(os.listdir('/workspace')), "
             "hashlib.sha256(open('/workspace/shared', 'rb').read()).hexdigest())")
    assert "'only-c2', 'shared'" in got and hashlib.sha256(content(2, MiB)).hexdigest() in got, got


def test_a_tenant_checkpoint_past_its_quota_is_refused_and_stores_nothing(gw):
    tok = tenant(gw, "hoarder", max_checkpoint_mb=48)  # room for a checkpoint of an idle kernel (~15-25 MB)
    sid = create(gw, tok)
    ex(gw, tok, sid, WRITE.format(name="big", seed=4, size=56 * MiB))  # more than the quota on its own
    blobs, chunks = set((gw.home / "checkpoints" / "blobs").glob("*/*")), chunk_files(gw)
    r = checkpoint(gw, tok, sid)
    assert r.status == 413 and r.json()["code"] == "quota", r.body
    msg = r.json()["message"]
    assert "max_checkpoint_mb is 48 MB" in msg and "SANDGATE_TENANT_MAX_CHECKPOINT_MB" in msg, msg
    assert set((gw.home / "checkpoints" / "blobs").glob("*/*")) == blobs  # refused before the files were stored
    assert chunk_files(gw) == chunks and gw.request("GET", f"/api/sandboxes/{sid}/checkpoints", token=tok).json() == []
    assert ex(gw, tok, sid, "print(1+1)").strip() == "2"  # it runs on
    # Within the quota it checkpoints; what it stores is what the tenant's model counts.
    ex(gw, tok, sid, "import os\nos.remove('/workspace/big')")
    r = checkpoint(gw, tok, sid)
    assert r.status == 201, r.body
    model = gw.request("GET", "/api/tenants/hoarder").json()
    assert model["max_checkpoint_mb"] == 48 and 0 < model["checkpoint_bytes"] <= 48 * MiB, model


def test_a_running_state_past_the_quota_is_refused_after_it_is_measured_and_removed(gw):
    tok = tenant(gw, "tiny", max_checkpoint_mb=1)  # less than any running state
    sid = create(gw, tok)
    chunks = chunk_files(gw)
    r = checkpoint(gw, tok, sid)
    assert r.status == 413 and "would add" in r.json()["message"], r.body
    assert chunk_files(gw) == chunks, "the refused checkpoint's chunks were left on disk"
    assert gw.request("GET", "/api/tenants/tiny").json()["checkpoint_bytes"] == 0
    assert ex(gw, tok, sid, "print(1+1)").strip() == "2"


def test_hard_links_are_kept_and_the_fork_fits_its_small_workspace(gw):
    """Scaled down: 20 MB with nine more names in a 64 MB workspace, which stored name by name would be
    200 MB in the checkpoint and run the fork's restore out of space."""
    sid = create(gw, None, limits={"disk_mb": 64})
    ex(gw, None, sid, WRITE.format(name="big", seed=5, size=20 * MiB)
       + "import os\nos.makedirs('/workspace/names')\nfor i in range(9):\n    os.link('/workspace/big', f'/workspace/names/{i}')")
    r = checkpoint(gw, None, sid)
    assert r.status == 201, r.body
    cp = r.json()
    fork = gw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]}, timeout=300)
    assert fork.status == 201, fork.body  # was 503: "No space left on device" restoring the ten copies
    assert cp["files_bytes"] == 20 * MiB and cp["new_bytes"] == 20 * MiB, cp
    got = ex(gw, None, fork.json()["id"], "import hashlib, os\nst = os.stat('/workspace/big')\n"
             "print(st.st_nlink, all(os.stat(f'/workspace/names/{i}').st_ino == st.st_ino for i in range(9)), "
             "hashlib.sha256(open('/workspace/names/8', 'rb').read()).hexdigest())")
    assert got.split() == ["10", "True", hashlib.sha256(content(5, 20 * MiB)).hexdigest()], got
