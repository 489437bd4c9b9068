"""`sandgate ls`, `sandgate tree ID` and `sandgate exec ID CODE`: a running gateway, for people at a
terminal, through the SDK (sandgate_client). --url and --token default to SANDGATE_URL and
SANDGATE_TOKEN. Errors are one line and exit status 1, never a traceback."""

from __future__ import annotations

import datetime
import sys
from typing import Dict, List


def _age(iso: str) -> str:
    try:
        then = datetime.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return "?"
    s = int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h" if s < 172800 else f"{s // 86400}d"


def table(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _http(args):
    from sandgate_client import _api as api
    from sandgate_client.sandbox import HTTP

    return HTTP(args.url, args.token), api


def cmd_ls(args) -> int:
    http, api = _http(args)
    sandboxes = http.call(api.list_())
    rows = [["ID", "STATE", "AGE", "MEMORY", "CHECKPOINTS", "DRIVER", "LABELS"]]
    for info in sorted(sandboxes, key=lambda i: i.created):
        count = len(http.call(api.checkpoints(info.id)))
        state = info.state + (f" ({info.execution_state})" if info.state == "running" else "")
        rows.append([info.id, state, _age(info.created), f"{info.limits.get('memory_mb', '?')} MB", str(count),
                     info.driver, ",".join(f"{k}={v}" for k, v in info.labels.items())])
    print(table(rows) if sandboxes else "no sandboxes")
    return 0


def cmd_tree(args) -> int:
    """The sandbox, its checkpoints in their line, and every fork from them, recursively."""
    http, api = _http(args)
    nodes = http.call(api.tree())["nodes"]
    cps = {n["id"]: n for n in nodes if n["kind"] == "checkpoint"}
    sbs = {n["id"]: n for n in nodes if n["kind"] == "sandbox"}
    if args.id not in sbs:
        print(f"sandgate tree: no sandbox {args.id}", file=sys.stderr)
        return 1
    children: Dict[str, list] = {}
    for cp in cps.values():  # under the previous checkpoint of its own sandbox, else under that sandbox
        parent = cps.get(cp.get("parent") or "")
        up = cp["parent"] if parent and parent["sandbox"] == cp["sandbox"] else cp["sandbox"]
        children.setdefault(up, []).append(cp)
    for sb in sbs.values():  # a fork, under the checkpoint it started from
        if sb.get("parent"):
            children.setdefault(sb["parent"], []).append(sb)

    def label(n: dict) -> str:
        if n["kind"] == "sandbox":
            return f"sandbox {n['id']} ({n['state']})"
        name = f" \"{n['name']}\"" if n.get("name") else ""
        when = datetime.datetime.fromtimestamp(n["created"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        return f"checkpoint {n['id']}{name} {when}"

    lines = [label(sbs[args.id])]

    def walk(key: str, prefix: str) -> None:
        kids = sorted(children.get(key, []), key=lambda n: n.get("created") or 0)
        for i, n in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(prefix + ("└─ " if last else "├─ ") + label(n))
            walk(n["id"], prefix + ("   " if last else "│  "))

    walk(args.id, "")
    print("\n".join(lines))
    return 0


def cmd_exec(args) -> int:
    """Run CODE in sandbox ID, its output streamed as it comes; exit 1 if the cell raised."""
    from sandgate_client import Sandbox

    sb = Sandbox.connect(args.id, args.url, args.token)
    code = sys.stdin.read() if args.code == "-" else args.code
    ex = sb.run_code(code, timeout=args.timeout,
                     on_stdout=lambda t: (sys.stdout.write(t), sys.stdout.flush()),
                     on_stderr=lambda t: (sys.stderr.write(t), sys.stderr.flush()))
    for r in ex.results:
        if r.is_main_result and r.text is not None:
            print(r.text)
    if ex.error:
        print(ex.error.traceback_text or f"{ex.error.ename}: {ex.error.evalue}", file=sys.stderr)
        return 1
    return 0


def run(fn, args) -> int:
    from sandgate_client import SandgateError

    try:
        return fn(args)
    except SandgateError as e:
        print(f"sandgate {args.cmd}: {e}", file=sys.stderr)
        return 1


def add_commands(sub, env_url: str, env_token) -> None:
    for name, fn, helptext in (("ls", cmd_ls, "list the gateway's sandboxes as a table"),
                               ("tree", cmd_tree, "a sandbox's checkpoints and forks, as a tree"),
                               ("exec", cmd_exec, "run code in a sandbox, its output streamed")):
        p = sub.add_parser(name, help=helptext)
        if name in ("tree", "exec"):
            p.add_argument("id", help="the sandbox")
        if name == "exec":
            p.add_argument("code", help="the code to run; - reads it from standard input")
            p.add_argument("--timeout", type=float, default=600, help="seconds before the cell is interrupted")
        p.add_argument("--url", default=env_url, help="the gateway (SANDGATE_URL)")
        p.add_argument("--token", default=env_token, help="its token (SANDGATE_TOKEN)")
        p.set_defaults(fn=lambda args, fn=fn: run(fn, args))
