"""The Unix socket kvd and kvd router serve on, when it is removed or replaced while they run."""

from __future__ import annotations

import asyncio
import os
import socket

from kvctl.daemon.server import unix_front
from kvctl.daemon.server.unix_front import UnixFront


def foreign_socket(path) -> socket.socket:
    """Another process's listening socket, moved onto `path` in one step (the path is never empty)."""
    aside = f"{path}.other"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(aside)
    other.listen(1)
    os.replace(aside, path)
    return other


def test_a_front_knows_its_socket_and_removes_only_its_own(tmp_path):
    path = str(tmp_path / "kvd.sock")
    front = UnixFront(path)
    assert front.state() == "ours"
    os.unlink(path)
    assert front.state() == "gone" and front.remove() is False
    first = front.sock
    again = front.rebind()
    assert front.state() == "ours" and again is not first and front.rebound == 1
    first.close()
    other = foreign_socket(path)
    assert front.state() == "taken"
    assert front.remove() is False and os.path.exists(path)  # a second kvd's socket outlives the first kvd
    other.close()
    os.unlink(path)
    assert UnixFront(path).remove() is True and not os.path.exists(path)


def test_keep_binds_a_removed_socket_again_and_leaves_a_replaced_one(tmp_path, caplog):
    path = str(tmp_path / "kvd.sock")
    front = UnixFront(path)
    served = []

    async def scenario():
        keeper = asyncio.create_task(unix_front.keep(front, served.append, seconds=0.01))
        os.unlink(path)
        while not served:
            await asyncio.sleep(0.01)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)  # a new client reaches the socket bound again
        other = foreign_socket(path)
        await asyncio.sleep(0.1)  # several rounds: it is said once
        keeper.cancel()
        other.close()

    with caplog.at_level("WARNING", logger="kvd"):
        asyncio.run(scenario())
    assert served == [front.sock] and front.rebound == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"the Unix socket {path!r} was removed under this process; bound again",
        f"the Unix socket {path!r} was replaced under this process (another socket or file stands there now, "
        "left as it is); clients of that path no longer reach this process"]


def test_keep_says_once_what_it_cannot_bind(tmp_path, caplog):
    folder = tmp_path / "run"
    front = UnixFront(str(folder / "kvd.sock"))

    async def scenario():
        keeper = asyncio.create_task(unix_front.keep(front, lambda sock: None, seconds=0.01))
        os.unlink(front.path)
        folder.rmdir()
        folder.write_text("a file where the folder was")
        await asyncio.sleep(0.1)
        keeper.cancel()

    with caplog.at_level("ERROR", logger="kvd"):
        asyncio.run(scenario())
    [message] = [r.getMessage() for r in caplog.records]
    assert message == (f"socket: {front.path!r} cannot be bound: a file stands at {str(folder)!r}, not a folder: it "
                       "was removed under this process, and its clients cannot reach this process until it restarts")
    assert front.rebound == 0

