"""The REST handlers are a thin layer over the service (core/service.py): they
never reach into the manager, its store, its drivers or its sandboxes table.
Checked on the source, so a new handler that does is caught without a gateway."""

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "gateway" / "api"


def reaches_into_manager(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "manager":
            yield f"{path.name}:{node.lineno}"


def test_handlers_call_only_the_service():
    modules = sorted(API.glob("*.py"))
    assert len(modules) > 5, f"no API modules found under {API}"
    found = [where for m in modules for where in reaches_into_manager(m)]
    assert found == [], f"API handlers reaching into the manager (use a SandboxService method): {found}"


def test_the_check_sees_a_reach(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self):\n    return self.service.manager.store\n")
    assert list(reaches_into_manager(bad)) == ["bad.py:2"]
