"""A real kvd in its own process, and kvctl run against it as an operator runs it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
TIERS = {"disk_cache_bytes": "64MiB", "write_policy": "write_through", "tiering": "always"}


def launch(state: Path, sock: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, httpx.Client]:
    """A real kvd with `extra` flags (default: a write-through disk tier) on 24 blocks; returns
    once /readyz answers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    tiers = extra or ("--disk-cache-bytes", TIERS["disk_cache_bytes"], "--write-policy", TIERS["write_policy"],
                      "--tiering", TIERS["tiering"])
    proc = subprocess.Popen(
        [str(BIN / "kvd"), "serve", "--state-dir", str(state), "--socket", str(sock), "--num-blocks", "24",
         *tiers, "--log-level", "warning"],
        env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    client = httpx.Client(base_url="http://kvd", transport=httpx.HTTPTransport(uds=str(sock)), timeout=60)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if client.get("/readyz").status_code == 200:
                return proc, client
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("kvd did not become ready")


def complete(post, prompt: str) -> dict:
    response = post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def kvctl(sock: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVD_SOCKET": str(sock), "COLUMNS": "80"}  # an operator's terminal: ids must stay whole
    return subprocess.run([str(BIN / "kvctl"), *args], env=env, capture_output=True, text=True, timeout=120)



@contextlib.contextmanager
def running_kvd(tmp_path: Path, *extra: str):
    """`launch` under tmp_path (state/, kvd.sock, kvd.log) -> (process, client, socket); on the way
    out kvd is stopped with SIGTERM and must exit cleanly."""
    sock = tmp_path / "kvd.sock"
    proc, client = launch(tmp_path / "state", sock, tmp_path / "kvd.log", *extra)
    try:
        yield proc, client, sock
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        client.close()
