"""examples/kvd-alerts.yml: every rule reads metrics and labels kvd (or kvd router) exports, stays
quiet on a healthy kvd, and fires on the condition it names, with the labels its text uses.

The rules run on two scrapes of a real kvd through tests/promql_eval.py; `for:` durations are
Prometheus's part and not modelled. (The kvctl commands the rules name are parsed in test_cli.py.)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("fastapi")
promql_parser = pytest.importorskip("promql_parser")

from kvctl.daemon.config import ConfigError  # noqa: E402
from kvctl.daemon.server.app import create_app  # noqa: E402
from kvctl.daemon.store import Store  # noqa: E402

from .daemon_fixtures import call, scrape_every_family, start_service  # noqa: E402
from .tls_certs import serving_tls  # noqa: E402
from .promql_eval import Scrapes, Unsupported, samples  # noqa: E402
from .test_router import drive, router_app  # noqa: E402

RULES = Path(__file__).parent.parent / "examples" / "kvd-alerts.yml"
KVD = {"job": "kvd", "instance": "gpu-node-1:8100"}  # the target labels Prometheus adds (examples/prometheus.yml)
ROUTER = {"job": "kvd-router", "instance": "gpu-node-1:8000"}
TARGET_LABELS = set(KVD)
# rules the evaluator cannot run (offset, histogram_quantile): checked for the names they use only
NOT_EVALUATED = {"KvdPrefixHitRatioFell", "KvdSlowFirstToken"}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def up(value: float, target: dict) -> dict:
    return {"up": {frozenset(target.items()): value}}


def fired(scrapes: Scrapes) -> dict[str, dict]:
    """Alert name -> the series it fires for (sorted label pairs -> value), for the rules that fire."""
    out = {}
    for rule in rules():
        if rule["alert"] in NOT_EVALUATED:
            continue
        firing = scrapes.firing(rule["expr"])
        if firing:
            out[rule["alert"]] = firing
    return out


def series(target: dict, value: float, **labels: str) -> dict:
    return {tuple(sorted({**target, **labels}.items())): value}


def scrape(app, target=KVD) -> dict:
    return samples(call(app, "GET", "/metrics").text, **target)


def test_the_rules_file_is_well_formed():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert [g["name"] for g in groups] == ["kvd", "kvd-store", "kvd-tiers", "kvd-router"]
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)) == 39
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"Kvd(Router)?[A-Z][A-Za-z]+", rule["alert"])
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        assert "kvctl " in rule["annotations"]["description"], f"{rule['alert']} names no kvctl command"
        promql_parser.parse(rule["expr"])  # raises on a syntax error
        if "for" in rule:
            promql_parser.parse_duration(rule["for"])
    assert {rule["alert"] for rule in rules() if rule["alert"] in NOT_EVALUATED} == NOT_EVALUATED


def test_every_rule_reads_metrics_and_labels_that_kvd_or_its_router_exports(tmp_path):
    """Each selector names a series with samples in kvd's (every family showing) or kvd router's
    /metrics, each matcher a label it carries (and, for =, a value it takes); each grouping and
    each {{ $labels.X }} of the text a label the result keeps. No family uses a label Prometheus
    sets on a target (job, instance): it would be renamed exported_job at the scrape."""
    kvd_text = scrape_every_family(tmp_path / "kvd")
    service = start_service(tmp_path / "replica", num_blocks=64)
    try:
        router, app = router_app([create_app(service, service.metrics, front="unix")], view="events")
        router.tls = serving_tls(tmp_path)  # its TCP front's certificate (tls.py), which kvd's families have too
        [router_text] = drive(app, [lambda c: c.get("/metrics")], service=router)
        router_text = router_text.text
    finally:
        service.shutdown(deadline=2)
    exported = {**samples(kvd_text), **samples(router_text)}
    assert all(not TARGET_LABELS & {name for name, _ in labels} for named in exported.values() for labels in named)
    exported["up"] = {frozenset(): 1.0}
    for rule in rules():
        tree, kept = promql_parser.parse(rule["expr"]), set(TARGET_LABELS)
        nodes = []
        promql_parser.walk(tree, nodes.append)
        for node in nodes:
            if isinstance(node, promql_parser.MatrixSelector):
                node = node.vector_selector
            if isinstance(node, promql_parser.VectorSelector):
                assert node.name in exported, f"{rule['alert']}: {node.name} is not exported"
                carried = {}
                for labels in exported[node.name]:
                    for name, value in labels:
                        carried.setdefault(name, set()).add(value)
                kept |= set(carried)
                for matcher in node.matchers.matchers:
                    if matcher.name in TARGET_LABELS:
                        continue
                    assert matcher.name in carried, f"{rule['alert']}: {node.name} has no label {matcher.name}"
                    if str(matcher.op).endswith(".Equal"):
                        assert matcher.value in carried[matcher.name], (rule["alert"], matcher.value)
        for node in reversed(nodes):  # (the walk goes outside in: an inner aggregation narrows first)
            grouping = node.modifier if isinstance(node, promql_parser.AggregateExpr) else None
            if grouping is not None:
                assert set(grouping.labels) <= kept | {"le"}, rule["alert"]
                kept &= set(grouping.labels)
        text = " ".join(rule["annotations"].values())
        for name in re.findall(r"\$labels\.(\w+)", text):
            assert name in kept, f"{rule['alert']}: its text uses $labels.{name}, which the result does not keep"


def test_the_certificate_rule_fires_two_weeks_before_kvd_or_its_router_serves_an_expired_one(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        service.tls = serving_tls(tmp_path, days=90)
        fresh = scrape(app)
        assert fired(Scrapes(fresh | up(1, KVD), fresh | up(1, KVD))) == {}
        service.tls = serving_tls(tmp_path, days=3)
        soon = scrape(app)
        now = service.tls.certificate.not_after - 3 * 86_400
        assert fired(Scrapes(fresh | up(1, KVD), soon | up(1, KVD), now=now)) == {
            "KvdTlsCertificateExpiring": series(KVD, 3 * 86_400.0)}
        router, router_front = router_app([create_app(service, service.metrics, front="unix")], view="events")
        router.tls = serving_tls(tmp_path, days=1)
        [text] = drive(router_front, [lambda c: c.get("/metrics")], service=router)
        at_router = samples(text.text, **ROUTER)
        now = router.tls.certificate.not_after - 86_400
        assert fired(Scrapes(at_router | up(1, ROUTER), at_router | up(1, ROUTER), now=now)) == {
            "KvdTlsCertificateExpiring": series(ROUTER, 86_400.0)}
    finally:
        service.shutdown(deadline=2)


def test_the_kvd_rules_stay_quiet_on_a_healthy_kvd_and_fire_on_what_they_name(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        healthy = scrape(app)
        for question in ("What is a block?", "What is a pin?"):
            answer = call(app, "POST", "/v1/completions", json={"prompt": "Answer briefly. " + question,
                                                                "max_tokens": 4})
            assert answer.status_code == 200
        now = scrape(app)
        assert fired(Scrapes(healthy | up(1, KVD), now | up(1, KVD))) == {}
        assert fired(Scrapes(now | up(1, KVD), now | up(0, KVD))) == {"KvdDown": series(KVD, 0.0)}

        refused = call(app, "POST", "/v1/completions", json={"prompt": list(range(200)) * 6, "max_tokens": 4})
        assert refused.status_code == 400 and "it can never fit" in refused.text
        before, now = now, scrape(app)
        assert fired(Scrapes(before, now)) == {"KvdRequestsNeverFit": series(KVD, 1.0, reason="never_fits")}

        def broken():
            raise ConfigError("max_queue: must be a positive integer, got 0 (from /etc/kvd/kvd.yaml)")
        service.config_source = broken
        with pytest.raises(Exception, match="reload refused, nothing changed: max_queue"):
            service.reload_from_source("ops")
        before, now = now, scrape(app)
        refused_reload = {"KvdConfigReloadRefused": series(KVD, 0.0)}
        assert fired(Scrapes(before, now)) == refused_reload

        path = tmp_path / "kvd.sqlite3"
        Store(tmp_path / "other.sqlite3").close()
        os.replace(tmp_path / "other.sqlite3", path)  # another file put in the store's place
        deadline = 100
        while service.store.file_ok and deadline:
            deadline -= 1
            service.store.check_file()
        assert call(app, "POST", "/admin/drain", json={}).status_code == 200  # audited: the record goes to the log
        before, now = now, scrape(app)
        assert fired(Scrapes(before, now)) == {**refused_reload, "KvdStoreFileReplaced": series(KVD, 0.0),
                                                   "KvdAuditWriteFailures": series(KVD, 1.0)}
    finally:
        service.shutdown(deadline=2)


def test_the_pins_rule_fires_when_pins_leave_a_request_no_room(tmp_path):
    # (no room kept at pin time: as pins restored at a start, or made before a reload raised it, stand)
    service = start_service(tmp_path, num_blocks=8, pin_budget_blocks=8, pin_room_tokens=0)
    try:
        app = create_app(service, service.metrics, front="unix")
        pinned = call(app, "POST", "/admin/pins", json={"tokens": list(range(3, 83))}).json()
        assert pinned["cached_blocks"] == 5
        before = scrape(app)
        refused = call(app, "POST", "/v1/completions", json={"prompt": list(range(100, 116)), "max_tokens": 33})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "pinned_out"
        assert fired(Scrapes(before | up(1, KVD), scrape(app) | up(1, KVD))) == {
            "KvdPinsKeepRequestsOut": series(KVD, 1.0, reason="pinned_out")}
    finally:
        service.shutdown(deadline=2)


def test_the_engine_rule_fires_when_a_step_fails(tmp_path):
    from .test_engine_step_failures import fail_a_step

    service = start_service(tmp_path)
    try:
        app = create_app(service, service.metrics, front="unix")
        before = scrape(app)
        fail_a_step(service, lambda engine: engine.num_running > 0)
        # (ignore_eos: a sampled end of text at the first token would finish it before a step that fails)
        failed = call(app, "POST", "/v1/completions", json={"prompt": "word " * 8, "max_tokens": 2, "ignore_eos": True})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
        assert fired(Scrapes(before | up(1, KVD), scrape(app) | up(1, KVD))) == {
            "KvdEngineStepFailing": series(KVD, 1.0)}
    finally:
        service.shutdown(deadline=2)


def test_the_stall_rule_fires_while_the_engine_does_not_come_round_its_loop(tmp_path):
    service = start_service(tmp_path)
    try:
        app = create_app(service, service.metrics, front="unix")
        before = scrape(app)
        service.engine_loop.after = 0.0  # (test_engine_liveness.py stalls a real step)
        stalled = scrape(app)
        assert list(stalled["kvd_engine_stalled"].values()) == [1.0]
        assert fired(Scrapes(before | up(1, KVD), stalled | up(1, KVD))) == {"KvdEngineStalled": series(KVD, 1.0)}
    finally:
        service.shutdown(deadline=2)


def test_the_responses_file_rule_fires_when_a_kept_response_is_not_written(tmp_path):
    service = start_service(tmp_path, responses_store_file=str(tmp_path / "responses.sqlite"))
    try:
        app = create_app(service, service.metrics, front="unix")
        before = scrape(app)
        file = service.responses.file
        file.flush()
        file.db.execute("PRAGMA query_only = ON")  # every write refused, as a full or read-only disk's would be
        answer = call(app, "POST", "/v1/responses", json={"input": "Remember this.", "max_output_tokens": 2})
        assert answer.status_code == 200
        file.flush()
        assert fired(Scrapes(before | up(1, KVD), scrape(app) | up(1, KVD))) == {
            "KvdResponsesFileWritesFailing": series(KVD, 1.0)}
        file.db.execute("PRAGMA query_only = OFF")
    finally:
        service.shutdown(deadline=2)


def test_the_files_rule_fires_once_the_files_kept_pass_nine_tenths_of_files_store_bytes(tmp_path):
    service = start_service(tmp_path, files_store_bytes=10_000)
    try:
        app = create_app(service, service.metrics, front="unix")
        upload = {"data": {"purpose": "batch"}}
        assert call(app, "POST", "/v1/files", files={"file": ("a.jsonl", b"a" * 9_000)}, **upload).status_code == 200
        assert fired(Scrapes(scrape(app) | up(1, KVD), scrape(app) | up(1, KVD))) == {}
        assert call(app, "POST", "/v1/files", files={"file": ("b.jsonl", b"b" * 1)}, **upload).status_code == 200
        assert fired(Scrapes(scrape(app) | up(1, KVD), scrape(app) | up(1, KVD))) == {
            "KvdFilesStoreNearlyFull": series(KVD, 0.9001)}
    finally:
        service.shutdown(deadline=2)


def test_the_webhooks_rule_fires_when_an_event_is_given_up(tmp_path):
    import asyncio

    import httpx

    from kvctl.daemon.server.webhooks import new_secret

    hooks = tmp_path / "webhooks.txt"
    hooks.write_text(f"acme https://acme.example/hooks {new_secret()}\n")
    hooks.chmod(0o600)
    service = start_service(tmp_path, webhooks_file=str(hooks))
    try:
        app = create_app(service, service.metrics, front="unix")
        service.webhooks.transport = httpx.MockTransport(lambda request: httpx.Response(500))
        before = scrape(app)
        service.webhooks.send("acme", "batch.completed", "batch_0")
        service.webhooks.clock = lambda: 1e12  # (years after it was written: given up at its first failure)

        async def deliver():
            service.webhooks.start()
            while service.webhooks.pending:
                await asyncio.sleep(0.01)

        asyncio.run(deliver())
        assert fired(Scrapes(before | up(1, KVD), scrape(app) | up(1, KVD))) == {
            "KvdWebhooksDropped": series(KVD, 1.0, outcome="dropped")}
    finally:
        service.shutdown(deadline=2)


def test_the_queue_timeout_rule_fires_when_requests_wait_past_max_queue_wait(tmp_path):
    service = start_service(tmp_path, max_queue_wait=0.2)
    try:
        app = create_app(service, service.metrics, front="unix")
        with service.lock:
            service.engine.admission_paused = True  # nothing is admitted: the request waits out its limit
        before = scrape(app)
        refused = call(app, "POST", "/v1/completions", json={"prompt": "word " * 8, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_timeout"
        assert fired(Scrapes(before | up(1, KVD), scrape(app) | up(1, KVD))) == {
            "KvdQueueTimeouts": series(KVD, 1.0, reason="queue_timeout")}
    finally:
        service.shutdown(deadline=2)


def test_the_tier_and_format_rules_fire_on_a_corrupt_disk_block_and_unit_scales(tmp_path):
    service = start_service(tmp_path, num_blocks=64, cache_dtype="fp8_e4m3", allow_uncalibrated=True,
                            disk_cache_bytes="4MiB", disk_cache_path=str(tmp_path / "disk"), tiering="always")
    try:
        app = create_app(service, service.metrics, front="unix")
        prompt = {"prompt": "A prompt whose blocks go down to disk and come back corrupt. " * 4, "max_tokens": 2,
                  "temperature": 0}
        assert call(app, "POST", "/v1/completions", json=prompt).status_code == 200
        [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        moved = call(app, "POST", "/admin/swap", json={"prefix": row["prefix_id"], "to": "disk"}).json()
        assert moved["verified_blocks"] == moved["blocks"] == row["blocks"]
        before = scrape(app)
        uncalibrated = {"KvdCacheUncalibrated": series(KVD, 1.0)}
        assert fired(Scrapes(before, before)) == uncalibrated
        disk = service.engine.tiers.disk
        name, offset, length = next(iter(disk.index.values()))
        segment = disk.segment_dir / name
        data = bytearray(segment.read_bytes())
        data[offset + length // 2] ^= 0x01
        segment.write_bytes(bytes(data))
        again = call(app, "POST", "/v1/completions", json=prompt)
        assert again.status_code == 200
        after = scrape(app)
        assert fired(Scrapes(before, after)) == {**uncalibrated,
                                                     "KvdTierChecksumFailures": series(KVD, 1.0, tier="disk")}
    finally:
        service.shutdown(deadline=2)


def test_the_router_rules_fire_for_a_replica_left_drained(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        router, app = router_app([create_app(service, service.metrics, front="unix")], view="events")

        async def metrics(client):
            return samples((await client.get("/metrics")).text, **ROUTER)

        async def drain(client):
            answer = await client.post("/router/drain", json={"replica": "replica-0", "drain": True})
            assert answer.status_code == 200, answer.text

        healthy, drained = drive(app, [metrics, drain, metrics], service=router)[::2]
        assert fired(Scrapes(healthy | up(1, ROUTER), healthy | up(1, ROUTER))) == {}
        assert fired(Scrapes(healthy | up(1, ROUTER), drained | up(1, ROUTER))) == {
            "KvdRouterReplicaLeftDrained": series(ROUTER, 1.0, replica="replica-0")}
    finally:
        service.shutdown(deadline=2)


def test_the_router_rules_fire_for_a_replica_that_does_not_answer(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        replica_app = create_app(service, service.metrics, front="unix")
        router, app = router_app([replica_app, replica_app], "least_loaded", down=(1,))

        async def metrics(client):
            return samples((await client.get("/metrics")).text, **ROUTER)

        async def routed(client):
            answer = await client.post("/v1/completions", json={"prompt": "fleet " * 20, "max_tokens": 2})
            assert answer.status_code == 200 and answer.headers["x-kvd-replica"] == "replica-0"

        healthy, resting = drive(app, [metrics, routed, metrics])[::2]
        assert fired(Scrapes(healthy | up(1, ROUTER), healthy | up(1, ROUTER))) == {}
        assert fired(Scrapes(healthy | up(1, ROUTER), resting | up(1, ROUTER))) == {
            "KvdRouterReplicaNotAnswering": series(ROUTER, 1.0, replica="replica-1")}
    finally:
        service.shutdown(deadline=2)


def test_the_router_rules_fire_when_a_replica_is_passed_over_and_a_timeout_has_nowhere_in_time(tmp_path):
    """replica-1 is 30 s behind with a 10 s max_queue_wait: passed over; replica-0 takes the request
    and turns it away after its wait, and with replica-1 still past its limit, the caller gets that 503."""
    from kvctl.daemon.server.router_service import replica_client
    from kvctl.policies.routing import make_router

    from .test_router import Behind

    service = start_service(tmp_path, num_blocks=64)
    try:
        replica_app = create_app(service, service.metrics, front="unix")
        router, app = router_app([replica_app, replica_app])
        router.router = make_router("least_loaded")
        for i, front in enumerate((Behind(replica_app, 1.0, 10.0, times_out=True), Behind(replica_app, 30.0, 10.0))):
            router.replicas[i].client = replica_client(f"/run/replica-{i}.sock", transport=front)

        async def metrics(client):
            return samples((await client.get("/metrics")).text, **ROUTER)

        async def refused(client):
            answer = await client.post("/v1/completions", json={"prompt": "fleet " * 20, "max_tokens": 2})
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "queue_timeout"

        healthy, behind = drive(app, [metrics, refused, metrics])[::2]
        assert fired(Scrapes(healthy | up(1, ROUTER), healthy | up(1, ROUTER))) == {}
        assert fired(Scrapes(healthy | up(1, ROUTER), behind | up(1, ROUTER))) == {
            "KvdRouterReplicaPastQueueLimit": series(ROUTER, 1.0, replica="replica-1"),
            "KvdRouterFleetPastQueueLimits": series(ROUTER, 1.0)}
    finally:
        service.shutdown(deadline=2)


def test_the_evaluator_refuses_what_it_does_not_implement():
    scrapes = Scrapes({}, {})
    for expr in ("x offset 1d", "histogram_quantile(0.9, x)", "x > bool 1"):
        with pytest.raises(Unsupported):
            scrapes.evaluate(expr)
    now = {"x": {frozenset({("tier", "disk")}): 5.0, frozenset({("tier", "host")}): 1.0}}
    was = {"x": {frozenset({("tier", "disk")}): 2.0}}
    assert Scrapes(was, now).firing("increase(x[1m]) > 2") == {(("tier", "disk"),): 3.0}
    assert Scrapes(was, now).firing("rate(x[1m]) * 60") == {(("tier", "disk"),): 3.0}
    assert Scrapes(was, now).firing("sum by (tier) (x{tier=~'d.*|h.*'}) >= 1") == {
        (("tier", "disk"),): 5.0, (("tier", "host"),): 1.0}
    assert Scrapes(was, now).firing("x and on(tier) increase(x[5m]) > 0") == {(("tier", "disk"),): 5.0}


def test_prometheus_loads_the_rules_and_scrapes_the_jobs_they_name():
    prometheus = yaml.safe_load((RULES.parent / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == [RULES.name]
    named = set(re.findall(r'job="([^"]+)"', " ".join(rule["expr"] for rule in rules())))
    assert named == {job["job_name"] for job in prometheus["scrape_configs"]} == {KVD["job"], ROUTER["job"]}


def test_the_router_rule_fires_when_decode_replicas_compute_whole_prompts(tmp_path):
    """A prefill replica without Redis refuses the transfer (409): the decode replica computes the
    whole prompt, and KvdRouterPrefillFailing names the outcome."""
    import asyncio

    import httpx

    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    services = [start_service(tmp_path / name, num_blocks=64) for name in ("prefill", "decode")]
    try:
        replicas = [Replica(f"replica-{role}", replica_client(f"/run/{role}.sock", transport=httpx.ASGITransport(
            app=create_app(s, s.metrics, front="unix"))), role=role)
            for role, s in zip(("prefill", "decode"), services)]
        router = RouterService(replicas, make_router("prefix"), view="ask", local_prefill_tokens=0)
        app = create_router_app(router)

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
                healthy = samples((await client.get("/metrics")).text, **ROUTER)
                answer = await client.post("/v1/completions", json={"prompt": "fleet " * 60, "max_tokens": 2})
                assert answer.status_code == 200 and answer.headers["x-kvd-prefill"].startswith("none: ")
                return healthy, samples((await client.get("/metrics")).text, **ROUTER)

        healthy, failed = asyncio.run(go())
        assert fired(Scrapes(healthy | up(1, ROUTER), healthy | up(1, ROUTER))) == {}
        assert fired(Scrapes(healthy | up(1, ROUTER), failed | up(1, ROUTER))) == {
            "KvdRouterPrefillFailing": series(ROUTER, 1.0, outcome="prefill_failed")}
    finally:
        for service in services:
            service.shutdown(deadline=2)


def test_the_speculation_rule_fires_when_few_draft_tokens_are_kept(tmp_path):
    """Speculative decoding on the demo checkpoint keeps most drafts (it repeats itself): quiet. Drafts
    of 1,000 tokens with 50 kept in the range fire KvdSpeculationRarelyKept."""
    service = start_service(tmp_path, num_blocks=64, speculative_config='{"num_speculative_tokens": 4}')
    try:
        app = create_app(service, service.metrics, front="unix")
        before = scrape(app)
        answer = call(app, "POST", "/v1/completions", json={"prompt": "Answer briefly. What is a block?",
                                                            "max_tokens": 64, "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200
        now = scrape(app)
        drafted, kept = (sum(now[name].values()) for name in ("kvd_spec_decode_draft_tokens_total",
                                                              "kvd_spec_decode_accepted_tokens_total"))
        assert drafted > 0 and kept / drafted >= 0.1
        assert fired(Scrapes(before, now)) == {}
        wasteful = {**now}
        for name, more in (("kvd_spec_decode_draft_tokens_total", 1000),
                           ("kvd_spec_decode_accepted_tokens_total", 50)):
            wasteful[name] = {labels: value + more for labels, value in now[name].items()}
        [(labels, share)] = fired(Scrapes(now, wasteful))["KvdSpeculationRarelyKept"].items()
        assert labels == (("instance", KVD["instance"]),) and share == pytest.approx(0.05)  # by instance
        assert fired(Scrapes(now, now)) == {}  # no draft in the range: no ratio, no alert
    finally:
        service.shutdown(deadline=2)


def test_the_fleet_rules_fire_while_kvds_of_one_job_run_other_builds_or_serve_a_model_otherwise(tmp_path,
                                                                                                  monkeypatch):
    """Two kvds of job kvd, scraped as two instances: quiet while they agree; one on another torch
    fires KvdFleetMixedBuilds, one on another checkpoint revision KvdFleetMixedCheckpoints (by model:
    a kvd serving another model is no difference)."""
    import dataclasses

    from kvctl.daemon.server import metrics
    from kvctl.daemon.server.service import EngineService

    other = {"job": "kvd", "instance": "gpu-node-1:8101"}

    def fleet(first: dict, second: dict) -> dict:
        return {name: {**first.get(name, {}), **second.get(name, {})} for name in {*first, *second}}

    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        agreeing = fleet(scrape(app), scrape(app, other))
        assert fired(Scrapes(agreeing, agreeing)) == {}
        real = metrics.software_versions()
        monkeypatch.setattr(metrics, "software_versions", lambda: {**real, "torch": "2.12.0+cu126"})
        builds = fleet(scrape(app), scrape(app, other))  # (both upgraded: one build again)
        assert fired(Scrapes(builds, builds)) == {}
        mixed = fleet(scrape(app), agreeing)
        assert fired(Scrapes(mixed, mixed)) == {"KvdFleetMixedBuilds": series({"job": "kvd"}, 2.0)}
        monkeypatch.undo()
        loaded = service.loaded
        service.loaded = dataclasses.replace(loaded, revision="f" * 64)
        try:
            revised = fleet(scrape(app), agreeing)
            assert fired(Scrapes(revised, revised)) == {
                "KvdFleetMixedCheckpoints": series({"job": "kvd"}, 2.0, model=service.model_name)}
            monkeypatch.setattr(EngineService, "model_name", property(lambda _: "kvd-other"))
            two_models = fleet(scrape(app), agreeing)
            assert fired(Scrapes(two_models, two_models)) == {}
        finally:
            service.loaded = loaded
    finally:
        service.shutdown(deadline=2)


def test_the_cache_size_rule_fires_where_twice_the_cache_would_serve_a_tenth_more(tmp_path):
    """Prompts that a cache of 64 blocks serves as well as one of 128: quiet. 10,000 more prompt tokens
    of which a cache twice the size would serve 1,500 more than kvd served: KvdCacheTooSmall. Where
    kvd's tiers served them (its hits as LRU's at twice the blocks): quiet again. Where kvd served
    fewer than LRU on its own blocks (evicted by hand): measured from LRU's."""
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        before = scrape(app)
        for first in (11, 12, 11):
            answer = call(app, "POST", "/v1/completions", json={"prompt": [first] + [7] * 70, "max_tokens": 2,
                                                                "temperature": 0, "ignore_eos": True})
            assert answer.status_code == 200
        now = scrape(app)
        hits = now["kvd_hit_curve_hit_tokens_total"]
        device, twice = (hits[frozenset({**KVD, "times": t}.items())] for t in ("1", "2"))
        assert device == twice == 64.0
        assert fired(Scrapes(before, now)) == {}
        small = {**now, "kvd_hit_curve_prompt_tokens_total": {
            labels: value + 10_000 for labels, value in now["kvd_hit_curve_prompt_tokens_total"].items()}}
        more = {"1": 4_000, "2": 5_500}  # the device's size and twice it; every larger size 6,000
        small["kvd_hit_curve_hit_tokens_total"] = {
            labels: value + more.get(dict(labels)["times"], 6_000) for labels, value in hits.items()}
        small["kvd_prefix_hit_tokens_total"] = {
            labels: value + 4_000 for labels, value in now["kvd_prefix_hit_tokens_total"].items()}
        [(labels, gain)] = fired(Scrapes(now, small))["KvdCacheTooSmall"].items()
        assert labels == (("instance", KVD["instance"]),) and gain == pytest.approx(0.15)
        tiered = {**small, "kvd_prefix_hit_tokens_total": {  # a host tier serves what twice the blocks would
            labels: value + 5_500 for labels, value in now["kvd_prefix_hit_tokens_total"].items()}}
        assert fired(Scrapes(now, tiered)) == {}
        evicted = {**small, "kvd_prefix_hit_tokens_total": now["kvd_prefix_hit_tokens_total"]}  # none served
        [(_, gain)] = fired(Scrapes(now, evicted))["KvdCacheTooSmall"].items()
        assert gain == pytest.approx(0.15)  # 5,500 against LRU's 4,000 on the device's blocks, not against 0
        assert fired(Scrapes(now, now)) == {}  # no prompt in the range: no ratio, no alert
    finally:
        service.shutdown(deadline=2)
