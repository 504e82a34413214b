"""`kvctl tiers verify`: the disk tier read through and every block verified, in the background,
after a start that read only the payloads' headers."""

from __future__ import annotations

import re
import threading
import time

import pytest

pytest.importorskip("torch")

from kvctl.daemon.cache.keys import PrefixHasher  # noqa: E402
from kvctl.daemon.server.tier_verify import DiskVerification  # noqa: E402

from .daemon_fixtures import call, start_service  # noqa: E402
from .kvd_process import kvctl, running_kvd  # noqa: E402
from .tier_engine import TEXT_A  # noqa: E402

DISK = dict(num_blocks=64, disk_cache_bytes="16MiB", tiering="always")


def flip_a_body_bit(service, text: str, block: int) -> bytes:
    """Flip one bit in the body of the `block`th block of `text`'s chain on disk; its key."""
    keys = PrefixHasher(service.engine.namespace("default")).feed(service.engine.tokenizer.encode(text))
    name, offset, length = service.tiers.disk.index[keys[block]]
    path = service.tiers.disk.segment_dir / name
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return keys[block]


def until_ended(app, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = call(app, "GET", "/admin/tiers").json()["verify"]
        if run["state"] != "running":
            return run
        time.sleep(0.02)
    raise AssertionError("the verification did not end")


def complete(app, text: str) -> dict:
    answer = call(app, "POST", "/v1/completions", json={"prompt": text, "max_tokens": 6, "temperature": 0,
                                                         "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_body_damaged_while_kvd_was_down_is_indexed_at_start_and_dropped_by_a_verification(tmp_path):
    from kvctl.daemon.server.app import create_app

    first = start_service(tmp_path, **DISK)
    before = complete(create_app(first, first.metrics, front="unix"), TEXT_A)
    first.shutdown(deadline=5)  # the device's blocks are written to disk
    service = start_service(tmp_path, **DISK)
    try:
        app = create_app(service, service.metrics, front="unix")
        victim = flip_a_body_bit(service, TEXT_A, 2)
        tiers = call(app, "GET", "/admin/tiers").json()
        blocks, segments = tiers["disk_scan"]["blocks"], tiers["disk_scan"]["segments"]
        assert blocks >= 3 and tiers["disk_scan"]["corrupt"] == 0  # the start read headers only
        assert victim in service.tiers.disk.index and tiers["verify"] is None
        folder_bytes = sum(s.size for s in service.tiers.disk.segments.values())

        started = call(app, "POST", "/admin/tiers/verify", json={})
        assert started.status_code == 200, started.text
        assert started.json()["verify"]["segments_total"] == segments
        assert started.json()["verify"]["rate_bytes_per_second"] == 256 << 20  # paced unless asked otherwise
        run = until_ended(app)
        assert {k: run[k] for k in ("state", "actor", "segments_total", "segments_done", "blocks", "bytes",
                                    "bad_blocks", "unreadable_segments", "error")} == {
            "state": "done", "actor": "unix-socket", "segments_total": segments, "segments_done": segments,
            "blocks": blocks, "bytes": folder_bytes, "bad_blocks": 1, "unreadable_segments": 0, "error": None}
        assert victim not in service.tiers.disk.index
        disk = call(app, "GET", "/admin/tiers").json()["tiers"]["disk"]
        assert (disk["blocks"], disk["checksum_failures"], disk["health"]) == (blocks - 1, 1, "ok")
        removed = service.engine.events.since(0, tiers=("disk",), kinds=("removed",)).events
        assert [(e.keys, e.reason) for e in removed] == [((victim,), "corrupt")]
        [audit] = call(app, "GET", "/admin/audit", params={"action": "tiers.verify"}).json()["entries"]
        assert (audit["actor"], audit["target"], audit["result"]) == ("unix-socket", "disk", "ok")

        after = complete(app, TEXT_A)  # blocks 0 and 1 restored; recomputed from the dropped one
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * 16
        assert call(app, "GET", "/admin/tiers").json()["tiers"]["disk"]["checksum_failures"] == 1
    finally:
        service.shutdown(deadline=2)


def test_one_verification_at_a_time_an_operator_can_stop_it_and_it_stops_with_kvd(tmp_path):
    from kvctl.daemon.server.app import create_app

    first = start_service(tmp_path, **DISK)
    complete(create_app(first, first.metrics, front="unix"), TEXT_A)
    first.shutdown(deadline=5)
    service = start_service(tmp_path, **DISK)
    try:
        app = create_app(service, service.metrics, front="unix")
        slow = call(app, "POST", "/admin/tiers/verify", json={"rate": 1})  # a byte a second: it waits after a segment
        assert slow.status_code == 200 and slow.json()["verify"]["rate_bytes_per_second"] == 1
        deadline = time.monotonic() + 10
        while call(app, "GET", "/admin/tiers").json()["verify"]["segments_done"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        again = call(app, "POST", "/admin/tiers/verify", json={})
        assert again.status_code == 409
        assert again.json()["error"]["message"] == (
            "tiers verify: one is running (started by unix-socket, 1 of "
            f"{slow.json()['verify']['segments_total']} segments read); stop it first (kvctl tiers verify --stop)")
        stopped = call(app, "DELETE", "/admin/tiers/verify")
        assert stopped.status_code == 200
        run = stopped.json()["verify"]
        assert (run["state"], run["stopped_by"], run["segments_done"]) == ("stopped", "unix-socket", 1)
        assert call(app, "DELETE", "/admin/tiers/verify").json()["error"]["message"] == "tiers verify: none is running"
        entries = call(app, "GET", "/admin/audit").json()["entries"]
        assert [e["action"] for e in entries if e["action"].startswith("tiers.")] == [  # newest first
            "tiers.verify.stop", "tiers.verify"]

        for bad in ({"rate": 0}, {"rate": -5}, {"rate": "fast"}, {"speed": 1}, {"unpaced": "yes"},
                    {"rate": 1 << 20, "unpaced": True}):
            refused = call(app, "POST", "/admin/tiers/verify", json=bad)
            assert refused.status_code == 400, (bad, refused.text)
            assert refused.json()["error"]["param"] in ("rate", "speed", "unpaced"), refused.text
        assert refused.json()["error"]["message"] == "rate: give a rate or unpaced, not both"
        unpaced = call(app, "POST", "/admin/tiers/verify", json={"unpaced": True}).json()["verify"]
        assert unpaced["rate_bytes_per_second"] is None
        until_ended(app)

        held = call(app, "POST", "/admin/tiers/verify", json={"rate": 1}).json()["verify"]
        assert held["state"] == "running"
        run = service.disk_verify
    finally:
        service.shutdown(deadline=2)
    assert (run.state, run.stopped_by) == ("stopped", "shutdown")  # kvd's stop ends it; no thread left
    assert not [t for t in threading.enumerate() if t.name == "kvd-tier-verify"]


def test_without_a_disk_tier_a_verification_is_refused_naming_the_setting(tmp_path):
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        refused = call(app, "POST", "/admin/tiers/verify", json={})
        assert refused.status_code == 409
        assert refused.json()["error"]["message"] == (
            "tiers verify: no disk tier is configured (tiers.disk.bytes, --disk-cache-bytes)")
    finally:
        service.shutdown(deadline=2)


class FakeDisk:
    def __init__(self, sizes):
        self.sizes = sizes

    def segment_names(self):
        return list(self.sizes)


class FakeTiers:
    """Segments of the given sizes; reading one advances the clock by a second."""

    def __init__(self, sizes, clock):
        self.disk, self.clock, self.read = FakeDisk(sizes), clock, []

    def verify_disk_segment(self, name):
        from kvctl.daemon.cache.tiers.disk import SegmentCheck

        self.read.append(name)
        self.clock.now += 1.0
        return SegmentCheck(blocks=2, bytes=self.disk.sizes[name])


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_rate_paces_the_reads_by_the_bytes_read_so_far():
    """At 100 bytes a second, 300 bytes read in the first second must wait until second 3."""
    clock = Clock()
    tiers = FakeTiers({"a": 300, "b": 100, "c": 50}, clock)
    run = DiskVerification(tiers, "ops", rate=100.0, clock=clock, wall=lambda: 1_700_000_000.0)
    waits = []

    def wait(seconds):
        waits.append(seconds)
        clock.now += seconds
        return False
    run._stop.wait = wait
    run.run()
    assert tiers.read == ["a", "b", "c"]
    assert waits == [2.0, 0.0, 0.0]  # 300 B by t=1 (wait to t=3); 400 B by t=4; 450 B by t=5 (4.5 was due)
    report = run.report()
    assert (report["state"], report["blocks"], report["bytes"], report["seconds"]) == ("done", 6, 450, 5.0)


def test_kvctl_tiers_verify_waits_shows_the_result_and_fails_when_a_block_failed(tmp_path):
    sock_dir = tmp_path / "run"
    sock_dir.mkdir()
    with running_kvd(sock_dir) as (_, client, sock):
        answer = client.post("/v1/completions", json={"prompt": TEXT_A, "max_tokens": 4, "temperature": 0,
                                                      "ignore_eos": True})
        assert answer.status_code == 200
    with running_kvd(sock_dir) as (_, client, sock):
        clean = kvctl(sock, "tiers", "verify", "--wait", "--rate", "max")
        assert clean.returncode == 0, clean.stderr
        assert re.fullmatch(r"disk verify: done \(started by unix-socket\): (\d+) of \1 segments, \d+ blocks, "
                            r"[\d.]+ [KMG]iB read in [\d.]+ m?s; no block failed verification\n", clean.stdout), clean.stdout
        shown = kvctl(sock, "tiers")
        assert "disk verify: done (started by unix-socket)" in shown.stdout
        assert re.search(r"disk at start: \d+ blocks re-indexed in [\d.]+ m?s", shown.stdout), shown.stdout
        segment = next((sock_dir / "state" / "kvcache" / "segments").glob("*.kvseg"))
        data = bytearray(segment.read_bytes())
        data[len(data) // 2] ^= 0x01  # inside one payload: that block alone fails
        segment.write_bytes(bytes(data))
        failed = kvctl(sock, "tiers", "verify", "--wait", "--json")
        assert failed.returncode == 1, failed.stderr
        assert '"bad_blocks": 1' in failed.stdout
        stop = kvctl(sock, "tiers", "verify", "--stop", "--rate", "1MiB")
        assert stop.returncode == 2 and "--stop: give it alone (not with --rate or --wait)" in stop.stderr
        bad = kvctl(sock, "tiers", "verify", "--rate", "fast")
        assert bad.returncode == 2 and "rate: must be a size > 0 (a size a second: 200MiB, 1GiB; or max), got 'fast'" in bad.stderr


def test_at_kvd_router_each_replica_verifies_its_own_disk_and_one_without_a_disk_says_why(tmp_path):
    from kvctl.daemon.server.app import create_app
    from kvctl.tiers_cmd import _wait_for_fleet, verify_text

    from .test_router import drive, router_app

    first = start_service(tmp_path / "r0", **DISK)
    complete(create_app(first, first.metrics, front="unix"), TEXT_A)
    first.shutdown(deadline=5)
    services = [start_service(tmp_path / "r0", **DISK), start_service(tmp_path / "r1", num_blocks=64)]
    try:
        apps = [create_app(s, s.metrics, front="unix") for s in services]
        _, router = router_app(apps)
        [answer] = drive(router, [lambda c: c.post("/admin/tiers/verify", json={})])
        assert answer.status_code == 200, answer.text
        body = answer.json()
        segments = services[0].tier_scan.segments
        assert (body["result"], body["segments_total"]) == ("partial", segments)
        rows = {row["replica"]: row for row in body["replicas"]}
        assert rows["replica-0"]["status"] == 200 and rows["replica-0"]["verify"]["segments_total"] == segments
        assert rows["replica-1"]["status"] == 409

        class RouterClient:
            def get(self, path):
                [got] = drive(router, [lambda c: c.get(path)])
                return got.json()

        waited = _wait_for_fleet(RouterClient(), body, quiet=True, sleep=lambda s: None)
        done = {row["replica"]: row for row in waited["replicas"]}["replica-0"]["verify"]
        assert (done["state"], done["segments_done"], done["bad_blocks"]) == ("done", segments, 0)
        lines = verify_text(waited).splitlines()
        assert lines[0].startswith(f"replica-0: disk verify: done (started by unix-socket): {segments} of {segments} "
                                   "segments, ")
        assert lines[1] == ("replica-1: refused (tiers verify: no disk tier is configured (tiers.disk.bytes, "
                            "--disk-cache-bytes))")
    finally:
        for service in services:
            service.shutdown(deadline=2)


def test_kvctl_tiers_verify_wait_shows_progress_on_stderr_and_ends_that_line_before_the_result(capsys):
    from kvctl.tiers_cmd import _wait_for_verify, verify_line

    report = {"state": "running", "actor": "ops", "stopped_by": None, "seconds": 1.5, "rate_bytes_per_second": None,
              "segments_total": 4, "segments_done": 1, "blocks": 8, "bytes": 1 << 20, "bad_blocks": 0,
              "unreadable_segments": 0, "error": None}
    answers = iter([report, {**report, "segments_done": 3}, {**report, "state": "done", "segments_done": 4}])

    class Kvd:
        def get(self, path):
            assert path == "/admin/tiers"
            return {"verify": next(answers)}

    done = _wait_for_verify(Kvd(), quiet=False, sleep=lambda s: None)
    assert done["state"] == "done"
    err = capsys.readouterr().err
    assert err == "\r" + verify_line(report) + "\r" + verify_line({**report, "segments_done": 3}) + "\n"
    assert verify_line(report) == ("disk verify: running (started by ops): 1 of 4 segments, 8 blocks, 1.0 MiB read "
                                   "in 1.50 s; no block failed verification")
