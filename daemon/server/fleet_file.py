"""The router's `--replicas-file`: the fleet's members, one per line, applied again on SIGHUP.

    # kvd replicas behind this router
    /run/kvd-0/kvd.sock
    /run/kvd-1/kvd.sock
    https://gpu-7.internal:8000     # a TCP replica (the router's --token-file is its bearer)
    prefill /run/kvd-p/kvd.sock     # disaggregated prefill and decode: a role before the replica
    decode /run/kvd-d/kvd.sock      # (prefill, decode, or both: the default)

A line that joins is followed at once; a line that goes is drained (no new request) and leaves
once its open requests have answered; a line whose role changed takes it for the next request.
Replicas given by `--replica`, `--prefill` or `--decode` stay whatever the file says. A file
that cannot be read, names a replica wrongly, or would leave prefill replicas with no replica
that decodes, changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


# a replica's part in disaggregated prefill and decode (router_service.Replica.role)
ROLES = ("both", "prefill", "decode")


def read_replicas_file(path: str) -> list[str]:
    """The replicas a `--replicas-file` names, in its order (`replica_lines` for their roles)."""
    return [spec for spec, _ in replica_lines(path)]


def replica_lines(path: str) -> list[tuple[str, str]]:
    """(replica, role) for each line of a `--replicas-file`: a socket path or URL, a role
    (prefill, decode or both) before it where given; blank lines and `#` comments are skipped.
    ValueError naming the file and line for what is not one."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"replicas_file: cannot read {path!r}: {exc.strerror or exc}") from None
    out: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        role, spec = ("both", words[0]) if len(words) == 1 else (words[0], words[1])
        if len(words) > 2 or role not in ROLES or not spec.startswith(("/", "http://", "https://")):
            raise ValueError(f"replicas_file: {path}:{number}: expected a socket path or an http(s) URL, a role "
                             f"({', '.join(ROLES)}) before it where given, got {' '.join(words)!r}")
        if spec in out:
            raise ValueError(f"replicas_file: {path}:{number}: {spec!r} is listed twice")
        out[spec] = role
    return list(out.items())


@dataclass
class FleetFile:
    """The router's `--replicas-file`, applied again on SIGHUP; replicas given by `--replica`
    (`fixed`) stay whatever the file says."""

    path: str
    fixed: set[str]
    client: Callable[[str], object]

    def apply(self, service) -> dict:
        """Bring the fleet in line with the file: {"added", "leaving", "roles"} (names; roles: the
        replicas whose role changed, and to what). ValueError (nothing changed) for a file that
        cannot be read, names a replica wrongly or names none at all, or would leave prefill
        replicas with no replica that decodes."""
        from .router_service import Replica

        lines = replica_lines(self.path)
        wanted, roles = [spec for spec, _ in lines], dict(lines)
        if not wanted and not self.fixed:
            raise ValueError(f"replicas_file: {self.path!r} names no replica: the fleet is left as it is")
        present = {r.name for r in service.replicas if not r.leaving}
        added = [spec for spec in wanted if spec not in present and spec not in self.fixed]
        leaving = sorted(present - set(wanted) - self.fixed)
        after = {r.name: roles.get(r.name, r.role) if r.name not in self.fixed else r.role
                 for r in service.replicas if r.name in present and r.name not in leaving}
        after.update({spec: roles[spec] for spec in added})
        if "prefill" in after.values() and all(role == "prefill" for role in after.values()):
            raise ValueError(f"replicas_file: {self.path!r} leaves prefill replicas with no replica that decodes "
                             "(a decode or both line): the fleet is left as it is")
        back = {r.name for r in service.replicas if r.leaving and r.name in added}  # it had not gone yet
        clients = {spec: self.client(spec) for spec in added if spec not in back}  # every one, before any change
        changed = {}
        for replica in service.replicas:
            if replica.name in present and replica.name not in self.fixed and replica.name in roles \
                    and replica.role != roles[replica.name]:
                replica.role = changed[replica.name] = roles[replica.name]
        for spec in added:
            if spec in back:
                service.stay(spec).role = roles[spec]
            else:
                service.add(Replica(spec, clients[spec], role=roles[spec]))
        for name in leaving:
            service.remove(name)
        return {"added": added, "leaving": leaving, "roles": changed}
