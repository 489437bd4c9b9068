"""core/sessions.py directly, over a real SQLite store: kernels here are records
(as a kernel on another node of a fleet is), and starting or deleting one is
recorded by a small Kernels stand-in, the part the API layer supplies."""

import asyncio

import pytest

from sandgate.core.errors import Conflict, NotFound
from sandgate.core.record import SandboxRecord
from sandgate.core.sessions import NotebookSessions
from sandgate.core.states import State
from sandgate.core.tenants import ADMIN, Principal
from sandgate.store.sqlite import SQLiteStore

ALICE, BOB = Principal("alice"), Principal("bob")


class Kernels:
    def __init__(self, store, owner):
        self.store, self.owner, self.started, self.deleted = store, owner, [], []

    async def start(self, name):
        kid = f"00000000-0000-0000-0000-{len(self.started):012d}"
        await self.store.put(SandboxRecord(id=kid, owner=self.owner, kernel_name=name or "python3",
                                           driver="gvisor", state=State.RUNNING, node="elsewhere"))
        self.started.append(kid)
        return kid

    async def delete(self, kernel_id):
        self.deleted.append(kernel_id)
        await self.store.delete(kernel_id)


@pytest.fixture
def store(tmp_path):
    return SQLiteStore(tmp_path / "store.db", node="here")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_session_is_bound_to_a_new_kernel_and_answers_its_model(store):
    sessions, kernels = NotebookSessions(store, lambda kid: None), Kernels(store, "alice")

    async def go():
        m = await sessions.create(ALICE, kernels, "a.ipynb", "notebook", kernel_name="python3")
        assert m["path"] == "a.ipynb" and m["kernel"]["id"] == kernels.started[0]
        assert m["kernel"]["node"] == "elsewhere" and m["kernel"]["execution_state"] == "idle"
        # The same path again answers the same session, no second kernel.
        again = await sessions.create(ALICE, kernels, "a.ipynb", "notebook", kernel_name="python3")
        assert again["id"] == m["id"] and len(kernels.started) == 1
        assert [s["id"] for s in await sessions.list(ALICE)] == [m["id"]]
        assert await sessions.list(BOB) == []
        assert [s["id"] for s in await sessions.list(ADMIN)] == [m["id"]]
        with pytest.raises(NotFound):
            await sessions.get(m["id"], BOB)

    run(go())


def test_another_tenants_kernel_is_not_found(store):
    sessions, theirs = NotebookSessions(store, lambda kid: None), Kernels(store, "bob")

    async def go():
        kid = await theirs.start(None)
        with pytest.raises(NotFound):
            await sessions.create(ALICE, Kernels(store, "alice"), "x.ipynb", "notebook", kernel_id=kid)
        assert await store.list_sessions(None) == []

    run(go())


def test_a_session_whose_kernel_died_is_removed_when_read(store):
    sessions, kernels = NotebookSessions(store, lambda kid: None), Kernels(store, "alice")

    async def go():
        m = await sessions.create(ALICE, kernels, "a.ipynb", "notebook")
        rec = await store.get(m["kernel"]["id"])
        await store.put(rec.model_copy(update={"state": State.DEAD}))
        assert await sessions.list(ALICE) == []
        assert await store.get_session(m["id"]) is None
        with pytest.raises(NotFound):
            await sessions.get(m["id"], ALICE)

    run(go())


def test_renaming_onto_a_taken_path_is_a_conflict_and_the_new_kernel_goes(store):
    sessions, kernels = NotebookSessions(store, lambda kid: None), Kernels(store, "alice")

    async def go():
        a = await sessions.create(ALICE, kernels, "a.ipynb", "notebook")
        b = await sessions.create(ALICE, kernels, "b.ipynb", "notebook")
        with pytest.raises(Conflict):
            await sessions.update(b["id"], ALICE, kernels, {"path": "a.ipynb"}, kernel_name="python3")
        # The kernel started for the refused change is deleted; b keeps its own.
        assert kernels.deleted == [kernels.started[2]]
        assert (await sessions.get(b["id"], ALICE))["kernel"]["id"] == b["kernel"]["id"]
        # A new kernel by name replaces the old one, which is deleted after.
        moved = await sessions.update(a["id"], ALICE, kernels, {"name": "renamed"}, kernel_name="python3")
        assert moved["name"] == "renamed" and moved["kernel"]["id"] == kernels.started[3]
        assert kernels.deleted[-1] == a["kernel"]["id"]
        await sessions.delete(b["id"], ALICE, kernels)
        assert kernels.deleted[-1] == b["kernel"]["id"]
        assert [s["id"] for s in await sessions.list(ALICE)] == [a["id"]]

    run(go())
