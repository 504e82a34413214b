"""The router's `--replicas-file`: the fleet's members, one per line, applied again on SIGHUP.

    # kvd replicas behind this router
    /run/kvd-0/kvd.sock
    /run/kvd-1/kvd.sock
    https://gpu-7.internal:8000     # a TCP replica (the router's --token-file is its bearer)

A line that joins is followed at once; a line that goes is drained (no new request) and leaves
once its open requests have answered. Replicas given by `--replica` stay whatever the file says.
A file that cannot be read, or names a replica wrongly, changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def read_replicas_file(path: str) -> list[str]:
    """The replicas a `--replicas-file` names: one socket path or URL per line; blank lines and
    `#` comments are skipped. ValueError naming the file and line for what is not one."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"replicas_file: cannot read {path!r}: {exc.strerror or exc}") from None
    out = []
    for number, line in enumerate(lines, 1):
        spec = line.split("#", 1)[0].strip()
        if not spec:
            continue
        if " " in spec or "\t" in spec or not (spec.startswith(("/", "http://", "https://"))):
            raise ValueError(f"replicas_file: {path}:{number}: expected a socket path or an http(s) URL, "
                             f"got {spec!r}")
        if spec in out:
            raise ValueError(f"replicas_file: {path}:{number}: {spec!r} is listed twice")
        out.append(spec)
    return out


@dataclass
class FleetFile:
    """The router's `--replicas-file`, applied again on SIGHUP; replicas given by `--replica`
    (`fixed`) stay whatever the file says."""

    path: str
    fixed: set[str]
    client: Callable[[str], object]

    def apply(self, service) -> dict:
        """Bring the fleet in line with the file: {"added", "leaving"} (names). ValueError (nothing
        changed) for a file that cannot be read, names a replica wrongly or names none at all."""
        from .router_service import Replica

        wanted = read_replicas_file(self.path)
        if not wanted and not self.fixed:
            raise ValueError(f"replicas_file: {self.path!r} names no replica: the fleet is left as it is")
        present = {r.name for r in service.replicas if not r.leaving}
        added = [spec for spec in wanted if spec not in present and spec not in self.fixed]
        leaving = sorted(present - set(wanted) - self.fixed)
        back = {r.name for r in service.replicas if r.leaving and r.name in added}  # it had not gone yet
        clients = {spec: self.client(spec) for spec in added if spec not in back}  # every one, before any change
        for spec in added:
            if spec in back:
                service.stay(spec)
            else:
                service.add(Replica(spec, clients[spec]))
        for name in leaving:
            service.remove(name)
        return {"added": added, "leaving": leaving}
