"""The host-side egress proxy: mitmproxy in the gateway's event loop, one policy per sandbox.

How a connection flows (docs/egress.md has the whole picture): the gateway calls ``open(sandbox_id)``
for each TCP connection the guest agent accepted inside a sandbox. ``open`` binds a local socket,
records its source port as that sandbox's, and connects to mitmproxy's listener on 127.0.0.1; the
``client_connected`` hook looks the port up, so every later hook knows the sandbox. Anything else that
connects to the listener has no recorded port and is dropped before a byte is read.

Checks, in hook order: ``http_connect`` refuses a CONNECT whose host the policy refuses by name (no DNS
for such names); ``requestheaders`` checks each request: the HTTP Host, the TLS SNI and the CONNECT
target agree, the policy allows the name, the proxy resolves it and the policy allows the addresses.
The address it allowed is pinned for that host:port on that client connection, and ``server_connect``
connects to exactly it (no second resolution); a server connection without a pin is refused, so nothing
reaches upstream unchecked. Refusals are 403s written by the proxy, the reason in the body.

What mitmproxy may hold for a connection is bounded in ``bounds.py``: heads, ClientHellos, and no client
bytes read while a hook or connect is in flight.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Dict, List, Optional, Tuple

from mitmproxy import certs, connection, hooks, http
from mitmproxy.addons import disable_h2c, next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master
from mitmproxy.net.http import url
from mitmproxy.options import Options
from mitmproxy.proxy import server_hooks

from .. import metrics
from . import bounds
from .policy import EgressPolicy, IPAddress, Verdict, ip_literal, normalize_host
from .secrets import Secret

logger = logging.getLogger("sandgate.egress")

Resolver = Callable[[str, int], Awaitable[List[IPAddress]]]
RESOLVE_TIMEOUT = 10.0
# mitmproxy answers a request only after reading its body, and holds that body in memory; a refused
# request announcing more than this (or a chunked one, of unknown size) is cut off instead of answered
REFUSED_BODY_MAX = 64 << 10
_CA_BASENAME = "mitmproxy"  # the file names mitmproxy's CertStore reads from its confdir


async def system_resolver(host: str, port: int) -> List[IPAddress]:
    """The host's resolver, every address once, in its order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: List[IPAddress] = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if address not in found:
            found.append(address)
    return found


def table_resolver(table: Dict[str, str], fallback: Resolver = system_resolver) -> Resolver:
    """Names in ``table`` (SANDGATE_EGRESS_HOSTS) to their fixed address, the rest through ``fallback``."""
    async def resolve(host: str, port: int) -> List[IPAddress]:
        address = table.get(host.lower().rstrip("."))
        return [ipaddress.ip_address(address)] if address else await fallback(host, port)
    return resolve


@dataclass
class _Sandbox:
    policy: EgressPolicy
    secrets: List[Secret]
    placeholders: Dict[str, Secret]  # placeholder -> the secret it stands for


@dataclass
class _Client:
    """One client connection (one open() call)."""

    sandbox_id: str
    pins: Dict[Tuple[str, int], str] = field(default_factory=dict)  # checked (address, port) -> host name


class _Count:
    """A stream callable that passes the body through and counts it."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, data: bytes) -> bytes:
        self.bytes += len(data)
        return data


@dataclass
class _Request:
    """What the log line of one request needs; kept in the flow's metadata."""

    sandbox_id: str
    host: str
    port: int
    verdict: Verdict
    up: _Count = field(default_factory=_Count)
    down: _Count = field(default_factory=_Count)


_META = "sandgate.egress"


def _refuse(flow: http.HTTPFlow, status: int, host: str, port: int, reason: str) -> None:
    body = f"sandgate egress: {host}:{port} refused: {reason}\n"
    flow.response = http.Response.make(status, body, {"Content-Type": "text/plain; charset=utf-8",
                                                      "Connection": "close"})


class _Guard:
    """The addon: maps connections to sandboxes, enforces the policy, adds credentials, logs."""

    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver
        self.sandboxes: Dict[str, _Sandbox] = {}
        self.pending: Dict[int, str] = {}  # local source port of an open() connection -> sandbox id
        self.clients: Dict[str, _Client] = {}  # mitmproxy client id -> its sandbox
        self.proxyserver: Optional[proxyserver.Proxyserver] = None  # set by EgressProxy.start

    def client_connected(self, client: connection.Client) -> None:
        peer = client.peername or ("", 0)
        sandbox_id = self.pending.pop(peer[1], None) if peer[0] == "127.0.0.1" else None
        if sandbox_id is None:
            client.error = "not a connection the gateway opened"  # mitmproxy closes it
            return
        self.clients[client.id] = _Client(sandbox_id)
        # Before mitmproxy reads a byte of it: no reads while its hooks or connects are in flight.
        bounds.Gate.install(self.proxyserver.connections[client.id])

    def refused(self, client_id: str, why: str) -> None:
        """A bound in bounds.py closed this client connection (a 431, or a failed handshake)."""
        client = self.clients.get(client_id)
        metrics.EGRESS_REQUESTS.labels("refused").inc()
        logger.info("sandbox %s: connection closed: %s", client.sandbox_id if client else "?", why)

    def client_disconnected(self, client: connection.Client) -> None:
        self.clients.pop(client.id, None)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        client = self.clients[flow.client_conn.id]
        host, port = normalize_host(flow.request.host), flow.request.port
        sandbox = self.sandboxes.get(client.sandbox_id)
        # Names only: a CONNECT to a name no rule allows is refused before anything resolves it.
        verdict = sandbox.policy.decide_name(host, port) if sandbox else _no_policy(client.sandbox_id)
        if not verdict.allowed:
            _refuse(flow, 403, host, port, verdict.reason)
            _log(_Request(client.sandbox_id, host, port, verdict), "CONNECT", 403)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        client = self.clients[flow.client_conn.id]
        host, port = normalize_host(flow.request.host), flow.request.port
        request = _Request(client.sandbox_id, host, port, Verdict(allowed=False, reason="unchecked"))
        flow.metadata[_META] = request
        sandbox = self.sandboxes.get(client.sandbox_id)
        mismatch = _mismatch(flow, host, port)
        if sandbox is None:
            request.verdict = _no_policy(client.sandbox_id)
        elif mismatch:
            request.verdict = Verdict(allowed=False, reason=mismatch)
        else:
            request.verdict = sandbox.policy.decide_name(host, port)
            if request.verdict.allowed:
                addresses = await self._resolve(host, port)
                if addresses is None:
                    request.verdict = Verdict(allowed=False, rule=request.verdict.rule,
                                              reason=f"cannot resolve {host}")
                    _refuse_or_kill(flow, 502, host, port, request.verdict.reason)
                    return
                request.verdict = sandbox.policy.decide(host, port, addresses)
        if not request.verdict.allowed:
            _refuse_or_kill(flow, 403, host, port, request.verdict.reason)
            return
        # Pin: mitmproxy connects to request.host and matches kept-alive server connections by it,
        # so it becomes the checked address; the Host header stays, and server_connect sets the SNI.
        client.pins[(request.verdict.address, port)] = host
        flow.request.data.host = request.verdict.address
        if flow.request.scheme == "https":  # a credential never crosses the network in clear text
            _add_credentials(flow, sandbox, host)
        # No WebSocket compression: mitmproxy inflates each frame whole before bounds.py can count it
        flow.request.headers.pop("Sec-WebSocket-Extensions", None)
        flow.request.stream = request.up

    async def _resolve(self, host: str, port: int) -> Optional[List[IPAddress]]:
        literal = ip_literal(host)
        if literal is not None:
            return [literal]
        try:
            return await asyncio.wait_for(self.resolver(host, port), RESOLVE_TIMEOUT)
        except (OSError, asyncio.TimeoutError, UnicodeError):
            return None

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.metadata.get(_META)
        if request is not None and request.verdict.allowed:
            flow.response.stream = request.down

    def response(self, flow: http.HTTPFlow) -> None:
        if _META in flow.metadata:
            _log(flow.metadata[_META], flow.request.method, flow.response.status_code)

    def error(self, flow: http.HTTPFlow) -> None:
        if _META in flow.metadata:
            _log(flow.metadata[_META], flow.request.method, None, flow.error.msg if flow.error else "error")

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        client = self.clients.get(data.client.id)
        host = client.pins.get(data.server.address) if client and data.server.address else None
        if host is None:  # nothing reaches upstream without a check
            data.server.error = "egress: no checked address for this destination"
            return
        data.server.sni = host  # mitmproxy would use the address; certificates name the host


def _refuse_or_kill(flow: http.HTTPFlow, status: int, host: str, port: int, reason: str) -> None:
    """mitmproxy sends a response set here only after reading the request's body, which it holds."""
    if _large_body(flow.request):
        flow.kill()  # logged by the error hook
    else:
        _refuse(flow, status, host, port, reason)


def _large_body(request: http.Request) -> bool:
    if "transfer-encoding" in request.headers:
        return True
    length = request.headers.get("content-length", "0")
    return not length.isdigit() or int(length) > REFUSED_BODY_MAX


def _no_policy(sandbox_id: str) -> Verdict:
    return Verdict(allowed=False, reason=f"sandbox {sandbox_id} has no egress policy")


def _mismatch(flow: http.HTTPFlow, host: str, port: int) -> Optional[str]:
    """Why the destinations a request names disagree (domain fronting), or None. Inside a CONNECT
    tunnel mitmproxy sets the request's host and port to the CONNECT target, so comparing the SNI
    and the Host header to them covers all three."""
    sni = flow.client_conn.sni
    if sni is not None and normalize_host(sni) != host:
        return f"TLS SNI {sni} does not match {host}"
    header = flow.request.host_header
    if header is not None:
        try:
            named, named_port = url.parse_authority(header, check=True)
        except ValueError:
            return "malformed Host header"
        if normalize_host(named) != host or named_port not in (None, port):
            return f"HTTP Host {header} does not match {host}:{port}"
    return None


def _add_credentials(flow: http.HTTPFlow, sandbox: _Sandbox, host: str) -> None:
    headers = flow.request.headers
    mine = {ph: s for ph, s in sandbox.placeholders.items() if s.applies_to(host)}
    if mine:
        for name in set(headers.keys()):
            values = headers.get_all(name)
            swapped = [_swap(v, mine) for v in values]
            if swapped != values:
                headers.set_all(name, swapped)
    for secret in sandbox.secrets:
        if secret.header is not None and secret.applies_to(host):
            headers[secret.header] = secret.value.get_secret_value()  # replaces what the client sent


def _swap(value: str, mine: Dict[str, Secret]) -> str:
    for placeholder, secret in mine.items():
        if placeholder in value:
            value = value.replace(placeholder, secret.value.get_secret_value())
    return value


def _log(request: _Request, method: str, status: Optional[int], error: Optional[str] = None) -> None:
    # Never headers, paths or queries: they may hold credentials or what the sandbox is working on.
    verdict = request.verdict
    outcome = "allowed" if verdict.allowed else "refused"
    rule = f" rule={verdict.rule!r}" if verdict.rule else ""
    extra = f" error={error!r}" if error else ""
    metrics.EGRESS_REQUESTS.labels(outcome).inc()
    metrics.EGRESS_BYTES.labels("up").inc(request.up.bytes)
    metrics.EGRESS_BYTES.labels("down").inc(request.down.bytes)
    logger.info("sandbox %s: %s %s:%d %s%s status=%s up=%d down=%d reason=%r%s", request.sandbox_id,
                method, request.host, request.port, outcome, rule, status, request.up.bytes,
                request.down.bytes, verdict.reason, extra)


class EgressProxy:
    """One per gateway: mitmproxy's proxy core and our addon, run in the gateway's loop."""

    def __init__(self, home: Path, upstream_ca_bundle: Optional[Path] = None,
                 resolver: Resolver = system_resolver) -> None:
        self.dir = Path(home) / "egress"
        self.upstream_ca_bundle = upstream_ca_bundle
        self._guard = _Guard(resolver)
        bounds.install()
        self._master: Optional[Master] = None
        self._address: Optional[Tuple[str, int]] = None

    def ca_certificate_pem(self) -> bytes:
        return (self.dir / f"{_CA_BASENAME}-ca-cert.pem").read_bytes()

    def _make_ca(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if not (self.dir / f"{_CA_BASENAME}-ca.pem").exists():
            certs.CertStore.create_store(self.dir, _CA_BASENAME, 2048, organization="Sandgate",
                                         cn="Sandgate egress CA")
        for key_file in (f"{_CA_BASENAME}-ca.pem", f"{_CA_BASENAME}-ca.p12"):
            if (self.dir / key_file).exists():
                os.chmod(self.dir / key_file, 0o600)

    def _trust_bundle(self) -> Path:
        """The system store plus the operator's extra CAs, as one file (mitmproxy takes one)."""
        system = ssl.get_default_verify_paths().cafile
        parts = [Path(system).read_bytes()] if system and Path(system).exists() else []
        if not parts:
            import certifi  # mitmproxy's own fallback, installed with it

            parts = [Path(certifi.where()).read_bytes()]
        if self.upstream_ca_bundle is not None:
            parts.append(Path(self.upstream_ca_bundle).read_bytes())
        bundle = self.dir / "upstream-ca.pem"
        bundle.write_bytes(b"\n".join(parts))
        return bundle

    async def start(self) -> None:
        self._make_ca()
        opts = Options(confdir=str(self.dir), ssl_verify_upstream_trusted_ca=str(self._trust_bundle()))
        master = Master(opts, event_loop=asyncio.get_running_loop())
        # Master puts a handler on the root logger that turns every log record of the process into a
        # mitmproxy event; the gateway owns logging, so it goes. mitmproxy's own INFO lines are per
        # connection noise next to our per-request line.
        master._legacy_log_events.uninstall()
        logging.getLogger("mitmproxy").setLevel(logging.WARNING)
        # Only the addons the proxy core needs: no onboarding app (it answers for mitm.it), no
        # scripts, replay or header rewriting. Ours is first, so its hooks run before any other.
        master.addons.add(self._guard, proxyserver.Proxyserver(), next_layer.NextLayer(),
                          tlsconfig.TlsConfig(), disable_h2c.DisableH2C())
        opts.update(
            mode=["regular@127.0.0.1:0"],
            connection_strategy="lazy",  # no upstream connection before a request is checked
            upstream_cert=False,  # so the client's certificate never waits on a server's
            http2=False,  # one request at a time per connection: a pin is never shared (docs)
            http3=False,
            rawtcp=False,  # after a CONNECT it is HTTP over TLS or nothing
            ssl_insecure=False,
        )
        # What Master.run() would do, without it: it swaps the loop's exception handler and task
        # factory for as long as it runs, and those are the gateway's.
        proxy = master.addons.get("proxyserver")
        self._guard.proxyserver = proxy
        bounds.on_refused = self._guard.refused
        if not await proxy.setup_servers():
            raise RuntimeError("the egress proxy could not listen on 127.0.0.1")
        await master.addons.trigger_event(hooks.RunningHook())
        self._address = proxy.listen_addrs()[0][:2]
        self._master = master
        logger.info("egress proxy listening on %s:%d, CA %s", *self._address, self.dir)

    async def stop(self) -> None:
        master, self._master = self._master, None
        if master is None:
            return
        proxy = master.addons.get("proxyserver")
        await proxy.servers.update([])
        for handler in list(proxy.connections.values()):  # the listener is gone; so are its clients
            io = handler.transports.get(handler.client)
            if io is not None and io.writer is not None:
                io.writer.close()
        await master.addons.trigger_event(hooks.DoneHook())

    def set_policy(self, sandbox_id: str, policy: EgressPolicy, secrets: List[Secret],
                   placeholders: Dict[str, str]) -> None:
        """Takes effect for every request checked after it, on open connections too."""
        by_name = {s.name: s for s in secrets if s.name is not None}
        self._guard.sandboxes[sandbox_id] = _Sandbox(
            policy, list(secrets), {ph: by_name[name] for name, ph in placeholders.items() if name in by_name})

    def forget(self, sandbox_id: str) -> None:
        self._guard.sandboxes.pop(sandbox_id, None)

    async def open(self, sandbox_id: str) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._address is None or self._master is None:
            raise RuntimeError("the egress proxy is not running")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            # recorded before connecting, so the proxy's client_connected always finds it
            self._guard.pending[port] = sandbox_id
            try:
                await asyncio.get_running_loop().sock_connect(sock, self._address)
            except BaseException:
                self._guard.pending.pop(port, None)
                raise
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)
