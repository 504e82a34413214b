"""systemd's notify protocol without extra libraries: datagrams to $NOTIFY_SOCKET.

READY=1 once the model is loaded, WATCHDOG=1 from the serving loop at half the interval
systemd asks for ($WATCHDOG_USEC), STOPPING=1 when shutdown begins. Outside systemd every
call is a no-op.

A datagram waits in the receiver's queue until it is read (Linux keeps 10 by default,
net.unix.max_dgram_qlen); a full queue blocks the sender. The serving loop must never wait on
a slow reader, so a watchdog ping is dropped when the queue is full, and READY and STOPPING
give up after `SEND_TIMEOUT` seconds.
"""

from __future__ import annotations

import os
import socket
import time


SEND_TIMEOUT = 2.0


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.interval = None if not watchdog_usec else watchdog_usec / 1e6 / 2
        self._last_ping = 0.0

    @classmethod
    def from_environment(cls) -> "Notifier":
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if pid and pid != str(os.getpid()):
            usec = None  # the watchdog is meant for another process
        return cls(os.environ.get("NOTIFY_SOCKET"), int(usec) if usec and usec.isdigit() else None)

    def send(self, message: str, timeout: float = SEND_TIMEOUT) -> bool:
        """Send one datagram; False when there is no socket, nobody receives on it, or its queue
        stayed full for `timeout` seconds (0: do not wait)."""
        if not self.address:
            return False
        address = self.address
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(address)
                sock.send(message.encode())
            except OSError:  # a full queue (BlockingIOError, TimeoutError) or a receiver gone
                return False
        return True

    def ready(self) -> bool:
        return self.send(f"READY=1\nSTATUS=serving\nMAINPID={os.getpid()}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1\nSTATUS=shutting down")

    def watchdog(self) -> bool:
        """Ping when half the watchdog interval has passed since the last ping."""
        if self.interval is None:
            return False
        now = time.monotonic()
        if now - self._last_ping < self.interval:
            return False
        self._last_ping = now
        return self.send("WATCHDOG=1", timeout=0)  # a full queue drops the ping, never the loop
