"""A sandbox's egress policy: the rule grammar, the address refusal list, and the decision.

Rules (docs/egress.md has the grammar with examples):
- ``api.example.com``: that host name exactly;
- ``*.example.org``: any name below example.org (not example.org itself);
- ``10.0.0.1``, ``10.0.0.0/8``, ``2001:db8::1``, ``2001:db8::/32``: an address or a network;
- any of these with ``:port`` (``api.example.com:443``, ``10.0.0.0/8:443``, ``[2001:db8::/32]:443``).

Deny wins over allow and nothing is allowed by default. A name is resolved only after a host rule has
allowed it, so that a name nobody allowed never reaches a resolver (DNS is a channel out, too).
"""

from __future__ import annotations

import ipaddress
import re
from typing import List, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_BRACKETED = re.compile(r"^\[([^\]]+)\](?::(.*))?$")


def normalize_host(host: str) -> str:
    """A host name as rules compare it: lower case, without the root's trailing dot."""
    return host.strip().lower().rstrip(".")


def valid_host_name(name: str) -> bool:
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split("."))


def ip_literal(host: str) -> Optional[IPAddress]:
    """The address a host string names literally ("10.0.0.1", "[::1]", "::1"), or None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


class Rule:
    """One parsed rule: a host name (exact or ``*.`` wildcard) or a network, and an optional port."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.port: Optional[int] = None
        self.network: Optional[IPNetwork] = None
        self.name: Optional[str] = None
        self.wildcard = False
        target, port = self._split_port(text.strip())
        if port is not None:
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"rule {text!r}: port must be a number from 1 to 65535")
            self.port = int(port)
        network = self._network(target)
        if network is not None:
            self.network = network
            return
        if text.strip().startswith("["):
            raise ValueError(f"rule {text!r}: brackets are for IPv6 addresses and networks")
        name = normalize_host(target)
        if name.startswith("*."):
            self.wildcard, name = True, name[2:]
        if not valid_host_name(name) or "*" in name:
            raise ValueError(f"rule {text!r}: not a host name, *.domain, address or CIDR "
                             "(names are ASCII; write an international name in its xn-- form)")
        self.name = name

    @staticmethod
    def _split_port(text: str) -> Tuple[str, Optional[str]]:
        bracketed = _BRACKETED.match(text)
        if bracketed:  # [v6] or [v6/len], with an optional :port
            return bracketed.group(1), bracketed.group(2)
        if text.count(":") == 1:  # name:port or v4:port; a bare IPv6 address has several colons
            target, port = text.split(":")
            return target, port
        return text, None

    def _network(self, target: str) -> Optional[IPNetwork]:
        if "/" not in target and ip_literal(target) is None:
            return None
        try:
            return ipaddress.ip_network(target, strict=True)
        except ValueError as e:
            if "/" in target and ip_literal(target.split("/")[0]) is None:
                raise ValueError(f"rule {self.text!r}: not a network") from None
            raise ValueError(f"rule {self.text!r}: {e}") from None

    def port_matches(self, port: int) -> bool:
        return self.port is None or self.port == port

    def name_matches(self, host: str, port: int) -> bool:
        if self.name is None or not self.port_matches(port):
            return False
        return host.endswith("." + self.name) if self.wildcard else host == self.name

    def contains(self, address: IPAddress, port: int) -> bool:
        return (self.network is not None and self.port_matches(port)
                and address.version == self.network.version and address in self.network)


# Addresses the proxy never connects to unless an allow rule names them (docs/egress.md, "Addresses").
# Python's is_global/is_private differ between versions and miss NAT64 and IPv4-compatible forms, so
# the list is written out; anything else that Python does not call global is refused as well.
_METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
_SPECIAL: List[Tuple[IPNetwork, str]] = [(ipaddress.ip_network(n), why) for n, why in [
    ("0.0.0.0/8", "unspecified"), ("10.0.0.0/8", "private"), ("100.64.0.0/10", "shared (carrier NAT)"),
    ("127.0.0.0/8", "loopback"), ("169.254.0.0/16", "link-local"), ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "reserved"), ("192.0.2.0/24", "documentation"), ("192.88.99.0/24", "a 6to4 relay"),
    ("192.168.0.0/16", "private"), ("198.18.0.0/15", "benchmarking"), ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"), ("224.0.0.0/4", "multicast"), ("240.0.0.0/4", "reserved"),
    ("::/128", "unspecified"), ("::1/128", "loopback"), ("::/96", "IPv4-compatible (deprecated)"),
    ("64:ff9b:1::/48", "local-use NAT64"), ("100::/64", "discard-only"), ("2001::/32", "Teredo"),
    ("2001:db8::/32", "documentation"), ("fc00::/7", "private (unique local)"),
    ("fe80::/10", "link-local"), ("fec0::/10", "site-local"), ("ff00::/8", "multicast"),
]]
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")


def embedded_v4(address: IPAddress) -> Optional[ipaddress.IPv4Address]:
    """The IPv4 address an IPv6 form carries to (IPv4-mapped, NAT64, 6to4), which is where it goes."""
    if address.version != 6:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _SIX_TO_FOUR:
        return address.sixtofour
    return None


def _category(address: IPAddress) -> Optional[str]:
    if address in _METADATA:
        return "a cloud metadata address"
    inner = embedded_v4(address)
    if inner is not None:
        why = _category(inner)
        return f"{why} (as {inner})" if why else None
    for network, why in _SPECIAL:
        if address.version == network.version and address in network:
            return why
    return None if address.is_global else "not globally reachable"


def refusal(address: IPAddress) -> Optional[str]:
    """Why the proxy will not connect to this address by default, or None if it may."""
    why = _category(address)
    return f"address {address} is {why}" if why else None


class Verdict(BaseModel):
    """A decision on one destination; ``reason`` is what the 403 body says."""

    allowed: bool
    rule: Optional[str] = None  # the rule that decided, if one did
    reason: str
    address: Optional[str] = None  # when allowed with addresses: the one to connect to (checked, pinned)


def _rules(field: str, values: List[str]) -> List[str]:
    for i, value in enumerate(values):
        try:
            Rule(value)
        except ValueError as e:
            raise ValueError(f"{field}[{i}]: {e}") from None
    return values


class EgressPolicy(BaseModel):
    """The create body's ``egress`` (and PATCH /egress): ``{"allow": [...], "deny": [...]}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: List[str] = []
    deny: List[str] = []
    _allow: List[Rule] = PrivateAttr()
    _deny: List[Rule] = PrivateAttr()

    @field_validator("allow", "deny")
    @classmethod
    def _parse(cls, values: List[str], info) -> List[str]:
        return _rules(info.field_name, values)

    def model_post_init(self, context) -> None:
        # parsed once: every request is decided against these
        self._allow = [Rule(text) for text in self.allow]
        self._deny = [Rule(text) for text in self.deny]

    def decide_name(self, host: str, port: int) -> Verdict:
        """The decision before resolving: refused here means the name is never resolved."""
        host = normalize_host(host)
        literal = ip_literal(host)
        for rule in self._deny:
            if rule.name_matches(host, port) or (literal is not None and rule.contains(literal, port)):
                return Verdict(allowed=False, rule=rule.text, reason=f"denied by rule {rule.text!r}")
        for rule in self._allow:
            if rule.name_matches(host, port) or (literal is not None and rule.contains(literal, port)):
                return Verdict(allowed=True, rule=rule.text, reason=f"allowed by rule {rule.text!r}")
        return Verdict(allowed=False, reason=f"no allow rule matched {host}:{port}")

    def decide(self, host: str, port: int, addresses: Sequence[IPAddress]) -> Verdict:
        """The decision on ``host:port`` resolved to ``addresses`` (all of which must pass)."""
        verdict = self.decide_name(host, port)
        if not verdict.allowed:
            return verdict
        if not addresses:
            return Verdict(allowed=False, rule=verdict.rule, reason=f"{normalize_host(host)} has no address")
        for rule in self._deny:
            hit = next((a for a in addresses if rule.contains(a, port)), None)
            if hit is not None:
                return Verdict(allowed=False, rule=rule.text, reason=f"address {hit} denied by rule {rule.text!r}")
        for address in addresses:
            why = refusal(address)
            if why and not any(self._names_literally(rule, address, port) for rule in self._allow):
                return Verdict(allowed=False, rule=verdict.rule, reason=why)
        return verdict.model_copy(update={"address": str(addresses[0])})

    @staticmethod
    def _names_literally(rule: Rule, address: IPAddress, port: int) -> bool:
        # A metadata address needs a rule for exactly it: a private CIDR someone allowed for their
        # own services must not open the cloud's credential endpoint as a side effect.
        if address in _METADATA:
            return rule.network is not None and rule.network.num_addresses == 1 and rule.contains(address, port)
        return rule.contains(address, port)
