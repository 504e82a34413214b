"""A real redis-server on a free loopback port, and blocks with content derived from their key."""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

import pytest
import torch

from kvctl.daemon.cache.tiers import BlockLayout, BlockMeta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_redis(port: int) -> None:
    """Until a redis-server on this loopback port answers PING (5 s at most)."""
    import redis

    client = redis.Redis(port=port, socket_timeout=0.5)
    for _ in range(100):
        try:
            client.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not start")


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--enable-debug-command", "local"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_redis(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (CI installs the Debian package)")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


def block_key(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def content(layout: BlockLayout, key: bytes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic (K, V) per layer for a key, exact in every dtype (small integers)."""
    seed = int.from_bytes(key[:4], "little")
    g = torch.Generator().manual_seed(seed)
    shape = (layout.block_size, layout.num_kv_heads, layout.head_dim)
    out = []
    for dtype in layout.layer_dtypes:
        k = torch.randint(-8, 8, shape, generator=g).to(dtype)
        v = torch.randint(-8, 8, shape, generator=g).to(dtype)
        out.append((k, v))
    return out


def group(layout: BlockLayout, keys: list[bytes]):
    """(metas, layers [n, ...]) for blocks 0..n-1 of one chain rooted at keys[0]."""
    metas = [BlockMeta(k, keys[0], d, keys[d - 1] if d else None) for d, k in enumerate(keys)]
    per = [content(layout, k) for k in keys]
    layers = [(torch.stack([p[l][0] for p in per]), torch.stack([p[l][1] for p in per]))
              for l in range(layout.num_layers)]
    return metas, layers


def same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for (x, y) in
               [(ka, kb) for (ka, _), (kb, _) in zip(a, b)] + [(va, vb) for (_, va), (_, vb) in zip(a, b)])


def free_cluster_port() -> int:
    """A loopback port p such that p + 10000 (the cluster bus) is free too and below 65536."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@pytest.fixture
def redis_cluster(tmp_path):
    """Three redis-server masters in cluster mode on free loopback ports; yields a seed URL."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed (CI installs the Debian package)")
    ports = sorted({free_cluster_port() for _ in range(3)})
    assert len(ports) == 3
    procs = []
    for port in ports:
        folder = tmp_path / f"node-{port}"
        folder.mkdir()
        procs.append(subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                       "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                       "--save", "", "--appendonly", "no"], cwd=folder,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        import redis

        for port in ports:
            wait_for_redis(port)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        client = redis.Redis(port=ports[0])
        for _ in range(100):
            if client.cluster("info").get("cluster_state") == "ok":
                break
            time.sleep(0.1)
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
