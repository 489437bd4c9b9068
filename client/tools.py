"""Tools for LLM agents, defined once: pydantic models give the JSON schemas for the
OpenAI and Anthropic tool formats (``sandgate tools --format openai|anthropic``) and
for the MCP server; ``run_tool`` is the dispatcher a framework calls with the model's
tool call. A tool's failure is a result with ``is_error`` set, never an exception."""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional, Type, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import NotFound, SandgateError
from .models import Execution, SandboxInfo
from .sandbox import Sandbox

MAX_TEXT = 100_000  # characters of output or file text a tool result carries (the rest is cut, and says so)
MAX_FILE = 10 << 20  # bytes read_file returns


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExecuteCode(_Args):
    """Run Python code in the sandbox's Jupyter kernel (IPython: `!cmd` and `%magics` work). State
    (variables, imports, files) persists between calls. Returns stdout, stderr, the value of the last
    expression, rich outputs (images come back as images) and any error with its traceback."""

    code: str = Field(description="Python source to run, as one notebook cell")
    timeout: float = Field(60, gt=0, le=3600, description="seconds before the cell is interrupted")


class ReadFile(_Args):
    """Read a file from the sandbox's workspace (its working directory). Text comes back as text;
    binary content as base64."""

    path: str = Field(min_length=1, description="path relative to the workspace, e.g. data/out.csv")


class WriteFile(_Args):
    """Write a file into the sandbox's workspace, creating parent directories; replaces an existing file."""

    path: str = Field(min_length=1, description="path relative to the workspace")
    content: str = Field(description="the file's content")
    encoding: Literal["utf-8", "base64"] = Field("utf-8", description="how content is encoded")


class ListFiles(_Args):
    """List a directory of the sandbox's workspace: name, type (file, directory, symlink) and size."""

    path: str = Field("", description="directory relative to the workspace; empty for the workspace itself")


class CheckpointArgs(_Args):
    """Save the sandbox's whole state (memory: variables and imports; and files) as a checkpoint.
    Returns its id, for fork and restore."""

    name: str = Field("", max_length=200, description="a label for the checkpoint")


class Fork(_Args):
    """Start a new sandbox as a copy of the current one, from a checkpoint (or from now), and continue in
    it; the original is kept unchanged. Use it to try something risky and keep a way back."""

    checkpoint: Optional[str] = Field(None, description="checkpoint id of the current sandbox; omitted: from now")


class Restore(_Args):
    """Start a new sandbox from a checkpoint (of a sandbox of this session) and continue in it: memory and
    files are as they were when the checkpoint was taken."""

    checkpoint: str = Field(min_length=1, description="checkpoint id, from the checkpoint tool")


TOOLS: Dict[str, Type[_Args]] = {
    "execute_code": ExecuteCode, "read_file": ReadFile, "write_file": WriteFile, "list_files": ListFiles,
    "checkpoint": CheckpointArgs, "fork": Fork, "restore": Restore,
}


def _clean(schema: Any) -> Any:
    """pydantic's schema without the titles (noise for a model), every property described."""
    if isinstance(schema, dict):
        return {k: _clean(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_clean(v) for v in schema]
    return schema


def input_schema(name: str) -> dict:
    schema = _clean(TOOLS[name].model_json_schema())
    schema.pop("description", None)
    # Optional[str] is anyOf [string, null]: keep it simple for every tool format.
    for prop in schema.get("properties", {}).values():
        if "anyOf" in prop:
            kinds = [k for k in prop.pop("anyOf") if k.get("type") != "null"]
            prop.update(kinds[0] if len(kinds) == 1 else {"anyOf": kinds})
        if prop.get("default", 0) is None:
            del prop["default"]
    return schema


def description(name: str) -> str:
    return " ".join((TOOLS[name].__doc__ or "").split())


def tool_definitions(format: str = "openai") -> List[dict]:
    """Every tool in one format: ``openai`` (Chat Completions ``tools``), ``openai-responses``
    (the Responses API), ``anthropic`` (Messages ``tools``) or ``mcp``."""
    out = []
    for name in TOOLS:
        schema, desc = input_schema(name), description(name)
        if format == "openai":
            out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": schema}})
        elif format == "openai-responses":
            out.append({"type": "function", "name": name, "description": desc, "parameters": schema})
        elif format == "anthropic":
            out.append({"name": name, "description": desc, "input_schema": schema})
        elif format == "mcp":
            out.append({"name": name, "description": desc, "inputSchema": schema})
        else:
            raise ValueError(f"unknown tool format {format!r}: openai, openai-responses, anthropic or mcp")
    return out


FORMATS = ("openai", "openai-responses", "anthropic", "mcp")


# -- results ----------------------------------------------------------------------
@dataclass
class ToolResult:
    """What a tool call gives back. ``content`` is a list of blocks, ``{"type": "text", "text"}`` or
    ``{"type": "image", "data": <base64>, "mime_type"}``; ``data`` the same as structured JSON;
    ``is_error`` marks a failed call (bad arguments, an error from the gateway, an exception in the code)."""

    content: List[dict] = field(default_factory=list)
    is_error: bool = False
    data: Dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "\n".join(c["text"] for c in self.content if c["type"] == "text")

    def to_openai(self, tool_call_id: str) -> dict:
        """A Chat Completions ``tool`` message (text only: images are described)."""
        return {"role": "tool", "tool_call_id": tool_call_id, "content": self._text_with_image_notes()}

    def to_anthropic(self, tool_use_id: str) -> dict:
        """An Anthropic ``tool_result`` content block, images included."""
        blocks = []
        for c in self.content:
            if c["type"] == "text":
                blocks.append({"type": "text", "text": c["text"]})
            else:
                blocks.append({"type": "image", "source": {"type": "base64", "media_type": c["mime_type"],
                                                           "data": c["data"]}})
        return {"type": "tool_result", "tool_use_id": tool_use_id, "content": blocks, "is_error": self.is_error}

    def _text_with_image_notes(self) -> str:
        parts = [c["text"] if c["type"] == "text" else f"[{c['mime_type']} image, {len(c['data']) * 3 // 4} bytes]"
                 for c in self.content]
        return "\n".join(parts)


def _cut(text: str) -> str:
    if len(text) <= MAX_TEXT:
        return text
    return text[:MAX_TEXT] + f"\n[... {len(text) - MAX_TEXT} more characters cut]"


def _error(message: str, **data) -> ToolResult:
    return ToolResult([{"type": "text", "text": message}], True, {"error": message, **data})


def execution_result(ex: Execution) -> ToolResult:
    content: List[dict] = []
    texts: List[str] = []
    if ex.stdout:
        texts.append(f"stdout:\n{ex.stdout}")
    if ex.stderr:
        texts.append(f"stderr:\n{ex.stderr}")
    images = 0
    for r in ex.results:
        for mime in ("image/png", "image/jpeg", "image/gif", "image/webp"):
            if isinstance(r.data.get(mime), str):
                content.append({"type": "image", "data": r.data[mime].replace("\n", ""), "mime_type": mime})
                images += 1
                break
        else:
            if r.is_main_result and r.text is not None:
                texts.append(f"result:\n{r.text}")
            elif r.text is not None:
                texts.append(f"display:\n{r.text}")
            elif r.html is not None:
                texts.append(f"display (html):\n{r.html}")
    if ex.error:
        texts.append(f"error: {ex.error.ename}: {ex.error.evalue}\n{ex.error.traceback_text}")
    if not texts and not images:
        texts.append("(no output)")
    if texts:
        content.insert(0, {"type": "text", "text": _cut("\n\n".join(texts))})
    data = {"status": ex.status, "execution_count": ex.execution_count, "stdout": _cut(ex.stdout),
            "stderr": _cut(ex.stderr), "result": ex.text, "images": images,
            "error": {"ename": ex.error.ename, "evalue": ex.error.evalue} if ex.error else None}
    return ToolResult(content, ex.error is not None or ex.status != "ok", data)


# -- the dispatcher ---------------------------------------------------------------
class ToolSession:
    """The sandbox tools act on, and every sandbox they started. ``fork`` and ``restore``
    start a new sandbox and make it the current one; ``close()`` deletes them all (the
    sandbox given at construction too, when ``own`` is true). ``create`` makes the first
    sandbox lazily, at the first call."""

    def __init__(self, sandbox: Optional[Sandbox] = None, create: Optional[Callable[[], Sandbox]] = None,
                 own: bool = False, url: Optional[str] = None, token: Optional[str] = None,
                 restore_args: Optional[dict] = None):
        if sandbox is None and create is None:
            raise ValueError("ToolSession needs a sandbox or a create function")
        self._sandbox, self._create = sandbox, create
        self.url, self.token = (sandbox._http.url, sandbox._http.token) if sandbox is not None else (url, token)
        self.restore_args = restore_args or {}  # what restore passes to Sandbox.create (labels, driver, ttl)
        self.sandboxes: List[Sandbox] = [sandbox] if (sandbox is not None and own) else []
        # Every sandbox this session worked in, owned or given: restore takes only their checkpoints. The
        # gateway's token may reach far more (an admin's reaches every tenant's checkpoints, and two MCP
        # sessions share one token), so the gateway's check alone would let one session restore another's.
        self.lineage: set = {sandbox.id} if sandbox is not None else set()
        self.lock = threading.Lock()

    @property
    def current(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = self._create()
            self.sandboxes.append(self._sandbox)
            self.lineage.add(self._sandbox.id)
        return self._sandbox

    @property
    def started(self) -> bool:
        return self._sandbox is not None

    def switch(self, sb: Sandbox) -> None:
        self.sandboxes.append(sb)
        self.lineage.add(sb.id)
        self._sandbox = sb

    def owns_checkpoint(self, checkpoint: str) -> bool:
        """Whether ``checkpoint`` was taken of one of this session's sandboxes (asked of the gateway: a
        fork from now, or a checkpoint made outside the tools, counts too)."""
        if self._sandbox is None:
            return False
        http = self._sandbox._http
        for sid in sorted(self.lineage):
            try:
                if any(cp.id == checkpoint for cp in Sandbox(SandboxInfo.from_json({"id": sid}), http).checkpoints()):
                    return True
            except NotFound:
                continue  # deleted meanwhile: its checkpoints went with it, or are another sandbox's now
        return False

    def close(self) -> List[str]:
        """Delete the sandboxes this session owns; the ids deleted."""
        gone = []
        for sb in self.sandboxes:
            try:
                sb.delete(timeout=30)
                gone.append(sb.id)
            except SandgateError:
                pass
        self.sandboxes = []
        return gone


def parse_arguments(arguments: Union[str, dict, None]) -> dict:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise TypeError("the arguments must be a JSON object")
    return arguments


def run_tool(target: Union[Sandbox, ToolSession], name: str, arguments: Union[str, dict, None]) -> ToolResult:
    """Run the tool ``name`` with the model's ``arguments`` (a dict or its JSON text) on
    ``target``: a ``Sandbox``, or a ``ToolSession`` (which fork and restore switch to the
    new sandbox). Never raises for a bad call: the result has ``is_error`` and says why.
    With a bare Sandbox, fork/restore return the new id in ``data["sandbox_id"]``
    and the caller owns it (``data`` has no Sandbox object; connect with Sandbox.connect)."""
    session = target if isinstance(target, ToolSession) else ToolSession(target)
    if name not in TOOLS:
        return _error(f"unknown tool {name!r}; the tools are {', '.join(TOOLS)}")
    try:
        args = TOOLS[name].model_validate(parse_arguments(arguments))
    except (ValueError, TypeError) as e:  # ValidationError and JSONDecodeError are ValueErrors
        detail = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'arguments'}: {err['msg']}" for err in e.errors()) \
            if isinstance(e, ValidationError) else str(e)
        return _error(f"bad arguments for {name}: {detail}")
    try:
        return _dispatch(session, name, args)
    except SandgateError as e:
        kind = type(e).__name__
        return _error(f"{name} failed: {kind}: {e.message}", kind=kind, code=e.code)


def _dispatch(session: ToolSession, name: str, args: _Args) -> ToolResult:
    if name == "execute_code":
        from .errors import Timeout
        try:
            ex = session.current.run_code(args.code, timeout=args.timeout)
        except Timeout as e:
            if e.execution is None:
                raise
            r = execution_result(e.execution)
            r.content.append({"type": "text", "text": f"timeout: the cell ran past {args.timeout:g} s and was "
                                                       "interrupted"})
            r.is_error, r.data["status"] = True, "timeout"
            return r
        return execution_result(ex)
    if name == "restore":
        if not session.owns_checkpoint(args.checkpoint):
            # The gateway's own words for an id that does not exist: nothing said about others' checkpoints.
            raise NotFound(f"No such checkpoint: {args.checkpoint} (this session restores only checkpoints of "
                           "its own sandboxes)", status=404, code="not_found")
        sb = session._sandbox
        new = Sandbox.restore(args.checkpoint, sb._http.url, sb._http.token, **session.restore_args)
        session.switch(new)
        return ToolResult([{"type": "text", "text": f"started sandbox {new.id} from checkpoint {args.checkpoint}; "
                                                    "later calls run in it"}], False,
                          {"sandbox_id": new.id, "checkpoint": args.checkpoint})
    sb = session.current
    if name == "read_file":
        raw = sb.files.read(args.path)
        cut = len(raw) > MAX_FILE
        raw = raw[:MAX_FILE]
        try:
            text, encoding = raw.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(raw).decode(), "base64"
        note = f"\n[cut at {MAX_FILE} bytes]" if cut else ""
        shown = text if encoding == "utf-8" else f"(binary, {len(raw)} bytes, base64)\n{text}"
        return ToolResult([{"type": "text", "text": shown + note}], False,
                          {"path": args.path, "content": text, "encoding": encoding, "truncated": cut})
    if name == "write_file":
        data = base64.b64decode(args.content, validate=True) if args.encoding == "base64" else args.content.encode()
        sb.files.write(args.path, data)
        return ToolResult([{"type": "text", "text": f"wrote {len(data)} bytes to {args.path}"}], False,
                          {"path": args.path, "bytes": len(data)})
    if name == "list_files":
        entries = sb.files.list(args.path)
        lines = [f"{e.name}{'/' if e.is_dir else ''}\t{e.type}\t{e.size}" for e in entries]
        return ToolResult([{"type": "text", "text": "\n".join(lines) or "(empty directory)"}], False,
                          {"path": args.path, "entries": [{"name": e.name, "type": e.type, "size": e.size}
                                                          for e in entries]})
    if name == "checkpoint":
        cp = sb.checkpoint(args.name)
        return ToolResult([{"type": "text", "text": f"checkpoint {cp.id} of sandbox {sb.id}"
                                                    + (f" ({cp.name})" if cp.name else "")}], False,
                          {"checkpoint": cp.id, "sandbox_id": sb.id, "name": cp.name})
    if name == "fork":
        child = sb.fork(args.checkpoint)
        session.switch(child)
        return ToolResult([{"type": "text", "text": f"forked sandbox {sb.id} into {child.id}"
                                                    + (f" from checkpoint {args.checkpoint}" if args.checkpoint else "")
                                                    + "; later calls run in the fork"}], False,
                          {"sandbox_id": child.id, "parent": sb.id, "checkpoint": args.checkpoint})
    raise AssertionError(name)
