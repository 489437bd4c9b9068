"""The sandbox's HTTP(S) proxy listener, carried over the stream to the gateway."""

from __future__ import annotations

import asyncio
import os
import stat
import uuid
from typing import TYPE_CHECKING

try:
    from . import tunnel as T
    from .diagnostics import log
    from .system import loopback_up
except ImportError:  # run as a script
    import tunnel as T  # type: ignore
    from diagnostics import log  # type: ignore
    from system import loopback_up  # type: ignore


if TYPE_CHECKING:
    from .outbox import Outbox


SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
NO_PROXY = "localhost,127.0.0.1,::1"


class Egress:
    """The sandbox's way out: a listener on 127.0.0.1:PORT, owned by the agent,
    that code inside uses as its HTTP(S) proxy; each connection is carried
    over the stream (tunnel.Mux) to the gateway, which hands it to the egress
    proxy outside. No network device is involved.

    This runsc cannot checkpoint a TCP socket, listening or not, so
    ``quiesce`` closes the listener and every connection before a checkpoint
    (clients get a reset), and ``apply`` (from ``egress`` or ``reconnect``)
    opens the listener again."""

    def __init__(self, out: "Outbox", ca_dir: str):
        self.mux = T.Mux(out.send)
        self.server: asyncio.base_events.Server | None = None
        self.port: int | None = None
        self.ca_pem = ""
        self.ca_dir = ca_dir
        self.env: dict[str, str] = {}  # what the agent and the kernel have now

    def env_for(self, port: int | None, bundle: str | None) -> dict[str, str]:
        if port is None:
            return {}
        proxy = f"http://127.0.0.1:{port}"
        env = {k: proxy for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
        env.update(NO_PROXY=NO_PROXY, no_proxy=NO_PROXY)
        if bundle:
            env.update({k: bundle for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")})
        return env

    def write_bundle(self, ca_pem: str) -> str:
        """The image's system bundle plus the proxy's CA, in a directory of the
        agent's own (root's, made before the kernel ran), not the workspace."""
        st = os.lstat(self.ca_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"refusing to write the CA bundle: {self.ca_dir} is not the agent's directory")
        try:
            with open(SYSTEM_CA_BUNDLE, "rb") as f:
                system = f.read()
        except OSError:
            system = b""
        path = os.path.join(self.ca_dir, "ca-bundle.pem")
        tmp = f"{path}.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(system.rstrip(b"\n") + b"\n" + ca_pem.strip().encode() + b"\n")
        os.replace(tmp, path)
        return path

    async def apply(self, port: int | None, ca_pem: str) -> dict[str, str]:
        """Make the listener match (open, move, close); returns the env to set."""
        if port != self.port:
            await self.close("egress turned off" if port is None else "egress moved to another port")
        self.port = port
        if port is not None and self.server is None:
            try:
                loopback_up()
            except OSError as e:
                log(f"cannot bring the loopback interface up: {e}")
            self.server = await asyncio.start_server(self.accept, "127.0.0.1", port, reuse_address=True)
        bundle = None
        if port is not None and ca_pem:
            bundle = self.write_bundle(ca_pem) if ca_pem != self.ca_pem or "SSL_CERT_FILE" not in self.env \
                else self.env["SSL_CERT_FILE"]
        self.ca_pem = ca_pem if port is not None else ""
        return self.env_for(port, bundle)

    async def close(self, why: str) -> int:
        """Close the listener and abort every connection (the port is kept:
        ``apply`` reopens it)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        return await self.mux.close_all(why)

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.server is None or self.mux.full():
            T._abort(writer)
            return
        await self.mux.connect(reader, writer)
