"""One kvd to a folder: `claim_folder` holds FOLDER/kvd.lock (flock) for as long as its handle is
open. The kernel drops the lock when the process ends, however it ends, so a crash leaves no
stale claim behind. kvctl and cron jobs never claim: they share a state folder with its kvd.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import TextIO


class FolderTaken(RuntimeError):
    """Another process holds the folder; `holder` is what it wrote of itself."""

    def __init__(self, folder: Path, holder: str) -> None:
        super().__init__(f"{str(folder)!r} is held by {holder}")
        self.folder, self.holder = folder, holder


def claim_folder(folder: Path, me: str) -> TextIO:
    """Hold `folder`/kvd.lock, writing `me` (who holds it, for the next claimant's message) in it.
    Close the returned handle to let the folder go. Raises FolderTaken."""
    handle = open(folder / "kvd.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise FolderTaken(folder, holder) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{me}\n")
    handle.flush()
    return handle
