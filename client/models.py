"""What the SDK returns: plain dataclasses built from the gateway's JSON."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Result:
    """One rich output (``execute_result`` or ``display_data``): every MIME type the
    kernel sent, in ``data``. ``is_main_result`` marks the cell's value (``Out[n]``)."""

    data: Dict[str, Any]
    metadata: Dict[str, Any] = field(default_factory=dict)
    is_main_result: bool = False

    @property
    def text(self) -> Optional[str]:
        return self.data.get("text/plain")

    @property
    def html(self) -> Optional[str]:
        return self.data.get("text/html")

    @property
    def markdown(self) -> Optional[str]:
        return self.data.get("text/markdown")

    @property
    def json(self) -> Any:
        return self.data.get("application/json")

    @property
    def png(self) -> Optional[str]:
        """base64, as Jupyter sends it; ``png_bytes`` decodes it."""
        return self.data.get("image/png")

    @property
    def png_bytes(self) -> Optional[bytes]:
        return base64.b64decode(self.png) if self.png else None

    @property
    def jpeg(self) -> Optional[str]:
        return self.data.get("image/jpeg")

    @property
    def svg(self) -> Optional[str]:
        return self.data.get("image/svg+xml")

    def formats(self) -> List[str]:
        return list(self.data)


@dataclass
class ExecutionError:
    ename: str
    evalue: str
    traceback: List[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.ename

    @property
    def value(self) -> str:
        return self.evalue

    @property
    def traceback_text(self) -> str:
        """The traceback as plain text (IPython colours it with ANSI escapes)."""
        return _ANSI.sub("", "\n".join(self.traceback))

    def __str__(self) -> str:
        return f"{self.ename}: {self.evalue}"


@dataclass
class Execution:
    """One cell's outcome. ``status`` is ok, error, timeout or aborted; ``outputs`` keeps the
    gateway's output dicts in order (``type``: stream, execute_result, display_data, error)."""

    status: str = "ok"
    execution_count: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    results: List[Result] = field(default_factory=list)
    error: Optional[ExecutionError] = None
    outputs: List[dict] = field(default_factory=list)
    truncated: bool = False
    # run_code after a lost fleet node: the run that had printed died with it, and the cell ran
    # again from the sandbox's last checkpoint (the callbacks got both runs' outputs).
    reran: bool = False
    # Over the kernel websocket only: every raw Jupyter message of this request (as
    # KernelConnection.recv returns them) and the execute_reply's content.
    messages: List[dict] = field(default_factory=list, repr=False)
    reply: Optional[dict] = None

    @property
    def text(self) -> Optional[str]:
        """The cell's value as text (``Out[n]``'s text/plain), or None."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    @property
    def logs(self) -> Dict[str, str]:
        return {"stdout": self.stdout, "stderr": self.stderr}

    def add(self, out: dict) -> None:
        """Take one output (the gateway's shape, docs/api.md ``ExecuteResult``)."""
        self.outputs.append(out)
        kind = out.get("type")
        if kind == "stream":
            if out.get("name") == "stderr":
                self.stderr += out.get("text") or ""
            else:
                self.stdout += out.get("text") or ""
        elif kind in ("execute_result", "display_data"):
            self.results.append(Result(out.get("data") or {}, out.get("metadata") or {},
                                       is_main_result=kind == "execute_result"))
        elif kind == "error":
            self.error = ExecutionError(out.get("ename") or "", out.get("evalue") or "", out.get("traceback") or [])

    @classmethod
    def from_json(cls, d: dict) -> "Execution":
        ex = cls(status=d.get("status", "ok"), execution_count=d.get("execution_count"),
                 truncated=bool(d.get("truncated")))
        for out in d.get("outputs") or []:
            ex.add(out)
        # The gateway's own stdout/stderr are authoritative (the truncation note included).
        ex.stdout, ex.stderr = d.get("stdout", ex.stdout), d.get("stderr", ex.stderr)
        if d.get("error") and ex.error is None:
            e = d["error"]
            ex.error = ExecutionError(e.get("ename") or "", e.get("evalue") or "", e.get("traceback") or [])
        return ex


@dataclass
class SandboxInfo:
    """The gateway's sandbox model (docs/api.md); ``raw`` has every field."""

    id: str
    state: str
    execution_state: str
    driver: str
    parent: Optional[Dict[str, Optional[str]]]
    head: Optional[str]
    limits: Dict[str, Any]
    labels: Dict[str, str]
    created: str
    expires: Optional[str]
    reason: Optional[str]
    egress: Optional[Dict[str, Any]]
    raw: Dict[str, Any]
    pause_mode: Optional[str] = None  # disk while paused, memory while frozen

    @classmethod
    def from_json(cls, d: dict) -> "SandboxInfo":
        return cls(id=d["id"], state=d.get("state", ""), execution_state=d.get("execution_state", ""),
                   driver=d.get("driver", ""), parent=d.get("parent"), head=d.get("head"),
                   limits=d.get("limits") or {}, labels=d.get("labels") or {}, created=d.get("created", ""),
                   expires=d.get("expires"), reason=d.get("reason"), egress=d.get("egress"), raw=d,
                   pause_mode=d.get("pause_mode"))


@dataclass
class Checkpoint:
    id: str
    sandbox: str
    name: str
    created: float
    parent: Optional[str]
    raw: Dict[str, Any]

    @classmethod
    def from_json(cls, d: dict) -> "Checkpoint":
        return cls(id=d["id"], sandbox=d.get("sandbox", ""), name=d.get("name", ""), created=d.get("created", 0.0),
                   parent=d.get("parent"), raw=d)


@dataclass
class FileEntry:
    name: str
    type: str  # file | directory | symlink
    size: int
    mtime: float
    path: str = ""  # the listed directory joined with name

    @property
    def is_dir(self) -> bool:
        return self.type == "directory"
