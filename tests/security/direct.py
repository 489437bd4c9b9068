"""A gVisor sandbox driven straight through its driver and agent link, no
gateway: for the tests that give it a workspace of their own making."""

import asyncio
import contextlib

from sandgate.agent_link import AgentLink
from sandgate.config import Settings
from sandgate.drivers.base import Limits, SandboxSpec
from sandgate.drivers.gvisor import GVisorDriver
from sandgate_images import rootfs as images


@contextlib.asynccontextmanager
async def sandbox(home, tmp_path, ws):
    """A gVisor sandbox whose /workspace is ``ws``, and the link to its agent."""
    spec = SandboxSpec(id=ws.id, rootfs=images.image_dir(home) / "rootfs", agent_dir=images.agent_bundle(home),
                       workspace=ws.path, state_dir=tmp_path / "sandboxes" / ws.id, limits=Limits(memory_mb=512))
    driver = GVisorDriver(str(tmp_path / "runtime"), Settings.load())
    sb = link = None
    try:
        sb = await driver.create(spec)
        link = AgentLink(sb.reader, sb.writer, lambda channel, parts: None, lambda event: None)
        await asyncio.wait_for(link.ready, 120)
        yield link
    finally:
        if link:
            await link.close()
        if sb:
            await sb.destroy()


async def py(link, code: str, timeout=120) -> str:
    """Run Python as the sandbox user (what a cell runs as); its stdout and stderr."""
    result, out = await link.request("exec", {"argv": ["python3", "-c", code], "timeout": timeout},
                                     timeout=timeout + 30)
    assert result["exit_code"] == 0, out.decode(errors="replace")
    return out.decode(errors="replace")
