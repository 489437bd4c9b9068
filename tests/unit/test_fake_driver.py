"""The fake driver (tests/fake_driver.py), driven through the real AgentLink:
what the gateway core's fast tests rely on it to do."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from fake_driver import FakeDriver
from sandgate.agent_link import AgentError, AgentLink
from sandgate.drivers.base import SandboxError, SandboxSpec


def spec(tmp_path, env=None) -> SandboxSpec:
    return SandboxSpec(id=f"sg-{uuid.uuid4().hex[:6]}", rootfs=tmp_path, agent_dir=tmp_path,
                       workspace=tmp_path / "ws", state_dir=tmp_path / "state", env=env or {})


class Client:
    """An AgentLink over a sandbox, recording every kernel message and event."""

    def __init__(self, sandbox):
        self.sandbox = sandbox
        self.msgs, self.events, self.arrived = [], [], asyncio.Event()
        self.link = AgentLink(sandbox.reader, sandbox.writer, self.on_kernel, self.on_event)

    def on_kernel(self, channel, parts):
        h, parent, _, content = (json.loads(p) for p in parts[:4])
        self.msgs.append({"channel": channel, "type": h["msg_type"], "header": h, "parent": parent, "content": content})
        self.arrived.set()

    def on_event(self, frame):
        self.events.append(frame)
        self.arrived.set()

    def send(self, code=None, msg_type="execute_request", channel="shell"):
        h = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": "client-session", "username": "t",
             "date": "2026-01-01T00:00:00Z", "version": "5.3"}
        content = {"code": code, "silent": False} if code is not None else {}
        self.link.send_kernel(channel, [json.dumps(h).encode(), b"{}", b"{}", json.dumps(content).encode()])
        return h

    def of(self, msg_id):
        return [m for m in self.msgs if m["parent"].get("msg_id") == msg_id]

    async def until(self, pred, timeout=2.0):
        async def loop():
            while not pred():
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(loop(), timeout)

    async def run(self, code, timeout=2.0):
        """Execute a cell; its messages, once iopub said idle."""
        h = self.send(code)
        await self.until(lambda: any(m["type"] == "status" and m["content"]["execution_state"] == "idle"
                                     for m in self.of(h["msg_id"])), timeout)
        return self.of(h["msg_id"])

    async def quiet(self, msg_id, seconds=0.1):
        await asyncio.sleep(seconds)
        return self.of(msg_id) == []


def reply(msgs):
    return next(m["content"] for m in msgs if m["type"].endswith("_reply"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))  # each takes well under a second


def test_cells_output_and_errors(tmp_path):
    async def main():
        driver = FakeDriver()
        sandbox = await driver.create(spec(tmp_path, {"GREETING": "hi"}))
        c = Client(sandbox)
        info = await asyncio.wait_for(c.link.ready, 1)
        assert info["language_info"]["name"] == "python" and info["pid"]

        assert reply(await c.run("x = 41")) == {"status": "ok", "execution_count": 1, "user_expressions": {},
                                                "payload": []}
        h = c.send("x + 1")
        await c.until(lambda: len(c.of(h["msg_id"])) == 5)
        msgs = c.of(h["msg_id"])
        assert [(m["channel"], m["type"]) for m in msgs] == [
            ("iopub", "status"), ("iopub", "execute_input"), ("iopub", "execute_result"),
            ("shell", "execute_reply"), ("iopub", "status")]
        assert [m["content"]["execution_state"] for m in (msgs[0], msgs[4])] == ["busy", "idle"]
        assert msgs[2]["content"]["data"] == {"text/plain": "42"} and msgs[2]["content"]["execution_count"] == 2
        assert all(m["parent"] == h and m["header"]["session"] == "client-session" and
                   m["header"]["version"] == "5.3" and m["header"]["date"] for m in msgs)

        out = await c.run("print('hello', x)\nprint('again')")
        assert [m["content"] for m in out if m["type"] == "stream"] == [{"name": "stdout", "text": "hello 41\nagain\n"}]
        assert not any(m["type"] == "execute_result" for m in out)

        out = await c.run("print('before')\n1 / 0")
        err = next(m["content"] for m in out if m["type"] == "error")
        assert err["ename"] == "ZeroDivisionError" and err["traceback"]
        assert reply(out)["status"] == "error" and reply(out)["ename"] == "ZeroDivisionError"
        assert [m["type"] for m in out].index("stream") < [m["type"] for m in out].index("error")

        h = c.send(msg_type="kernel_info_request")
        await c.until(lambda: len(c.of(h["msg_id"])) == 3)
        assert reply(c.of(h["msg_id"]))["language_info"]["name"] == "python"

        await c.link.request("setup", {"env": {"TOKEN": "t1"}})
        out = await c.run("ENV['GREETING'] + os_environ['TOKEN']")
        assert next(m for m in out if m["type"] == "execute_result")["content"]["data"]["text/plain"] == "'hit1'"

        # Strict arrival order: a sleeping cell holds the one behind it.
        a, b = c.send("#sleep 0.05\norder = [1]"), c.send("order.append(2); order")
        await c.until(lambda: len(c.of(b["msg_id"])) == 5)
        assert reply(c.of(a["msg_id"]))["status"] == "ok"
        assert c.of(b["msg_id"])[2]["content"]["data"]["text/plain"] == "[1, 2]"
        await sandbox.destroy()
        assert driver.live == set() and not sandbox.running
    run(main())


def test_ops_and_files(tmp_path):
    async def main():
        driver = FakeDriver()
        sandbox = await driver.create(spec(tmp_path))
        c = Client(sandbox)
        await c.link.ready
        assert (await c.link.request("ping"))[0]["kernel_alive"]
        await c.link.request("file_write", {"path": "/d/a.txt"}, b"data")
        assert (tmp_path / "ws" / "d" / "a.txt").read_bytes() == b"data"
        assert (await c.link.request("file_read", {"path": "d/a.txt"}))[1] == b"data"
        entries = (await c.link.request("file_list", {"path": ""}))[0]["entries"]
        assert [(e["name"], e["type"]) for e in entries] == [("d", "directory")]
        await c.link.request("file_delete", {"path": "d"})
        assert not (tmp_path / "ws" / "d").exists()
        with pytest.raises(AgentError, match="PermissionError"):
            await c.link.request("file_read", {"path": "../outside"})
        with pytest.raises(AgentError, match="unknown op"):
            await c.link.request("bogus")

        await c.run("x = 1")
        await c.run("x")
        await c.link.request("restart")
        assert [m["content"]["execution_state"] for m in c.msgs[-2:]] == ["starting", "idle"]
        out = await c.run("x")
        assert reply(out)["ename"] == "NameError" and reply(out)["execution_count"] == 1

        h = c.send(msg_type="kernel_info_request", channel="control")
        await c.until(lambda: len(c.of(h["msg_id"])) == 3)
        assert [m["channel"] for m in c.of(h["msg_id"])] == ["iopub", "control", "iopub"]

        sandbox.kill_kernel(exit_code=9)
        await c.until(lambda: [e.event for e in c.events] == ["ready", "kernel_died", "kernel_restarted"])
        assert reply(await c.run("1"))["execution_count"] == 1
        sandbox.kill_kernel(exit_code=9, final=True)
        await c.until(lambda: len(c.events) == 5)
        assert c.events[-1].data["final"] and not (await c.link.request("ping"))[0]["kernel_alive"]

        await c.link.close()  # like the stdio agent: the gateway ends the stream, the sandbox stops
        assert await asyncio.wait_for(sandbox.wait(), 1) == 0 and "closed the stream" in sandbox.failure()
        await sandbox.destroy()
    run(main())


def test_checkpoint_and_restore(tmp_path):
    async def main():
        driver = FakeDriver()
        sandbox = await driver.create(spec(tmp_path))
        c = Client(sandbox)
        await c.link.ready
        await c.run("x = 41\nf = lambda: 1")
        await c.link.request("setup", {"env": {"K": "v"}})
        # A cell waiting at a gate when the checkpoint is taken resumes after the restore.
        blocked = c.send("#block g\ny = x + 1\ny")
        await driver.at_gate["g"].wait()
        await driver.checkpoint(sandbox, tmp_path / "img")
        assert await asyncio.wait_for(c.link.closed, 1) == "stream closed"
        assert await sandbox.wait() == 0 and not sandbox.running
        assert [m["type"] for m in c.of(blocked["msg_id"])] == ["status", "execute_input"]

        restored = await driver.restore(spec(tmp_path), tmp_path / "img")
        assert (driver.created, driver.restored, len(driver.live)) == (1, 1, 2)
        c2 = Client(restored)
        h = c2.send("(x, sorted(ENV), 'f' in dir())")
        assert await c2.quiet(h["msg_id"])  # nothing runs before reconnect, and no ready event
        assert c2.events == [] and not c2.link.ready.done()
        info, _ = await c2.link.request("reconnect", {"clock": 0})
        assert info["status"] == "ok" and info["language_info"]["name"] == "python"
        driver.cell_gates["g"].set()
        await c2.until(lambda: len(c2.of(h["msg_id"])) == 5)
        resumed = c2.of(blocked["msg_id"])  # the resumed cell finished first, without its start again
        assert [m["type"] for m in resumed] == ["execute_result", "execute_reply", "status"]
        assert resumed[0]["content"] == {"execution_count": 2, "data": {"text/plain": "42"}, "metadata": {}}
        assert c2.msgs.index(resumed[-1]) < c2.msgs.index(c2.of(h["msg_id"])[0])
        assert c2.of(h["msg_id"])[2]["content"]["data"]["text/plain"] == "(41, ['K'], False)"
        assert reply(c2.of(h["msg_id"]))["execution_count"] == 3
        await sandbox.destroy()
        await restored.destroy()
        assert driver.live == set()

        with pytest.raises(SandboxError, match="missing"):
            await driver.restore(spec(tmp_path), tmp_path / "nothing")
    run(main())


def test_checkpoint_faults_and_gates(tmp_path):
    async def main():
        driver = FakeDriver()
        sandbox = await driver.create(spec(tmp_path))
        c = Client(sandbox)
        await c.link.ready
        await c.run("x = 41")

        driver.fail["checkpoint"] = "disk full"  # fails before stopping: the sandbox runs on
        with pytest.raises(SandboxError, match="disk full"):
            await driver.checkpoint(sandbox, tmp_path / "img")
        assert sandbox.running and "checkpoint" not in driver.fail
        assert reply(await c.run("x"))["status"] == "ok"

        # Held at a gate: the sandbox is frozen, a frame sent now stays unread and dies with it.
        driver.gates["checkpoint"] = asyncio.Event()
        task = asyncio.ensure_future(driver.checkpoint(sandbox, tmp_path / "img"))
        await driver.entered["checkpoint"].wait()
        late = c.send("x = 0")
        assert await c.quiet(late["msg_id"]) and sandbox.running
        driver.gates["checkpoint"].set()
        await task
        assert await sandbox.wait() == 0

        restored = await driver.restore(spec(tmp_path), tmp_path / "img")
        c2 = Client(restored)
        await c2.link.request("reconnect")
        out = await c2.run("x")
        assert out[2]["content"]["data"]["text/plain"] == "41" and c2.of(late["msg_id"]) == []

        driver.fail["checkpoint_after_stop"] = "upload failed"
        with pytest.raises(SandboxError, match="upload failed"):
            await driver.checkpoint(restored, tmp_path / "img2")
        assert not restored.running and await restored.wait() == 0

        driver.fail["create"], driver.delays["create"] = "no room", 0.05
        with pytest.raises(SandboxError, match="no room"):
            await driver.create(spec(tmp_path))
        assert (await driver.create(spec(tmp_path))).running and driver.created == 2
        for s in list(driver.live):
            await s.destroy()
    run(main())


def test_freeze_interrupt_crash(tmp_path):
    async def main():
        driver = FakeDriver()
        sandbox = await driver.create(spec(tmp_path))
        c = Client(sandbox)
        await c.link.ready

        await driver.freeze(sandbox)
        h = c.send("1 + 1")
        assert await c.quiet(h["msg_id"])
        await driver.thaw(sandbox)
        await c.until(lambda: len(c.of(h["msg_id"])) == 5)

        blocked = c.send("#block forever\nx = 1")
        after = c.send("'next'")
        await driver.at_gate["forever"].wait()
        await c.link.request("interrupt")
        await c.until(lambda: len(c.of(after["msg_id"])) == 5)
        out = c.of(blocked["msg_id"])
        assert next(m for m in out if m["type"] == "error")["content"]["ename"] == "KeyboardInterrupt"
        assert reply(out)["status"] == "error"
        assert (await c.run("'x' in dir()"))[2]["content"]["data"] == {"text/plain": "False"}

        waiter = asyncio.ensure_future(sandbox.wait())
        sandbox.crash("out of memory")
        assert await asyncio.wait_for(c.link.closed, 1) == "stream closed"
        assert await waiter == 137 and not sandbox.running and "out of memory" in sandbox.failure()
        with pytest.raises(AgentError):
            await c.link.request("ping")
        with pytest.raises(SandboxError):
            await driver.checkpoint(sandbox, tmp_path / "img")
        await sandbox.destroy()
        assert driver.live == set() and await driver.reap() == 0
    run(main())
