"""The egress proxy end to end on the host: real mitmproxy in this test's event loop, real HTTP and
HTTPS servers on 127.0.0.3/127.0.0.4 (HTTPS with a CA made here, passed as the extra upstream bundle),
and real clients: urllib through a local listener that hands each connection to ``open()`` (what the
gateway does for a connection from inside a sandbox), or raw bytes written to ``open()``'s streams.

Test seam: names resolve through ``RESOLVER`` (the proxy takes a resolver), and because loopback is
refused by default every policy that should reach the servers names their address literally
("127.0.0.3", "127.0.0.4"), which is exactly the documented exception. Nothing leaves loopback."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import http.server
import ipaddress
import json
import logging
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sandgate.egress.policy import EgressPolicy
from sandgate.egress.proxy import EgressProxy
from sandgate.egress.secrets import Secret, placeholders

PLAIN_IP, TLS_IP = "127.0.0.3", "127.0.0.4"
RESOLVER_TABLE = {"plain.test": [PLAIN_IP], "secure.test": [TLS_IP], "other.test": [TLS_IP],
                  "loop.test": [PLAIN_IP], "denied.test": [PLAIN_IP]}
SECRET = "sk-live-do-not-leak-4242"
SID = "sb-1"


async def RESOLVER(host, port):
    if host not in RESOLVER_TABLE:
        raise socket.gaierror(f"unknown test name {host}")
    return [ipaddress.ip_address(a) for a in RESOLVER_TABLE[host]]


def run(test):
    """Runs an async test in its own loop (the suite has no asyncio plugin)."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 60))
    return wrapper


# --- upstream servers ---------------------------------------------------------------------------

def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(tmp: Path):
    """A test CA and a leaf for secure.test and other.test, as files."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("test CA")).issuer_name(_name("test CA"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(_name("secure.test")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("secure.test"), x509.DNSName("other.test")]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (tmp / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return tmp / "ca.pem", tmp / "leaf.pem"


class Echo(http.server.BaseHTTPRequestHandler):
    """Answers with what it received (so a test sees the headers upstream), or redirects."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path.startswith("/redirect?"):
            self.send_response(302)
            self.send_header("Location", self.path.split("?", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"path": self.path, "headers": dict(self.headers.items())}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("upstream")
    ca, leaf = make_ca(tmp)
    plain = http.server.ThreadingHTTPServer((PLAIN_IP, 0), Echo)
    tls = http.server.ThreadingHTTPServer((TLS_IP, 0), Echo)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(leaf)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    for server in (plain, tls):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"ca": ca, "http": plain.server_address[1], "https": tls.server_address[1]}
    for server in (plain, tls):
        server.shutdown()
        server.server_close()


def policy_for(upstream, *extra, deny=()):
    return EgressPolicy(allow=[f"secure.test:{upstream['https']}", f"plain.test:{upstream['http']}",
                               PLAIN_IP, TLS_IP, *extra], deny=list(deny))


# --- the proxy and the sandbox side -------------------------------------------------------------

async def _pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def proxy_and_bridge(tmp_path, upstream, policy=None, secrets=(), phs=None, resolver=RESOLVER,
                           bundle=True):
    """A started proxy, and a listener standing in for the agent's: each connection to it becomes
    one open() for sandbox SID. Yields (proxy, "http://127.0.0.1:port" for HTTP(S)_PROXY)."""
    proxy = EgressProxy(tmp_path, upstream_ca_bundle=upstream["ca"] if bundle else None, resolver=resolver)
    await proxy.start()
    if policy is not None:
        proxy.set_policy(SID, policy, list(secrets), phs or {})

    async def bridge(reader, writer):
        up_reader, up_writer = await proxy.open(SID)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(bridge, "127.0.0.1", 0)
    try:
        yield proxy, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await proxy.stop()


def _fetch(proxy_url, url, ca_pem: bytes, headers=None):
    """urllib through the proxy, as code inside a sandbox would: (status, body)."""
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy_url, "https": proxy_url}),
                                         urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except urllib.error.URLError as e:  # a refused CONNECT: "Tunnel connection failed: 403 ..."
        return int(str(e.reason).split("failed: ")[1][:3]), str(e.reason).encode()


async def fetch(proxy, proxy_url, url, headers=None):
    return await asyncio.to_thread(_fetch, proxy_url, url, proxy.ca_certificate_pem(), headers)


async def response(reader):
    """One HTTP/1.1 response with a Content-Length from a kept-alive connection: (head, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head, await reader.readexactly(length)


async def tunnel(proxy, connect, sni, host_header, headers=""):
    """Raw bytes on open(): CONNECT, TLS with this SNI, one request with this Host. The reply's bytes."""
    reader, writer = await proxy.open(SID)
    writer.write(f"CONNECT {connect} HTTP/1.1\r\nHost: {connect}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        writer.close()
        return head + await reader.read()
    ctx = ssl.create_default_context(cadata=proxy.ca_certificate_pem().decode())
    ctx.check_hostname = False  # the SNI under test may differ from the name the certificate is for
    await writer.start_tls(ctx, server_hostname=sni)
    writer.write(f"GET / HTTP/1.1\r\nHost: {host_header}\r\n{headers}Connection: close\r\n\r\n".encode())
    reply = await reader.read()
    writer.close()
    return reply


# --- policy enforcement -------------------------------------------------------------------------

@run
async def test_allowed_http_and_https_reach_the_servers(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream)) as (proxy, url):
        status, body = await fetch(proxy, url, f"http://plain.test:{upstream['http']}/a")
        assert status == 200 and json.loads(body)["path"] == "/a"
        status, body = await fetch(proxy, url, f"https://secure.test:{upstream['https']}/b")
        assert status == 200 and json.loads(body)["headers"]["Host"] == f"secure.test:{upstream['https']}"


@run
async def test_refusals_are_403s_naming_the_rule(tmp_path, upstream):
    policy = policy_for(upstream, f"other.test:{upstream['https']}", deny=["other.test"])
    async with proxy_and_bridge(tmp_path, upstream, policy) as (proxy, url):
        status, body = await fetch(proxy, url, f"http://denied.test:{upstream['http']}/")  # default deny
        assert status == 403 and b"no allow rule matched denied.test:" in body
        assert (await fetch(proxy, url, f"https://other.test:{upstream['https']}/"))[0] == 403  # deny wins
        reply = await tunnel(proxy, f"other.test:{upstream['https']}", "other.test", "other.test")
        assert reply.startswith(b"HTTP/1.1 403") and b"denied by rule 'other.test'" in reply
        status, body = await fetch(proxy, url, f"http://plain.test:{upstream['http'] + 1}/")  # port rule
        assert status == 403 and b"no allow rule matched" in body


@run
async def test_a_refused_connect_names_its_rule(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream, deny=["*.test:1"])) as (proxy, _):
        reply = await tunnel(proxy, "secure.test:1", "secure.test", "secure.test:1")
        assert reply.startswith(b"HTTP/1.1 403") and b"denied by rule '*.test:1'" in reply


@run
async def test_loopback_after_resolution_is_refused_unless_named(tmp_path, upstream):
    # loop.test resolves to 127.0.0.3; the policy allows the name but not the address
    policy = EgressPolicy(allow=[f"loop.test:{upstream['http']}"])
    async with proxy_and_bridge(tmp_path, upstream, policy) as (proxy, url):
        status, body = await fetch(proxy, url, f"http://loop.test:{upstream['http']}/")
        assert status == 403 and b"address 127.0.0.3 is loopback" in body
        proxy.set_policy(SID, EgressPolicy(allow=[f"loop.test:{upstream['http']}", "127.0.0.3/32"]), [], {})
        status, _ = await fetch(proxy, url, f"http://loop.test:{upstream['http']}/")
        assert status == 200


@run
async def test_wildcard_and_cidr_rules(tmp_path, upstream):
    policy = EgressPolicy(allow=["*.test", "127.0.0.0/29"])
    async with proxy_and_bridge(tmp_path, upstream, policy) as (proxy, url):
        assert (await fetch(proxy, url, f"https://other.test:{upstream['https']}/"))[0] == 200
        assert (await fetch(proxy, url, f"http://{PLAIN_IP}:{upstream['http']}/"))[0] == 200  # literal, by CIDR
        proxy.set_policy(SID, EgressPolicy(allow=["*.test"]), [], {})
        status, body = await fetch(proxy, url, f"http://{PLAIN_IP}:{upstream['http']}/")
        assert status == 403 and b"no allow rule matched 127.0.0.3" in body


@run
async def test_redirects_are_checked_again(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream)) as (proxy, url):
        target = f"http://denied.test:{upstream['http']}/"
        status, body = await fetch(proxy, url, f"http://plain.test:{upstream['http']}/redirect?{target}")
        assert status == 403 and b"no allow rule matched denied.test" in body


@run
async def test_policy_changes_apply_to_the_next_request_on_an_open_connection(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream)) as (proxy, _):
        reader, writer = await proxy.open(SID)
        request = f"GET http://plain.test:{upstream['http']}/ HTTP/1.1\r\nHost: plain.test:{upstream['http']}\r\n\r\n"
        writer.write(request.encode())
        assert (await response(reader))[0].startswith(b"HTTP/1.1 200")
        proxy.set_policy(SID, EgressPolicy(deny=["plain.test"]), [], {})
        writer.write(request.encode())
        head, body = await response(reader)
        assert head.startswith(b"HTTP/1.1 403") and b"denied by rule 'plain.test'" in body
        writer.close()
        proxy.forget(SID)
        reader, writer = await proxy.open(SID)
        writer.write(request.encode())
        assert b"sandbox sb-1 has no egress policy" in await reader.read()


@run
async def test_names_are_resolved_once_per_allowed_request_and_never_when_refused(tmp_path, upstream):
    asked = []

    async def counting(host, port):
        asked.append(host)
        return await RESOLVER(host, port)

    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream), resolver=counting) as (proxy, url):
        for _ in range(2):
            assert (await fetch(proxy, url, f"https://secure.test:{upstream['https']}/"))[0] == 200
        assert (await fetch(proxy, url, f"http://plain.test:{upstream['http']}/"))[0] == 200
        # a name no rule allows is not looked up at all (DNS would carry it out)
        assert (await fetch(proxy, url, f"http://exfil-1234.attacker.test:{upstream['http']}/"))[0] == 403
        assert (await fetch(proxy, url, f"https://exfil-5678.attacker.test:{upstream['https']}/"))[0] == 403
    # one lookup per request, by the proxy; the connection goes to what was checked (mitmproxy
    # would resolve again if it were given the name)
    assert asked == ["secure.test", "secure.test", "plain.test"]


@run
async def test_an_allowed_name_that_does_not_resolve_is_a_502(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream, "nowhere.test")) as (proxy, url):
        status, body = await fetch(proxy, url, "http://nowhere.test/")
        assert status == 502 and b"cannot resolve nowhere.test" in body


@run
async def test_upstream_certificates_are_verified(tmp_path, upstream):
    # without the extra bundle the test CA is not trusted: the system store alone does not know it
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream), bundle=False) as (proxy, url):
        status, body = await fetch(proxy, url, f"https://secure.test:{upstream['https']}/")
        assert status == 502 and b"certificate verify failed" in body.lower()


# --- no domain fronting -------------------------------------------------------------------------

@run
async def test_sni_host_and_connect_must_agree(tmp_path, upstream):
    port = upstream["https"]
    policy = policy_for(upstream, f"other.test:{port}")
    async with proxy_and_bridge(tmp_path, upstream, policy) as (proxy, _):
        ok = await tunnel(proxy, f"secure.test:{port}", "secure.test", f"secure.test:{port}")
        assert ok.startswith(b"HTTP/1.1 200")
        sni = await tunnel(proxy, f"secure.test:{port}", "other.test", f"secure.test:{port}")
        assert sni.startswith(b"HTTP/1.1 403") and b"TLS SNI other.test does not match secure.test" in sni
        host = await tunnel(proxy, f"secure.test:{port}", "secure.test", f"other.test:{port}")
        assert host.startswith(b"HTTP/1.1 403") and b"HTTP Host other.test" in host
        both = await tunnel(proxy, f"secure.test:{port}", "other.test", f"other.test:{port}")
        assert both.startswith(b"HTTP/1.1 403") and b"does not match secure.test" in both


@run
async def test_plain_http_host_header_must_match_the_url(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream)) as (proxy, url):
        status, body = await fetch(proxy, url, f"http://plain.test:{upstream['http']}/",
                                   headers={"Host": "denied.test"})
        assert status == 403 and b"HTTP Host denied.test does not match plain.test" in body


# --- connections --------------------------------------------------------------------------------

@run
async def test_garbage_closes_only_its_own_connection(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream)) as (proxy, _):
        request = f"GET http://plain.test:{upstream['http']}/ HTTP/1.1\r\nHost: plain.test:{upstream['http']}\r\n\r\n"
        good_reader, good_writer = await proxy.open(SID)
        good_writer.write(request.encode())
        assert (await response(good_reader))[0].startswith(b"HTTP/1.1 200")
        bad_reader, bad_writer = await proxy.open(SID)
        bad_writer.write(b"\x00\xff NOT HTTP \x01\x02\r\n\r\n")
        assert b"400" in await bad_reader.read()  # an error, then EOF: the proxy closed it
        good_writer.write(request.encode())
        assert (await response(good_reader))[0].startswith(b"HTTP/1.1 200")
        good_writer.close()


@run
async def test_a_refused_request_with_a_large_body_is_cut_off_not_read(tmp_path, upstream, caplog):
    caplog.set_level(logging.INFO, logger="sandgate.egress")
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream)) as (proxy, _):
        small = b"x" * 1000
        reader, writer = await proxy.open(SID)
        writer.write(f"POST http://denied.test:{upstream['http']}/ HTTP/1.1\r\nHost: denied.test:{upstream['http']}\r\n"
                     f"Content-Length: {len(small)}\r\n\r\n".encode() + small)
        head, body = await response(reader)
        assert head.startswith(b"HTTP/1.1 403") and b"no allow rule matched" in body
        writer.close()
        # 1 GB announced, none of it sent: the proxy closes at once instead of waiting to hold it
        reader, writer = await proxy.open(SID)
        writer.write(f"POST http://denied.test:{upstream['http']}/ HTTP/1.1\r\nHost: denied.test:{upstream['http']}\r\n"
                     f"Content-Length: {1 << 30}\r\n\r\n".encode())
        with contextlib.suppress(ConnectionResetError):
            assert await reader.read() == b""
    assert any("POST denied.test" in r.getMessage() and "refused" in r.getMessage()
               and "killed" in r.getMessage() for r in caplog.records)


@run
async def test_a_connection_not_opened_by_the_gateway_gets_nothing(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream)) as (proxy, _):
        reader, writer = await asyncio.open_connection(*proxy._address)
        writer.write(f"GET http://plain.test:{upstream['http']}/ HTTP/1.1\r\nHost: plain.test\r\n\r\n".encode())
        with contextlib.suppress(ConnectionResetError):
            assert await reader.read() == b""


@run
async def test_a_sandbox_without_a_policy_is_refused(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream, policy=None) as (proxy, url):
        status, body = await fetch(proxy, url, f"http://plain.test:{upstream['http']}/")
        assert status == 403 and b"sandbox sb-1 has no egress policy" in body


# --- secrets ------------------------------------------------------------------------------------

@run
async def test_secret_header_goes_to_its_host_only_and_never_to_logs(tmp_path, upstream, caplog):
    caplog.set_level(logging.DEBUG)
    port = upstream["https"]
    secret = Secret(host="secure.test", header="X-Api-Key", value=SECRET)
    plain_secret = Secret(host="plain.test", header="X-Api-Key", value=SECRET)
    policy = policy_for(upstream, f"other.test:{port}")
    async with proxy_and_bridge(tmp_path, upstream, policy, [secret, plain_secret]) as (proxy, url):
        status, body = await fetch(proxy, url, f"https://secure.test:{port}/", headers={"X-Api-Key": "mine"})
        assert status == 200 and json.loads(body)["headers"]["X-Api-Key"] == SECRET  # replaced, not added
        status, body = await fetch(proxy, url, f"https://other.test:{port}/")
        assert status == 200 and "X-Api-Key" not in json.loads(body)["headers"]
        # over plain HTTP a credential would cross the network in clear text: not added
        status, body = await fetch(proxy, url, f"http://plain.test:{upstream['http']}/")
        assert status == 200 and "X-Api-Key" not in json.loads(body)["headers"]
    assert SECRET not in caplog.text
    assert "sandbox sb-1: GET secure.test" in caplog.text


@run
async def test_placeholders_are_swapped_for_their_host_only(tmp_path, upstream, caplog):
    caplog.set_level(logging.DEBUG)
    port = upstream["https"]
    secrets = [Secret(host="secure.test", value=SECRET, name="OPENAI_API_KEY")]
    phs = placeholders(secrets)
    ph = phs["OPENAI_API_KEY"]
    policy = policy_for(upstream, f"other.test:{port}")
    async with proxy_and_bridge(tmp_path, upstream, policy, secrets, phs) as (proxy, url):
        status, body = await fetch(proxy, url, f"https://secure.test:{port}/", headers={"Authorization": f"Bearer {ph}"})
        assert json.loads(body)["headers"]["Authorization"] == f"Bearer {SECRET}"
        status, body = await fetch(proxy, url, f"https://other.test:{port}/", headers={"Authorization": f"Bearer {ph}"})
        assert json.loads(body)["headers"]["Authorization"] == f"Bearer {ph}"
        status, body = await fetch(proxy, url, f"http://plain.test:{upstream['http']}/", headers={"X-K": ph})
        assert json.loads(body)["headers"]["X-K"] == ph
        # a refused request's 403 says nothing of the secret either
        status, body = await fetch(proxy, url, f"https://secure.test:{port}/",
                                   headers={"Authorization": f"Bearer {ph}", "Host": "other.test"})
        assert status == 403 and SECRET.encode() not in body
    assert SECRET not in caplog.text


@run
async def test_curl_and_requests_work_unchanged_through_it(tmp_path, upstream):
    port = upstream["https"]
    secrets = [Secret(host="secure.test", value=SECRET, name="OPENAI_API_KEY")]
    phs = placeholders(secrets)
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream), secrets, phs) as (proxy, url):
        ca = tmp_path / "sandbox-ca.pem"
        ca.write_bytes(proxy.ca_certificate_pem())
        curl = await asyncio.to_thread(subprocess.run, [
            "curl", "-sS", "--max-time", "20", "--proxy", url, "--cacert", str(ca),
            "-H", f"Authorization: Bearer {phs['OPENAI_API_KEY']}", f"https://secure.test:{port}/c"],
            capture_output=True, env={"PATH": "/usr/bin:/bin"}, check=True)
        assert json.loads(curl.stdout)["headers"]["Authorization"] == f"Bearer {SECRET}"
        refused = await asyncio.to_thread(subprocess.run, [
            "curl", "-sS", "--max-time", "20", "--proxy", url, f"http://denied.test:{upstream['http']}/"],
            capture_output=True, env={"PATH": "/usr/bin:/bin"})
        assert b"no allow rule matched denied.test" in refused.stdout
        r = await asyncio.to_thread(requests.get, f"https://secure.test:{port}/r", timeout=20, verify=str(ca),
                                    proxies={"https": url, "http": url})
        assert r.status_code == 200 and r.json()["path"] == "/r"


# --- CA, logging --------------------------------------------------------------------------------

@run
async def test_the_ca_is_made_once_under_the_home_key_private(tmp_path, upstream):
    async with proxy_and_bridge(tmp_path, upstream) as (proxy, _):
        pem = proxy.ca_certificate_pem()
    cert = x509.load_pem_x509_certificate(pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "Sandgate egress CA"
    assert (tmp_path / "egress" / "mitmproxy-ca.pem").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "egress").stat().st_mode & 0o777 == 0o700
    async with proxy_and_bridge(tmp_path, upstream) as (proxy, _):
        assert proxy.ca_certificate_pem() == pem


@run
async def test_every_request_is_logged_with_bytes_and_verdict(tmp_path, upstream, caplog):
    caplog.set_level(logging.INFO, logger="sandgate.egress")
    async with proxy_and_bridge(tmp_path, upstream, policy_for(upstream)) as (proxy, url):
        status, body = await fetch(proxy, url, f"http://plain.test:{upstream['http']}/x")
        await fetch(proxy, url, f"http://denied.test:{upstream['http']}/")
    lines = [r.getMessage() for r in caplog.records if r.name == "sandgate.egress" and "sandbox sb-1" in r.getMessage()]
    allowed = next(line for line in lines if "plain.test" in line)
    assert "allowed rule=" in allowed and "status=200" in allowed and f"down={len(body)}" in allowed
    refused = next(line for line in lines if "denied.test" in line)
    assert "refused" in refused and "no allow rule matched" in refused and "down=0" in refused
