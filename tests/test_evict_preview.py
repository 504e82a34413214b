"""`kvctl evict --dry-run` (`POST /admin/evict/preview`): what an eviction would take, in the
eviction's own answer, with nothing evicted, searched or audited."""

from __future__ import annotations

from kvctl.daemon.engine.sampling import SamplingParams
from kvctl.daemon.server import evict_ops
from kvctl.daemon.server.calls import Principal

from .daemon_fixtures import call
from .evict_cases import ASK_A, ASK_B, BLOCK, ask, serving


def state(unix) -> tuple:
    """Everything an eviction changes: the device's blocks, the rows, every tier, the audit log."""
    rows = [{k: v for k, v in row.items() if k not in ("idle_seconds", "last_use")}  # (clock readings)
            for row in call(unix, "GET", "/admin/prefixes").json()["prefixes"]]
    return (call(unix, "GET", "/admin/status").json()["blocks"], rows,
            call(unix, "GET", "/admin/tiers").json()["tiers"]["disk"]["blocks"],
            call(unix, "GET", "/admin/audit").json()["entries"])


def test_a_preview_answers_as_the_eviction_then_does_and_changes_nothing(tmp_path):
    with serving(tmp_path, disk_cache_bytes="16MiB", tiering="always",
                 write_policy="write_through") as (service, unix):
        ask(unix, ASK_A)
        ask(unix, ASK_B)
        ask(unix, ASK_B, tenant="acme")
        assert service.tiers.flush(timeout=10)
        a_row = [r for r in call(unix, "GET", "/admin/prefixes").json()["prefixes"] if r["start_token"] > 0][0]
        for body in ({"tokens": ASK_A}, {"prefix": a_row["prefix_id"]}, {"tenant": "acme"}, {"all_unpinned": True}):
            before = state(unix)
            preview = call(unix, "POST", "/admin/evict/preview", json=body).json()
            assert state(unix) == before, body  # nothing went, nothing was audited
            assert preview.pop("dry_run") is True
            done = call(unix, "POST", "/admin/evict", json=body).json()
            assert service.tiers.flush(timeout=10)
            assert preview == done and done["evicted_blocks"] > 0 and done["lower_tier_blocks_dropped"] > 0, body
        assert call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"] == 0


def test_a_preview_is_refused_as_the_eviction_is_and_says_what_in_use_would_keep(tmp_path):
    with serving(tmp_path) as (service, unix):
        bad = call(unix, "POST", "/admin/evict/preview", json={"tenant": "acme", "prefix": "abcd"})
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("evict: give exactly one of")
        ask(unix, ASK_A)
        with service.lock:  # the engine's thread waits: a request holds the prompt's blocks meanwhile
            engine = service.engine
            engine.add_request(ASK_A, SamplingParams(max_tokens=50, temperature=0.0), request_id="held")
            engine.step()
            preview = evict_ops.evict(service, prefix_id=None, tenant=None, model_revision=None, all_unpinned=True,
                                      principal=Principal("default", "admin", "test"), dry_run=True)
            engine.cancel("held")
            del engine.requests["held"]
        held = preview["skipped"]["in_use"]
        assert held == len(ASK_A) // BLOCK  # the prompt's full blocks
        assert preview["message"] == f"{held} blocks are in use by running requests now and would stay"
        assert preview["result"] == "ok"  # the preview itself did all it was asked

