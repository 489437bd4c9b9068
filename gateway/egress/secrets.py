"""Credentials the proxy adds on a sandbox's behalf, and the placeholders that stand in for them inside.

A secret's value is write-only: it is a ``SecretStr`` (masked in repr and str), and validation errors
never echo input (``hide_input_in_errors``), so a typo in a create body cannot print a key into a 400
or a log line.
"""

from __future__ import annotations

import re
import secrets as _random
from typing import Dict, Iterable, List, Mapping, Optional

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, SecretStr, field_validator, model_validator

from .policy import normalize_host, valid_host_name

# RFC 7230 section 3.2.6: token = 1*tchar
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# an environment variable name a shell and os.environ both take
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PLACEHOLDER_PREFIX = "sandgate-ph-"


class Secret(BaseModel):
    """``{"host", "header", "value", "name"}``: ``header`` is set to ``value`` on HTTPS requests to
    ``host``; with a ``name``, the sandbox gets the variable ``name`` holding a placeholder, which the
    proxy replaces by ``value`` in any header of an HTTPS request to ``host``. At least one of the two."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    host: str  # an exact host name, or *.domain for the names below it (as in policy rules)
    header: Optional[str] = None
    value: SecretStr
    name: Optional[str] = None

    @field_validator("host")
    @classmethod
    def _host(cls, host: str) -> str:
        name = normalize_host(host)
        if not valid_host_name(name[2:] if name.startswith("*.") else name):
            raise ValueError("must be a host name or *.domain")
        return name

    @field_validator("header")
    @classmethod
    def _header(cls, header: Optional[str]) -> Optional[str]:
        if header is not None and not _TOKEN.match(header):
            raise ValueError("must be an HTTP header name (an RFC 7230 token)")
        return header

    @field_validator("value")
    @classmethod
    def _value(cls, value: SecretStr) -> SecretStr:
        # a header value: no control characters (CR/LF would split the request), not empty
        raw = value.get_secret_value()
        if not raw or any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F for c in raw):
            raise ValueError("must be a non-empty header value without control characters")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, name: Optional[str]) -> Optional[str]:
        if name is not None and not _ENV_NAME.match(name):
            raise ValueError("must be an environment variable name")
        return name

    @model_validator(mode="after")
    def _used(self) -> "Secret":
        if self.header is None and self.name is None:
            raise ValueError("a secret needs a header, a name, or both")
        return self

    def applies_to(self, host: str) -> bool:
        host = normalize_host(host)
        return host.endswith(self.host[1:]) if self.host.startswith("*.") else host == self.host


def placeholders(secrets: Iterable[Secret], existing: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Env var name -> placeholder for every named secret. ``existing`` (the sandbox record's) is kept
    for names still present, so a PATCH or a restore does not change what running code already read."""
    existing = existing or {}
    return {s.name: existing.get(s.name) or PLACEHOLDER_PREFIX + _random.token_hex(16)
            for s in secrets if s.name is not None}


def _unique_names(secrets: List[Secret]) -> List[Secret]:
    # two secrets with one name would give one variable two meanings
    names = [s.name for s in secrets if s.name is not None]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"secret name {dup!r} is used twice")
    return secrets


# The create body's ``secrets`` field type.
Secrets = Annotated[List[Secret], AfterValidator(_unique_names)]
