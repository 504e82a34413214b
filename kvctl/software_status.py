"""How `kvctl status` says what software a kvd runs (its `software`, daemon/software.py), and
how the fleet's view says where replicas differ (the router's `differences`,
daemon/server/fleet_differences.py)."""

from __future__ import annotations

from rich.text import Text

# the libraries after kvd and Python, in the order the line names them
NAMED = ("torch", "triton", "tokenizers", "llguidance")


def software_line(software: dict) -> str:
    """"kvd 0.1.0 on Python 3.11.9: torch 2.13.0+cu128 (CUDA 12.8), triton 3.9.0, ...": a library
    not installed is left out."""
    libraries = []
    for name in NAMED:
        found = software.get(name)
        if found is None:
            continue
        cuda = software.get("cuda") if name == "torch" else None
        libraries.append(f"{name} {found}" + (f" (CUDA {cuda})" if cuda else ""))
    return f"kvd {software['kvd']} on Python {software['python']}: " + ", ".join(libraries)


def difference_line(difference: dict) -> Text:
    """"replicas differ in torch build (a request may take other tokens on each, seeded or greedy):
    2.13.0+cu128 on a, b; 2.12.0+cu126 on c" (the router's `held` line of the difference)."""
    return Text.assemble((f"replicas differ in {difference['label']}", "yellow"),
                         f" ({difference['why']}): {difference['held']}")


def router_version_line(fleet: dict) -> Text | None:
    """"kvd router runs kvd 0.1.0, its replicas 0.2.0 on a, b (...)": None where the router runs the
    kvd every answering replica runs, or an older router or replica does not say."""
    router = (fleet.get("software") or {}).get("kvd")
    others: dict[str, list[str]] = {}
    for status in fleet.get("replica_status") or ():
        version = (status.get("software") or {}).get("kvd")
        if version is not None and version != router:
            others.setdefault(version, []).append(status["replica"])
    if router is None or not others:
        return None
    held = "; ".join(f"{version} on {', '.join(names)}" for version, names in sorted(others.items()))
    return Text.assemble((f"kvd router runs kvd {router}", "yellow"), f", its replicas {held} (a router of another "
                         "version may not read what they answer: upgrade it with them)")
