"""Where kvctl looks for kvd when not told (--socket, KVD_SOCKET): kvd's default socket, else the
one socket systemd's kvd units keep (/run/kvd for kvd.service, /run/kvd-N for kvd@N,
/run/kvd-router); where it finds none or several, the error names them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvctl import client as client_module
from kvctl.client import Client
from kvctl.errors import KvdUnavailable


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A /run of its own, and no kvd at this user's default socket."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(client_module, "SYSTEMD_RUN", run)
    for name in ("KVD_SOCKET", "KVD_URL", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    bound = []

    def unit_socket(folder: str, name: str = "kvd.sock") -> str:
        """A socket bound where a unit keeps it, listening for no one (connections are refused)."""
        (run / folder).mkdir(exist_ok=True)
        path = str(run / folder / name)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        bound.append(sock)
        return path

    yield run, unit_socket, tmp_path / "xdg" / "kvd" / "kvd.sock"
    for sock in bound:
        sock.close()


def refusal(client: Client) -> str:
    """What kvctl says when nothing answers where `client` looks."""
    with pytest.raises(KvdUnavailable) as error:
        client.get("/admin/status")
    return str(error.value)


def test_the_one_socket_a_kvd_unit_keeps_is_used_when_the_default_has_none(host, monkeypatch):
    run, unit_socket, default = host
    (run / "kvd-notes").mkdir()  # a folder without a socket is no kvd
    path = unit_socket("kvd")
    assert Client().socket == path
    monkeypatch.setenv("KVD_SOCKET", "/elsewhere/kvd.sock")  # told: told it is, found or not
    assert Client().socket == "/elsewhere/kvd.sock"
    assert Client(socket="/mine.sock").socket == "/mine.sock"


def test_with_several_kvd_units_kvctl_names_them_rather_than_guess(host):
    run, unit_socket, default = host
    replicas = [unit_socket("kvd-0"), unit_socket("kvd-1"), unit_socket("kvd-router", "router.sock")]
    client = Client(timeout=2.0)
    assert client.socket == str(default)
    assert refusal(client) == (f"kvd is not reachable at {default} (is it running? `kvd serve`); kvd sockets on "
                               f"this host: {', '.join(replicas)} (--socket or KVD_SOCKET)")


def test_a_kvd_folder_this_user_cannot_read_is_named_with_the_group_it_needs(host, monkeypatch):
    """/run/kvd is 0750, group kvd: someone outside the group cannot see the socket in it (root,
    who runs the tests, can: the refusal is played by iterdir)."""
    run, unit_socket, default = host
    closed = unit_socket("kvd")
    iterdir = Path.iterdir

    def refused(self):
        if str(self) == str(Path(closed).parent):
            raise PermissionError(13, "Permission denied")
        return iterdir(self)

    monkeypatch.setattr(Path, "iterdir", refused)
    client = Client(timeout=2.0)
    assert client.socket == str(default)
    assert refusal(client) == (f"kvd is not reachable at {default} (is it running? `kvd serve`); {run / 'kvd'} may "
                               f"hold one, open to the kvd group only (join it, or run kvctl as its user)")


def test_a_socket_kvctl_was_told_gets_no_guesses(host, tmp_path):
    run, unit_socket, default = host
    unit_socket("kvd-0")
    unit_socket("kvd-1")
    told = str(tmp_path / "none.sock")
    assert refusal(Client(socket=told, timeout=2.0)) == f"kvd is not reachable at {told} (is it running? `kvd serve`)"
