"""The gateway's side of sandbox egress: what the core needs from the egress proxy.

Sandboxes have no network device. With egress on, the guest agent listens on
127.0.0.1:``SandboxRecord.egress_port`` inside the sandbox, code there uses it
as its HTTP(S) proxy, and each connection comes over the agent's stream
(``tunnel`` frames, sandgate_agent/tunnel.py). For each one the sandbox's
AgentLink calls ``EgressHook.connect(sandbox_id)`` and pumps bytes both ways
between the tunnel and the stream pair it returns.

Whoever runs the proxy installs it on the manager::

    manager.egress = EgressHook(connect=proxy.open, ca_pem=proxy.ca_pem)

and turns egress on or off per sandbox with ``await sandbox.set_egress(3128)``
or ``await sandbox.set_egress(None)``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Tuple

DEFAULT_PORT = 3128

Connector = Callable[[str], Awaitable[Tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass
class EgressHook:
    # One connection to the egress proxy on behalf of a sandbox (by its id);
    # it speaks plain HTTP proxy (absolute-form requests, CONNECT).
    connect: Connector
    # The proxy's CA certificate (PEM) that TLS clients inside must trust; ""
    # when the proxy does not intercept TLS.
    ca_pem: str = ""
    # What the proxy enforces for a sandbox: (id, EgressPolicy, secrets, {env name: placeholder}).
    set_policy: Callable[..., None] = lambda *args: None
    forget: Callable[[str], None] = lambda sandbox_id: None
