"""`kvctl profile` (POST /admin/profile/start and /stop; vLLM's and SGLang's /start_profile and
/stop_profile): torch.profiler over the engine thread, started and stopped between steps, each step
under kvd.step, written whole as a gzipped Chrome trace, one at a time, stopped by itself after
max_seconds, and written when kvd stops."""

from __future__ import annotations

import gzip
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.server import engine_profile  # noqa: E402

from .daemon_fixtures import USER_TOKEN, apps, call, settled, token_table  # noqa: E402
from .evict_cases import serving  # noqa: E402
from .test_router import _kvctl_prints  # noqa: E402


def steps_run(unix) -> int:
    return sum(kind["count"] for kind in call(unix, "GET", "/admin/status").json()["steps"].values())


def complete(unix, text: str) -> None:
    answer = call(unix, "POST", "/v1/completions", json={"prompt": text, "max_tokens": 4, "ignore_eos": True})
    assert answer.status_code == 200, answer.text


def test_a_profile_records_each_engine_step_and_is_written_whole(tmp_path):
    with serving(tmp_path) as (service, unix):
        complete(unix, "A first request, before the profile.")
        before = steps_run(unix)
        started = call(unix, "POST", "/admin/profile/start", json={"max_seconds": 120})
        assert started.status_code == 200
        assert (started.json()["profiling"], started.json()["max_seconds"], started.json()["by"]) == (
            True, 120.0, "unix-socket")
        complete(unix, "Profile me.")
        complete(unix, "And me too, please.")
        steps = steps_run(unix) - before
        written = call(unix, "POST", "/admin/profile/stop").json()
        assert (written["steps"], written["stopped_by"], written["started_by"], written["device"]) == (
            steps, "unix-socket", "unix-socket", "cpu")
        path = tmp_path / "profiles" / written["path"].rsplit("/", 1)[-1]
        assert str(path) == written["path"] and path.stat().st_size == written["bytes"]
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no partial file beside it
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        assert sum(e.get("name") == "kvd.step" and e.get("ph") == "X" for e in events) == steps
        top = written["top"]
        assert [row["self_cpu_ms"] for row in top] == sorted((row["self_cpu_ms"] for row in top), reverse=True)
        [step_row] = [row for row in top if row["name"] == "kvd.step"]
        assert step_row["calls"] == steps and step_row["cpu_ms"] >= step_row["self_cpu_ms"] > 0
        assert any(row["name"] == "aten::mm" for row in top) and "top_device" not in written  # no kernels on a CPU
        assert written["self_ms_total"] >= sum(row["self_cpu_ms"] for row in top) - 0.01 * len(top)
        assert call(unix, "GET", "/admin/profile").json() == {"running": None, "latest": written,
                                                              "folder": str(tmp_path / "profiles")}
        audit = call(unix, "GET", "/admin/audit").json()["entries"]
        assert [(e["action"], e["target"], e["actor"]) for e in audit[:2]] == [
            ("profile_stop", "engine", "unix-socket"), ("profile_start", "engine", "unix-socket")]
        assert audit[0]["detail"] == {"path": written["path"], "seconds": written["seconds"], "steps": steps}


def test_one_profile_runs_at_a_time_and_stops_by_itself_after_max_seconds(tmp_path):
    with serving(tmp_path) as (service, unix):
        for bad in (0, -1, 601):
            refused = call(unix, "POST", "/admin/profile/start", json={"max_seconds": bad})
            assert refused.status_code == 400 and refused.json()["error"]["message"] == (
                f"max_seconds: must be more than 0 and at most 600, got {float(bad)!r}")
        none = call(unix, "POST", "/admin/profile/stop")
        assert none.status_code == 409 and none.json()["error"]["message"] == (
            "profile: none is running; `kvctl profile start` starts one")
        assert call(unix, "POST", "/admin/profile/start", json={"max_seconds": 0.2}).status_code == 200
        again = call(unix, "POST", "/admin/profile/start", json={})
        assert again.status_code == 409 and again.json()["error"]["message"] == (
            "profile: one is running (started by unix-socket); `kvctl profile stop` ends it")
        status = settled(lambda: call(unix, "GET", "/admin/profile").json(), lambda d: d["latest"] is not None)
        assert status["running"] is None and status["latest"]["stopped_by"] == "max_seconds"
        late = call(unix, "POST", "/admin/profile/stop")  # the one that stopped by itself, once
        assert late.status_code == 200 and late.json() == status["latest"]
        again = call(unix, "POST", "/admin/profile/stop")
        assert again.status_code == 409 and again.json()["error"]["message"] == (
            "profile: none is running; `kvctl profile start` starts one (the latest, "
            f"{status['latest']['seconds']:.1f} s stopped by max_seconds, is {status['latest']['path']})")


def test_a_profile_stops_by_itself_after_its_steps(tmp_path):
    """Under load the trace grows with the steps (thousands of steps took minutes to summarise and
    gigabytes of memory): max_steps bounds it whatever the time."""
    with serving(tmp_path) as (_, unix):
        for bad in (0, 10_001):
            refused = call(unix, "POST", "/admin/profile/start", json={"max_steps": bad})
            assert refused.status_code == 400 and refused.json()["error"]["message"] == (
                f"max_steps: must be from 1 to 10,000, got {bad}")
        started = call(unix, "POST", "/admin/profile/start", json={"max_seconds": 120, "max_steps": 2}).json()
        assert (started["max_seconds"], started["max_steps"]) == (120.0, 2)
        complete(unix, "Four tokens, so more steps than the profile takes.")
        written = call(unix, "POST", "/admin/profile/stop").json()
        assert (written["steps"], written["stopped_by"]) == (2, "max_steps")
        [step_row] = [row for row in written["top"] if row["name"] == "kvd.step"]
        assert step_row["calls"] == 2


def test_vllm_s_and_sglang_s_names_need_the_admin_role_and_kvd_writes_a_profile_as_it_stops(tmp_path):
    with serving(tmp_path) as (service, unix):
        _, tcp = apps(service, token_table(tmp_path))
        user = call(tcp, "POST", "/start_profile", headers={"Authorization": f"Bearer {USER_TOKEN}"})
        assert user.status_code == 403
        assert call(unix, "POST", "/start_profile").json()["max_seconds"] == 30.0  # an empty POST, as AIPerf's
        complete(unix, "Between the start and the stop.")
        stopped = call(unix, "POST", "/stop_profile")
        assert stopped.status_code == 200 and stopped.json()["steps"] > 0
        assert call(unix, "POST", "/start_profile").status_code == 200
    latest = service.profiler.latest  # the one running when kvd stopped: written, not lost
    assert latest["stopped_by"] == "kvd stopping" and latest["serial"] == 2
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == sorted(
        [stopped.json()["path"].rsplit("/", 1)[-1], latest["path"].rsplit("/", 1)[-1]])


def test_only_the_newest_profiles_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_profile, "PROFILES_KEPT", 2)
    with serving(tmp_path) as (service, unix):
        paths = []
        for _ in range(3):
            assert call(unix, "POST", "/admin/profile/start", json={}).status_code == 200
            paths.append(call(unix, "POST", "/admin/profile/stop").json()["path"])
        assert sorted(str(p) for p in (tmp_path / "profiles").iterdir()) == sorted(paths[1:])


WRITTEN = {"serial": 3, "path": "/var/lib/kvd/profiles/kvd-profile-20261203T010130Z-77-3.json.gz",
           "bytes": 2_300_000, "since": 1796259690.0, "seconds": 9.87, "steps": 1234, "started_by": "ops",
           "stopped_by": "ops", "device": "cpu", "self_ms_total": 1000.0,
           "top": [{"name": "kvd.step", "calls": 1234, "self_cpu_ms": 462.0, "cpu_ms": 997.5},
                   {"name": "aten::mm", "calls": 11106, "self_cpu_ms": 98.25, "cpu_ms": 99.0},
                   {"name": "aten::index_select", "calls": 6170, "self_cpu_ms": 57.0, "cpu_ms": 72.4}]}


def test_kvctl_profile_shows_where_the_trace_is_and_the_ops_that_took_longest():
    lines = [line.rstrip() for line in _kvctl_prints(["profile", "stop", "--top", "2"], WRITTEN).splitlines()]
    assert lines == [
        "profile of 9.9 s, 1,234 steps (cpu), stopped by ops; its trace (2.2 MiB):",
        "/var/lib/kvd/profiles/kvd-profile-20261203T010130Z-77-3.json.gz",
        "op        calls self CPU ms CPU ms self share",
        "kvd.step  1,234       462.0  997.5      46.2%",
        "aten::mm 11,106        98.2   99.0       9.8%",
        "self share: of every op's own CPU time (less the ops inside it); kvd.step's own time is the engine's",
        "Python around its ops. Open the trace in https://ui.perfetto.dev"]
    gpu = {**WRITTEN, "device": "cuda", "device_ms_total": 500.0,
           "top_device": [{"name": "_paged_decode_kernel", "calls": 80, "device_ms": 250.0},
                          {"name": "_write_kv_kernel", "calls": 80, "device_ms": 50.0}]}
    shown = [line.rstrip() for line in _kvctl_prints(["profile", "stop", "--top", "1"], gpu).splitlines()]
    assert shown[2:7] == ["op       calls self CPU ms CPU ms self share",
                          "kvd.step 1,234       462.0  997.5      46.2%",
                          "GPU kernel           calls GPU ms share",
                          "_paged_decode_kernel    80  250.0 50.0%",
                          "self share: of every op's own CPU time (less the ops inside it); kvd.step's own time is "
                          "the engine's"]
    running = {"running": {"by": "ops", "steps": 40, "max_seconds": 30.0, "max_steps": 200, "since": 1.0},
               "latest": None, "folder": "/var/lib/kvd/profiles"}
    assert _kvctl_prints(["profile", "show"], running).splitlines() == [
        "a profile is running: started by ops, 40 steps so far, for at most 30 s and 200 steps"]


def test_kvctl_profile_refuses_a_length_kvd_would_refuse(capsys):
    from .test_cli import cli

    status, _, err = cli(capsys, "profile", "--seconds", "0")
    assert status == 2 and "--seconds: must be more than 0 and at most 595, got 0" in err
    status, _, err = cli(capsys, "profile", "start", "--max-seconds", "700")
    assert status == 2 and "--max-seconds: must be more than 0 and at most 600, got 700" in err
    status, _, err = cli(capsys, "profile", "--steps", "0")
    assert status == 2 and "--steps: must be from 1 to 10,000, got 0" in err


def test_kvctl_profile_starts_waits_and_stops(monkeypatch):
    """`kvctl profile --seconds S`: a start with S and a little more as kvd's own limit (kvd stops
    it by itself if kvctl is killed meanwhile), then every half second a look whether it stopped by
    itself (its steps), for S seconds at most, then the stop, whose answer it shows."""
    import kvctl.profile_cmd as profile_cmd

    asked, slept, clock = [], [], [100.0]

    class Client:
        def post(self, path, body):
            asked.append((path, body))
            return WRITTEN if path.endswith("/stop") else {"profiling": True, **body}

        def get(self, path):
            asked.append((path, None))
            return {"running": {"steps": 10} if len(slept) < 3 else None}

    monkeypatch.setattr(profile_cmd, "client_for", lambda ctx: Client())
    monkeypatch.setattr(profile_cmd.time, "sleep", lambda s: (slept.append(s), clock.append(clock[-1] + s)))
    monkeypatch.setattr(profile_cmd.time, "monotonic", lambda: clock[-1])
    from typer.testing import CliRunner

    from kvctl.cli import app

    result = CliRunner().invoke(app, ["profile", "--seconds", "12.5"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert asked == [("/admin/profile/start", {"max_seconds": 17.5, "max_steps": 200}),
                     *[("/admin/profile", None)] * 3, ("/admin/profile/stop", {})]  # it stopped by itself
    assert slept == [0.5, 0.5, 0.5] and result.output.startswith("profile of 9.9 s, 1,234 steps (cpu)")
    asked.clear(), slept.clear()
    result = CliRunner().invoke(app, ["profile", "--seconds", "1.2", "--steps", "50"], env={"COLUMNS": "100"})
    assert asked[0] == ("/admin/profile/start", {"max_seconds": 6.2, "max_steps": 50})
    assert slept == [0.5, 0.5, pytest.approx(0.2)] and asked[-1] == ("/admin/profile/stop", {})


@pytest.mark.cuda
def test_on_cuda_a_profile_ranks_the_kernels_by_their_gpu_time(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with serving(tmp_path, device="cuda") as (service, unix):
        assert call(unix, "POST", "/admin/profile/start", json={}).status_code == 200
        complete(unix, "Profile the kernels.")
        written = call(unix, "POST", "/admin/profile/stop").json()
        kernels = written["top_device"]
        assert written["device"] == "cuda" and kernels[0]["device_ms"] > 0 and written["device_ms_total"] > 0
        assert [row["device_ms"] for row in kernels] == sorted((row["device_ms"] for row in kernels), reverse=True)


def profiling_stub():
    """A replica that answers the profile calls as a kvd does (torch's profiler is one per process:
    two real replicas in this test process could not both profile)."""
    from fastapi import FastAPI

    stub = FastAPI()
    for path in ("/admin/profile/start", "/start_profile"):
        stub.post(path)(lambda: {"profiling": True, "max_seconds": 30.0, "max_steps": 200, "since": 1.0,
                                 "by": "router"})
    for path in ("/admin/profile/stop", "/stop_profile"):
        stub.post(path)(lambda: WRITTEN)
    stub.get("/admin/profile")(lambda: {"running": None, "latest": WRITTEN, "folder": "/var/lib/kvd/profiles"})
    return stub


def test_at_kvd_router_each_replica_profiles_its_own_engine(tmp_path):
    """kvctl profile (and AIPerf's /start_profile, /stop_profile) at kvd router: every replica
    profiles its engine and writes its own trace; the answer keeps each one's under its name, and a
    replica that could not start one makes it partial (exit 3 in kvctl)."""
    from kvctl.daemon.server.app import create_app

    from .test_router import drive, router_app

    with serving(tmp_path) as (service, unix):
        _, app = router_app([create_app(service, service.metrics, front="unix"), profiling_stub()])

        async def start(client):
            return (await client.post("/start_profile")).json()

        async def stop(client):
            return (await client.post("/stop_profile")).json()

        async def show(client):
            return (await client.get("/admin/profile")).json()

        [started] = drive(app, [start])
        assert (started["result"], started["replicas_profiled"], started["max_seconds"]) == ("ok", 2, 30.0)
        complete(unix, "At the replica.")
        written, shown = drive(app, [stop, show])
        assert [(row["replica"], row["status"]) for row in written["replicas"]] == [("replica-0", 200),
                                                                                     ("replica-1", 200)]
        mine = written["replicas"][0]
        assert mine["path"].startswith(str(tmp_path / "profiles")) and mine["steps"] == 4  # a prefill, 3 decodes
        assert [row["report"]["latest"]["path"] for row in shown["replicas"]] == [mine["path"], WRITTEN["path"]]
        printed = _kvctl_prints(["profile", "stop"], written).splitlines()
        assert [line for line in printed if line.startswith(("replica ", "profile of"))] == [
            "replica replica-0", printed[1], "replica replica-1",
            "profile of 9.9 s, 1,234 steps (cpu), stopped by ops; its trace (2.2 MiB):"]
        assert printed[1].startswith("profile of ")
        assert "4 steps (cpu), stopped by unix-socket; its trace (" in printed[1]

        assert call(unix, "POST", "/admin/profile/start", json={}).status_code == 200  # replica-0 is busy
        [half] = drive(app, [start])
        assert half["result"] == "partial" and half["replicas_profiled"] == 1
        assert half["message"] == ("replica-0: refused (409: profile: one is running (started by unix-socket); "
                                   "`kvctl profile stop` ends it)")
        assert " ".join(_kvctl_prints(["profile", "start"], half).split()).startswith(
            "profiling kvd's engine thread on 1 replica, for at most 30 s and 200 steps: `kvctl profile stop` ends it")


def test_two_engines_in_one_process_take_turns_at_the_profiler(tmp_path):
    """torch's profiler is one per process (two at once crashed it): a second engine in the same
    process (tests; never kvd serve) is refused until the first profile is written."""
    with serving(tmp_path / "a") as (_, first), serving(tmp_path / "b") as (_, second):
        assert call(first, "POST", "/admin/profile/start", json={}).status_code == 200
        refused = call(second, "POST", "/admin/profile/start", json={})
        assert refused.status_code == 409 and refused.json()["error"]["message"] == (
            "profile: another engine in this process is being profiled (torch's profiler is one per process)")
        assert call(first, "POST", "/admin/profile/stop").status_code == 200
        assert call(second, "POST", "/admin/profile/start", json={}).status_code == 200
        assert call(second, "POST", "/admin/profile/stop").status_code == 200


def test_an_op_s_own_time_is_its_time_less_the_ops_inside_it_on_its_thread():
    """The summary of a profile's events (engine_profile.summarise), from spans made by hand:
    nested ops on one thread, another thread's op beside them, and kernels on the device."""
    ms = 1_000_000
    events = [(1, 0, 10 * ms, "kvd.step", False),  # a step of 10 ms on thread 1...
              (1, 1 * ms, 5 * ms, "aten::linear", False),  # ...with a linear of 4 ms in it...
              (1, 2 * ms, 4 * ms, "aten::mm", False),  # ...whose mm takes 2 of them
              (1, 6 * ms, 7 * ms, "aten::mm", False),  # and another mm, after the linear
              (1, 10 * ms, 12 * ms, "kvd.step", False),  # the next step, starting as the first ends
              (2, 3 * ms, 9 * ms, "aten::copy_", False),  # thread 2, overlapping in time: not nested
              (3, 0, 5 * ms // 2, "aten::sum", False),  # as torch counts it, one op: the dispatcher's
              (3, ms // 2, 2 * ms, "aten::sum", False),  # second frame of the same name is folded into it
              (0, 2 * ms, 3 * ms, "_paged_decode_kernel", True), (0, 7 * ms, 9 * ms, "_paged_decode_kernel", True),
              (0, 4 * ms, 5 * ms, "_write_kv_kernel", True)]
    summary = engine_profile.summarise(events, count=4)
    assert summary["top"] == [{"name": "kvd.step", "calls": 2, "self_cpu_ms": 7.0, "cpu_ms": 12.0},
                              {"name": "aten::copy_", "calls": 1, "self_cpu_ms": 6.0, "cpu_ms": 6.0},
                              {"name": "aten::mm", "calls": 2, "self_cpu_ms": 3.0, "cpu_ms": 3.0},
                              {"name": "aten::sum", "calls": 1, "self_cpu_ms": 2.5, "cpu_ms": 2.5}]
    assert summary["self_ms_total"] == 7.0 + 6.0 + 3.0 + 2.5 + 2.0  # and the linear's own 2 ms
    assert summary["top_device"] == [{"name": "_paged_decode_kernel", "calls": 2, "device_ms": 3.0},
                                     {"name": "_write_kv_kernel", "calls": 1, "device_ms": 1.0}]
    assert summary["device_ms_total"] == 4.0
    assert "top_device" not in engine_profile.summarise(events[:8])


def test_the_summary_agrees_with_torch_s_own_key_averages():
    """engine_profile.top_ops reads kineto's events itself (torch's key_averages took 21 s for a
    200-step profile): each op's calls, own and total time as torch's reference counts them."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(8, 32)
    recorded = profile(activities=[ProfilerActivity.CPU])
    recorded.start()
    for _ in range(5):
        with record_function(engine_profile.STEP_NAME):
            for _ in range(3):
                (x @ torch.randn(32, 32)).relu().sum()
    recorded.stop()
    ours = {row["name"]: row for row in engine_profile.top_ops(recorded, count=1000)["top"]}
    theirs = {e.key: e for e in recorded.key_averages()}
    assert set(ours) == set(theirs) and ours[engine_profile.STEP_NAME]["calls"] == 5
    for name, row in ours.items():
        reference = theirs[name]
        assert row["calls"] == reference.count, name
        assert row["self_cpu_ms"] == pytest.approx(reference.self_cpu_time_total / 1e3, abs=0.002), name
        assert row["cpu_ms"] == pytest.approx(reference.cpu_time_total / 1e3, abs=0.002), name
