"""The agent tool definitions (client/tools.py): valid JSON Schema in every format, the
`sandgate tools` command, and the dispatcher run_tool against a real sandbox."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import jsonschema
import pytest

from conftest import Gateway
from sandgate_client import NotFound, Sandbox
from sandgate_client.tools import TOOLS, ToolSession, input_schema, run_tool, tool_definitions

NAMES = ["execute_code", "read_file", "write_file", "list_files", "checkpoint", "fork", "restore"]
VALID = {"execute_code": {"code": "1+1"}, "read_file": {"path": "a.txt"}, "write_file": {"path": "a", "content": "x"},
         "list_files": {}, "checkpoint": {"name": "n"}, "fork": {}, "restore": {"checkpoint": "abc"}}
INVALID = {"execute_code": {}, "read_file": {"path": 3}, "write_file": {"path": "a"},
           "list_files": {"nope": 1}, "checkpoint": {"name": 5}, "fork": {"checkpoint": 1}, "restore": {}}


def schemas(fmt: str) -> dict:
    defs = tool_definitions(fmt)
    if fmt == "openai":
        assert all(d["type"] == "function" and set(d["function"]) == {"name", "description", "parameters"}
                   for d in defs)
        return {d["function"]["name"]: d["function"]["parameters"] for d in defs}
    if fmt == "anthropic":
        assert all(set(d) == {"name", "description", "input_schema"} for d in defs)
        return {d["name"]: d["input_schema"] for d in defs}
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["openai", "anthropic"])
def test_definitions_are_valid_json_schema(fmt):
    by_name = schemas(fmt)
    assert list(by_name) == NAMES
    for name, schema in by_name.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert all(p.get("description") for p in schema["properties"].values())
        jsonschema.validate(VALID[name], schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(INVALID[name], schema)
    # The same schema in every format: defined once.
    assert by_name == {n: input_schema(n) for n in TOOLS}


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "openai-responses", "mcp"])
def test_cli_prints_them(fmt):
    out = subprocess.run([sys.executable, "-m", "sandgate.cli", "tools", "--format", fmt], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert json.loads(out) == tool_definitions(fmt)


def test_cli_refuses_an_unknown_format():
    r = subprocess.run([sys.executable, "-m", "sandgate.cli", "tools", "--format", "gemini"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_bad_calls_are_tool_errors_without_a_sandbox():
    made = []
    session = ToolSession(create=lambda: made.append(1))  # must never be called
    for name, args in [("execute_code", {}), ("execute_code", "{not json"), ("read_file", {"path": ""}),
                       ("write_file", {"path": "a", "content": "%%%", "encoding": "base64", "x": 1}),
                       ("nope", {}), ("execute_code", ["1+1"]), ("execute_code", {"code": "1", "timeout": -1})]:
        r = run_tool(session, name, args)
        assert r.is_error and r.text, (name, args)
    assert "unknown tool 'nope'" in run_tool(session, "nope", {}).text
    assert "code: Field required" in run_tool(session, "execute_code", {}).text
    assert made == []


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("gw"), env={"SANDGATE_MAX_KERNELS": "5"})
    yield g
    g.stop()


def test_dispatcher_against_a_real_sandbox(gw):
    session = ToolSession(create=lambda: Sandbox.create(gw.url, gw.token), url=gw.url, token=gw.token)
    try:
        r = run_tool(session, "execute_code", json.dumps({"code": "x = 20\nprint('hi')\nx + 22"}))
        assert not r.is_error and r.data["result"] == "42" and r.data["stdout"] == "hi\n"
        assert "result:\n42" in r.text and "stdout:\nhi" in r.text
        first = session.current.id

        r = run_tool(session, "execute_code", {"code": "1/0"})
        assert r.is_error and r.data["error"]["ename"] == "ZeroDivisionError" and "ZeroDivisionError" in r.text

        r = run_tool(session, "execute_code", {"code": "import time; time.sleep(30)", "timeout": 1})
        assert r.is_error and r.data["status"] == "timeout"

        r = run_tool(session, "execute_code", {"code": (
            "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n%matplotlib inline\n"
            "plt.plot([3, 1, 2]); plt.show()")})
        images = [c for c in r.content if c["type"] == "image"]
        assert not r.is_error and len(images) == 1 and images[0]["mime_type"] == "image/png"
        assert base64.b64decode(images[0]["data"]).startswith(b"\x89PNG")
        anthropic = r.to_anthropic("toolu_1")
        assert anthropic["content"][0]["type"] == "image" and anthropic["content"][0]["source"]["type"] == "base64"

        assert not run_tool(session, "write_file", {"path": "d/notes.txt", "content": "hello file"}).is_error
        assert run_tool(session, "read_file", {"path": "d/notes.txt"}).data["content"] == "hello file"
        png = bytes([0x89, 0x50, 0x4E, 0x47, 0, 255, 254])
        run_tool(session, "write_file", {"path": "d/raw.bin", "content": base64.b64encode(png).decode(),
                                         "encoding": "base64"})
        r = run_tool(session, "read_file", {"path": "d/raw.bin"})
        assert r.data["encoding"] == "base64" and base64.b64decode(r.data["content"]) == png
        r = run_tool(session, "list_files", {"path": "d"})
        assert [e["name"] for e in r.data["entries"]] == ["notes.txt", "raw.bin"]
        r = run_tool(session, "read_file", {"path": "missing.txt"})
        assert r.is_error and r.data["kind"] == "NotFound"

        cp = run_tool(session, "checkpoint", {"name": "x is 20"}).data["checkpoint"]
        run_tool(session, "execute_code", {"code": "x = 99"})
        r = run_tool(session, "fork", {"checkpoint": cp})
        assert not r.is_error and session.current.id == r.data["sandbox_id"] != first
        assert run_tool(session, "execute_code", {"code": "x"}).data["result"] == "20"
        r = run_tool(session, "restore", {"checkpoint": cp})
        assert not r.is_error and session.current.id == r.data["sandbox_id"]
        assert run_tool(session, "execute_code", {"code": "x + 1"}).data["result"] == "21"
        assert run_tool(session, "restore", {"checkpoint": "no-such"}).is_error
        owned = [sb.id for sb in session.sandboxes]
        assert len(owned) == 3 and owned[0] == first
    finally:
        gone = session.close()
    assert sorted(gone) == sorted(owned)
    live = {s.id for s in Sandbox.list(gw.url, gw.token)}
    assert not live & set(owned)


def test_dispatcher_on_a_bare_sandbox(gw):
    with Sandbox.create(gw.url, gw.token) as sb:
        r = run_tool(sb, "execute_code", {"code": "'bare'"})
        assert r.data["result"] == "'bare'"
        r = run_tool(sb, "fork", {})
        child = Sandbox.connect(r.data["sandbox_id"], gw.url, gw.token)
        with child:
            assert child.run_code("'bare'").text == "'bare'"
    with pytest.raises(NotFound):
        Sandbox.connect(child.id, gw.url, gw.token)
