"""Holds one runtime's stdio, so that the sandbox outlives a killed gateway.

    python shim.py SOCKET STATUS -- runsc ... run ...

The gateway starts a runtime whose agent speaks on stdin/stdout (runsc)
through this shim. The shim owns those pipes and offers the agent's stream on
the unix socket SOCKET to one gateway at a time (a new connection replaces
the old one). When the gateway process dies, nothing reaches the agent's
stdin: it runs on, and the next gateway process connects and adopts it
(Driver.adopt). Frames (u32 header length, u32 payload length, header,
payload; see sandgate_agent/protocol.py) are relayed so that every connection
starts and ends on a frame boundary: what a gateway sent is passed on only
once a frame is whole, and a frame from the agent that a gateway missed the
start of is skipped. When the runtime exits, its exit status (negative for a
signal, as in asyncio) goes to the file STATUS and the shim exits.

Standard library only and run by path, not imported with the package: it
lives as long as its sandbox, so it starts fast and holds little.
"""

import asyncio
import os
import struct
import sys

PREFIX = struct.Struct(">II")
MAX_FRAME = (1 << 20) + (256 << 20) + PREFIX.size  # protocol.MAX_HEADER + MAX_PAYLOAD
CHUNK = 1 << 20


class Shim:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.client = None  # the StreamWriter of the connected gateway
        self.connected = asyncio.Event()

    async def from_agent(self) -> None:
        """Agent -> gateway, frame by frame; waits while no gateway listens,
        which holds the agent back through its pipe."""
        out = self.proc.stdout
        while True:
            await self.connected.wait()
            try:
                head = await out.readexactly(PREFIX.size)
            except asyncio.IncompleteReadError:
                return  # the runtime closed its stdout: it is exiting
            size = sum(PREFIX.unpack(head))
            client = self.client
            self.send(client, head)
            while size:
                chunk = await out.read(min(size, CHUNK))
                if not chunk:
                    return
                size -= len(chunk)
                if client is not self.client:
                    client = None  # that gateway went away mid-frame: the rest is skipped
                self.send(client, chunk)
                if client is not None:
                    try:
                        await client.drain()
                    except ConnectionError:
                        client = None

    @staticmethod
    def send(client, data: bytes) -> None:
        if client is not None and not client.is_closing():
            client.write(data)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Gateway -> agent: whole frames only, so a gateway killed mid-frame
        leaves nothing half-written in the agent's stream."""
        if self.client is not None:
            self.client.close()
        self.client = writer
        self.connected.set()
        stdin = self.proc.stdin
        try:
            while True:
                head = await reader.readexactly(PREFIX.size)
                size = sum(PREFIX.unpack(head))
                if size > MAX_FRAME:
                    break  # not our gateway's framing: the agent would refuse it anyway
                body = await reader.readexactly(size)
                stdin.write(head + body)
                await stdin.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # that gateway went away, or the runtime did and the shim is ending: nothing to report
        finally:
            writer.close()
            if self.client is writer:
                self.client = None
                self.connected.clear()


async def main(sock: str, status: str, argv: list) -> int:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    shim = Shim(proc)
    old = os.umask(0o077)  # the socket is the gateway's (root's) alone
    try:
        server = await asyncio.start_unix_server(shim.serve, path=sock, limit=CHUNK)
    finally:
        os.umask(old)
    relay = asyncio.ensure_future(shim.from_agent())
    code = await proc.wait()
    server.close()
    relay.cancel()
    tmp = status + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(code))
    os.rename(tmp, status)
    return code


if __name__ == "__main__":
    sep = sys.argv.index("--")
    rc = asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[sep + 1:]))
    sys.exit(rc if rc >= 0 else 128 - rc)
