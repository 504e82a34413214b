"""Where kvd keeps its state and listens by default (systemd's directories, else XDG's): read by kvd
and by kvctl, which must not import kvd's whole settings module to find its socket."""

from __future__ import annotations

import os


def default_state_dir() -> str:
    if os.environ.get("STATE_DIRECTORY"):  # systemd StateDirectory=
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "kvd")


def default_socket() -> str:
    if os.environ.get("RUNTIME_DIRECTORY"):  # systemd RuntimeDirectory=
        return os.path.join(os.environ["RUNTIME_DIRECTORY"].split(":")[0], "kvd.sock")
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvd-{os.getuid()}"
    return os.path.join(base, "kvd", "kvd.sock")
