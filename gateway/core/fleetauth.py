"""Node-to-node trust in a fleet: one key every node holds (SANDGATE_FLEET_KEY), never Redis.

Redis is shared state, not a credential: whoever can write it can rewrite a node's URL. So

- **heartbeats are signed**: a node's heartbeat carries an HMAC over its node id and every field
  (URL, capacity, time), and a node forwards only to a node whose heartbeat verifies (and is at
  most ``WINDOW`` s old); a URL written into Redis by anyone else is not a node;
- **forwarded requests carry no caller credential**: the forwarding node authenticated the caller
  and states who it is (``X-Sandgate-Principal``); the request is signed with an HMAC over method,
  URI, body hash, time, a nonce, the sending and the receiving node's ids and that principal
  (``X-Sandgate-Fleet-Auth``). The receiving node checks it is the node named, the time is within
  ``WINDOW`` and the nonce new, then trusts the stated principal. A listener that is not a node
  gets a request it cannot change or send to any other node, and no token.

Separate keys for the two uses are derived from the fleet key (HKDF-SHA256), as is the key that
seals secret values at rest (store/seal.py).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import secrets
import time
from typing import Callable, Dict, Optional

from ..store.seal import hkdf
from .tenants import ADMIN, Principal

AUTH = "X-Sandgate-Fleet-Auth"
PRINCIPAL = "X-Sandgate-Principal"
WINDOW = 60.0  # seconds a signature stays good either way: clocks of a fleet agree to within this
NONCES_MAX = 100_000  # nonces remembered; past it (100k forwarded requests a minute) the oldest go


class FleetAuthError(Exception):
    """A forwarded request or heartbeat that does not verify: why."""


def principal_text(who: Principal) -> str:
    return "admin" if who.admin else f"tenant:{who.tenant}"


def parse_principal(text: str) -> Principal:
    if text == "admin":
        return ADMIN
    if text.startswith("tenant:") and len(text) > 7:
        return Principal(text[7:])
    raise FleetAuthError(f"bad {PRINCIPAL}: {text!r}")


class FleetAuth:
    def __init__(self, key: str, node: str, clock: Callable[[], float] = time.time):
        self.node = node
        self.clock = clock
        self._forward_key = hkdf(key.encode(), b"sandgate forward v1")
        self._beat_key = hkdf(key.encode(), b"sandgate heartbeat v1")
        self._nonces: "collections.OrderedDict[str, float]" = collections.OrderedDict()

    # -- heartbeats ------------------------------------------------------------------
    def _beat_mac(self, node: str, info: dict) -> str:
        # every field (URL, capacity, time): a signed heartbeat cannot be edited, only replayed within WINDOW
        body = {k: v for k, v in info.items() if k != "sig"}
        msg = json.dumps(["sandgate-heartbeat-v1", node, body], sort_keys=True).encode()
        return hmac.new(self._beat_key, msg, hashlib.sha256).hexdigest()

    def sign_heartbeat(self, info: dict) -> dict:
        info = {**info, "ts": round(self.clock(), 3)}
        return {**info, "sig": self._beat_mac(self.node, info)}

    def heartbeat_ok(self, node: str, info: dict) -> bool:
        """Whether ``info`` is a heartbeat ``node`` signed with the fleet key, not older than WINDOW."""
        ts, sig, url = info.get("ts"), info.get("sig"), info.get("url")
        if not isinstance(ts, (int, float)) or not isinstance(sig, str) or not isinstance(url, str):
            return False
        if abs(self.clock() - ts) > WINDOW:
            return False
        try:
            return hmac.compare_digest(sig, self._beat_mac(node, info))
        except (TypeError, ValueError):  # fields JSON cannot order or encode: not a heartbeat a node wrote
            return False

    # -- forwarded requests --------------------------------------------------------------
    def _request_mac(self, method: str, uri: str, digest: str, ts: str, nonce: str, frm: str, to: str,
                     principal: str) -> str:
        msg = "\n".join(["sandgate-forward-v1", method.upper(), uri, ts, nonce, frm, to, principal,
                         digest]).encode()
        return hmac.new(self._forward_key, msg, hashlib.sha256).hexdigest()

    def sign(self, method: str, uri: str, body: bytes, to: str, who: Principal) -> Dict[str, str]:
        """The headers that carry ``who`` to node ``to`` for this request. The body's hash is in
        them too (``body=``), so a node that takes the body as it arrives can verify the rest first
        and the body at its end (``body_digest``)."""
        ts, nonce, principal = f"{self.clock():.3f}", secrets.token_hex(16), principal_text(who)
        digest = hashlib.sha256(body or b"").hexdigest()
        mac = self._request_mac(method, uri, digest, ts, nonce, self.node, to, principal)
        return {AUTH: f"v1 ts={ts} nonce={nonce} from={self.node} to={to} body={digest} sig={mac}",
                PRINCIPAL: principal}

    @staticmethod
    def _fields(headers) -> dict:
        version, _, rest = headers.get(AUTH, "").partition(" ")
        fields = dict(part.split("=", 1) for part in rest.split() if "=" in part)
        if version != "v1" or not {"ts", "nonce", "from", "to", "sig", "body"} <= fields.keys():
            raise FleetAuthError(f"malformed {AUTH}")
        return fields

    def body_digest(self, headers) -> str:
        """The SHA-256 (hex) of the body a request was signed with; its receiver compares the body
        it took as it arrived (verify with ``body=None``) before acting on the last of it."""
        return self._fields(headers)["body"]

    def verify(self, method: str, uri: str, body: Optional[bytes], headers) -> tuple:
        """(the principal the sending node vouches for, that node's id); FleetAuthError otherwise.
        ``body`` None: a body still arriving, checked by the caller against ``body_digest``."""
        fields = self._fields(headers)
        if fields["to"] != self.node:
            raise FleetAuthError(f"signed for node {fields['to']!r}, this is {self.node!r}")
        try:
            ts = float(fields["ts"])
        except ValueError:
            raise FleetAuthError("bad timestamp") from None
        now = self.clock()
        if abs(now - ts) > WINDOW:
            raise FleetAuthError(f"signed {now - ts:.0f} s ago (at most {WINDOW:g}: are the nodes' clocks apart?)")
        principal = headers.get(PRINCIPAL, "")
        digest = fields["body"] if body is None else hashlib.sha256(body).hexdigest()
        mac = self._request_mac(method, uri, digest, fields["ts"], fields["nonce"], fields["from"], fields["to"],
                                principal)
        if not hmac.compare_digest(mac, fields["sig"]):
            raise FleetAuthError("bad signature (another fleet key, or an altered request)")
        self._remember(fields["nonce"], now)
        return parse_principal(principal), fields["from"]

    def _remember(self, nonce: str, now: float) -> None:
        while self._nonces and (next(iter(self._nonces.values())) < now or len(self._nonces) >= NONCES_MAX):
            self._nonces.popitem(last=False)
        if nonce in self._nonces:
            raise FleetAuthError("replayed (its nonce was seen)")
        self._nonces[nonce] = now + 2 * WINDOW
