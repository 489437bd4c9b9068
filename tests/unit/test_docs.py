"""The docs say what the code does: the lifecycle table in docs/architecture.md
is the one core/states.py defines, and docs/operations.md names every setting."""

from __future__ import annotations

import re
from pathlib import Path

from sandgate.config import Settings
from sandgate.core.states import table_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_states_table_is_the_transition_table():
    text = (DOCS / "architecture.md").read_text()
    found = re.search(r"^<!-- states table -->\n(.*?)\n<!-- /states table -->$", text, re.S | re.M)
    assert found, "docs/architecture.md has no <!-- states table --> ... <!-- /states table --> block"
    assert found.group(1).strip() == table_markdown(), (
        "docs/architecture.md's states table differs from core/states.py; paste the output of\n"
        "python -c 'from sandgate.core.states import table_markdown; print(table_markdown())'")


def test_operations_names_every_setting():
    text = (DOCS / "operations.md").read_text()
    variables = set(Settings.ENV.values()) | set(Settings.LIMIT_ENV.values())
    missing = sorted(v for v in variables if f"`{v}`" not in text)
    assert not missing, f"docs/operations.md does not mention {missing}"
