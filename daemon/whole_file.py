"""A small file replaced whole: written aside, fsynced, renamed over the old one, and the rename
made durable, so that a crash or a power cut leaves the old file or the new one, never a torn one."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_whole(path: str | Path, document) -> None:
    """Replace `path` with `document` as JSON. Raises OSError (the old file stays) on failure."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(document, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """fsync a folder: the renames and deletions in it survive a power cut."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
