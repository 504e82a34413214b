"""kvd router's own spans (daemon/server/route_spans.py): a route span per forwarded request, a
child of the caller's, and a try span per replica asked, whose context the replica's span takes as
parent; refusals and failures are the tries' errors; a streamed answer's route ends with its last
byte; and the router's processes send them over OTLP."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from kvctl.daemon.server.route_spans import RouteSpans  # noqa: E402
from kvctl.daemon.server.router_service import replica_client  # noqa: E402

from .daemon_fixtures import settled  # noqa: E402
from .test_request_spans import CALLER_SPAN, TRACE_ID, TRACEPARENT, traced  # noqa: E402
from .test_router import Refusing, drive, router_app  # noqa: E402

PROMPT = "Route this question about the cache of a serving fleet to the replica that holds it"


def traced_router(replica_apps, routing="round_robin"):
    service, front = router_app(replica_apps, routing=routing)
    exporter = InMemorySpanExporter()
    service.route_spans = RouteSpans(SimpleSpanProcessor(exporter))
    return service, front, exporter


def by_name(spans, name):
    return [span for span in spans if span.name == name]


def test_a_route_span_has_a_try_per_replica_asked_and_the_replica_s_span_is_the_last_try_s_child(tmp_path):
    replica, replica_exporter, replica_app = traced(tmp_path)
    try:
        service, front, exporter = traced_router([replica_app, replica_app])
        service.replicas[0].client = replica_client("/run/replica-0.sock", transport=Refusing(replica_app, 429))
        [answer] = drive(front, [lambda c: c.post("/v1/completions", headers={
            "traceparent": TRACEPARENT, "X-Request-Id": "gw-7"}, json={"prompt": PROMPT, "max_tokens": 2})])
        assert answer.status_code == 200 and answer.headers["x-kvd-tried"] == "replica-0 (429)"
        spans = exporter.get_finished_spans()
        [route] = by_name(spans, "kvd.router.route")
        refused, taken = by_name(spans, "kvd.router.forward")
        assert (route.kind, route.context.trace_id, route.parent.span_id) == (SpanKind.SERVER, int(TRACE_ID, 16),
                                                                              int(CALLER_SPAN, 16))
        attributes = dict(route.attributes)
        assert len(attributes.pop("kvd.route_id")) == 16
        assert attributes == {
            "http.request.method": "POST", "url.path": "/v1/completions", "kvd.tenant": "default",
            "kvd.client_request_id": "gw-7", "kvd.replica": "replica-1", "kvd.route_reason": answer.headers["x-kvd-route"],
            "kvd.tried": "replica-0 (429)", "kvd.request_id": answer.headers["x-kvd-request-id"],
            "http.response.status_code": 200}
        assert answer.headers["x-kvd-route"] == "its turn"
        assert route.status.status_code == StatusCode.UNSET
        for span in (refused, taken):
            assert span.kind == SpanKind.CLIENT and span.parent.span_id == route.context.span_id
            assert span.context.trace_id == int(TRACE_ID, 16)
        assert dict(refused.attributes) == {"kvd.replica": "replica-0", "kvd.phase": "whole",
                                            "http.response.status_code": 429}
        assert (refused.status.status_code, refused.status.description) == (StatusCode.ERROR, "refused: 429")
        assert dict(taken.attributes) == {"kvd.replica": "replica-1", "kvd.phase": "whole",
                                          "http.response.status_code": 200}
        assert taken.status.status_code == StatusCode.UNSET
        assert route.start_time <= refused.start_time <= refused.end_time <= taken.start_time <= taken.end_time \
            <= route.end_time
        # the replica's own span hangs under the try that reached it, in the caller's trace
        [at_replica] = settled(replica_exporter.get_finished_spans, lambda found: len(found) == 1)
        assert at_replica.context.trace_id == int(TRACE_ID, 16)
        assert at_replica.parent.span_id == taken.context.span_id
        assert not any(PROMPT[:20] in str(value) for span in spans for value in span.attributes.values())
    finally:
        replica.shutdown(deadline=2)


def test_the_router_s_openmetrics_scrape_links_the_choice_s_time_to_its_route_s_trace(tmp_path):
    """Asked for OpenMetrics, kvd_router_decision_seconds names the route span of the request each
    bucket saw last (Grafana jumps from a slow choice to its trace); the classic text has none."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    replica, _, replica_app = traced(tmp_path)
    try:
        service, front, exporter = traced_router([replica_app, replica_app])
        answer, scraped, plain = drive(front, [
            lambda c: c.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                             json={"prompt": PROMPT, "max_tokens": 2}),
            lambda c: c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}),
            lambda c: c.get("/metrics")])
        assert answer.status_code == 200
        [route] = by_name(exporter.get_finished_spans(), "kvd.router.route")
        assert scraped.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
        families = {family.name: family for family in text_string_to_metric_families(scraped.text)}
        linked = [s for s in families["kvd_router_decision_seconds"].samples if s.exemplar is not None]
        assert len(linked) == 1  # the one choice, in the lowest bucket its time fits
        assert linked[0].exemplar.labels == {"trace_id": TRACE_ID, "span_id": f"{route.context.span_id:016x}"}
        assert float(linked[0].labels["le"]) >= linked[0].exemplar.value > 0
        assert families["kvd_router_requests"].type == "counter"
        assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert TRACE_ID not in plain.text and "# EOF" not in plain.text
    finally:
        replica.shutdown(deadline=2)


def test_a_streamed_answer_s_route_ends_with_its_last_byte_or_breaks_off_as_an_error():
    import asyncio

    from starlette.responses import StreamingResponse

    exporter = InMemorySpanExporter()
    spans = RouteSpans(SimpleSpanProcessor(exporter))

    async def answer_of(pieces, fail_after=None):
        span = spans.begin("/v1/chat/completions", {"traceparent": TRACEPARENT}, "acme")
        span.attempt("replica-0", "whole", {})
        span.answered(200)
        span.chose(replica="replica-0")

        async def events():
            for n, piece in enumerate(pieces):
                if n == fail_after:
                    span.broke_off("replica replica-0 failed during the answer: ReadError: gone")
                yield piece
        answer = span.ended_with(StreamingResponse(events(), media_type="text/event-stream"))
        seen = []
        async for piece in answer.body_iterator:
            seen.append((piece, [s.name for s in exporter.get_finished_spans()]))
        return seen

    seen = asyncio.run(answer_of([b"data: {}\n\n", b"data: [DONE]\n\n"]))
    assert seen == [(b"data: {}\n\n", []), (b"data: [DONE]\n\n", [])]  # both open while it streamed
    route, = by_name(exporter.get_finished_spans(), "kvd.router.route")
    taken, = by_name(exporter.get_finished_spans(), "kvd.router.forward")
    assert taken.end_time <= route.end_time and route.status.status_code == StatusCode.UNSET
    assert (route.attributes["kvd.tenant"], route.attributes["http.response.status_code"]) == ("acme", 200)
    assert route.parent.span_id == int(CALLER_SPAN, 16)
    exporter.clear()
    asyncio.run(answer_of([b"data: {}\n\n", b"data: {error}\n\n", b"data: [DONE]\n\n"], fail_after=1))
    route, = by_name(exporter.get_finished_spans(), "kvd.router.route")
    taken, = by_name(exporter.get_finished_spans(), "kvd.router.forward")
    why = "replica replica-0 failed during the answer: ReadError: gone"
    assert (taken.status.status_code, taken.status.description) == (StatusCode.ERROR, why)
    assert (route.status.status_code, route.status.description) == (StatusCode.ERROR, why)


def test_a_streamed_answer_through_the_router_is_traced_whole(tmp_path):
    replica, replica_exporter, replica_app = traced(tmp_path)
    try:
        service, front, exporter = traced_router([replica_app])
        [answer] = drive(front, [lambda c: c.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 6, "stream": True, "ignore_eos": True})])
        assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
        [route] = by_name(exporter.get_finished_spans(), "kvd.router.route")
        [taken] = by_name(exporter.get_finished_spans(), "kvd.router.forward")
        assert route.parent is None and taken.parent.span_id == route.context.span_id  # no caller's trace
        assert route.attributes["http.response.status_code"] == 200 and route.status.status_code == StatusCode.UNSET
        [at_replica] = settled(replica_exporter.get_finished_spans, lambda found: len(found) == 1)
        assert at_replica.parent.span_id == taken.context.span_id
        assert at_replica.context.trace_id == route.context.trace_id
    finally:
        replica.shutdown(deadline=2)


def test_no_replica_reached_is_an_error_route_whose_tries_say_why(tmp_path):
    replica, replica_exporter, replica_app = traced(tmp_path)
    try:
        service, front, exporter = traced_router([replica_app, replica_app])
        service.replicas[0].client = replica_client("/run/replica-0.sock",
                                                    transport=Refusing(replica_app, "unreachable"))
        service.replicas[1].client = replica_client("/run/replica-1.sock", transport=Refusing(replica_app, 503))
        [answer] = drive(front, [lambda c: c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})])
        assert answer.status_code == 503
        spans = exporter.get_finished_spans()
        [route] = by_name(spans, "kvd.router.route")
        tries = by_name(spans, "kvd.router.forward")
        assert [(t.attributes["kvd.replica"], t.status.description) for t in tries] == [
            ("replica-0", "unreachable: ConnectError: connection refused"), ("replica-1", "refused: 503")]
        assert (route.status.status_code, route.status.description) == (StatusCode.ERROR, "answered 503")
        assert "kvd.replica" not in route.attributes and route.attributes["http.response.status_code"] == 503
        assert (route.attributes["kvd.tried"], route.attributes["kvd.refused"]) == (
            "replica-0 (unreachable); replica-1 (503)", "no replica left to try")
        assert replica_exporter.get_finished_spans() == ()  # no replica ran it
    finally:
        replica.shutdown(deadline=2)


def test_the_router_refuses_an_endpoint_or_protocol_it_cannot_send_to(tmp_path):
    from kvctl.daemon.config import ConfigError
    from kvctl.daemon.router_config import resolve_router

    base = {"socket": str(tmp_path / "r.sock"), "replicas": ("/run/a.sock", "/run/b.sock")}
    with pytest.raises(ConfigError) as refused:
        resolve_router({**base, "otlp_traces_endpoint": "collector:4317"}, env={})
    assert str(refused.value).startswith("otlp_traces_endpoint: invalid value 'collector:4317' from "
                                         "--otlp-traces-endpoint: must be an http:// or https:// URL")
    with pytest.raises(ConfigError) as refused:
        resolve_router({**base, "otlp_traces_endpoint": "http://collector:4317"},
                       env={"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})
    assert str(refused.value) == ("OTEL_EXPORTER_OTLP_PROTOCOL: invalid value 'thrift': must be one of "
                                  "http/protobuf, grpc (http/json is not sent by OpenTelemetry's Python exporters)")
    config = resolve_router({**base, "otlp_traces_endpoint": "http://collector:4317"},
                            env={"KVD_ROUTER_OTLP_TRACES_ENDPOINT": "http://other:4318/v1/traces"})
    assert config.otlp_traces_endpoint == "http://collector:4317"  # the flag over the variable
    assert json.dumps(config.sources["otlp_traces_endpoint"]) == '"--otlp-traces-endpoint"'


def test_a_real_kvd_router_sends_its_spans_over_otlp_grpc_and_flushes_them_as_it_stops(tmp_path):
    """`kvd router --otlp-traces-endpoint` with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc: a request
    no replica can take (both are down) is a 503 whose route span reaches the collector, as
    service kvd-router, when the router stops."""
    import os
    import signal
    import subprocess
    import time

    import httpx
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from .kvd_process import BIN
    from .test_request_spans import Collector, collector

    server, endpoint = collector("grpc")
    front = tmp_path / "router.sock"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    router = subprocess.Popen([str(BIN / "kvd"), "router", "--replica", str(tmp_path / "a.sock"), "--replica",
                               str(tmp_path / "b.sock"), "--socket", str(front), "--otlp-traces-endpoint", endpoint,
                               "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = httpx.Client(base_url="http://router", transport=httpx.HTTPTransport(uds=str(front)), timeout=30)
        deadline = time.monotonic() + 60
        while not front.exists() and time.monotonic() < deadline and router.poll() is None:
            time.sleep(0.1)
        answer = client.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                             json={"prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica"
        router.send_signal(signal.SIGTERM)
        assert router.wait(60) == 0, router.stdout.read().decode()
        [export] = [ExportTraceServiceRequest.FromString(body) for body in Collector.received]
        [resource] = export.resource_spans
        assert {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"] == "kvd-router"
        [span] = [span for scope in resource.scope_spans for span in scope.spans]
        assert (span.name, span.trace_id.hex(), span.parent_span_id.hex()) == ("kvd.router.route", TRACE_ID,
                                                                               CALLER_SPAN)
        assert span.status.message == "answered 503"
    finally:
        if router.poll() is None:
            router.kill()
        server.shutdown()
