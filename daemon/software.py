"""The software a kvd process runs: its own version and those of the libraries whose numbers or
text it serves.

Two replicas that differ here may answer one request differently: a seeded sample draws other
tokens under another torch or kvd, a prompt may tokenize otherwise under another tokenizers, a
grammar masks otherwise under another llguidance. `GET /admin/status` carries it (`software`),
`kvd_build_info` exports it as labels, and the router names the replicas that differ
(fleet_differences.py) so that a rolling upgrade's end is seen, and one left half done is not missed.
"""

from __future__ import annotations

import platform
from functools import cache
from importlib.metadata import PackageNotFoundError, version

# the libraries besides torch whose versions are reported, as pip names them (None: not installed)
LIBRARIES = ("triton", "tokenizers", "llguidance")


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


@cache
def software_versions() -> dict[str, str | None]:
    """{"kvd", "python", "torch", "cuda", "triton", "tokenizers", "llguidance"}: versions as
    strings, None for a library not installed (cuda: the CUDA torch was built for, None on a CPU
    build). Read once a process: what is imported does not change under it."""
    try:
        import torch

        # with its local tag (+cpu, +cu128): the build, not just the release
        built = {"torch": torch.__version__, "cuda": torch.version.cuda}
    except ImportError:
        built = {"torch": None, "cuda": None}
    return {**router_versions(), **built, **{name: _installed(name) for name in LIBRARIES}}


def router_versions() -> dict[str, str]:
    """{"kvd", "python"}: what kvd router runs (it imports neither torch nor a kernel library, and
    its answers do not depend on them; naming torch's would cost it the import)."""
    from kvctl import __version__

    return {"kvd": __version__, "python": platform.python_version()}
