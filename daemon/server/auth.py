"""Bearer tokens for the TCP front end: a file of `TOKEN TENANT ROLE` lines (mode 0600 or 0640;
kvd refuses a file that other users may read or write).

Lines starting with '#' are comments. Roles are `user` and `admin`. Tokens are compared
with hmac.compare_digest against every entry, so timing reveals nothing of a token.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# user: its own tenant; proxy: a front end's token (a gateway's), a user whose requests are served as the
# X-KVD-Tenant it names (its own tenant where it names none), trusted_proxy or not; admin: every endpoint
ROLES = ("user", "proxy", "admin")


class TokenFileError(ValueError):
    pass


def read_private_file(path: str | Path, setting: str, error: type[ValueError] = ValueError) -> bytes:
    """A secret file's bytes (`token_file`, `trace_key_file`): `error`, naming the setting and the
    file, when it cannot be read or every user on the machine may read it (the service's group
    may: systemd's root:kvd 0640)."""
    path = Path(path)
    try:
        data = path.read_bytes()
        mode = path.stat().st_mode & 0o777
    except OSError as exc:
        raise error(f"{setting}: cannot read {str(path)!r} ({exc.strerror})") from None
    if mode & 0o007:
        raise error(f"{setting}: {str(path)!r} is open to every user on the machine (mode "
                    f"{mode:04o}); restrict it, e.g. chmod 600 {path}")
    return data


@dataclass(frozen=True)
class TokenEntry:
    token: bytes
    tenant: str
    role: str
    name: str  # for the audit log: "token:<line>" (never the token itself)


class TokenTable:
    def __init__(self, entries: list[TokenEntry]) -> None:
        self.entries = entries

    @classmethod
    def load(cls, path: str | Path) -> "TokenTable":
        path = Path(path)
        try:
            text = read_private_file(path, "token_file", TokenFileError).decode("utf-8")
        except UnicodeDecodeError:
            raise TokenFileError(f"token_file: {str(path)!r} is not UTF-8 text") from None
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 3:
                raise TokenFileError(f"token_file line {number}: expected 'TOKEN TENANT ROLE'")
            token, tenant, role = parts
            if len(token) < 16:
                raise TokenFileError(f"token_file line {number}: token shorter than 16 characters")
            if not TENANT_PATTERN.match(tenant):
                raise TokenFileError(f"token_file line {number}: tenant {tenant!r} is not [A-Za-z0-9._-]{{1,64}}")
            if role not in ROLES:
                raise TokenFileError(f"token_file line {number}: role {role!r} is not user, proxy or admin")
            entries.append(TokenEntry(token.encode(), tenant, role, f"token:{number}"))
        if not entries:
            raise TokenFileError(f"token_file: {str(path)!r} holds no token")
        return cls(entries)

    def adopt(self, fresh: "TokenTable") -> dict:
        """Take `fresh`'s tokens (a token file loaded again) in one step: the next request is
        checked against them. Says how many tokens came and went, never which."""
        old, new = {e.token for e in self.entries}, {e.token for e in fresh.entries}
        self.entries = fresh.entries
        return {"tokens": len(fresh.entries), "added": len(new - old), "removed": len(old - new)}

    def lookup(self, presented: str) -> TokenEntry | None:
        candidate = presented.encode()
        found = None
        for entry in self.entries:
            if hmac.compare_digest(entry.token, candidate):
                found = entry
        return found


class BearerRefused(Exception):
    """A request's Authorization header names no token of the table (the message says how)."""


def bearer_entry(tokens: TokenTable, authorization: str) -> TokenEntry:
    """The table's entry for an `Authorization: Bearer TOKEN` header; BearerRefused when the header
    is missing, not a bearer, or names no token (compared in constant time, see `lookup`)."""
    scheme, _, credential = authorization.partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        raise BearerRefused("missing bearer token")
    entry = tokens.lookup(credential.strip())
    if entry is None:
        raise BearerRefused("invalid bearer token")
    return entry
