"""Every import of the project's own modules names something that exists, the ones inside
functions too (a lazy import of a moved module fails only when its code first runs, which
for a bench or a recovery path can be long after the move)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"gateway": "sandgate", "bench": "sandgate_bench", "client": "sandgate_client",
            "guest-agent": None, "lab": None}
OURS = ("sandgate", "sandgate_bench", "sandgate_client", "sandgate_wire", "sandgate_lab")


def module_of(path: Path) -> list:
    """The dotted name of the package a file's relative imports start from."""
    root = path.relative_to(REPO).parts[0]
    parts = [PACKAGES[root], *path.relative_to(REPO / root).with_suffix("").parts]
    return parts[:-1]  # an __init__'s package is its directory, as is any module's


def unresolved(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if PACKAGES.get(path.relative_to(REPO).parts[0]) is None:
                continue
            base = module_of(path)
            base = base[:len(base) - (node.level - 1)]
            name = ".".join(base + ([node.module] if node.module else []))
        elif node.module and node.module.split(".")[0] in OURS:
            name = node.module
        else:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            yield f"{path.relative_to(REPO)}:{node.lineno}: {name}: {e}"
            continue
        for alias in node.names:
            if alias.name == "*" or hasattr(module, alias.name):
                continue
            try:
                importlib.import_module(f"{name}.{alias.name}")
            except ImportError:
                yield f"{path.relative_to(REPO)}:{node.lineno}: {name} has no {alias.name}"


def test_every_import_of_our_modules_resolves():
    files = [p for d in ("gateway", "bench", "client", "tests") for p in (REPO / d).rglob("*.py")]
    assert len(files) > 100
    found = [line for f in files for line in unresolved(f)]
    assert found == []


def test_the_check_sees_a_moved_module(tmp_path, monkeypatch):
    bad = REPO / "tests" / "unit" / "_moved_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        "def f():\n    from sandgate.state_chunks import manifest_keys\n" if self == bad else Path.read_bytes(self).decode()))
    assert [line.split(": ", 1)[0] for line in unresolved(bad)] == ["tests/unit/_moved_probe.py:2"]
