"""A small file replaced whole: written aside, fsynced, renamed over the old one, and the rename
made durable, so that a crash or a power cut leaves the old file or the new one, never a torn one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


def write_json_whole(path: str | Path, document) -> None:
    """Replace `path` with `document` as JSON. Raises OSError (the old file stays) on failure."""
    def fill(tmp: Path) -> None:
        with open(tmp, "w") as f:
            json.dump(document, f, indent=1, sort_keys=True)

    write_whole(path, fill)


def write_whole(path: str | Path, fill: Callable[[Path], None], errors: tuple = (OSError,), mode: int | None = None
                ) -> None:
    """Replace `path` with what `fill(tmp)` writes into a file beside it (`mode`: its permissions):
    fsynced, renamed over `path`, the rename made durable. `errors` (OSError, and whatever `fill`
    may raise besides) pass through, the old file left as it was and the one beside it removed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        fill(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        with open(tmp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except errors:
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
