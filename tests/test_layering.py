"""What imports what: the gateway (sandgate) imports neither the SDK (sandgate_client) nor the bench
(sandgate_bench) when its modules load, the SDK does not import the gateway, and what both share is
sandgate_wire; no import cycle between the gateway's own modules."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import sandgate

GATEWAY = Path(sandgate.__file__).parent


def loaded_after(code: str) -> set:
    """Top-level packages a fresh interpreter has loaded after running code."""
    probe = code + "\nimport json, sys; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def gateway_modules() -> dict:
    """Every module of the gateway package: dotted name -> its file."""
    mods = {}
    for path in GATEWAY.rglob("*.py"):
        parts = ["sandgate", *path.relative_to(GATEWAY).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def test_the_gateway_imports_neither_the_sdk_nor_the_bench():
    names = sorted(gateway_modules())
    loaded = loaded_after("import importlib\n" + "\n".join(f"importlib.import_module({n!r})" for n in names))
    assert "sandgate" in loaded and "sandgate_wire" in loaded
    assert not loaded & {"sandgate_client", "sandgate_bench"}


def test_the_sdk_does_not_import_the_gateway():
    loaded = loaded_after("import sandgate_client, sandgate_client.kernel, sandgate_client.aio, "
                          "sandgate_client.tools, sandgate_client.mcp_server")
    assert "sandgate_client" in loaded and "sandgate_wire" in loaded
    assert not loaded & {"sandgate", "sandgate_bench"}


def module_level_imports(name: str, path: Path, known: set) -> set:
    """The gateway modules `name` imports as it loads (its body, not functions; not under
    TYPE_CHECKING), each with the packages above it, which Python imports first."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.dump(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)  # `from . import x`: a module x

    visit(ast.parse(path.read_text()).body)
    with_parents = set()
    for dep in found:
        parts = dep.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {d for d in with_parents if d in known and d != name and not name.startswith(d + ".")}


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle_between_gateway_modules():
    mods = gateway_modules()
    graph = {name: module_level_imports(name, path, set(mods)) for name, path in mods.items()}
    assert graph["sandgate.core.sandbox"] >= {"sandgate.core.messages", "sandgate.core.states"}  # the parser sees imports
    assert cycles(graph) == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
