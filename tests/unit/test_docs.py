"""The docs say what the code does: the lifecycle table in docs/architecture.md
is the one core/states.py defines, and docs/operations.md's settings tables are the ones
gateway/config.py declares."""

from __future__ import annotations

import re
from pathlib import Path

from sandgate import config
from sandgate.core.states import table_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_states_table_is_the_transition_table():
    text = (DOCS / "architecture.md").read_text()
    found = re.search(r"^<!-- states table -->\n(.*?)\n<!-- /states table -->$", text, re.S | re.M)
    assert found, "docs/architecture.md has no <!-- states table --> ... <!-- /states table --> block"
    assert found.group(1).strip() == table_markdown(), (
        "docs/architecture.md's states table differs from core/states.py; paste the output of\n"
        "python -c 'from sandgate.core.states import table_markdown; print(table_markdown())'")


def test_the_settings_tables_are_the_declared_settings():
    text = (DOCS / "operations.md").read_text()
    start, end = text.find(config.BEGIN), text.find(config.END)
    assert 0 <= start < end, f"docs/operations.md has no {config.BEGIN} ... {config.END} block"
    assert text[start:end + len(config.END)] == config.markdown(), (
        "docs/operations.md's settings tables differ from gateway/config.py; write them with\n"
        "python -m sandgate.config docs/operations.md")
    for variable in [*config.Settings.ENV.values(), *config.Settings.LIMIT_ENV.values()]:
        assert f"| `{variable}` |" in text
