"""The Unix socket kvd and kvd router serve on: bound safely, kept while they run, and removed at
the end only while it is still theirs.

A socket file removed under a running kvd (a cleanup of its folder, an `rm` meant for a stale one)
leaves kvd serving every connection it has and reachable by none new: kvctl says that no kvd
answers, while kvd goes on. `keep` binds it again. A socket another process put at the path is
never touched: not replaced while kvd runs, not removed when it stops (which took a second kvd's
socket away with the first).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Callable

from kvctl.daemon.file_identity import file_identity, os_problem

log = logging.getLogger("kvd")

CHECK_SECONDS = 2.0  # how often `keep` looks at the path
SUN_PATH_BYTES = 107  # the longest path a Unix socket address holds on Linux (108 with its NUL)


def bind_unix_socket(path: str) -> socket.socket:
    """Bind the API socket with mode 0660, replacing a stale socket but never a live daemon's,
    nor anything that is not a socket (a slip in --socket must not delete a file). Raises
    RuntimeError naming `socket`."""
    if len(os.fsencode(path)) > SUN_PATH_BYTES:
        raise RuntimeError(f"socket: {path!r} is {len(os.fsencode(path))} bytes long, over the {SUN_PATH_BYTES} a "
                           "Unix socket's path may have; choose a shorter one")
    try:
        return _bind_unix_socket(path)
    except OSError as exc:  # its folder cannot be made (a file there), or written
        raise RuntimeError(f"socket: {path!r} cannot be bound: {os_problem(exc)}") from None


def _bind_unix_socket(path: str) -> socket.socket:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    if target.exists() or target.is_symlink():
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise RuntimeError(f"socket: {path!r} exists and is not a socket; kvd will not replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(target))
        except OSError:
            target.unlink()  # stale: nobody listens
        else:
            raise RuntimeError(f"socket: another kvd is listening on {path!r}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117)
    try:
        sock.bind(str(target))
    finally:
        os.umask(old_umask)
    os.chmod(str(target), 0o660)
    sock.listen(128)
    return sock


class UnixFront:
    """The socket at `path` that this process bound, and whether the path still holds it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = bind_unix_socket(path)
        self._identity = file_identity(path)
        self.rebound = 0  # times the socket was removed under this process and bound again

    def state(self) -> str:
        """"ours", "gone" (nothing at the path) or "taken" (another socket or file is there)."""
        identity = file_identity(self.path)
        return "ours" if identity == self._identity else "gone" if identity is None else "taken"

    def rebind(self) -> socket.socket:
        """Bind the path again (after `state()` said "gone"); the old socket stays open, with the
        connections it serves."""
        self.sock = bind_unix_socket(self.path)
        self._identity = file_identity(self.path)
        self.rebound += 1
        return self.sock

    def remove(self) -> bool:
        """Remove the socket file if it is still this process's; whether it was."""
        if self.state() != "ours":
            return False
        try:
            os.unlink(self.path)
        except OSError:
            return False
        return True


async def keep(front: UnixFront, serve: Callable[[socket.socket], None], seconds: float = CHECK_SECONDS) -> None:
    """Every `seconds`, make sure `front` still stands at its path; bound again when it is gone,
    `serve` is handed the new socket. Runs until cancelled. What it cannot mend it says once."""
    said = None
    while True:
        await asyncio.sleep(seconds)
        state = front.state()
        problem = None
        if state == "gone":
            try:
                serve(front.rebind())
            except RuntimeError as exc:  # bind_unix_socket's, naming the socket and why
                problem = (f"{exc}: it was removed under this process, and its clients cannot reach this process "
                           "until it restarts")
            else:
                log.warning("the Unix socket %r was removed under this process; bound again", front.path)
        elif state == "taken":
            problem = (f"the Unix socket {front.path!r} was replaced under this process (another socket or file "
                       f"stands there now, left as it is); clients of that path no longer reach this process")
        if problem and problem != said:
            log.error("%s", problem)
        said = problem
