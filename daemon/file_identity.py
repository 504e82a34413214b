"""Which file stands at a path: kvd keeps its store, its socket and its state folder's lock file,
and tells a file deleted under it (nothing there) from one put in its place (another there). And
what was wrong with a path kvd could not make or open, in words."""

from __future__ import annotations

import os
from pathlib import Path


def file_identity(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`; None when there is none, or none this process can
    reach (its folder gone, or a file now)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def os_problem(exc: OSError) -> str:
    """An OSError about a path as an operator reads it: `a file stands at '/x', not a folder`,
    `Permission denied ('/run/kvd')`."""
    if isinstance(exc, FileExistsError) and exc.filename:
        return f"a file stands at {exc.filename!r}, not a folder"
    if isinstance(exc, NotADirectoryError) and exc.filename:
        return f"a folder on the way to {exc.filename!r} is a file"
    return f"{exc.strerror or exc}" + (f" ({exc.filename!r})" if exc.filename else "")
