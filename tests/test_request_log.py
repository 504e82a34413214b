"""kvd's log while it serves (daemon/server/request_log.py, daemon/log_format.py): a logfmt line
per finished request with its counts and times and never its text, the engine's summary where
something happened, both live on a reload, and JSON lines whose fields are the record's own."""

from __future__ import annotations

import io
import json
import logging
from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.config import ConfigError, resolve  # noqa: E402
from kvctl.daemon.log_format import handler_for  # noqa: E402
from kvctl.daemon.server.app import create_app  # noqa: E402
from kvctl.daemon.server.request_log import RequestLog, logfmt  # noqa: E402

from .daemon_fixtures import call, settled, start_service  # noqa: E402

PROMPT = "The quarterly numbers for the secret project are"
FIELDS = ["request_id", "tenant", "api", "model", "finish", "prompt_tokens", "cached_tokens", "restored_tokens",
          "recomputed_tokens", "output_tokens", "preemptions", "queued_s", "ttft_s", "e2e_s"]


def logged(caplog, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if (getattr(r, "fields", None) or {}).get("event") == event]


def complete(app, **extra):
    answer = call(app, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                       "ignore_eos": True, **extra})
    assert answer.status_code == 200, answer.text
    return answer


def test_each_finished_request_is_a_logfmt_line_of_counts_and_times_never_its_text(tmp_path, caplog):
    service = start_service(tmp_path, num_blocks=64, log_requests=True)
    try:
        app = create_app(service, service.metrics, front="unix")
        with caplog.at_level(logging.INFO, logger="kvd"):
            first = complete(app)
            settled(lambda: logged(caplog, "request"), lambda found: len(found) == 1)
            second = complete(app)
            records = settled(lambda: logged(caplog, "request"), lambda found: len(found) == 2)
        assert len(records) == 2
        for record, answer in zip(records, (first, second)):
            fields = {k: v for k, v in record.fields.items() if k != "event"}
            assert list(fields) == FIELDS
            usage = answer.json()["usage"]
            assert fields["request_id"] == answer.headers["x-kvd-request-id"]
            assert (fields["tenant"], fields["api"], fields["model"], fields["finish"]) == (
                "default", "completions", service.model_name, "length")
            assert fields["prompt_tokens"] == usage["prompt_tokens"] and fields["output_tokens"] == 4
            assert fields["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
            assert fields["restored_tokens"] == fields["recomputed_tokens"] == fields["preemptions"] == 0
            assert 0 <= fields["queued_s"] <= fields["ttft_s"] <= fields["e2e_s"]
            assert record.getMessage() == "request " + logfmt(fields)
            assert "quarterly" not in record.getMessage() and "secret" not in record.getMessage()
        assert records[0].fields["cached_tokens"] == 0
        assert records[1].fields["cached_tokens"] == service.engine.cache.block_size * (
            (records[1].fields["prompt_tokens"] - 1) // service.engine.cache.block_size)
    finally:
        service.shutdown(deadline=2)


def test_request_lines_are_off_by_default_and_a_reload_turns_them_on(tmp_path, caplog):
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        with caplog.at_level(logging.INFO, logger="kvd"):
            complete(app)
            settled(lambda: service.request_log.finished_outputs, lambda outputs: outputs == 4)
            assert logged(caplog, "request") == []
            result = service.reload(replace(service.config, log_requests=True, log_stats_interval=2.5))
            assert result["changed"] == {"log_requests": True, "log_stats_interval": 2.5}
            assert service.request_log.every() == 2.5
            complete(app, n=2, temperature=0.8, seed=7)
            [record] = settled(lambda: logged(caplog, "request"), lambda found: len(found) == 1)
        assert record.fields["finish"] == "length,length" and record.fields["output_tokens"] == 8
        service.reload(replace(service.config, log_stats_interval=0.0))
        assert service.request_log.every() == 10.0  # off: it looks every 10 s whether a reload turned it on
    finally:
        service.shutdown(deadline=2)


def test_the_summary_counts_the_interval_and_says_nothing_when_nothing_happened(tmp_path, caplog):
    service = start_service(tmp_path, num_blocks=64)
    now = [1000.0]
    try:
        app = create_app(service, service.metrics, front="unix")
        summary = RequestLog(service, clock=lambda: now[0])
        assert summary.summarise() is None  # the first takes the totals
        now[0] += 10
        assert summary.summarise() is None  # nothing happened
        before = dict(vars(service.engine.stats))
        with caplog.at_level(logging.INFO, logger="kvd"):
            complete(app)
            complete(app)
            settled(lambda: summary.finished_outputs, lambda outputs: outputs == 8)
            now[0] += 10
            line = summary.summarise()
        stats = service.engine.stats
        prompt, hits = stats.prompt_tokens - before["prompt_tokens"], stats.hit_tokens - before["hit_tokens"]
        [record] = logged(caplog, "stats")
        counts = service.engine.cache.state_counts()
        assert record.fields == {
            "event": "stats", "seconds": 10.0, "prompt_tokens_per_s": round(prompt / 10, 1),
            "output_tokens_per_s": 0.8, "prefix_hit_ratio": round(hits / prompt, 4), "running": 0, "waiting": 0,
            "device_cache_used": round((64 - counts["free"] - counts["cached"]) / 64, 4),
            "device_cache_cached": round(counts["cached"] / 64, 4), "preemptions": 0, "rejections": 0}
        assert line == record.getMessage()
        assert line.startswith(f"stats, last 10 s: prompt {prompt / 10:,.1f} tokens/s ({hits / prompt:.1%} from the "
                               "cache), output 0.8 tokens/s; 0 running, 0 waiting; device cache ")
        assert line.endswith("; 0 preemptions, 0 rejections")
        now[0] += 10
        assert summary.summarise() is None
    finally:
        service.shutdown(deadline=2)


def test_json_lines_carry_the_records_fields_as_their_own():
    stream = io.StringIO()
    logger = logging.getLogger("kvd-json-test")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(handler_for("json", stream))
    try:
        logger.info("request %s", "x=1", extra={"fields": {"event": "request", "output_tokens": 4, "level": "no"}})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.handlers.clear()
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["ts"].endswith("Z") and len(first["ts"]) == len("2026-12-04T19:00:00.000Z")
    assert {k: v for k, v in first.items() if k != "ts"} == {
        "level": "INFO", "logger": "kvd-json-test", "message": "request x=1", "event": "request", "output_tokens": 4}
    assert second["message"] == "failed" and second["exception"].endswith("RuntimeError: boom")
    with pytest.raises(ValueError) as refused:
        handler_for("yaml", stream)
    assert str(refused.value) == "log_format: must be text or json (got 'yaml')"


def test_logfmt_quotes_what_would_split_and_marks_what_is_unknown():
    assert logfmt({"a": 1, "b": None, "c": "two words", "d": 'say "hi"', "e": ""}) == \
        'a=1 b=- c="two words" d="say \\"hi\\"" e=""'


def test_a_negative_summary_interval_is_refused_by_name():
    with pytest.raises(ConfigError) as refused:
        resolve({"log_stats_interval": -1.0}, env={})
    assert str(refused.value) == ("log_stats_interval: invalid value -1.0 from --log-stats-interval: must be a "
                                  "number of seconds >= 0 (0: no summary)")


def test_kvd_and_its_router_refuse_a_log_format_they_do_not_write():
    from typer.testing import CliRunner

    from kvctl.daemon.cli import app

    for command in (["serve"], ["router", "--replica", "/a.sock", "--replica", "/b.sock", "--socket", "/r.sock"]):
        result = CliRunner().invoke(app, [*command, "--log-format", "yaml"])
        assert result.exit_code == 2
        assert result.output.strip().splitlines()[-1] == "kvd: error: log_format: must be text or json (got 'yaml')"


def test_a_request_turned_away_at_admission_is_logged_with_the_limit_it_met(tmp_path, caplog):
    service = start_service(tmp_path, num_blocks=8, log_requests=True)  # 128 tokens: a longer prompt never fits
    try:
        app = create_app(service, service.metrics, front="unix")
        with caplog.at_level(logging.INFO, logger="kvd"):
            answer = call(app, "POST", "/v1/completions", json={"prompt": "word " * 200, "max_tokens": 4})
        assert answer.status_code == 400, answer.text
        [record] = logged(caplog, "request")
        assert (record.fields["finish"], record.fields["rejected"], record.fields["output_tokens"]) == (
            "rejected", "never_fits", 0)
        assert record.fields["ttft_s"] is None and "word" not in record.getMessage()
        assert " finish=rejected rejected=never_fits " in record.getMessage()  # the limit beside the outcome
        assert record.getMessage().endswith(" ttft_s=- e2e_s=-")
    finally:
        service.shutdown(deadline=2)


def test_kvd_router_logs_where_each_request_went_and_why_never_its_body(tmp_path, caplog):
    from .test_router import drive, post, router_app

    service = start_service(tmp_path, num_blocks=64)
    try:
        replica_app = create_app(service, service.metrics, front="unix")
        router, front = router_app([replica_app, replica_app], routing="round_robin")
        router.log_requests = True
        with caplog.at_level(logging.INFO, logger="kvd.router"):
            answers = drive(front, [lambda c: post(c, PROMPT), lambda c: post(c, PROMPT)])
        records = logged(caplog, "route")
        assert [r.fields["replica"] for r in records] == [a.headers["x-kvd-replica"] for a in answers] == [
            "replica-0", "replica-1"]
        for record, answer in zip(records, answers):
            assert {k: v for k, v in record.fields.items() if k not in ("route_id", "reason")} == {
                "event": "route", "tenant": "default", "path": "/v1/completions", "replica": answer.headers[
                    "x-kvd-replica"], "status": 200, "request_id": answer.headers["x-kvd-request-id"],
                "tried": None, "prefill": None}
            assert record.fields["reason"] == answer.headers["x-kvd-route"] and len(record.fields["route_id"]) == 16
            assert "quarterly" not in record.getMessage()
        router.log_requests = False
        with caplog.at_level(logging.INFO, logger="kvd.router"):
            drive(front, [lambda c: post(c, PROMPT)])
        assert len(logged(caplog, "route")) == 2
    finally:
        service.shutdown(deadline=2)


def test_a_gateways_request_id_is_logged_echoed_and_passed_on_by_the_router(tmp_path, caplog):
    from .test_router import drive, router_app

    service = start_service(tmp_path, num_blocks=64, log_requests=True)
    try:
        app = create_app(service, service.metrics, front="unix")
        with caplog.at_level(logging.INFO, logger="kvd"):
            answer = complete_with(app, {"X-Request-Id": "gw-7f3a9c01"})
            [record] = settled(lambda: logged(caplog, "request"), lambda found: len(found) == 1)
        assert answer.headers["x-request-id"] == "gw-7f3a9c01"
        assert record.fields["client_request_id"] == "gw-7f3a9c01"
        assert record.getMessage().endswith(" client_request_id=gw-7f3a9c01")
        refused = complete_with(app, {"X-Request-Id": "two words"}, status=400)
        assert refused.json()["error"]["message"] == (
            "X-Request-Id: must be 1 to 128 visible ASCII characters, got 'two words'")
        assert refused.json()["error"]["param"] == "X-Request-Id" and "x-request-id" not in refused.headers
        # error answers echo it too: a body that does not validate, and a prompt the cache can never hold
        malformed = call(app, "POST", "/v1/completions", headers={"X-Request-Id": "gw-3"}, json={"max_tokens": 1})
        too_long = call(app, "POST", "/v1/completions", headers={"X-Request-Id": "gw-4"},
                        json={"prompt": "word " * 1100, "max_tokens": 1})
        assert (malformed.status_code, malformed.headers["x-request-id"]) == (400, "gw-3")
        assert (too_long.status_code, too_long.headers["x-request-id"]) == (400, "gw-4")
        router, front = router_app([app], routing="round_robin")
        router.log_requests = True
        with caplog.at_level(logging.INFO, logger="kvd"):  # (kvd.router's too)
            [routed] = drive(front, [lambda c: c.post("/v1/completions", headers={"X-Request-Id": "gw-2"},
                                                      json={"prompt": PROMPT, "max_tokens": 2})])
            replica_lines = settled(lambda: logged(caplog, "request"), lambda found: len(found) == 2)
        assert routed.headers["x-request-id"] == "gw-2"
        assert logged(caplog, "route")[-1].fields["client_request_id"] == "gw-2"
        assert replica_lines[-1].fields["client_request_id"] == "gw-2"
    finally:
        service.shutdown(deadline=2)


def complete_with(app, headers: dict, status: int = 200):
    answer = call(app, "POST", "/v1/completions", headers=headers,
                  json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert answer.status_code == status, answer.text
    return answer
