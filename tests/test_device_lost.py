"""A device error CUDA keeps (an illegal memory access, a device-side assert) leaves the process
unable to use the GPU again: kvd answers its requests in flight 500, refuses new ones 503 (its
probes too), records why, saves what host memory holds, and exits 75 for systemd to start it again,
where it served 500s until someone restarted it by hand (device_loss.py)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.server import device_loss  # noqa: E402
from kvctl.daemon.server.app import create_app  # noqa: E402

from .daemon_fixtures import call, start_service  # noqa: E402
from .test_engine_step_failures import ERROR, fail_a_step, retired  # noqa: E402

ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"
BODY = {"prompt": "Tell me a story about blocks.", "max_tokens": 8, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def device_gone(monkeypatch):
    """The device answers nothing any more, as after a sticky CUDA error; returns the questions put."""
    asked = []

    def answer_of(device):
        asked.append(device.type)
        raise torch.AcceleratorError(ILLEGAL_ACCESS)

    monkeypatch.setattr(device_loss, "answer_of", answer_of)
    return asked


def test_only_a_device_error_the_device_then_fails_on_again_is_a_lost_device(monkeypatch):
    real, asked = device_loss.answer_of, []
    monkeypatch.setattr(device_loss, "answer_of", asked.append)  # a device that answers
    cpu = torch.device("cpu")
    assert device_loss.lost_device(torch.OutOfMemoryError("CUDA out of memory"), cpu) is None
    assert device_loss.lost_device(RuntimeError("shape mismatch"), cpu) is None
    assert asked == []  # not a device error: the device is not asked
    assert device_loss.lost_device(torch.AcceleratorError("CUDA error: invalid configuration argument"), cpu) is None
    assert asked == [cpu]  # asked, and it answered: an error of that launch, not of the device

    def gone(device):
        raise torch.AcceleratorError(ILLEGAL_ACCESS)

    monkeypatch.setattr(device_loss, "answer_of", gone)
    assert device_loss.lost_device(torch.AcceleratorError(ILLEGAL_ACCESS), cpu) == (
        f"AcceleratorError: {ILLEGAL_ACCESS}; then AcceleratorError: {ILLEGAL_ACCESS}")
    real(cpu)  # the real question, put to a device that works: answered


def test_a_device_error_the_device_answers_after_is_an_ordinary_failed_step(tmp_path, monkeypatch):
    monkeypatch.setattr(device_loss, "answer_of", lambda device: None)
    service = start_service(tmp_path)
    try:
        app = create_app(service, service.metrics, front="unix")
        fail_a_step(service, lambda engine: bool(engine.requests),
                    torch.AcceleratorError("CUDA error: invalid configuration argument"))
        assert (lambda a: (a.status_code, a.json()))(call(app, "POST", "/v1/completions", json=BODY)) == (500, ERROR)
        assert service.device_lost is None
        assert call(app, "POST", "/v1/completions", json=BODY).status_code == 200  # kvd serves on
        assert call(app, "GET", "/healthz").json() == {"status": "ok"}
    finally:
        service.shutdown(deadline=2)


def test_a_lost_device_refuses_what_comes_records_why_and_saves_the_host_tier(tmp_path, device_gone):
    settings = dict(num_blocks=64, host_cache_bytes="4MiB", disk_cache_bytes="16MiB", tiering="always")
    service = start_service(tmp_path, **settings)
    exits = []
    service.on_device_lost = lambda: exits.append(threading.current_thread().name)
    app = create_app(service, service.metrics, front="unix")
    kept = call(app, "POST", "/v1/completions", json={**BODY, "prompt": "A prefix kept in host memory. " * 4})
    [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
    moved = call(app, "POST", "/admin/swap", json={"prefix": row["prefix_id"], "to": "host"}).json()
    assert kept.status_code == 200 and moved["evicted_from_device"] == row["blocks"] > 0
    assert call(app, "POST", "/v1/completions", json={**BODY, "prompt": "On the device only. " * 4}).status_code == 200
    fail_a_step(service, lambda engine: bool(engine.requests), torch.AcceleratorError(ILLEGAL_ACCESS))

    failed = call(app, "POST", "/v1/completions", json=BODY)
    assert (failed.status_code, failed.json()) == (500, ERROR)  # in flight: as any failed step
    assert device_gone == ["cpu"] and exits == ["kvd-engine"]
    why = f"AcceleratorError: {ILLEGAL_ACCESS}; then AcceleratorError: {ILLEGAL_ACCESS}"
    assert service.device_lost == why
    service._thread.join(10)
    assert not service._thread.is_alive()  # the engine steps no more
    retired(service)
    refused = call(app, "POST", "/v1/completions", json=BODY)
    assert (refused.status_code, refused.json()["error"]["message"]) == (503, (
        "kvd's device failed and cannot be used again by this process: kvd is exiting, to be started again"))
    said = ("kvd's device failed and cannot be used again by this process (" + why + "): kvd is exiting, to be "
            "started again")
    health, ready = call(app, "GET", "/healthz"), call(app, "GET", "/readyz")
    assert (health.status_code, health.json()) == (503, {"status": "device_lost", "reason": said})
    assert (ready.status_code, ready.json()) == (503, {"ready": False, "reason": said})

    def unreadable(block_ids):
        raise torch.AcceleratorError(ILLEGAL_ACCESS)

    service.tiers.gather = unreadable  # the device's blocks cannot be read: not even tried
    service.shutdown(deadline=5)
    [record] = service.store.audit_since(action="exit")
    assert {k: record[k] for k in ("actor", "tenant", "target", "result", "detail")} == {
        "actor": "kvd", "tenant": "-", "target": "device", "result": "device_lost",
        "detail": {"error": why, "exit_code": 75}}

    again = start_service(tmp_path, **settings)  # a fresh process: the host tier's prefix came back from disk
    try:
        app = create_app(again, again.metrics, front="unix")
        [back] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert (back["prefix_id"], back["tiers"]) == (row["prefix_id"], {"disk": row["blocks"]})
    finally:
        again.shutdown(deadline=2)


def test_an_idle_kvd_whose_device_stops_answering_exits_before_a_request_meets_it(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(device_loss, "answer_of", lambda device: asked.append(device.type))  # it answers
    service = start_service(tmp_path)
    exits = []
    service.on_device_lost = lambda: exits.append(threading.current_thread().name)
    try:
        app = create_app(service, service.metrics, front="unix")
        service.device_check_seconds = 0.2  # (30 s in kvd serve)
        deadline = time.monotonic() + 20
        while len(asked) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert asked[:2] == ["cpu", "cpu"] and service.device_lost is None  # asked while idle, and answered
        assert call(app, "GET", "/healthz").json() == {"status": "ok"}

        def gone(device):
            raise torch.AcceleratorError(ILLEGAL_ACCESS)

        monkeypatch.setattr(device_loss, "answer_of", gone)
        service._thread.join(20)
        assert not service._thread.is_alive() and exits == ["kvd-engine"]
        why = f"it did not answer kvd's idle check: AcceleratorError: {ILLEGAL_ACCESS}"
        assert service.device_lost == why
        health = call(app, "GET", "/healthz")
        assert (health.status_code, health.json()["reason"]) == (503, (
            f"kvd's device failed and cannot be used again by this process ({why}): kvd is exiting, to be started "
            "again"))
        refused = call(app, "POST", "/v1/completions", json=BODY)
        assert refused.status_code == 503 and refused.json()["error"]["message"].startswith("kvd's device failed")
    finally:
        service.shutdown(deadline=2)
    [record] = service.store.audit_since(action="exit")
    assert (record["result"], record["detail"]) == ("device_lost", {"error": why, "exit_code": 75})


def test_kvd_serve_exits_75_once_its_device_is_lost(tmp_path, device_gone, monkeypatch):
    """`kvd serve` end to end: a request whose step meets the lost device is answered 500, and kvd
    stops by itself with exit code 75 (systemd's Restart=on-failure starts it again)."""
    from typer.testing import CliRunner

    from kvctl.daemon.cli import app as kvd
    from kvctl.daemon.engine.engine import Engine

    real = Engine.step

    def step(engine):
        if engine.requests:
            raise torch.AcceleratorError(ILLEGAL_ACCESS)
        return real(engine)

    monkeypatch.setattr(Engine, "step", step)
    socket = tmp_path / "kvd.sock"
    answers = []

    def client():
        deadline = time.monotonic() + 60
        while not socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://kvd", timeout=60) as c:
            while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            answers.append(c.post("/v1/completions", json=BODY))

    asker = threading.Thread(target=client)
    asker.start()
    result = CliRunner().invoke(kvd, ["serve", "--state-dir", str(tmp_path), "--socket", str(socket),
                                      "--num-blocks", "64"])
    asker.join(10)
    assert (answers[0].status_code, answers[0].json()) == (500, ERROR)
    assert result.exit_code == 75, result.output
    assert not socket.exists()
