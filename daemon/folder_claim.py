"""One kvd to a folder: `claim_folder` holds FOLDER/kvd.lock (flock) for as long as its handle is
open. The kernel drops the lock when the process ends, however it ends, so a crash leaves no
stale claim behind. kvctl and cron jobs never claim: they share a state folder with its kvd.
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path
from typing import TextIO

from kvctl.daemon.file_identity import file_identity

log = logging.getLogger("kvd")


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


class FolderClaim:
    """`claim_folder` held for a process's life, and kept: a lock file deleted under it (a cleanup
    of the folder) would let a second kvd claim the folder beside this one, so `check` makes it
    and holds it again."""

    def __init__(self, folder: Path, me: str) -> None:
        self.folder, self.me = folder, me
        self.handle: TextIO | None = claim_folder(folder, me)
        self._identity = file_identity(folder / "kvd.lock")
        self._said: str | None = None

    def check(self) -> bool:
        """Whether this process holds the folder still, claiming it again when its lock file was
        deleted; False (and an ERROR, once) when it cannot, or another process holds it now."""
        if file_identity(self.folder / "kvd.lock") == self._identity:
            return True
        try:
            self.folder.mkdir(parents=True, exist_ok=True)  # the whole folder removed: made again
            handle = claim_folder(self.folder, self.me)
        except (FolderTaken, OSError) as exc:
            problem = (f"{str(self.folder)!r} lost its lock file under this process and cannot be claimed again "
                       f"({exc}): another kvd may start on it")
            if problem != self._said:
                log.error("%s", problem)
                self._said = problem
            return False
        self.close()
        self.handle, self._identity, self._said = handle, file_identity(self.folder / "kvd.lock"), None
        log.warning("%r lost its lock file under this process; claimed again", str(self.folder))
        return True

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

