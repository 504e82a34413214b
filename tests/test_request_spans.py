"""OpenTelemetry spans of kvd's requests (daemon/server/request_spans.py): one per request, a child
of the caller's trace (passed on by kvd router too), with the cache's part as attributes and never
the text; a turned-away request's span says why; and a real kvd sends them to a collector over
OTLP/HTTP."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from kvctl.daemon.config import ConfigError, resolve  # noqa: E402
from kvctl.daemon.server.app import create_app  # noqa: E402
from kvctl.daemon.server.otlp_export import span_processor, traces_protocol  # noqa: E402
from kvctl.daemon.server.request_spans import install  # noqa: E402

from .daemon_fixtures import call, settled, start_service  # noqa: E402

PROMPT = "The quarterly numbers for the secret project are"
TRACE_ID, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


def traced(tmp_path, **settings):
    service = start_service(tmp_path, num_blocks=64, **settings)
    exporter = InMemorySpanExporter()
    install(service, SimpleSpanProcessor(exporter))
    return service, exporter, create_app(service, service.metrics, front="unix")


def test_a_span_per_request_is_a_child_of_the_callers_trace_with_the_caches_part(tmp_path):
    service, exporter, app = traced(tmp_path)
    try:
        answer = call(app, "POST", "/v1/completions", headers={"traceparent": TRACEPARENT, "X-Request-Id": "gw-1"},
                      json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200
        [span] = settled(exporter.get_finished_spans, lambda spans: len(spans) == 1)
        assert (span.name, span.kind) == ("kvd.request", SpanKind.SERVER)
        assert span.context.trace_id == int(TRACE_ID, 16) and span.parent.span_id == int(CALLER_SPAN, 16)
        usage, attributes = answer.json()["usage"], dict(span.attributes)
        assert attributes == {
            "gen_ai.system": "kvd", "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": service.model_name, "gen_ai.response.model": service.model_name,
            "gen_ai.request.id": answer.headers["x-kvd-request-id"], "gen_ai.request.max_tokens": 4,
            "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0, "gen_ai.request.n": 1,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"], "gen_ai.usage.output_tokens": 4,
            "gen_ai.response.finish_reasons": ("length",), "kvd.api": "completions", "kvd.tenant": "default",
            "kvd.cached_tokens": 0, "kvd.restored_tokens": 0, "kvd.recomputed_tokens": 0, "kvd.preemptions": 0,
            "kvd.queued_s": attributes["kvd.queued_s"], "kvd.ttft_s": attributes["kvd.ttft_s"],
            "kvd.e2e_s": attributes["kvd.e2e_s"], "kvd.client_request_id": "gw-1"}
        assert 0 <= attributes["kvd.queued_s"] <= attributes["kvd.ttft_s"] <= attributes["kvd.e2e_s"]
        assert [event.name for event in span.events] == ["admitted", "first_token"]
        assert span.start_time <= span.events[0].timestamp <= span.events[1].timestamp <= span.end_time
        assert abs((span.end_time - span.start_time) / 1e9 - attributes["kvd.e2e_s"]) < 1e-3
        assert span.status.status_code == StatusCode.UNSET
        assert not any("quarterly" in str(value) for value in attributes.values())
        again = call(app, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        spans = settled(exporter.get_finished_spans, lambda spans: len(spans) == 2)
        assert spans[1].parent is None  # no traceparent: a trace of its own
        assert spans[1].attributes["kvd.cached_tokens"] == again.json()["usage"]["prompt_tokens_details"][
            "cached_tokens"] > 0
    finally:
        service.shutdown(deadline=2)


def test_a_request_turned_away_has_a_span_whose_error_names_the_limit(tmp_path):
    service, exporter, app = traced(tmp_path)
    try:
        answer = call(app, "POST", "/v1/completions", headers={"traceparent": TRACEPARENT},
                      json={"prompt": "word " * 1100, "max_tokens": 4})
        assert answer.status_code == 400, answer.text
        [span] = settled(exporter.get_finished_spans, lambda spans: len(spans) == 1)
        assert span.status.status_code == StatusCode.ERROR and span.status.description == "rejected: never_fits"
        assert span.attributes["kvd.rejected"] == "never_fits" and span.attributes["gen_ai.usage.output_tokens"] == 0
        assert span.parent.span_id == int(CALLER_SPAN, 16) and span.events == ()
    finally:
        service.shutdown(deadline=2)


def test_kvd_router_passes_the_callers_trace_context_on_to_the_replica(tmp_path):
    from .test_router import drive, router_app

    service, exporter, replica_app = traced(tmp_path)
    try:
        router, front = router_app([replica_app], routing="round_robin")
        assert router.route_spans is None  # the router sends no span of its own (route_spans.py): it passes the
        # caller's context on as it came
        [answer] = drive(front, [lambda c: c.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                                                  json={"prompt": PROMPT, "max_tokens": 2})])
        assert answer.status_code == 200
        [span] = settled(exporter.get_finished_spans, lambda spans: len(spans) == 1)
        assert span.context.trace_id == int(TRACE_ID, 16) and span.parent.span_id == int(CALLER_SPAN, 16)
    finally:
        service.shutdown(deadline=2)


def test_the_endpoint_must_be_an_http_url():
    with pytest.raises(ConfigError) as refused:
        resolve({"otlp_traces_endpoint": "collector:4318"}, env={})
    assert str(refused.value) == (
        "otlp_traces_endpoint: invalid value 'collector:4318' from --otlp-traces-endpoint: must be an http:// or "
        "https:// URL (OTLP over HTTP, e.g. http://collector:4318/v1/traces; over gRPC, with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc, e.g. http://collector:4317)")
    assert span_processor(resolve({}, env={}).otlp_traces_endpoint) is None


def test_the_protocol_is_opentelemetry_s_variable_and_one_the_exporters_speak_or_kvd_does_not_start():
    assert traces_protocol({}) == "http/protobuf"
    assert traces_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    # the traces' own variable wins over the one for every signal
    assert traces_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    with pytest.raises(ConfigError) as refused:
        resolve({"otlp_traces_endpoint": "http://collector:4318/v1/traces"},
                env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert str(refused.value) == ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: invalid value 'http/json': must be one of "
                                  "http/protobuf, grpc (http/json is not sent by OpenTelemetry's Python exporters)")
    # without an endpoint the variable is nobody's business: it may be set for another program
    assert resolve({}, env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}).otlp_traces_endpoint is None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    for env, kind in (({}, HttpExporter), ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, GrpcExporter)):
        processor = span_processor("http://127.0.0.1:9/v1/traces", env)
        try:
            assert type(processor.span_exporter) is kind
        finally:
            processor.shutdown()


class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that keeps each export's body (protobuf)."""
    received: list[bytes] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        Collector.received.append(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


class GrpcCollector:
    """An OTLP/gRPC collector (OpenTelemetry's own service definition) that keeps each export, as
    the OTLP/HTTP one keeps its bodies."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the service's name)
                Collector.received.append(request.SerializeToString())
                return trace_service_pb2.ExportTraceServiceResponse()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def shutdown(self) -> None:
        self.server.stop(grace=None)


def collector(protocol: str):
    """A collector of `protocol`, started, and its endpoint URL."""
    Collector.received = []
    if protocol == "grpc":
        server = GrpcCollector()
        return server, f"http://127.0.0.1:{server.port}"
    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_real_kvd_sends_its_spans_to_a_collector_over_otlp(tmp_path, monkeypatch, protocol):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from .kvd_process import running_kvd

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    server, endpoint = collector(protocol)
    try:
        with running_kvd(tmp_path, "--otlp-traces-endpoint", endpoint) as (_, client, _):
            answer = client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                                 json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3})
            assert answer.status_code == 200
        # kvd's stop sent the batch
        spans = [span for body in Collector.received
                 for resource in ExportTraceServiceRequest.FromString(body).resource_spans
                 for scope in resource.scope_spans for span in scope.spans]
        assert len(spans) == 1
        span = spans[0]
        assert span.name == "kvd.request" and span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == \
            CALLER_SPAN
        attributes = {a.key: a.value for a in span.attributes}
        assert attributes["gen_ai.operation.name"].string_value == "chat"
        assert attributes["gen_ai.usage.input_tokens"].int_value == answer.json()["usage"]["prompt_tokens"]
        assert attributes["gen_ai.request.id"].string_value == answer.headers["x-kvd-request-id"]
        resource = ExportTraceServiceRequest.FromString(Collector.received[0]).resource_spans[0].resource
        assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "kvd"
    finally:
        server.shutdown()


def test_openmetrics_scrapes_link_each_ttft_bucket_to_its_latest_request_s_trace(tmp_path):
    """Exemplars (metrics.py): asked for OpenMetrics, kvd_ttft_seconds and kvd_tenant_ttft_seconds
    name the span of the request each bucket saw last; the classic text has none, and the whole
    OpenMetrics answer parses."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    service, exporter, app = traced(tmp_path)
    try:
        answer = call(app, "POST", "/v1/completions", headers={"traceparent": TRACEPARENT},
                      json={"prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200
        [span] = settled(exporter.get_finished_spans, lambda spans: len(spans) == 1)
        ids = {"trace_id": TRACE_ID, "span_id": f"{span.context.span_id:016x}"}
        # (the span ends before the metrics' books take the request: scraped once they have)
        scraped = settled(lambda: call(app, "GET", "/metrics",
                                       headers={"Accept": "application/openmetrics-text; version=1.0.0"}),
                          lambda answer: "kvd_ttft_seconds_count 1.0" in answer.text)
        assert scraped.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
        families = {family.name: family for family in text_string_to_metric_families(scraped.text)}
        for name in ("kvd_ttft_seconds", "kvd_tenant_ttft_seconds"):
            linked = [sample for sample in families[name].samples if sample.exemplar is not None]
            assert len(linked) == 1, name  # the one request, in the lowest bucket its TTFT fits
            assert linked[0].exemplar.labels == ids
            assert round(linked[0].exemplar.value, 4) == span.attributes["kvd.ttft_s"]  # (rounded there)
            assert float(linked[0].labels["le"]) >= linked[0].exemplar.value
        assert "kvd_prompt_tokens" in families and families["kvd_prompt_tokens"].type == "counter"
        plain = call(app, "GET", "/metrics")
        assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert TRACE_ID not in plain.text and "# EOF" not in plain.text
    finally:
        service.shutdown(deadline=2)
