"""A real EngineService on the demo checkpoint, and in-process HTTP calls (httpx.ASGITransport)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx

from kvctl.daemon.config import resolve
from kvctl.daemon.server.app import create_app
from kvctl.daemon.server.auth import TokenTable
from kvctl.daemon.server.metrics import Metrics
from kvctl.daemon.server.service import EngineService
from kvctl.daemon.store import Store

ADMIN_TOKEN = "admin-token-0123456789"
USER_TOKEN = "acme-user-token-0123456789"
GLOBEX_TOKEN = "globex-user-token-012345"


def start_service(state_dir, confine_threads: bool = False, **settings) -> EngineService:
    config = resolve({"state_dir": str(state_dir), "socket": str(state_dir / "kvd.sock"),
                      "num_blocks": 64, **settings}, env={})
    service = EngineService(config, Store(state_dir / "kvd.sqlite3"))
    service.metrics = Metrics(service)
    service.start(confine_threads=confine_threads)
    assert service.ready.wait(60), service.load_error
    return service


def failed_start(state_dir, **settings) -> str:
    """Start a service that must fail to load (its settings are wrong for the demo checkpoint):
    waits for the failure, checks it never answered ready, and returns its error."""
    config = resolve({"state_dir": str(state_dir), "socket": str(state_dir / "kvd.sock"),
                      "num_blocks": 64, **settings}, env={})
    service = EngineService(config, Store(state_dir / "kvd.sqlite3"))
    service.metrics = Metrics(service)
    service.start()
    try:
        deadline = time.monotonic() + 60
        while service.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.load_error is not None and not service.ready.is_set()
        return service.load_error
    finally:
        service.shutdown(deadline=2)


def token_table(tmp_path) -> TokenTable:
    path = tmp_path / "tokens"
    path.write_text(f"# token tenant role\n{ADMIN_TOKEN} ops admin\n{USER_TOKEN} acme user\n"
                    f"{GLOBEX_TOKEN} globex user\n")
    path.chmod(0o600)
    return TokenTable.load(path)


@contextlib.contextmanager
def kvd_in(tmp_path, folder: str, **settings):
    """A kvd whose state is `tmp_path / folder` (made here), and its Unix app; shut down after
    (several in turn on one file of settings: a restart, or an upgrade)."""
    (tmp_path / folder).mkdir()
    service = start_service(tmp_path / folder, **settings)
    try:
        yield service, apps(service, token_table(tmp_path))[0]
    finally:
        service.shutdown(1)


def apps(service, tokens, trusted_proxy=False):
    return (create_app(service, service.metrics, front="unix"),
            create_app(service, service.metrics, front="tcp", tokens=tokens, trusted_proxy=trusted_proxy))


def assert_admin_only(tcp, method: str, path: str, **kwargs) -> None:
    """`path` on kvd's TCP app `tcp`: a 403 naming the role for a user's token, a 401 without one."""
    user = call(tcp, method, path, headers={"Authorization": f"Bearer {USER_TOKEN}"}, **kwargs)
    assert user.status_code == 403 and user.json()["error"]["message"] == "this endpoint needs the admin role"
    assert call(tcp, method, path, **kwargs).status_code == 401


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvd", timeout=60) as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def sse_events(response: httpx.Response) -> list:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def blocks_all_back(service) -> bool:
    engine = service.engine
    with service.lock:
        engine.cache.audit()
        counts = engine.cache.state_counts()
    return counts["reserved"] == counts["active"] == counts["shared"] == 0 and not engine.has_work()


def holds_engine_lock(service) -> bool:
    """Whether the calling thread holds kvd's engine lock, for tests that record where a view does
    its work. The lock is a Condition over an RLock; Python has no public way to ask an RLock for
    its owner, so this is the one place that uses Condition's own check (CPython's `_is_owned`)."""
    return service.lock._is_owned()


@contextlib.contextmanager
def a_long_step(service):
    """kvd's engine lock held by another thread, as a long step holds it, until the block ends
    (not a stall: the engine's loop does not count it)."""
    held, release = threading.Event(), threading.Event()

    def step():
        with service.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=step)
    holder.start()
    held.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join(10)


def settled(read, done, timeout: float = 10.0):
    """`read()` again until `done(answer)`, within `timeout`: kvd's engine thread hands a request's
    last event to its client just before its books (rollouts, metrics, trace) take the request."""
    deadline = time.monotonic() + timeout
    while not done(answer := read()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return answer


def scrape_every_family(state_dir) -> str:
    """kvd's /metrics with every family it may export showing: host and disk tiers, tenant shares,
    a running rollout, the responses file and the garbage collector's pauses (as kvd serve installs them), after one
    completion. For the tests that check what the dashboards and alert rules read is exported."""
    from kvctl.daemon.server.app import create_app

    from .tls_certs import serving_tls

    service = start_service(state_dir, num_blocks=64, host_cache_bytes="1MiB", disk_cache_bytes="4MiB",
                            disk_cache_path=str(state_dir / "disk"), tiering="always",
                            tenant_cache_shares="default=0.5",
                            responses_store_file=str(state_dir / "responses.sqlite"))
    try:
        app = create_app(service, service.metrics, front="unix")
        service.rollouts.start({"settings": {"reservation": "p95"}}, "50%", [], None, "test")
        service.gc_pauses.install()
        service.tls = serving_tls(state_dir)  # a TCP front's certificate (tls.py)
        answer = call(app, "POST", "/v1/completions", json={"prompt": "Every family shows after one completion.",
                                                            "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        return call(app, "GET", "/metrics").text
    finally:
        service.gc_pauses.uninstall()
        service.shutdown(deadline=2)
