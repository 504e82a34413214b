"""Which file stands at a path: kvd keeps its store, its socket and its state folder's lock file,
and tells a file deleted under it (nothing there) from one put in its place (another there)."""

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
