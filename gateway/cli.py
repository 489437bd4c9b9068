"""`sandgate`: serve | image build | doctor | bench."""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys

from . import __version__, faults, logformat, usercli
from . import config
from .config import CommandSettings, Settings


def cmd_serve(args) -> int:
    from sandgate_images import rootfs as images

    from .app import make_app, make_service, start_egress
    from .connections import BoundedHTTPServer, descriptor_headroom
    from .malloc import return_large_blocks
    from .core.culler import Culler
    from .core.fleet import Fleet
    from .core.fleetauth import FleetAuth
    from .drivers.base import RuntimeLease
    from .store.seal import SealError

    from . import trace
    from .workspace import WorkspaceError, choose_sandbox_uid

    settings = Settings.load(**config.flag_values(args, config.SETTINGS))
    faults.install(settings.fault)  # armed before the recovery, whose steps have points too
    trace.enable(settings.trace)
    try:
        choose_sandbox_uid(settings.sandbox_uid)  # checked now, not at the first sandbox
    except WorkspaceError as e:
        print(f"sandgate: invalid setting: {e}", file=sys.stderr)
        return 1
    if settings.redis_url and not settings.fleet_secret():
        # Without it a node would have to trust whatever the store says another node is, and anyone
        # who can write to the store could pose as one.
        print("sandgate: a fleet node (SANDGATE_REDIS_URL is set) needs the fleet's key: set SANDGATE_FLEET_KEY "
              "(or SANDGATE_FLEET_KEY_FILE) to the same secret of at least 32 characters on every node, e.g. "
              "`openssl rand -hex 32`; it authenticates the nodes to each other and seals secret values in Redis",
              file=sys.stderr)
        return 1
    generated = settings.token is None
    if settings.token == "":
        logging.getLogger("sandgate").warning("the token is empty: authentication is OFF")
    if generated:
        settings.token = secrets.token_urlsafe(24)
    logformat.add_secret(settings.token)  # redacted from every log line, whatever carries it
    if settings.default_driver == "gvisor" and not images.is_built(settings.home):
        try:
            images.build(settings.home)
        except RuntimeError as e:
            print(f"sandgate: cannot build the sandbox image: {e}", file=sys.stderr)
            return 1

    return_large_blocks()
    # One gateway per home: at start it reclaims whatever sandboxes and
    # workspaces are there, which would be another live gateway's.
    settings.home.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        settings.home.chmod(0o700)  # sandbox files, checkpoints and the session store are root's alone
    lock = open(settings.home / "gateway.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        print(f"sandgate: another gateway is running with home {settings.home} (set --home)", file=sys.stderr)
        return 1
    if settings.gateway_memory_mb:
        from .confine import ConfineError, confine

        try:
            confine(settings.gateway_memory_mb, settings.home)
        except ConfineError as e:
            print(f"sandgate: SANDGATE_GATEWAY_MEMORY_MB={settings.gateway_memory_mb}: {e}", file=sys.stderr)
            return 1

    async def run() -> None:
        # Renewed from before recover() on: the runtimes the last process left wait for this one.
        lease = RuntimeLease(settings.home, settings.lease_seconds)
        renewing = asyncio.ensure_future(lease.keep())
        try:
            service = make_service(settings, lease)
        except ValueError as e:
            raise SystemExit(f"sandgate: {e}") from None
        if faults.plan_error():  # a test's switch naming no fault point: said, not ignored
            raise SystemExit(f"sandgate: {faults.plan_error()}")
        app = make_app(settings, service)
        manager = service.manager
        proxy = await start_egress(settings, manager)
        try:
            await manager.store.reseal()  # the key checked; records from before sealing sealed now
        except ValueError as e:  # SealError
            raise SystemExit(f"sandgate: {e}") from None
        except Exception as e:  # the store itself: Redis unreachable, AUTH or TLS refused (never the password)
            from .store.redis import redact
            raise SystemExit(f"sandgate: cannot use the session store {redact(settings.redis_url) or 'sessions.db'}: "
                             f"{type(e).__name__}: {e}") from None
        try:
            await manager.recover()
        except SealError as e:  # a record whose sealed secret does not open: say which, start nothing
            raise SystemExit(f"sandgate: {e}") from None
        default = manager.specs.get(manager.specs.default).driver
        manager.pool.refill(default)  # other drivers warm up after their first sandbox starts
        culler = Culler(manager)
        cap, nofile = descriptor_headroom(settings.http_max_connections)
        server = BoundedHTTPServer(app, max_body_size=settings.max_message_mb << 20,
                                   idle_connection_timeout=settings.http_idle_timeout,
                                   body_timeout=settings.http_body_timeout, max_connections=cap,
                                   max_connections_per_client=settings.http_max_connections_per_client)
        logging.getLogger("sandgate").info(
            "connections: at most %d (%d per client address) of %d descriptors; headers within %g s, bodies %g s",
            cap, settings.http_max_connections_per_client, nofile, settings.http_idle_timeout,
            settings.http_body_timeout)
        try:
            server.listen(settings.port, settings.ip)
        except OSError as e:
            raise SystemExit(f"sandgate: cannot listen on {settings.ip}:{settings.port}: {e}") from None
        culler.start()
        port = next(iter(server._sockets.values())).getsockname()[1]
        url = f"http://{settings.ip}:{port}"
        fleet = None
        if settings.redis_url:  # one node of a fleet: beat, and forward what other nodes hold
            fleet = Fleet(manager, settings.node_url or url, FleetAuth(settings.fleet_secret(), settings.node_id))
            await fleet.beat()
            fleet.start()
            app.settings["fleet"] = fleet
        print(f"Sandgate {__version__} serving at {url} (drivers: {', '.join(manager.drivers) or 'none'})", flush=True)
        if generated:
            print(f"Token (generated): {settings.token}", flush=True)
        print(f"  jupyter lab --gateway-url={url} --GatewayClient.auth_token=<token>", flush=True)
        stop = asyncio.Event()
        app.settings["shutdown"] = stop.set
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        app.settings["stopping"] = True  # /healthz: 503 on connections still open while it stops
        log = logging.getLogger("sandgate")
        server.stop()
        await culler.stop()
        if settings.keep_sandboxes:
            log.info("shutting down: %d sandboxes are kept for the next start", len(manager.sandboxes))
            await manager.suspend_all()
        else:
            log.info("shutting down: deleting %d sandboxes", len(manager.sandboxes))
            await manager.delete_all()
        if fleet:  # beating until every sandbox is paused: another node takes none over while it still runs here
            await fleet.stop()
        renewing.cancel()
        await proxy.stop()
        await manager.store.close()
        log.info("gateway stopped")

    asyncio.run(run())
    return 0


def cmd_image(args) -> int:
    from sandgate_images import rootfs as images

    settings = Settings.load(home=args.home)
    if args.action == "runsc":
        from sandgate_images import runsc

        try:
            path = runsc.fetch(settings.home, progress=lambda m: print(m, file=sys.stderr, flush=True))
        except runsc.FetchError as e:
            print(f"sandgate: {e}", file=sys.stderr)
            return 1
        print(f"runsc {(path.parent / 'VERSION').read_text().strip()} at {path}; use it with:\n"
              f"export SANDGATE_RUNSC={path}")
        return 0
    if args.action == "build":
        try:
            path = images.build(settings.home)
            if args.vm:
                from sandgate_images import vm

                print(vm.build(settings.home))
        except RuntimeError as e:
            print(f"sandgate: image build failed: {e}", file=sys.stderr)
            return 1
        print(path)
    else:
        path = images.image_dir(settings.home)
        print(json.dumps({"image": path.name, "path": str(path), "built": images.is_built(settings.home)}))
    return 0


def kvm_usable(timeout: float = 8.0) -> tuple[bool, str]:
    """Try KVM for real: /dev/kvm can exist and still hang every guest (nested PVM)."""
    if not os.path.exists("/dev/kvm"):
        return False, "no /dev/kvm"
    qemu = shutil.which("qemu-system-x86_64")
    if not qemu:
        return False, "/dev/kvm present; qemu-system-x86_64 not installed to try it"
    try:
        p = subprocess.run([qemu, "-accel", "kvm", "-M", "microvm", "-nodefaults", "-no-user-config",
                            "-display", "none", "-S", "-qmp", "stdio"], input=b'{"execute":"qmp_capabilities"}\n'
                           b'{"execute":"quit"}\n', capture_output=True, timeout=timeout)
        if p.returncode == 0:
            # Opening is not booting: on nested PVM hosts a stock guest kernel hangs.
            return None, "/dev/kvm opens and qemu accepts -accel kvm; whether a guest boots is not tried yet"
        return False, "qemu cannot use /dev/kvm: " + p.stderr.decode(errors="replace").strip().splitlines()[-1:][0]
    except subprocess.TimeoutExpired:
        return False, f"qemu with -accel kvm did not answer within {timeout:g} s"
    except IndexError:
        return False, "qemu with -accel kvm failed"


def cmd_doctor(args) -> int:
    from sandgate_images import rootfs as images

    from .drivers import DRIVERS

    settings = Settings.load(home=args.home)
    rows = []
    for name, cls in DRIVERS.items():
        ok, why = cls.probe(settings)
        rows.append((f"driver {name}", ok, why))
    qemu = shutil.which("qemu-system-x86_64")
    rows.append(("qemu", bool(qemu), qemu or "qemu-system-x86_64 not found (apt-get install qemu-system-x86)"))
    from sandgate_images import vm

    from .drivers.qemu import accel

    if vm.is_built(settings.home) and qemu:
        mode, why = accel(settings.home, vm.vm_dir(settings.home), settings.qemu_accel)  # a trial boot, remembered
        rows.append(("kvm", mode == "kvm", f"qemu uses {mode}: {why}"))
    else:
        ok, why = kvm_usable()
        rows.append(("kvm", ok, why + ("; build the VM image (`sandgate image build --vm`) for a trial boot"
                                        if ok is None else "")))
    vsock = os.path.exists("/dev/vhost-vsock")
    rows.append(("vsock", vsock, "/dev/vhost-vsock present" if vsock else "no /dev/vhost-vsock: VMs use virtio-serial"))
    mm = shutil.which("mmdebstrap")
    rows.append(("mmdebstrap", bool(mm), mm or "not found (apt-get install mmdebstrap)"))
    rows.append(("image", images.is_built(settings.home), str(images.image_dir(settings.home))))
    rows.append(("cgroups", True, "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1"))
    rows.append(("root", os.geteuid() == 0, "running as root" if os.geteuid() == 0 else "not root: runsc --rootless"))
    if args.json:
        print(json.dumps({r[0]: {"ok": r[1], "detail": r[2]} for r in rows}, indent=1))
    else:
        for what, ok, detail in rows:
            print(f"{'?  ' if ok is None else 'ok ' if ok else 'no '} {what:<15} {detail}")
    return 0


def cmd_e2b_key(args) -> int:
    from .api.e2b import e2b_api_key

    if not args.token:
        print("sandgate e2b-key: give --token or set SANDGATE_TOKEN", file=sys.stderr)
        return 1
    print(e2b_api_key(args.token))
    return 0


def cmd_drain(args) -> int:
    """Hand this node's sandboxes off to the rest of the fleet, with a line per sandbox, then it stops."""
    import urllib.error
    import urllib.request

    url = args.url.rstrip("/") + "/api/fleet/drain"
    req = urllib.request.Request(url, data=b"{}", method="POST",
                                 headers={"Authorization": f"token {args.token or ''}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            for line in r:
                step = json.loads(line)
                if step.get("drained"):
                    print(f"drained: {step['moved']} moved, {step['failed']} failed; the gateway stops")
                    return 1 if step["failed"] else 0
                what = f"at checkpoint {step['checkpoint']}" if step.get("checkpoint") else step.get("error", "dead: as it was")
                print(f"{step['done']}/{step['total']}: sandbox {step['sandbox']} {what}", flush=True)
    except urllib.error.HTTPError as e:
        print(f"sandgate drain: {e.code}: {json.loads(e.read() or b'{}').get('message', e.reason)}", file=sys.stderr)
    except (OSError, ValueError) as e:
        print(f"sandgate drain: {url}: {e}", file=sys.stderr)
    return 1


def cmd_bench(args) -> int:
    if args.chaos:
        from sandgate_bench.chaos import run as run_chaos

        return run_chaos(args)
    if args.hostile:
        from sandgate_bench.hostile import run as run_hostile

        return run_hostile(args)
    if args.load is not None:
        from sandgate_bench.load import run as run_load

        return run_load(args)
    if args.fleet:
        from sandgate_bench.fleet import run as run_fleet

        return run_fleet(args)
    if args.egress:
        from sandgate_bench.egress import run as run_egress

        return run_egress(args)
    if args.restart:
        from sandgate_bench.restart import run as run_restart

        return run_restart(args)
    if args.e2b:
        from sandgate_bench.e2b import run as run_e2b

        return run_e2b(args)
    if args.density:
        from sandgate_bench.density import run as run_density

        return run_density(args)
    if args.drivers:
        from sandgate_bench.drivers import run as run_drivers

        return run_drivers(args)
    from sandgate_bench.kernels import run

    return run(args)


def cmd_tools(args) -> int:
    from sandgate_client.tools import tool_definitions

    print(json.dumps(tool_definitions(args.format), indent=2))
    return 0


def cmd_mcp(args) -> int:
    from sandgate_client.mcp_server import main as mcp_main

    return mcp_main(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sandgate", description="A Jupyter kernel gateway whose kernels run in sandboxes.")
    ap.add_argument("--version", action="version", version=__version__)
    config.add_flags(ap, [d for d in config.COMMAND if d.name in ("log_level", "log_format")])
    env = CommandSettings.load()  # the user commands' --url and --token default to its url and token
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the gateway (each flag also reads its variable; the flag wins)")
    config.add_flags(s, config.SETTINGS)
    s.set_defaults(fn=cmd_serve)

    i = sub.add_parser("image", help="build or show the sandbox image; `runsc` fetches Debian 13's runsc, "
                                     "which checkpoints in place (docs/checkpoints.md)")
    i.add_argument("action", choices=["build", "show", "runsc"])
    i.add_argument("--vm", action="store_true", help="also build the microVM kernel, initramfs and root disk")
    i.add_argument("--home")
    i.set_defaults(fn=cmd_image)

    usercli.add_commands(sub, env.url, env.token)

    ek = sub.add_parser("e2b-key", help="a Sandgate token as an E2B_API_KEY (e2b_<hex>, the shape e2b SDKs check)")
    ek.add_argument("--token", default=env.token, help="the token (SANDGATE_TOKEN)")
    ek.set_defaults(fn=cmd_e2b_key)

    dr = sub.add_parser("drain", help="move this node's sandboxes to the rest of the fleet, then stop it")
    dr.add_argument("--url", default=env.url,
                    help="the node to drain (SANDGATE_URL)")
    dr.add_argument("--token", default=env.token, help="its admin token (SANDGATE_TOKEN)")
    dr.set_defaults(fn=cmd_drain)

    d = sub.add_parser("doctor", help="what this host supports")
    d.add_argument("--json", action="store_true")
    d.add_argument("--home")
    d.set_defaults(fn=cmd_doctor)

    b = sub.add_parser("bench", help="benchmark against jupyter-client and jupyter-kernel-gateway")
    b.add_argument("--runs", type=int, default=200, help="execute round trips per target")
    b.add_argument("--output", default="bench.json")
    b.add_argument("--drivers", help="compare sandbox drivers instead, e.g. gvisor,qemu (boot, memory, "
                                     "checkpoint, restore, pause, resume)")
    b.add_argument("--runsc", help="with --drivers gvisor: compare runsc binaries, one gateway each, e.g. "
                                   "runsc,trixie (trixie: the one `sandgate image runsc` fetches)")
    b.add_argument("--density", type=int, metavar="N",
                   help="host memory for N idle sandboxes measured together instead, beside N idle local "
                        "ipykernels; then all paused to disk (processes and disk left)")
    b.add_argument("--restart", type=int, metavar="N",
                   help="a gateway restart with N sandboxes instead: SIGTERM to exit, start to each one's first "
                        "result, the 1+1 round trip before and after")
    b.add_argument("--e2b", type=int, metavar="N",
                   help="the E2B adapter instead: N rounds of the e2b SDK's create -> run_code('1+1') -> kill beside "
                        "the same through the native sandbox API, and their ratio (needs the e2b SDKs)")
    b.add_argument("--egress", action="store_true",
                   help="the egress proxy instead: HTTP and HTTPS from a gVisor sandbox through it, and from the "
                        "host through it and direct, to servers on 127.0.0.3/.4 (latency, requests/s, MB/s at 1 "
                        "and 16 connections); the 1+1 round trip with egress on and off")
    b.add_argument("--egress-seconds", type=float, default=2.0, metavar="S",
                   help="with --egress: seconds per measurement (default 2)")
    b.add_argument("--load", type=int, nargs="?", const=50, metavar="N",
                   help="a load run instead: N sandboxes (default 50) running cells at once for --load-seconds, "
                        "beside N local ipykernels behind Kernel Gateway: p50/p99 round trip, cells/s, gateway CPU "
                        "per message, and lost, duplicated or out-of-order messages (which fail the run)")
    b.add_argument("--load-seconds", type=float, default=60.0, metavar="S",
                   help="with --load: length of each side's load phase (default 60)")
    b.add_argument("--fleet", action="store_true",
                   help="a fleet instead: redis-server and three nodes on loopback; the 1+1 round trip through a "
                        "second node vs direct, routing lookups/s, a load run with p50/p99 and lost messages, "
                        "and kill -9 of a node to its sandboxes answering elsewhere (--runs rounds)")
    b.add_argument("--fleet-kernels", type=int, default=30, metavar="N",
                   help="with --fleet: kernels in the load run (default 30)")
    b.add_argument("--fleet-seconds", type=float, default=30.0, metavar="S",
                   help="with --fleet: length of the load run (default 30)")
    b.add_argument("--fleet-cells", type=int, default=1000, metavar="N",
                   help="with --fleet: at most N cells per kernel in the load run (default 1000)")
    b.add_argument("--fleet-lookup-seconds", type=float, default=3.0, metavar="S",
                   help="with --fleet: seconds per routing-lookup measurement (default 3)")
    b.add_argument("--fleet-death", type=int, default=3, metavar="N",
                   help="with --fleet: sandboxes on the node that is killed (default 3)")
    b.add_argument("--hostile", action="store_true",
                   help="the hostile soak: every hostile-load attack at once (gzip bombs, egress head floods, "
                        "half-open connections, bogus tokens, unread downloads and websockets, huge execute "
                        "bodies) while ordinary sandboxes run cells, against a quiet run of the same")
    b.add_argument("--hostile-seconds", type=float, default=120.0, metavar="S",
                   help="with --hostile: seconds of each phase, quiet and hostile (default 120)")
    b.add_argument("--hostile-sandboxes", type=int, default=10, metavar="N",
                   help="with --hostile: ordinary sandboxes running cells (default 10)")
    b.add_argument("--hostile-attacks", metavar="A,B",
                   help="with --hostile: only these attacks (gzip, heads, half_open, tokens, downloads, websockets, "
                        "execute; default all), to see what each costs")
    b.add_argument("--chaos", action="store_true",
                   help="the chaos soak: clients doing random operations while gateways, shims, runsc, Redis and "
                        "nodes are killed at random; reports operations, faults, invariant violations and recovery")
    b.add_argument("--minutes", type=float, default=5.0, metavar="M", help="with --chaos: how long (default 5)")
    b.add_argument("--seed", type=int, metavar="S", help="with --chaos: the seed (default: a random one, printed)")
    b.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="with --chaos: 1 gateway, or a fleet of 2 or 3 sharing a redis-server (default 1)")
    b.add_argument("--chaos-clients", type=int, default=3, metavar="N",
                   help="with --chaos: clients, each with a sandbox or two (default 3)")
    b.add_argument("--chaos-fault-interval", type=float, default=20.0, metavar="S",
                   help="with --chaos: mean seconds between one fault's recovery and the next fault (default 20)")
    b.add_argument("--chaos-disk-mb", type=int, default=4096, metavar="MB",
                   help="with --chaos: each node's home is an ext4 file system of this size on a loop file (root), "
                        "which the full-disk fault fills; 0: homes on the host's disk and no full-disk fault "
                        "(default 4096)")
    b.add_argument("--trace", action="store_true",
                   help="run the Sandgate gateways with SANDGATE_TRACE=1 and report where sandgate-gvisor's 1+1 "
                        "round trip goes (gateway, agent, kernel; median ms per message)")
    b.add_argument("--home")
    b.set_defaults(fn=cmd_bench)

    t = sub.add_parser("tools", help="print the agent tool definitions (JSON schema) for a tool-calling API")
    t.add_argument("--format", default="openai", choices=["openai", "openai-responses", "anthropic", "mcp"])
    t.set_defaults(fn=cmd_tools)

    m = sub.add_parser("mcp", help="run an MCP server whose tools run code in a sandbox of a gateway (docs/mcp.md)")
    m.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    m.add_argument("--url", default=env.url, help="the gateway (SANDGATE_URL)")
    m.add_argument("--token", default=env.token, help="its token (SANDGATE_TOKEN)")
    m.add_argument("--driver", help="sandbox driver for the sessions' sandboxes (the gateway's default)")
    m.add_argument("--ttl", type=float, help="seconds a session's sandbox may live")
    m.add_argument("--host", default="127.0.0.1", help="HTTP transport: address to listen on")
    m.add_argument("--port", type=int, default=8765, help="HTTP transport: port")
    m.add_argument("--path", default="/mcp", help="HTTP transport: the endpoint's path")
    m.set_defaults(fn=cmd_mcp)

    args = ap.parse_args(argv)
    given = CommandSettings.load(log_level=args.log_level, log_format=args.log_format)
    logformat.setup(given.log_level, given.log_format)
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
